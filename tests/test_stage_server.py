"""The stage server (mergeflow.runner.stage_server): a stage forked from it writes the same bytes as the stage run
in its own process, its exit status and error line come back unchanged, and it dies with its command."""

import hashlib
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import yaml

from mergeflow.runner.stage_server import SERVER_ENV

from .conftest import copy_project, run
from .test_faults import _project_processes

pytestmark = pytest.mark.e2e


def _digest(path: Path) -> str:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode() + f.read_bytes())
    return h.hexdigest()


def _own_process_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k != SERVER_ENV}


@pytest.fixture(scope="module")
def project(tiny_reference, tmp_path_factory):
    return copy_project(tiny_reference[0], tmp_path_factory.mktemp("stage-server") / "p")


def test_the_session_runs_its_stages_through_a_server(tiny_env):
    assert Path(tiny_env[SERVER_ENV]).exists()


@pytest.mark.parametrize(
    "stage, outputs",
    [
        (
            ["finetune", "--task", "digits"],
            ["models/finetuned/digits.safetensors", "models/heads/digits.safetensors", "metrics/finetune/digits.json"],
        ),
        (["vectors"], ["vectors"]),
        (
            ["merge", "--method", "ties"],
            ["merged/ties.safetensors", "metrics/merge/ties.json", "metrics/evaluate/ties.json"],
        ),
    ],
)
def test_a_stage_in_its_own_process_writes_what_the_server_wrote(project, tiny_reference, tiny_env, stage, outputs):
    """The reference run's stages forked from the session's server; here each runs again in a process of its own
    (no server): the same bytes. Fine-tuning shows that seeds, threads and the probe's solver start alike."""
    reference = tiny_reference[0]
    run(["mergeflow", *stage], project, _own_process_env(tiny_env))
    for out in outputs:
        assert _digest(project / out) == _digest(reference / out), out


def test_exit_status_and_error_line_come_back(project, tiny_env):
    (project / "bad.yaml").write_text("seed: [1\n")
    for env in (tiny_env, _own_process_env(tiny_env)):
        proc = run(["mergeflow", "--params", "bad.yaml", "vectors"], project, env, check=False)
        assert proc.returncode == 2 and proc.stderr.startswith("error: bad.yaml") and "Traceback" not in proc.stderr, (
            proc.stderr
        )


def _wait(predicate, what: str, timeout: float = 120) -> None:
    """Polls, with a limit for a hang only (not a measurement)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_a_stage_dies_with_its_command(project, tiny_env, how):
    """A long pretraining through the server: the command killed outright (SIGKILL, as a dying parent's death
    signal or a scheduler does) or asked to stop (SIGTERM): the forked stage is gone with it."""
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["pretrain"]["steps"] = 100000
    (project / "long.yaml").write_text(yaml.safe_dump(params))
    command = subprocess.Popen(
        ["mergeflow", "--params", "long.yaml", "pretrain"],
        cwd=project,
        env=tiny_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait(lambda: len(_project_processes(project)) >= 2, "the forked stage did not start")  # the command and its stage
    stage = next(p for p in _project_processes(project) if p.pid != command.pid)
    assert stage.ppid() != command.pid  # forked by the server, not started by the command
    time.sleep(1.0)
    command.send_signal(how)
    command.wait()
    _wait(
        lambda: not stage.is_running() or stage.status() == psutil.STATUS_ZOMBIE,
        f"the stage outlived its command ({how.name})",
    )
    if how == signal.SIGTERM:
        assert command.returncode == 128 + signal.SIGTERM


def test_a_variable_the_servers_own_imports_set_does_not_send_a_command_away():
    """A launcher that imported torch passes on what torch's import set (TORCHINDUCTOR_CACHE_DIR): its stages are
    still the server's; a value the user set otherwise, or a variable the server never had, sends them away."""
    from mergeflow.runner.stage_server import _same_imports

    server = {"HF_HUB_OFFLINE": "1"}
    set_by_imports = {"TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_u"}
    assert _same_imports({"HF_HUB_OFFLINE": "1"}, server, set_by_imports)
    assert _same_imports(
        {"HF_HUB_OFFLINE": "1", "TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_u"}, server, set_by_imports
    )
    assert not _same_imports({"HF_HUB_OFFLINE": "1", "TORCHINDUCTOR_CACHE_DIR": "/elsewhere"}, server, set_by_imports)
    assert not _same_imports({"HF_HUB_OFFLINE": "0"}, server, set_by_imports)
    assert not _same_imports({}, server, set_by_imports)
    assert not _same_imports({"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}, server, set_by_imports)
