"""dvc.yaml declares the same paths as mergeflow.pipeline.stages.Layout, and each stage runs its own CLI command."""

from dvc.repo import Repo

from mergeflow.params import load_params
from mergeflow.pipeline.stages import Layout


def test_dvc_stages_match_layout(repo_root):
    params = load_params(repo_root / "params.yaml")
    layout = Layout()
    with Repo(str(repo_root)) as repo:
        stages = {s.addressing: s for s in repo.index.stages}
    outs = {a: {str(o.def_path) for o in s.outs} for a, s in stages.items()}
    expected = {"prepare", "pretrain", "vectors", "statistics", "sources", "report", "track"} | {
        f"finetune@{t}" for t in params.suite.tasks
    }
    expected |= {f"merge@{m}" for m in params.merge.methods}
    expected |= {f"{stage}@{r}" for stage in ("regime", "regime_merge") for r in params.regimes.run} | {
        f"study@{s}" for s in params.studies.run
    }
    assert set(stages) == expected
    assert str(layout.pretrained) in outs["pretrain"] and str(layout.metrics("pretrain")) in outs["pretrain"]
    for t in params.suite.tasks:
        assert {
            str(layout.finetuned(t)),
            str(layout.head(t)),
            str(layout.epochs(t)),
            str(layout.metrics("finetune", t)),
            str(layout.log("finetune", t)),
            str(layout.predictions("finetune", t)),
        } == outs[f"finetune@{t}"]
        assert stages[f"finetune@{t}"].cmd == "mergeflow finetune"  # the task comes from DVC_STAGE
    for m in params.merge.methods:
        assert {
            str(layout.merged(m)),
            str(layout.metrics("merge", m)),
            str(layout.metrics("evaluate", m)),
            str(layout.log("merge", m, ".png")),
            str(layout.log("merge", m)),
            str(layout.predictions("merge", m)),
        } == outs[f"merge@{m}"]
        assert stages[f"merge@{m}"].cmd == "mergeflow merge"  # the method comes from DVC_STAGE
    for r in params.regimes.run:
        assert outs[f"regime@{r}"] == {str(layout.regime(r)), str(layout.metrics("regime", r))}
        assert (
            stages[f"regime@{r}"].cmd == "mergeflow regime"
            and stages[f"regime_merge@{r}"].cmd == "mergeflow regime_merge"
        )
        for variant in params.regimes.config(r).variants(r, params.finetune.steps):
            assert layout.regime_vectors(r, variant).is_relative_to(layout.regime(r))
            for m in params.regimes.methods_of(r):
                run = layout.merge_run(m, r, variant)
                for path in (
                    run.merged,
                    run.choice,
                    run.evaluation,
                    run.search_plot,
                    run.search_log,
                    run.predictions,
                ):  # each inside one of the stage's outs
                    assert sum(path.is_relative_to(o) for o in outs[f"regime_merge@{r}"]) == 1, path
    for s in params.studies.run:
        assert outs[f"study@{s}"] == {str(layout.study(s)), str(layout.metrics("studies", s)), str(layout.verdicts(s))}
        assert stages[f"study@{s}"].cmd == "mergeflow study"
    assert outs["vectors"] == {str(layout.vectors), str(layout.metrics("vectors"))}
    assert outs["statistics"] == {
        str(layout.statistics(params.suite.tasks[0]).parent),
        str(layout.metrics("statistics")),
    }
    assert stages["statistics"].cmd == "mergeflow statistics"
    assert outs["report"] == {str(layout.results), str(layout.headline)}
    # the declared metrics are the headline and the verdict counts (what `dvc metrics show` and `dvc exp show`
    # compare); no stage depends on a wall time
    metrics = {str(o.def_path): o for s in stages.values() for o in s.outs if o.metric}
    assert set(metrics) == {str(layout.headline)} | {str(layout.verdicts(s)) for s in params.studies.run}
    # ... kept in git, not DVC's cache: a clone shows the committed run's headline (dvc metrics show, diff HEAD~1)
    assert not any(o.use_cache for o in metrics.values())
    import subprocess

    for path in (layout.headline / "ties.json", layout.verdicts("mima")):
        assert subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=repo_root).returncode == 1, path
    assert not [
        d
        for s in stages.values()
        for d in s.deps
        if str(d.def_path).startswith("logs/timing") or str(d.def_path) == "logs"
    ]
    # wall times and the MLflow run ids are no stage's output: they differ from run to run, and a run must leave the
    # committed dvc.lock as it is
    assert not [o for s in stages.values() for o in s.outs if str(o.def_path).startswith("logs/timing")]
    assert not stages["track"].outs and str(layout.metrics("tracking")) not in {o for os_ in outs.values() for o in os_}
