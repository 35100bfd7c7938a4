"""The stage graph as DVC defines it (dvc.yaml): which stages there are, what each waits for, which are out of
date; DVC's repository lock held for a run, and each finished stage committed to dvc.lock.

The runners hold no copy of the pipeline: they read the stages from dvc.yaml, run their commands (runner.running)
and commit each finished stage to dvc.lock, so after a Prefect run ``dvc status`` is clean, and after ``dvc repro``
the flow finds nothing to redo. Commands run as argument lists, never through a shell: no value can become code.
The flow holds DVC's repository lock for its whole run (``locked_repo``), so a concurrent ``dvc repro`` is refused
with DVC's one line, and it refuses to start while another DVC command is running a stage; its dvc.lock writes are
atomic (mergeflow.core.lockfile)."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from mergeflow.core import lockfile
from mergeflow.core.errors import MergeflowError, TransientError

_SHELL_TOKENS = {"&&", "||", ";", "|", ">", ">>", "<", "&"}


@dataclass(frozen=True)
class StageNode:
    address: str  # e.g. "finetune@digits"
    argv: tuple[str, ...]  # the stage's command, split as a POSIX shell would split it, run without one
    upstream: tuple[str, ...]  # stages whose outputs this one reads
    outs: tuple[str, ...] = ()  # its outputs, relative to the repository root


def _repo(root: str | Path):
    from dvc.repo import Repo

    return Repo(str(root))


def _argv(address: str, cmd) -> tuple[str, ...]:
    if not isinstance(cmd, str):
        raise MergeflowError(f"dvc.yaml: stage '{address}' has a list of commands; the flow runs one command per stage")
    argv = tuple(shlex.split(cmd))
    if not argv or _SHELL_TOKENS & set(argv):
        raise MergeflowError(
            f"dvc.yaml: stage '{address}' command {cmd!r} needs a shell; the flow runs commands as argument lists"
        )
    return argv


def stage_graph(root_or_repo=".") -> list[StageNode]:
    """Every stage of dvc.yaml, in an order where each comes after those it depends on."""
    import networkx as nx

    with (
        contextlib.nullcontext(root_or_repo)
        if not isinstance(root_or_repo, (str, Path))
        else _repo(root_or_repo) as repo
    ):
        graph = repo.index.graph  # edges point from a stage to the stages it depends on
        order = list(reversed(list(nx.topological_sort(graph))))
        return [
            StageNode(
                s.addressing,
                _argv(s.addressing, s.cmd),
                tuple(sorted(u.addressing for u in graph.successors(s))),
                tuple(str(o.def_path) for o in s.outs),
            )
            for s in order
        ]


def changed_stages(root_or_repo) -> set[str]:
    """The stages DVC reports as changed: their own dependencies, parameters or outputs differ from dvc.lock."""
    with (
        contextlib.nullcontext(root_or_repo)
        if not isinstance(root_or_repo, (str, Path))
        else _repo(root_or_repo) as repo
    ):
        return set(repo.status())


def still_changed(repo, changed: set[str]) -> Callable[[StageNode], bool]:
    """For the scheduler (scheduler.run_graph's ``must_run``): whether a stage must run now that the stages before
    it ran. One of ``changed`` must; one only downstream of them is asked of DVC again (its dependencies are the
    upstream stages' outputs, which may have come out the same bytes)."""

    def check(node: StageNode) -> bool:
        if node.address in changed:
            return True
        repo._reset()  # dvc.lock changed since the index was read: the upstream stages' commits
        return bool(repo.status(targets=[node.address]))

    return check


def stale_stages(
    root_or_repo, nodes: list[StageNode], also: set[str] | frozenset[str] = frozenset(), changed: set[str] | None = None
) -> set[str]:
    """Stages DVC reports as changed (``changed`` when the caller asked already) and those in ``also``, and every
    stage downstream of one."""
    changed = (changed_stages(root_or_repo) if changed is None else set(changed)) | set(also)
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


def _running_dvc_commands(root: Path) -> list[str]:
    """Commands another DVC process is running here: DVC records them in .dvc/tmp/rwlock while a stage runs (it
    releases its repository lock meanwhile, so the lock alone does not show them)."""
    from mergeflow.core.files import process_alive

    path = root / ".dvc" / "tmp" / "rwlock"
    try:
        lock = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    infos = [*(i for entries in lock.get("read", {}).values() for i in entries), *lock.get("write", {}).values()]
    return sorted(
        {
            f"pid {i['pid']}: {i['cmd']}"
            for i in infos
            if isinstance(i, dict) and i.get("pid") != os.getpid() and process_alive(int(i.get("pid", 0)))
        }
    )


@contextlib.contextmanager
def locked_repo(root: str | Path = ".") -> Iterator:
    """The DVC repository at ``root``, with DVC's repository lock held until the context ends and dvc.lock written
    atomically. Refuses (one line, TransientError: exit status 75, a later run gets past it) when another DVC
    command holds the lock or is running a stage."""
    from dvc.lock import LockError
    from dvc.repo import lock_repo

    root = Path(root)
    with lockfile.atomic_dvc_writes(), _repo(root) as repo, contextlib.ExitStack() as stack:
        try:
            stack.enter_context(lock_repo(repo))
        except LockError:
            raise TransientError(
                f"{root.resolve()}: another DVC command holds the repository lock; run again when it ends"
            ) from None
        if running := _running_dvc_commands(root):
            raise TransientError(
                f"{root.resolve()}: another DVC command is running a stage here ({running[0]}); run again when it ends"
            )
        yield repo


def commit_stage(repo, address: str) -> None:
    """Record a finished stage's outputs in dvc.lock and the cache (call with the repository lock held), and keep
    the new dvc.lock as the last whole copy (mergeflow.core.lockfile)."""
    repo.commit(
        f"{os.path.join(repo.root_dir, 'dvc.yaml')}:{address}", force=True
    )  # the repository's, whatever the cwd
    lockfile.keep_good_copy(repo.root_dir, check=False)  # written atomically (locked_repo): whole


def describe(nodes: list[StageNode]) -> str:
    return "\n".join(f"{n.address}: {shlex.join(n.argv)} after {', '.join(n.upstream) or '-'}" for n in nodes)


def check_repo(root: str | Path) -> None:
    if not (Path(root) / "dvc.yaml").is_file() or not (Path(root) / ".dvc").is_dir():
        raise MergeflowError(f"{Path(root).resolve()}: not a DVC project with dvc.yaml (run from the repository root)")
