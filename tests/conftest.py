import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

import mergeflow  # noqa: F401 - before torch: the deterministic mode's kernels, pinned as every stage has them
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


# `make test` runs on pytest-xdist workers (-n auto): the cores are shared among them
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
SHARED_ENV = "MERGEFLOW_TEST_SHARED"  # the folder every worker of one run shares
THREADS = max(1, min(2, (os.cpu_count() or 1) // WORKERS))  # a worker's share of the cores, for torch in-process


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(THREADS)


def pytest_configure(config):
    """Under pytest-xdist (`make test`: -n auto --dist loadfile) the controller makes a folder the workers share:
    the tiny reference run and the Prefect server are made there once for the whole run."""
    if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ[SHARED_ENV] = tempfile.mkdtemp(prefix="mergeflow-tests-")


def pytest_unconfigure(config):
    """The controller stops the Prefect server a worker started for the run, and removes the shared folder."""
    shared = os.environ.get(SHARED_ENV)
    if shared and not os.environ.get("PYTEST_XDIST_WORKER"):
        pid = Path(shared, "prefect-server.pid")
        if pid.exists():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(pid.read_text()), signal.SIGTERM)
        shutil.rmtree(shared, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """On xdist workers, the modules that use the tiny reference run or the Prefect server go first (a module is one
    unit of work, its module fixtures built once): the longest units start early instead of ending the run last.
    While one worker makes the reference run (two stages at once), the other waits for it: running the ta8-shaped
    module beside it instead took both 2x longer (threads that wait spin under OpenMP)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = {item.path for item in items if {"tiny_reference", "prefect_server"} & set(item.fixturenames)}
        items.sort(key=lambda item: item.path not in shared)


def run(cmd, cwd, env, timeout=None, check=True):
    """Run a command (a list, or a shell string), assert it succeeded (unless check=False); stdout + stderr."""
    proc = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, shell=isinstance(cmd, str)
    )
    if check:
        assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc if not check else proc.stdout + proc.stderr


@pytest.fixture(scope="session")
def tiny_env(tmp_path_factory) -> dict[str, str]:
    """The environment every end-to-end command runs in: this venv first, offline, its own homes, and
    one stage server for the session (mergeflow.runner.stage_server: the stages fork from it instead of importing torch
    and timm, seconds each; tests/test_stage_server.py checks that a stage gives the same bytes either way)."""
    from mergeflow.runner.stage_server import SERVER_ENV, running_server

    home = tmp_path_factory.mktemp("homes")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_", "DVC_", SERVER_ENV))}
    env |= {
        "PATH": f"{Path(sys.executable).parent}:{env['PATH']}",
        "HF_HUB_OFFLINE": "1",
        "PREFECT_HOME": str(home / "prefect"),
    }
    env |= {
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    with running_server(env) as address:
        if address:
            env[SERVER_ENV] = address
        yield env


@pytest.fixture(scope="session", autouse=True)
def _stage_commands_served(tiny_env):
    """Every `mergeflow <stage>` a test starts as a process forks from the session's stage server (seconds of
    imports saved each), whatever environment the test builds from os.environ; one whose import-time variables
    differ runs in its own process, as without a server."""
    from mergeflow.runner.stage_server import SERVER_ENV

    os.environ[SERVER_ENV] = tiny_env[SERVER_ENV]
    yield
    os.environ.pop(SERVER_ENV, None)


def make_tiny_project(dst: Path, env: dict[str, str], **override) -> Path:
    """A fresh clone-like copy of this repository (tracked and untracked-not-ignored files, no tests, no outputs)
    on the tiny profile, committed in a git repository of its own."""
    from .profiles import tiny_params_text

    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for f in files:
        if (REPO / f).is_file() and not f.startswith("tests/") and f != "dvc.lock":
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, dst / f)
    (dst / "params.yaml").write_text(tiny_params_text(REPO / "params.yaml", **override))
    run("git init -q && git add -A && git commit -qm tiny", dst, env)
    return dst


@pytest.fixture(scope="session")
def tiny_reference(tmp_path_factory, tiny_env):
    """One `mergeflow repro` of the tiny profile on a fresh project (stages at once, as `make pipeline` runs them),
    run once per test session, whichever xdist worker asks first: (root, its output). Tests that change a project work
    on a copy (copy_project)."""
    from filelock import FileLock

    shared = Path(os.environ.get(SHARED_ENV) or tmp_path_factory.getbasetemp())
    root, output = shared / "tiny-reference", shared / "tiny-reference.out"
    with FileLock(f"{root}.lock"):
        if not output.exists():
            shutil.rmtree(root, ignore_errors=True)  # what a failed attempt left
            root.mkdir()
            output.write_text(run("mergeflow repro", make_tiny_project(root, tiny_env), tiny_env))
    return root, output.read_text()


def copy_project(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True)
    return dst


def _start_prefect_server(
    home: Path, env: dict[str, str], pid_file: Path | None = None
) -> tuple[subprocess.Popen, str]:
    """`prefect server start` on a free port, in a process group of its own (its id written to ``pid_file``); (its
    process, its API URL) once it answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = ["prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(
        cmd,
        env=env | {"PREFECT_HOME": str(home)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    if pid_file:
        pid_file.write_text(str(proc.pid))
    url = f"http://127.0.0.1:{port}/api"
    while True:  # no deadline: pytest-timeout ends a hang, and a busy machine may take long
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return proc, url
        except OSError:
            assert proc.poll() is None, "prefect server did not start"
            time.sleep(1)


_SHARED_SERVERS: list[subprocess.Popen] = []  # a worker's handle on the run's server, which the controller stops


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory, tiny_env):
    """A running Prefect server, started once per test run (under xdist by the first worker that asks, and stopped
    by the controller): the flows' PREFECT_API_URL."""
    shared = os.environ.get(SHARED_ENV)
    if not shared:
        proc, url = _start_prefect_server(tmp_path_factory.mktemp("prefect-server-home"), tiny_env)
        try:
            yield url
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        return
    from filelock import FileLock

    url_file = Path(shared, "prefect-server.url")
    with FileLock(f"{url_file}.lock"):
        if not url_file.exists():
            proc, url = _start_prefect_server(
                Path(shared, "prefect-server-home"), tiny_env, Path(shared, "prefect-server.pid")
            )
            _SHARED_SERVERS.append(proc)
            url_file.write_text(url)
    yield url_file.read_text()
