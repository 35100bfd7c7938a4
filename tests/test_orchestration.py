"""The Prefect task's retry rule, the stage runner (argument lists, failure report, stopping), dvc.lock's
recovery and atomic writes, and the flow's refusal to share the repository: without a Prefect server."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from mergeflow.core import lockfile

from mergeflow.runner import graph, running
from mergeflow.core.errors import MergeflowError, TransientError
from mergeflow.runner.graph import StageNode, locked_repo
from mergeflow.runner.running import StageFailed, StageNotStarted, run_stage
from tasks.stages import _retry_if_transient

DVC = os.path.join(os.path.dirname(sys.executable), "dvc")


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
        (StageFailed("merge@ties", -9, "killed"), True),  # the OOM killer, a preempted node
        (StageFailed("merge@ties", 75, "error: the MLflow store is locked by another process"), True),
        (
            StageFailed("merge@ties", 2, "error: params.yaml: merge.ties.k: ..."),
            False,
        ),  # bad input: retrying cannot help
        (StageFailed("merge@ties", 1, "ZeroDivisionError: division by zero"), False),  # a bug fails the same way again
        (RuntimeError("lost the connection"), True),
        (None, False),
    ],
)
def test_retry_rule(error, retry):
    assert _retry_if_transient(None, None, _State(error)) is retry


def _node(tmp_path, script: str, address="finetune@digits") -> StageNode:
    (tmp_path / "stage.py").write_text(script)
    return StageNode(address, (sys.executable, "stage.py"), ())


def test_failed_stage_reports_its_status_and_last_line(tmp_path):
    node = _node(
        tmp_path,
        "import sys\nprint('starting')\nprint('error: task digits: no such file', file=sys.stderr)\nsys.exit(2)\n",
    )
    with pytest.raises(StageFailed) as err:
        run_stage(node, tmp_path)
    assert (
        err.value.returncode == 2
        and err.value.address == "finetune@digits"
        and err.value.bad_input
        and not err.value.transient
    )
    assert str(err.value).endswith("error: task digits: no such file")


def test_stage_runs_as_an_argument_list_with_dvc_stage_set(tmp_path):
    """No shell: metacharacters in an argument stay characters, and the stage learns its address as under DVC."""
    (tmp_path / "show.py").write_text("import os, sys\nprint(repr(sys.argv[1:]), os.environ['DVC_STAGE'])\n")
    node = StageNode("merge@ties", (sys.executable, "show.py", "a;touch pwned;#", "$(touch pwned2)"), ())
    result = run_stage(node, tmp_path)
    assert "['a;touch pwned;#', '$(touch pwned2)'] merge@ties" in result["output"]
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "pwned2").exists()


@pytest.mark.parametrize(
    "cmd", ["mergeflow prepare && rm -rf data", "mergeflow merge | tee log", "mergeflow report > out"]
)
def test_a_command_needing_a_shell_is_refused(cmd):
    with pytest.raises(MergeflowError, match=r"needs a shell; the flow runs commands as argument lists"):
        graph._argv("report", cmd)


def test_stop_stages_ends_running_stages_and_refuses_new_ones(tmp_path):
    node = _node(tmp_path, "import time\ntime.sleep(60)\n")
    errors = []
    thread = threading.Thread(target=lambda: errors.append(pytest.raises(StageFailed, run_stage, node, tmp_path).value))
    thread.start()
    deadline = time.monotonic() + 20
    while not running._running and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        started = time.monotonic()
        assert running.stop_stages(grace_s=5) == 1
        thread.join(50)
        # well short of the stage's 60 s sleep (SIGTERM after a 5 s grace), with room for a busy machine
        assert time.monotonic() - started < 50 and errors[0].returncode == -signal.SIGTERM
        assert not errors[0].transient  # stopped on purpose: not retried
        with pytest.raises(
            StageNotStarted, match="not started: the run is stopping"
        ):  # a StageFailed, recorded as not run
            run_stage(node, tmp_path)
    finally:
        running._stopping.clear()


def test_a_foreach_stages_items_share_the_cores_by_params_alone(repo_root, monkeypatch):
    """A stage's threads follow from params.yaml and its address alone (they decide the last bits of what it
    trains): plain `dvc repro`, `mergeflow repro` and the flow give each the same count."""
    from mergeflow.params import load_params

    params = load_params(repo_root / "params.yaml")  # 8 tasks, 24 methods, 2 regimes, 2 studies
    # deterministic (the default): two threads a stage whatever the machine; the share below is the fast mode's
    with monkeypatch.context() as m:
        m.setattr(os, "cpu_count", lambda: 16)
        assert params.threads() == 2
    params = params.model_copy(update={"runtime": params.runtime.model_copy(update={"deterministic": False})})
    items = ("finetune@digits", "merge@ties", "regime_merge@mima", "study@mima")
    lone = ("prepare", "pretrain", "vectors", "statistics", "regime@mima", "report", "track", "")
    assert [params.stage_share(a, cores=2) for a in items + lone] == [None] * 12  # 2 cores: every stage takes both
    assert [params.stage_share(a, cores=16) for a in items] == [2, 2, 8, 8]  # 8 fine-tunes at once, 8 merges, 2 studies
    assert [params.stage_share(a, cores=16) for a in lone] == [None] * 8
    assert params.stage_share("finetune@digits", cores=3) == 2 and params.stage_share("merge@ties", cores=1) is None
    monkeypatch.delenv("MERGEFLOW_THREADS", raising=False)
    monkeypatch.setenv("DVC_STAGE", "merge@ties")
    assert params.threads() == params.stage_share("merge@ties")
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert params.threads() == 2
    monkeypatch.setenv("MERGEFLOW_THREADS", "3")  # fixed by the user: wins
    assert params.threads() == 3


def test_on_the_gpu_path_each_stage_takes_its_gpus_share_of_the_cores(repo_root, monkeypatch):
    """A stage with a GPU to itself runs beside as many stages as there are GPUs, not beside its foreach siblings:
    on 16 cores and one GPU every stage takes every core (a ta8 merge's host work: TIES, DARE, Breadcrumbs); on
    eight GPUs, two each. The count is the GPUs `mergeflow repro` hands out (MERGEFLOW_RUN_GPUS) or, under plain
    `dvc repro`, the GPUs the stage sees: the same for both. No GPU path where the stages stay on the CPU."""
    import torch

    from mergeflow.params import load_params
    from mergeflow.core.devices import RUN_GPUS_ENV, run_gpus

    params = load_params(repo_root / "params.yaml")
    stages = ("finetune@digits", "merge@ties", "vectors", "statistics")
    assert [params.stage_share(a, cores=16, gpus=1) for a in stages] == [None] * 4
    assert [params.stage_share(a, cores=16, gpus=8) for a in stages] == [2] * 4
    assert (
        params.stage_share("prepare", cores=16, gpus=8) is None
        and params.stage_share("pretrain", cores=16, gpus=8) is None
    )  # alone
    assert (
        params.stage_share("merge@ties", cores=16, gpus=3) == 5
        and params.stage_share("merge@ties", cores=2, gpus=2) is None
    )
    from mergeflow.core import devices

    monkeypatch.setattr(devices, "gpu_driver_present", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv(RUN_GPUS_ENV, raising=False)
    assert run_gpus(params.runtime.device) == 4  # plain dvc repro: the GPUs it sees
    monkeypatch.setenv(RUN_GPUS_ENV, "2")
    assert run_gpus(params.runtime.device) == 2 and params.stage_share("merge@ties", cores=16) == 8
    on_cpu = params.model_copy(update={"runtime": params.runtime.model_copy(update={"device": "cpu"})})
    assert (
        run_gpus(on_cpu.runtime.device) == 0 and on_cpu.stage_share("merge@ties", cores=16) == 2
    )  # the items' share again
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run_gpus(params.runtime.device) == 0  # pretend GPUs on a machine without CUDA: the CPU's rule
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(devices, "gpu_driver_present", lambda: False)
    assert run_gpus(params.runtime.device) == 0  # no GPU driver on the machine: CUDA is not asked


def _dvc_project(tmp_path):
    """A one-stage DVC project: `echo` into out.txt."""
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([DVC, "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "dvc.yaml").write_text(
        "stages:\n  one:\n    cmd: python -c \"open('out.txt','w').write('1')\"\n    outs: [out.txt]\n"
    )
    return tmp_path


def test_truncated_lock_is_restored_from_the_good_copy(tmp_path):
    root = _dvc_project(tmp_path)
    subprocess.run([DVC, "repro", "-q"], cwd=root, check=True)
    good = (root / "dvc.lock").read_text()
    assert lockfile.recover(root) is None and lockfile.good_copy(root).read_text() == good
    (root / "dvc.lock").write_text(good[: len(good) // 2])  # as a kill in the middle of DVC's write leaves it
    notice = lockfile.recover(root)
    assert "was unreadable" in notice and "restored from" in notice
    assert (root / "dvc.lock").read_text() == good
    assert subprocess.run([DVC, "status"], cwd=root, capture_output=True, text=True).returncode == 0


def test_empty_lock_without_a_copy_comes_back_from_git(tmp_path):
    root = _dvc_project(tmp_path)
    subprocess.run([DVC, "repro", "-q"], cwd=root, check=True)
    good = (root / "dvc.lock").read_text()
    subprocess.run(
        "git add -A && git -c user.name=t -c user.email=t@t commit -qm one", shell=True, cwd=root, check=True
    )
    (root / "dvc.lock").write_text("")
    assert "restored from git HEAD" in lockfile.recover(root)
    assert (root / "dvc.lock").read_text() == good


def test_unrecoverable_lock_is_one_line(tmp_path):
    root = _dvc_project(tmp_path)
    (root / "dvc.lock").write_text("schema: '2.0'\nstages:\n  one:\n    cmd: [")
    with pytest.raises(MergeflowError, match=r"dvc.lock: unreadable \(\d+ bytes\) and no good copy to restore it from"):
        lockfile.recover(root)


def test_dvc_lock_writes_are_atomic(tmp_path, monkeypatch):
    """A failure in the middle of DVC's dump (as a kill would be) leaves the previous dvc.lock, not half of one."""
    from dvc.repo import Repo

    root = _dvc_project(tmp_path)
    subprocess.run([DVC, "repro", "-q"], cwd=root, check=True)
    before = (root / "dvc.lock").read_text()
    (root / "out.txt").write_text("2")
    import ruamel.yaml

    def half_then_die(self, data, stream, *args, **kwargs):
        stream.write("schema: '2.0'\nsta")
        raise KeyboardInterrupt

    with lockfile.atomic_dvc_writes(), Repo(str(root)) as repo:
        monkeypatch.setattr(ruamel.yaml.YAML, "dump", half_then_die)
        with pytest.raises(KeyboardInterrupt):
            graph.commit_stage(repo, "one")
    assert (root / "dvc.lock").read_text() == before
    assert not [p for p in root.iterdir() if ".tmp-" in p.name]


def test_flow_refuses_a_repository_another_dvc_command_holds(tmp_path):
    root = _dvc_project(tmp_path)
    with locked_repo(root):
        proc = subprocess.run([DVC, "repro"], cwd=root, capture_output=True, text=True)
        assert proc.returncode != 0 and "Unable to acquire lock" in proc.stderr
        assert not (root / "out.txt").exists()  # refused before running anything
        with pytest.raises(
            TransientError, match=r"another DVC command holds the repository lock; run again when it ends$"
        ):
            with locked_repo(root):  # exit status 75: a later run gets past it
                pass
    # a stage that another DVC process is running (DVC drops its repository lock meanwhile, but records it)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (root / ".dvc" / "tmp" / "rwlock").write_text(
            json.dumps({"read": {}, "write": {str(root / "out.txt"): {"pid": sleeper.pid, "cmd": "dvc repro"}}})
        )
        with pytest.raises(
            TransientError, match=rf"another DVC command is running a stage here \(pid {sleeper.pid}: dvc repro\)"
        ):
            with locked_repo(root):
                pass
    finally:
        sleeper.kill()
    with locked_repo(root):  # the recorded process is gone: nothing blocks
        pass


def test_sweep_removes_only_dead_processes_temporaries(tmp_path):
    from mergeflow.core.files import sweep_temporaries, temporary_prefix

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "vectors").mkdir()
    leftovers = [
        tmp_path / "vectors" / f".digits.safetensors.tmp-{dead.pid}-ab12",
        tmp_path / f".vectors.old-{dead.pid}",
    ]
    leftovers[0].write_bytes(b"half")
    leftovers[1].mkdir()
    (leftovers[1] / "x.safetensors").write_bytes(b"old")
    mine = tmp_path / "vectors" / (temporary_prefix(tmp_path / "count.safetensors") + "cd34")  # a write in progress
    mine.write_bytes(b"being written")
    kept = [tmp_path / "vectors" / "digits.safetensors", tmp_path / "vectors" / "notes.tmp-1-x"]  # not hidden: not ours
    for path in kept:
        path.write_bytes(b"output")
    assert sorted(sweep_temporaries([tmp_path])) == sorted(leftovers)
    assert mine.exists() and all(p.exists() for p in kept) and not any(p.exists() for p in leftovers)
