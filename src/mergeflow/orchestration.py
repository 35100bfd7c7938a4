"""The stage graph as DVC defines it (dvc.yaml), for the Prefect flow: which stages there are, what each waits
for, which are out of date, running one stage's command, and recording it in dvc.lock.

The flow holds no copy of the pipeline: it reads the stages from dvc.yaml, runs their commands, and commits each
finished stage to dvc.lock, so after a Prefect run ``dvc status`` is clean, and after ``dvc repro`` the flow
finds nothing to redo.

Safety, and why:
- commands run as argument lists, never through a shell: no value can become code;
- the flow holds DVC's repository lock for its whole run (``locked_repo``), so a concurrent ``dvc repro`` is
  refused with DVC's one line instead of doing the same work, and it refuses to start while another DVC command
  is running a stage; its dvc.lock writes are atomic (mergeflow.lockfile);
- stages run in their own process groups, are stopped with the flow (``stop_stages``), and die with it when it is
  killed outright (the parent-death signal the CLI asks for: ``DIE_WITH_PARENT_ENV``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mergeflow import lockfile
from mergeflow.errors import BAD_INPUT_STATUS, TRANSIENT_STATUS, MergeflowError

# set to the flow's pid in a stage's environment: the stage asks the kernel to send it SIGTERM when the flow dies
DIE_WITH_PARENT_ENV = "MERGEFLOW_DIE_WITH_PARENT"
_SHELL_TOKENS = {"&&", "||", ";", "|", ">", ">>", "<", "&"}


@dataclass(frozen=True)
class StageNode:
    address: str  # e.g. "finetune@digits"
    argv: tuple[str, ...]  # the stage's command, split as a POSIX shell would split it, run without one
    upstream: tuple[str, ...]  # stages whose outputs this one reads


def _repo(root: str | Path):
    from dvc.repo import Repo

    return Repo(str(root))


def _argv(address: str, cmd) -> tuple[str, ...]:
    if not isinstance(cmd, str):
        raise MergeflowError(f"dvc.yaml: stage '{address}' has a list of commands; the flow runs one command per stage")
    argv = tuple(shlex.split(cmd))
    if not argv or _SHELL_TOKENS & set(argv):
        raise MergeflowError(f"dvc.yaml: stage '{address}' command {cmd!r} needs a shell; the flow runs commands as argument lists")
    return argv


def stage_graph(root_or_repo=".") -> list[StageNode]:
    """Every stage of dvc.yaml, in an order where each comes after those it depends on."""
    import networkx as nx

    with contextlib.nullcontext(root_or_repo) if not isinstance(root_or_repo, (str, Path)) else _repo(root_or_repo) as repo:
        graph = repo.index.graph  # edges point from a stage to the stages it depends on
        order = list(reversed(list(nx.topological_sort(graph))))
        return [StageNode(s.addressing, _argv(s.addressing, s.cmd), tuple(sorted(u.addressing for u in graph.successors(s)))) for s in order]


def stale_stages(root_or_repo, nodes: list[StageNode]) -> set[str]:
    """Stages DVC reports as changed, and every stage downstream of one."""
    with contextlib.nullcontext(root_or_repo) if not isinstance(root_or_repo, (str, Path)) else _repo(root_or_repo) as repo:
        changed = set(repo.status())
    downstream = {n.address: set() for n in nodes}
    for n in nodes:
        for u in n.upstream:
            downstream[u].add(n.address)
    stale, frontier = set(), list(changed)
    while frontier:
        address = frontier.pop()
        if address in stale:
            continue
        stale.add(address)
        frontier.extend(downstream.get(address, ()))
    return stale


def stage_threads(nodes: list[StageNode], stale: set[str], workers: int, cores: int) -> dict[str, int]:
    """CPU threads for each stale stage when ``workers`` stages may run at once: a stage shares the cores with
    its siblings (stale stages with the same upstream stages, e.g. the fine-tunes), up to ``workers`` of them;
    a stage with none (prepare, pretrain, vectors, report) gets every core."""
    siblings: dict[tuple[str, ...], int] = {}
    for n in nodes:
        if n.address in stale:
            siblings[n.upstream] = siblings.get(n.upstream, 0) + 1
    return {n.address: max(1, cores // min(workers, siblings[n.upstream])) for n in nodes if n.address in stale}


def _running_dvc_commands(root: Path) -> list[str]:
    """Commands another DVC process is running here: DVC records them in .dvc/tmp/rwlock while a stage runs (it
    releases its repository lock meanwhile, so the lock alone does not show them)."""
    path = root / ".dvc" / "tmp" / "rwlock"
    try:
        lock = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    infos = [*(i for entries in lock.get("read", {}).values() for i in entries), *lock.get("write", {}).values()]
    return sorted({f"pid {i['pid']}: {i['cmd']}" for i in infos if isinstance(i, dict) and i.get("pid") != os.getpid() and process_alive(int(i.get("pid", 0)))})


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` is running here (a zombie, dead but not yet reaped, is not)."""
    import psutil

    if pid <= 0:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@contextlib.contextmanager
def locked_repo(root: str | Path = ".") -> Iterator:
    """The DVC repository at ``root``, with DVC's repository lock held until the context ends and dvc.lock written
    atomically. Refuses (one line, MergeflowError) when another DVC command holds the lock or is running a stage."""
    from dvc.lock import LockError
    from dvc.repo import lock_repo

    root = Path(root)
    with lockfile.atomic_dvc_writes(), _repo(root) as repo, contextlib.ExitStack() as stack:
        try:
            stack.enter_context(lock_repo(repo))
        except LockError:
            raise MergeflowError(f"{root.resolve()}: another DVC command holds the repository lock; run again when it ends") from None
        if running := _running_dvc_commands(root):
            raise MergeflowError(f"{root.resolve()}: another DVC command is running a stage here ({running[0]}); run again when it ends")
        yield repo


def commit_stage(repo, address: str) -> None:
    """Record a finished stage's outputs in dvc.lock and the cache (call with the repository lock held)."""
    repo.commit(f"{os.path.join(repo.root_dir, 'dvc.yaml')}:{address}", force=True)  # the repository's, whatever the cwd


class StageFailed(Exception):
    def __init__(self, address: str, returncode: int, tail: str):
        self.address, self.returncode, self.tail = address, returncode, tail
        super().__init__(f"stage {address} exited with status {returncode}: {tail}")

    @property
    def transient(self) -> bool:
        """Worth a retry: killed by a signal (the OOM killer, a preempted node) or a transient error (status 75).
        Bad input (2) and unexpected errors (1, a traceback) fail the same way again."""
        return (self.returncode < 0 or self.returncode == TRANSIENT_STATUS) and not _stopping.is_set()

    @property
    def bad_input(self) -> bool:
        return self.returncode == BAD_INPUT_STATUS


class PipelineFailed(MergeflowError):
    """Stages of a flow run failed (each is reported with its own status and last line)."""

    exit_status = 1


_stopping = threading.Event()
_running: dict[int, subprocess.Popen] = {}
_running_lock = threading.Lock()


def stopping() -> bool:
    """Whether stop_stages was called: the run is being stopped on purpose."""
    return _stopping.is_set()


def stop_stages(grace_s: float = 10.0) -> int:
    """Stop every running stage (SIGTERM to its process group, SIGKILL after ``grace_s``) and start no more.
    Returns how many were running."""
    _stopping.set()
    with _running_lock:
        procs = list(_running.values())
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    return len(procs)


def run_stage(node: StageNode, root: str | Path = ".", env: dict[str, str] | None = None) -> dict:
    """Run one stage's command in the repository root, in a process group of its own, as DVC would (DVC_STAGE and
    DVC_ROOT set). Raises StageFailed with the last line the command printed when it fails."""
    if _stopping.is_set():
        raise StageFailed(node.address, -signal.SIGTERM, "not started: the flow is stopping")
    root = Path(root).resolve()
    stage_env = {**os.environ, **(env or {}), "DVC_STAGE": node.address, "DVC_ROOT": str(root), DIE_WITH_PARENT_ENV: str(os.getpid())}
    with _running_lock:
        proc = subprocess.Popen(list(node.argv), cwd=root, env=stage_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        _running[proc.pid] = proc
    try:
        stdout, stderr = proc.communicate()
    finally:
        with _running_lock:
            _running.pop(proc.pid, None)
    if proc.returncode != 0:
        lines = (stderr or stdout).strip().splitlines()
        raise StageFailed(node.address, proc.returncode, lines[-1] if lines else "(no output)")
    return {"stage": node.address, "argv": list(node.argv), "output": (stdout + stderr)[-4000:]}


def die_with_parent() -> None:
    """In a stage started by the flow: ask for SIGTERM when the flow dies (Linux), so that a flow killed outright
    (SIGKILL) leaves no stage running, and pass a SIGTERM on to the stage's process group; exit at once if the
    flow is already gone."""
    parent = os.environ.get(DIE_WITH_PARENT_ENV)
    if not parent:
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):
        raise SystemExit(f"error: the flow that started this stage (pid {parent}) is gone")

    def end_group(signum, frame):
        # the stage leads its own process group (run_stage): take its workers (prepare's process pool) with it
        signal.signal(signum, signal.SIG_DFL)
        os.killpg(os.getpgrp(), signum)

    signal.signal(signal.SIGTERM, end_group)


def describe(nodes: list[StageNode]) -> str:
    return "\n".join(f"{n.address}: {shlex.join(n.argv)} after {', '.join(n.upstream) or '-'}" for n in nodes)


def check_repo(root: str | Path) -> None:
    if not (Path(root) / "dvc.yaml").is_file() or not (Path(root) / ".dvc").is_dir():
        raise MergeflowError(f"{Path(root).resolve()}: not a DVC project with dvc.yaml (run from the repository root)")
