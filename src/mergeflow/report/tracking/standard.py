"""The runs of the standard pipeline's stages (prepare, pretrain, each fine-tune, vectors, each merge), one recorder
per stage, and ``RECORDERS``: which recorder logs each stage of stage_table.STAGES, in the order track logs them
(``NOT_RECORDED`` says why the others have no run of their own)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mergeflow.config import Params
from mergeflow.ml.evaluation import mean
from mergeflow.core.files import read_json
from mergeflow.core.layout import Layout
from mergeflow.core.reproducibility.machine import tags as machine_tags
from mergeflow.report.plots import INDIVIDUAL
from mergeflow.report.summary import percent, pretrained_name
from mergeflow.report.tracking.merges import _val_curve, merge_metrics, merge_params
from mergeflow.report.tracking.regimes import _track_regimes
from mergeflow.report.tracking.registry import _log_merged_model
from mergeflow.report.tracking.runs import (
    _flatten,
    _Hashes,
    _out_md5,
    _Recorder,
    _sha256,
    curve_records,
    fingerprint,
    log_search_plot,
    stage_times,
)
from mergeflow.report.tracking.studies import _track_studies

STANDARD_TAGS = {
    "regime": "standard",
    "variant": "standard",
}  # the standard fine-tune's runs (finetune, vectors, merge), beside the training-time regimes'


@dataclass
class Tracked:
    """What every recorder reads (the params, the files, dvc.lock, the MLflow recorder) and what they leave for
    the pipeline run (each single model's merge run, the regime merges' and the studies' runs)."""

    params: Params
    layout: Layout
    rec: _Recorder
    client: Any  # MlflowClient
    lock: Mapping[str, dict]
    machines: Mapping[str, dict]  # provenance.json: the machine and kernels each stage ran on
    single_models: dict[str, str] = field(default_factory=dict)  # method -> its merge run (a single merged model)
    regime_merges: list[tuple[str, str, str]] = field(default_factory=list)
    studies: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        tasks = self.params.suite.tasks
        self.finetunes = {t: read_json(self.layout.metrics("finetune", t)) for t in tasks}
        self.individual = {t: self.finetunes[t]["individual"]["test"] for t in tasks}
        self.probe_avg = mean(self.finetunes[t]["probe"]["test"] for t in tasks)
        self.individual_avg = mean(self.individual.values())
        board = self.layout.results / "leaderboard.json"
        self.leaderboard = read_json(board) if board.is_file() else {"boards": {}}

    def interval(self, variant: str, method: str) -> dict[str, float]:
        """The leaderboard's 95% bootstrap interval of the method's test_avg in ``variant`` ("standard" or a regime
        variant) as test_avg_ci_low/high, %; {} where it has none."""
        entry = next((e for e in self.leaderboard["boards"].get(variant, []) if e["method"] == method), None)
        return (
            {}
            if entry is None or entry["low"] is None
            else {"test_avg_ci_low": entry["low"], "test_avg_ci_high": entry["high"]}
        )

    @property
    def root(self) -> Path:
        return self.layout.root

    def item(
        self,
        name: str,
        stage: str,
        files: list[Path],
        timing: Path,
        label: str = "",
        extra_time: tuple[str, ...] = (),
        extra_tags: Mapping[str, str] = {},
    ):
        """The run of stage item ``name`` (a context yielding its id, None when already logged) and its end time."""
        times = stage_times(timing, extra_time)
        tags = (
            {"mergeflow.stage": stage}
            | ({"mergeflow.item": label} if label else {})
            | dict(extra_tags)
            | machine_tags(self.machines.get(name))
        )
        return self.rec.run(name, fingerprint(self.lock.get(name), files, self.root), times, tags), times[1]

    def weights(self, run_id: str, entry_name: str, files: Mapping[Path, str]) -> None:
        if self.params.tracking.log_checkpoints:
            self.rec.weights(
                run_id, {p: _out_md5(self.lock.get(entry_name), p, self.root) for p in files}, lambda p: files[p]
            )


def _curve_history(log: Path) -> dict[str, list[tuple[int, float]]]:
    curve = curve_records(read_json(log), log)
    return {f"train.{k}": [(r["step"], r[k]) for r in curve] for k in curve[0] if k != "step"} if curve else {}


def record_prepare(t: Tracked) -> None:
    layout, params = t.layout, t.params
    ctx, end = t.item("prepare", "prepare", [layout.metrics("prepare")], layout.timing("prepare"))
    with ctx as run_id:
        if run_id:
            prep = read_json(layout.metrics("prepare"))
            images = {s: sum(sizes[s] for sizes in prep["tasks"].values()) for s in ("train", "val", "test")}
            metrics = {
                "wall_time_s": read_json(layout.timing("prepare"))["wall_time_s"],
                "pretrain_images": prep["pretrain_images"],
            }
            t.rec.log(
                run_id,
                {"seed": params.seed} | _flatten("suite", params.suite.model_dump(mode="json")),
                metrics | {f"task_images.{s}": n for s, n in images.items()},
                end,
            )


def record_pretrain(t: Tracked) -> None:
    layout, params = t.layout, t.params
    ctx, end = t.item(
        "pretrain", "pretrain", [layout.metrics("pretrain"), layout.pretrained], layout.timing("pretrain")
    )
    with ctx as run_id:
        if run_id:
            pre = read_json(layout.metrics("pretrain"))
            t.rec.log(
                run_id,
                _flatten("backbone", params.backbone.model_dump(mode="json"))
                | _flatten("pretrain", params.pretrain.model_dump(mode="json")),
                {
                    "wall_time_s": read_json(layout.timing("pretrain"))["wall_time_s"],
                    "parameters": pre["parameters"],
                    "final_loss": pre["final_loss"],
                }
                | {f"head_acc.{k}": percent(v) for k, v in pre["train_head_accuracy"].items()},
                end,
                _curve_history(layout.log("pretrain")),
            )
            t.weights(run_id, "pretrain", {layout.pretrained: "checkpoints"})


def record_finetunes(t: Tracked) -> None:
    layout, params = t.layout, t.params
    for task in params.suite.tasks:
        name = f"finetune@{task}"
        ctx, end = t.item(
            name,
            "finetune",
            [layout.metrics("finetune", task), layout.finetuned(task), layout.head(task)],
            layout.timing("finetune", task),
            task,
            extra_tags=STANDARD_TAGS,
        )
        with ctx as run_id:
            if run_id:
                m, probe = t.finetunes[task], t.finetunes[task]["probe"]
                logged = (
                    {"task": task, "steps": m["steps"], "head": probe.get("head", "probe")}
                    | ({"probe.C": probe["C"]} if probe.get("C") is not None else {})
                    | ({"imported": m["imported"]} if m.get("imported") else {})
                )
                metrics = {
                    "wall_time_s": read_json(layout.timing("finetune", task))["wall_time_s"],
                    "probe_acc": percent(probe["test"]),
                    "individual_acc": percent(m["individual"]["test"]),
                    "individual_val_acc": percent(m["individual"]["val"]),
                    "gain": percent(m["gain_over_probe"]["test"]),
                }
                t.rec.log(
                    run_id,
                    logged | _flatten("finetune", params.finetune.model_dump(mode="json")),
                    metrics,
                    end,
                    _curve_history(layout.log("finetune", task)),
                )
                t.weights(run_id, name, {layout.finetuned(task): "checkpoints", layout.head(task): "heads"})


def record_vectors(t: Tracked) -> None:
    layout = t.layout
    ctx, end = t.item(
        "vectors",
        "vectors",
        [layout.metrics("vectors"), layout.vectors / "stats.json"],
        layout.timing("vectors"),
        extra_tags=STANDARD_TAGS,
    )
    with ctx as run_id:
        if run_id:
            vec = read_json(layout.metrics("vectors"))
            metrics = (
                {"wall_time_s": read_json(layout.timing("vectors"))["wall_time_s"]}
                | {f"norm.{k}": v for k, v in vec["norms"].items()}
                | {f"relative_norm.{k}": v for k, v in vec["relative_norms"].items()}
            )
            t.rec.log(run_id, {"tasks": ",".join(t.params.suite.tasks)}, metrics, end)
            for f in ("stats.json", "cosine.png"):
                if (layout.vectors / f).is_file():
                    t.client.log_artifact(run_id, str(layout.vectors / f))


def _log_merge(t: Tracked, run_id: str, method: str, end: float) -> None:
    layout, name = t.layout, f"merge@{method}"
    mm, ev = read_json(layout.metrics("merge", method)), read_json(layout.metrics("evaluate", method))
    timing = read_json(layout.timing("merge", method))
    metrics = (
        merge_metrics(mm, ev, t.params.suite.tasks, t.individual, t.probe_avg, t.individual_avg)
        | {"wall_time_s": timing["wall_time_s"] + timing.get("evaluate_wall_time_s", 0.0)}
        | t.interval("standard", method)
    )
    t.rec.log(run_id, merge_params(mm, ev), metrics, end)
    t.client.log_dict(run_id, _val_curve(mm), "curves/val_curve.json")
    if "learned" in mm:  # AdaMerging's coefficients and entropy per step (the plot draws them)
        t.client.log_dict(run_id, mm["learned"], "learned/coefficients.json")
    log_search_plot(t.client, run_id, layout.log("merge", method, ".png"))
    if t.params.tracking.log_checkpoints and mm["kind"] == "model":
        _log_merged_model(
            t.rec, run_id, layout.merged(method), _out_md5(t.lock.get(name), layout.merged(method), t.root), t.params
        )
    elif mm["kind"] in ("per_task", "routed"):  # a store, not a timm model
        t.weights(run_id, name, {layout.merged(method): "merged"})


RANKED = {"mergeflow.ranked": "yes"}  # the runs the methods views rank: merges but negation, and the baselines


def baseline_run(method: str) -> str:
    """The run name of a leaderboard baseline ("Individual", "Pretrained (...)")."""
    return "baseline@individual" if method == INDIVIDUAL else "baseline@probe"


def record_baselines(t: Tracked) -> None:
    """The leaderboard's baselines as runs of their own (stage tag ``baseline``), so that the methods views rank
    the merges beside them: the pretrained model under the tasks' heads and the individual fine-tunes, with the
    merge runs' metrics (test_avg and its interval, test_acc.<task>, val_avg, gap_recovered, storage_models)."""
    tasks, layout = t.params.suite.tasks, t.layout
    timings = [stage_times(layout.timing("finetune", task)) for task in tasks]
    times = (min(a for a, _ in timings), max(b for _, b in timings))  # the fine-tunes', which measured them
    for key in ("probe", "individual"):
        test = {task: t.finetunes[task][key]["test"] for task in tasks}
        method = INDIVIDUAL if key == "individual" else pretrained_name(t.finetunes)
        metrics = {
            "test_avg": percent(mean(test.values())),
            "val_avg": percent(mean(t.finetunes[task][key]["val"] for task in tasks)),
            "gap_recovered": 0.0 if key == "probe" else 100.0,
            "storage_models": float(len(tasks)) if key == "individual" else 1.0,
            **{f"test_acc.{task}": percent(v) for task, v in test.items()},
        } | t.interval("standard", method)
        name = baseline_run(method)
        with t.rec.run(
            name,
            _sha256({"item": name, "method": method, "metrics": metrics}),
            times,
            {"mergeflow.stage": "baseline", "mergeflow.item": key} | STANDARD_TAGS | RANKED,
        ) as run_id:
            if run_id:
                t.rec.log(run_id, {"method": method, "kind": "baseline"}, metrics, times[1])


def record_merges(t: Tracked) -> None:
    layout = t.layout
    for method in t.params.merge.methods:
        name = f"merge@{method}"
        # the predictions: the leaderboard's interval, logged with the run, comes from them
        files = [
            layout.metrics("merge", method),
            layout.metrics("evaluate", method),
            layout.merged(method),
            *[p for p in [layout.predictions("merge", method)] if p.is_file()],
        ]
        kind = read_json(layout.metrics("merge", method))["kind"]
        ctx, end = t.item(
            name,
            "merge",
            files,
            layout.timing("merge", method),
            method,
            ("evaluate_wall_time_s",),
            STANDARD_TAGS | (RANKED if kind != "negation" else {}),
        )
        with ctx as run_id:
            if run_id:
                _log_merge(t, run_id, method, end)
        if kind == "model":
            t.single_models[method] = t.rec.stage_runs[name]
    record_baselines(t)


def record_regimes(t: Tracked) -> None:
    t.regime_merges = _track_regimes(
        t.params,
        t.layout,
        t.rec,
        _Hashes(t.lock, t.root),
        t.params.suite.tasks,
        t.individual,
        t.probe_avg,
        t.individual_avg,
        t.interval,
    )


def record_studies(t: Tracked) -> None:
    t.studies = _track_studies(t.params, t.layout, t.rec, t.lock)


# (the stages whose runs it logs, the recorder), in the order track logs them
RECORDERS: tuple[tuple[tuple[str, ...], Callable[[Tracked], None]], ...] = (
    (("prepare",), record_prepare),
    (("pretrain",), record_pretrain),
    (("finetune",), record_finetunes),
    (("vectors",), record_vectors),
    (("merge",), record_merges),
    (("regime", "regime_merge"), record_regimes),
    (("study",), record_studies),
)
# the stages with no run of their own, and why
NOT_RECORDED = {
    "statistics": "its Fisher diagonals and Grams are inputs of the data-aware merges, whose runs hold what they gave",
    "sources": "file digests: dvc.lock, logged with the pipeline run, holds them",
    "replicate": "its spread over seeds is in results/, logged with the pipeline run",
    "report": "the pipeline run holds results/",
    "track": "the pipeline run itself",
}
