import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)


def run(cmd, cwd, env, timeout=None, check=True):
    """Run a command (a list, or a shell string), assert it succeeded (unless check=False); stdout + stderr."""
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, shell=isinstance(cmd, str))
    if check:
        assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc if not check else proc.stdout + proc.stderr


@pytest.fixture(scope="session")
def tiny_env(tmp_path_factory) -> dict[str, str]:
    """The environment every end-to-end command runs in: this venv first, offline, its own homes, and
    one stage server for the session (mergeflow.stage_server: the stages fork from it instead of importing torch
    and timm, seconds each; tests/test_stage_server.py checks that a stage gives the same bytes either way)."""
    from mergeflow.stage_server import SERVER_ENV, running_server

    home = tmp_path_factory.mktemp("homes")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_", "DVC_", SERVER_ENV))}
    env |= {"PATH": f"{Path(sys.executable).parent}:{env['PATH']}", "HF_HUB_OFFLINE": "1", "PREFECT_HOME": str(home / "prefect")}
    env |= {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    with running_server(env) as address:
        if address:
            env[SERVER_ENV] = address
        yield env


@pytest.fixture(scope="session", autouse=True)
def _stage_commands_served(tiny_env):
    """Every `mergeflow <stage>` a test starts as a process forks from the session's stage server (seconds of
    imports saved each), whatever environment the test builds from os.environ; one whose import-time variables
    differ runs in its own process, as without a server."""
    from mergeflow.stage_server import SERVER_ENV

    os.environ[SERVER_ENV] = tiny_env[SERVER_ENV]
    yield
    os.environ.pop(SERVER_ENV, None)


def make_tiny_project(dst: Path, env: dict[str, str], **override) -> Path:
    """A fresh clone-like copy of this repository (tracked and untracked-not-ignored files, no tests, no outputs)
    on the tiny profile, committed in a git repository of its own."""
    from .profiles import tiny_params_text

    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
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
    run once per test session: (root, its output). Tests that change a project work on a copy (copy_project)."""
    root = make_tiny_project(tmp_path_factory.mktemp("reference"), tiny_env)
    out = run("mergeflow repro", root, tiny_env)
    return root, out


def copy_project(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True)
    return dst


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory, tiny_env):
    """A running Prefect server (`prefect server start`), started once per test session: the flows' PREFECT_API_URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server_env = tiny_env | {"PREFECT_HOME": str(tmp_path_factory.mktemp("prefect-server-home"))}
    proc = subprocess.Popen(["prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)], env=server_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "prefect server did not start"
                time.sleep(1)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
