"""A stage started by plain `dvc repro` dies with it: SIGKILL or SIGTERM to the dvc process alone (a closed
terminal, a job scheduler) leaves no process of the run, neither the stage nor its worker pool's processes.

The stage here is a stand-in that does what a mergeflow stage does at its start (mergeflow.runner.lifetime's
die_with_parent, then a pool from mergeflow.core.parent_death.process_pool, as prepare's), without seconds of torch."""

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
HANG_S = 120  # a limit for a hang on a loaded machine, not a measurement

STAGE = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path

    def work(path):
        Path(path).write_text(str(os.getpid()))
        time.sleep(3600)

    if __name__ == "__main__":
        from mergeflow.runner.lifetime import die_with_parent
        from mergeflow.core.parent_death import process_pool

        if os.environ.get("STANDIN_DIES_WITH_PARENT", "1") == "1":
            die_with_parent()
        Path("stage.pid").write_text(f"{os.getpid()} {os.getppid()}")
        if os.environ.get("STANDIN_POOL") == "plain":  # as a regime's pool: no parent-death signal of its own
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            pool = ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"))
        else:
            pool = process_pool(2)
        for i in range(2):
            pool.submit(work, f"worker{i}.pid")
        time.sleep(3600)
""")


def _project(root: Path, shell: str) -> dict[str, str]:
    root.mkdir()
    (root / "stage.py").write_text(STAGE)
    (root / "dvc.yaml").write_text(f"stages:\n  standin:\n    cmd: {sys.executable} stage.py\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DVC_", "MERGEFLOW_"))}
    env |= {
        "PYTHONPATH": str(REPO / "src"),
        "SHELL": shell,
        "DVC_NO_ANALYTICS": "1",
        "PATH": f"{Path(sys.executable).parent}:{env['PATH']}",
    }
    subprocess.run(["dvc", "init", "--no-scm", "-q"], cwd=root, env=env, check=True)
    return env


def _pids(root: Path) -> list[int]:
    return [
        int((root / f).read_text().split()[0])
        for f in ("stage.pid", "worker0.pid", "worker1.pid")
        if (root / f).is_file() and (root / f).read_text()
    ]


def _alive(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _kill_dvc_and_wait(root: Path, env: dict[str, str], sig: int, wait_s: float = HANG_S) -> tuple[str, list[int]]:
    """Start `dvc repro`, wait for the stage and its two workers, send ``sig`` to dvc alone; what the stage's
    parent was ("dvc", or the name of a shell between), and the pids still alive once they are gone or ``wait_s``
    passed."""
    dvc = subprocess.Popen(
        ["dvc", "repro"],
        cwd=root,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    pids: list[int] = []
    try:
        deadline = time.monotonic() + HANG_S
        while len(pids := _pids(root)) < 3 and dvc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(pids) == 3, f"the stand-in stage did not start its workers (dvc status {dvc.poll()})"
        parent = psutil.Process(int((root / "stage.pid").read_text().split()[1]))
        parent = "dvc" if parent.pid == dvc.pid else parent.name() if parent.ppid() == dvc.pid else "?"
        os.kill(dvc.pid, sig)  # dvc alone, not its process group
        dvc.wait()
        deadline = time.monotonic() + wait_s
        while (left := _alive(pids)) and time.monotonic() < deadline:
            time.sleep(0.2)
        return parent, left
    finally:
        for pid in _alive(pids):
            os.kill(pid, signal.SIGKILL)
        if dvc.poll() is None:
            os.killpg(dvc.pid, signal.SIGKILL)
            dvc.wait()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
@pytest.mark.parametrize("shell", ["/bin/sh", "/bin/bash"])
def test_a_stage_and_its_workers_die_with_plain_dvc_repro(tmp_path, sig, shell):
    env = _project(tmp_path / "p", shell)
    parent, left = _kill_dvc_and_wait(tmp_path / "p", env, sig)
    # DVC runs `$SHELL -c CMD`: bash execs a single command, Debian's dash forks it and waits
    assert (
        parent
        == {"/bin/bash": "dvc", "/bin/sh": "dvc" if os.path.realpath("/bin/sh").endswith("bash") else "sh"}[shell]
    )
    assert left == [], f"still running after dvc got {signal.Signals(sig).name}: {left}"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_pool_without_its_own_signal_dies_with_the_stage(tmp_path, sig):
    """A pool started as the regimes start theirs (a plain ProcessPoolExecutor): the stage ends its workers."""
    env = _project(tmp_path / "p", "/bin/sh") | {"STANDIN_POOL": "plain"}
    _, left = _kill_dvc_and_wait(tmp_path / "p", env, sig)
    assert left == [], f"still running after dvc got {signal.Signals(sig).name}: {left}"


def test_without_asking_the_stage_outlives_dvc(tmp_path):
    """The control: the same stand-in that does not call die_with_parent outlives a SIGKILLed dvc (so the test
    above sees the mechanism, not dvc taking its children down itself)."""
    env = _project(tmp_path / "p", "/bin/sh") | {"STANDIN_DIES_WITH_PARENT": "0"}
    _, left = _kill_dvc_and_wait(tmp_path / "p", env, signal.SIGKILL, wait_s=3)  # surviving: no load shortens it
    assert left, "the stand-in died with dvc without asking"


def _cmdline(proc: psutil.Process) -> str:
    """A process's command line, empty once it has ended (a zombie between the listing and this read)."""
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def _run_processes(root: Path) -> list[psutil.Process]:
    """Processes working in ``root`` (dvc, the stage, its workers), this one aside."""
    found = []
    for proc in psutil.process_iter(["cwd"]):
        with contextlib.suppress(psutil.Error):
            if proc.info["cwd"] == str(root) and proc.pid != os.getpid() and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_the_real_prepare_stage_dies_with_plain_dvc_repro(tmp_path, tiny_env, sig):
    """`mergeflow prepare` in its own process under plain `dvc repro` (no stage server), killed with dvc while its
    worker pool builds the tasks: nothing of the run remains, and dvc.lock and `dvc status` are as before."""
    from mergeflow.runner.stage_server import SERVER_ENV

    from .conftest import make_tiny_project, run

    root = make_tiny_project(
        tmp_path / "p", tiny_env, suite={"n_train": 50000, "pretrain_images": 200000}, runtime={"threads": None}
    )  # minutes of work left when killed; a worker process per core
    env = {k: v for k, v in tiny_env.items() if k != SERVER_ENV}
    dvc = subprocess.Popen(
        ["dvc", "repro", "prepare"],
        cwd=root,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + HANG_S
        workers = []
        while dvc.poll() is None and time.monotonic() < deadline:
            stage = [p for p in _run_processes(root) if "prepare" in _cmdline(p)]
            workers = []
            for p in stage:
                with contextlib.suppress(psutil.Error):  # the stage may end between the listing and this
                    workers += [c for c in p.children() if "spawn_main" in _cmdline(c)]
            if workers:
                break
            time.sleep(0.1)
        assert workers, f"prepare's workers were not seen (dvc status {dvc.poll()})"
        os.kill(dvc.pid, sig)
        dvc.wait()
        deadline = time.monotonic() + HANG_S
        while (left := _run_processes(root)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert left == [], f"still running after dvc got {signal.Signals(sig).name}: {[_cmdline(p) for p in left]}"
        # ended by the kill, not by finishing its minutes of work after it (the tiny profile's would be seconds)
        assert not (root / "metrics" / "prepare.json").exists(), "prepare ran on to its end after dvc was killed"
    finally:
        for proc in _run_processes(root):
            with contextlib.suppress(psutil.Error):
                proc.kill()
        if dvc.poll() is None:
            os.killpg(dvc.pid, signal.SIGKILL)
    assert run(["dvc", "status"], root, env, check=False).returncode == 0
