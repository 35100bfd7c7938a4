"""Where every stage reads and writes, relative to the repository root: the pipeline's files, known in one place.
dvc.yaml declares the same paths (a test checks that they agree); the stages, the studies, ``track`` and the CLI
read them from here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Layout:
    """Where every stage reads and writes, relative to the repository root."""

    root: Path = Path(".")
    replica: int | None = None  # a replicate@<seed>'s layout: its outputs under replicates/<seed>/ (``replicate``)

    def _p(self, *parts: str) -> Path:
        if self.replica is not None and parts[:1] != ("data",) and parts != ("models", "pretrained.safetensors"):
            return self.root.joinpath("replicates", str(self.replica), *parts)  # the data and backbone: the run's own
        return self.root.joinpath(*parts)

    # ------------------------------------------------------------ more seeds (stage replicate@<seed>)
    def replicate(self, seed: int) -> Layout:
        """Where replicate@<seed> writes its fine-tunes, task vectors, statistics and merges: the same paths under
        replicates/<seed>/, reading the run's data and pretrained backbone."""
        return Layout(self.root, seed)

    def replicate_root(self, seed: int) -> Path:
        return self.root / "replicates" / str(seed)

    def replicate_summary(self, seed: int) -> Path:
        """metrics/replicates/<seed>.json: one seed's individual, probe and per-method test averages."""
        return self.root / "metrics" / "replicates" / f"{seed}.json"

    @property
    def output_roots(self) -> list[Path]:
        """Every folder a stage writes under (each stage sweeps their leftover temporaries when it starts)."""
        return [
            self._p(d)
            for d in (
                "data",
                "models",
                "vectors",
                "statistics",
                "merged",
                "metrics",
                "results",
                "logs",
                "regimes",
                "studies",
                "checkpoints",
                "replicates",
                "sources",
                "predictions",
            )
        ]

    @property
    def pretrain_corpus(self) -> Path:
        return self._p("data", "pretrain.safetensors")

    def task_data(self, task: str) -> Path:
        return self._p("data", "tasks", f"{task}.safetensors")

    @property
    def pretrained(self) -> Path:
        return self._p("models", "pretrained.safetensors")

    def finetuned(self, task: str) -> Path:
        return self._p("models", "finetuned", f"{task}.safetensors")

    def epochs(self, task: str) -> Path:
        return self._p("models", "epochs", task)

    def head(self, task: str) -> Path:
        return self._p("models", "heads", f"{task}.safetensors")

    @property
    def vectors(self) -> Path:
        return self._p("vectors")

    def statistics(self, task: str) -> Path:
        """Fisher diagonals and layer-input Grams of task's fine-tuned model (keys <kind>/<tensor>)."""
        return self._p("statistics", f"{task}.safetensors")

    def merged(self, method: str) -> Path:
        return self._p("merged", f"{method}.safetensors")

    def predictions(self, stage: str, name: str) -> Path:
        """The test predictions an evaluation kept (the leaderboard's bootstrap): finetune@<task>'s labels, probe
        and individual model; merge@<method>'s, one tensor per task."""
        return self._p("predictions", stage, f"{name}.safetensors")

    @property
    def sources(self) -> Path:
        return self.root / "sources"

    def method_sources(self, method: str) -> Path:
        """The source files (path: md5) that merge@<method> follows from (stage sources: mergeflow.pipeline.sources)."""
        return self.sources / "merge" / f"{method}.json"

    def study_sources(self, study: str) -> Path:
        """The source files that study@<study> follows from."""
        return self.sources / "study" / f"{study}.json"

    def regime_sources(self, regime: str) -> Path:
        """The source files that regime@<regime> follows from."""
        return self.sources / "regime" / f"{regime}.json"

    def regime_merge_sources(self, regime: str) -> Path:
        """The source files that regime_merge@<regime> follows from: its methods' (regimes.methods) and LoRA's."""
        return self.sources / "regime_merge" / f"{regime}.json"

    @property
    def statistics_needed(self) -> Path:
        """Whether any method of merge.methods reads the statistics stage's outputs ({"needed": bool})."""
        return self.sources / "statistics.json"

    @property
    def replicate_sources(self) -> Path:
        """The merging files that every replicate@<seed> follows from: those of the methods in merge.methods."""
        return self.sources / "replicate.json"

    def metrics(self, stage: str, name: str | None = None) -> Path:
        return self._p("metrics", f"{stage}.json") if name is None else self._p("metrics", stage, f"{name}.json")

    def log(self, stage: str, name: str | None = None, suffix: str = ".json") -> Path:
        return self._p("logs", f"{stage}{suffix}") if name is None else self._p("logs", stage, f"{name}{suffix}")

    def timing(self, stage: str, name: str | None = None) -> Path:
        """A stage's wall time: apart from its metrics, which later stages depend on, so that re-running a stage
        that gives the same outputs in another time leaves everything downstream up to date."""
        return self.log("timing", stage) if name is None else self._p("logs", "timing", stage, f"{name}.json")

    @property
    def results(self) -> Path:
        return self._p("results")

    @property
    def headline(self) -> Path:
        """metrics/headline/: a small file per method (<method>.json; a regime variant's under <variant>/), in git."""
        return self._p("metrics", "headline")

    def verdicts(self, study: str) -> Path:
        """metrics/verdicts/<study>.json: a study's verdict counts, in git (the claims are in metrics/studies)."""
        return self._p("metrics", "verdicts", f"{study}.json")

    # ------------------------------------------------------------ training-time regimes (stage regime@<regime>)
    def regime(self, regime: str) -> Path:
        """regimes/<regime>/<variant>/: vectors/<task>.safetensors (tau_t = theta_t - theta0) and stats.json,
        model.safetensors (the regime's own model, when it has one), updates/round<i>/<task>.safetensors (ATM's
        per-round task vectors). Its measurements (accuracies, per-round norms and cosines) are in
        metrics/regime/<regime>.json."""
        return self._p("regimes", regime)

    def regime_vectors(self, regime: str, variant: str) -> Path:
        return self.regime(regime) / variant / "vectors"

    def regime_model(self, regime: str, variant: str) -> Path:
        return self.regime(regime) / variant / "model.safetensors"

    def regime_updates(self, regime: str, variant: str, round: int) -> Path:
        return self.regime(regime) / variant / "updates" / f"round{round}"

    def regime_checkpoint(self, regime: str, variant: str) -> Path:
        """The last finished round of a regime run (not a DVC output: a resumed run reads it, a finished run
        removes it)."""
        return self._p("checkpoints", "regime", regime, f"{variant}.safetensors")

    def merge_run(self, method: str, regime: str | None = None, variant: str | None = None) -> MergeRun:
        """Where one merge reads and writes: the standard regime's at merge@<method>'s paths, a regime's
        variant's under regime_merge@<regime>'s folders."""
        if regime is None:
            return MergeRun(
                method,
                self.vectors,
                self.merged(method),
                self.metrics("merge", method),
                self.metrics("evaluate", method),
                self.log("merge", method, ".png"),
                self.log("merge", method),
                self.predictions("merge", method),
            )
        return MergeRun(
            method,
            self.regime_vectors(regime, variant),
            self._p("merged", "regime", regime, variant, f"{method}.safetensors"),
            self._p("metrics", "regime_merge", regime, variant, "merge", f"{method}.json"),
            self._p("metrics", "regime_merge", regime, variant, "evaluate", f"{method}.json"),
            self._p("logs", "regime_merge", regime, variant, f"{method}.png"),
            self._p("logs", "regime_merge", regime, variant, f"{method}.json"),
            self._p("predictions", "regime_merge", regime, variant, f"{method}.safetensors"),
        )

    # ------------------------------------------------------------ studies (stage study@<study>)
    def study(self, study: str) -> Path:
        """studies/<study>/: report.md and its figures."""
        return self._p("studies", study)


@dataclass(frozen=True)
class MergeRun:
    """One merge's inputs and outputs: the task vectors it merges, and where its merged model, its choice on
    validation (metrics), its test evaluation, its search (plot, records) and its test predictions go."""

    method: str
    vectors: Path
    merged: Path
    choice: Path
    evaluation: Path
    search_plot: Path
    search_log: Path
    predictions: Path
