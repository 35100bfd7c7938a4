"""The Prefect task's retry rule and the stage runner's failure report, without a Prefect server."""

import pytest

from mergeflow.orchestration import StageFailed, StageNode, run_stage, stage_graph, stage_threads
from tasks.stages import _retry_unless_bad_input


class _State:
    def __init__(self, error: Exception | None):
        self.error = error

    def result(self):
        if self.error:
            raise self.error
        return {"stage": "x"}


@pytest.mark.parametrize(
    ("error", "retry"),
    [
        (StageFailed("merge@ties", 1, "killed"), True),  # a crash may be transient
        (StageFailed("merge@ties", 137, "out of memory"), True),
        (StageFailed("merge@ties", 2, "error: params.yaml: merge.ties.k: ..."), False),  # bad input: retrying cannot help
        (RuntimeError("lost the connection"), True),
        (None, False),
    ],
)
def test_retry_rule(error, retry):
    assert _retry_unless_bad_input(None, None, _State(error)) is retry


def test_failed_stage_reports_its_status_and_last_line(tmp_path):
    node = StageNode("finetune@digits", "echo starting; echo 'error: task digits: no such file' >&2; exit 2", ())
    with pytest.raises(StageFailed) as err:
        run_stage(node, tmp_path)
    assert err.value.returncode == 2 and err.value.address == "finetune@digits"
    assert str(err.value).endswith("error: task digits: no such file")


def test_concurrent_stages_share_the_cores_and_lone_stages_get_them_all(repo_root):
    nodes = stage_graph(repo_root)  # the real dvc.yaml: 8 fine-tunes, 19 merges
    every = {n.address for n in nodes}
    threads = stage_threads(nodes, every, workers=2, cores=2)
    assert threads["prepare"] == threads["pretrain"] == threads["vectors"] == threads["report"] == 2
    assert threads["finetune@digits"] == threads["merge@ties"] == 1
    assert stage_threads(nodes, every, workers=4, cores=16)["finetune@digits"] == 4
    # only one merge left to run: it has no sibling to share with
    assert stage_threads(nodes, {"merge@ties", "report", "track"}, workers=2, cores=2) == {"merge@ties": 2, "report": 2, "track": 2}
