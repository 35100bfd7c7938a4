"""dvc.yaml declares the same paths as mergeflow.stages.Layout, and each stage runs its own CLI command."""

from dvc.repo import Repo

from mergeflow.config import load_params
from mergeflow.stages import Layout


def test_dvc_stages_match_layout(repo_root):
    params = load_params(repo_root / "params.yaml")
    layout = Layout()
    with Repo(str(repo_root)) as repo:
        stages = {s.addressing: s for s in repo.index.stages}
    outs = {a: {str(o.def_path) for o in s.outs} for a, s in stages.items()}
    expected = {"prepare", "pretrain", "vectors", "report", "track"} | {f"finetune@{t}" for t in params.suite.tasks}
    expected |= {f"merge@{m}" for m in params.merge.methods}
    assert set(stages) == expected
    assert str(layout.pretrained) in outs["pretrain"] and str(layout.metrics("pretrain")) in outs["pretrain"]
    for t in params.suite.tasks:
        assert {str(layout.finetuned(t)), str(layout.head(t)), str(layout.epochs(t)), str(layout.metrics("finetune", t)), str(layout.log("finetune", t)), str(layout.timing("finetune", t))} == outs[f"finetune@{t}"]
        assert stages[f"finetune@{t}"].cmd == "mergeflow finetune"  # the task comes from DVC_STAGE
    for m in params.merge.methods:
        assert {str(layout.merged(m)), str(layout.metrics("merge", m)), str(layout.metrics("evaluate", m)), str(layout.log("merge", m, ".png")), str(layout.log("merge", m)), str(layout.timing("merge", m))} == outs[f"merge@{m}"]
        assert stages[f"merge@{m}"].cmd == "mergeflow merge"  # the method comes from DVC_STAGE
    assert outs["vectors"] == {str(layout.vectors), str(layout.metrics("vectors")), str(layout.timing("vectors"))}
    assert outs["report"] == {str(layout.results), str(layout.metrics("summary"))}
    # the headline is the one metrics file (what `dvc exp show` compares); no stage depends on a wall time
    assert {str(o.def_path) for s in stages.values() for o in s.outs if o.metric} == {str(layout.metrics("summary"))}
    assert not [d for s in stages.values() for d in s.deps if str(d.def_path).startswith("logs/timing") or str(d.def_path) == "logs"]
