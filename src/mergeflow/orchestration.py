"""The stage graph as DVC defines it (dvc.yaml), for the Prefect flow: which stages there are, what each waits
for, which are out of date, and running one stage's command then recording it in dvc.lock.

The flow holds no copy of the pipeline: it reads the stages from dvc.yaml, runs their commands, and commits each
finished stage to dvc.lock, so after a Prefect run ``dvc status`` is clean, and after ``dvc repro`` the flow
finds nothing to redo.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

from mergeflow.errors import MergeflowError

_commit_lock = threading.Lock()  # dvc.lock is written by one stage at a time


@dataclass(frozen=True)
class StageNode:
    address: str  # e.g. "finetune@digits"
    cmd: str
    upstream: tuple[str, ...]  # stages whose outputs this one reads


def _repo(root: str | Path):
    from dvc.repo import Repo

    return Repo(str(root))


def stage_graph(root: str | Path = ".") -> list[StageNode]:
    """Every stage of dvc.yaml, in an order where each comes after those it depends on."""
    with _repo(root) as repo:
        graph = repo.index.graph  # edges point from a stage to the stages it depends on
        order = list(reversed(list(nx.topological_sort(graph))))
        return [StageNode(s.addressing, s.cmd if isinstance(s.cmd, str) else " && ".join(s.cmd), tuple(sorted(u.addressing for u in graph.successors(s)))) for s in order]


def stale_stages(root: str | Path, nodes: list[StageNode]) -> set[str]:
    """Stages DVC reports as changed, and every stage downstream of one."""
    with _repo(root) as repo:
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


class StageFailed(Exception):
    def __init__(self, address: str, returncode: int, tail: str):
        self.address, self.returncode = address, returncode
        super().__init__(f"stage {address} exited with status {returncode}: {tail}")


def run_stage(node: StageNode, root: str | Path = ".", env: dict[str, str] | None = None) -> dict:
    """Run one stage's command in the repository root, then record its outputs in dvc.lock and the cache."""
    proc = subprocess.run(node.cmd, shell=True, cwd=root, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        raise StageFailed(node.address, proc.returncode, lines[-1] if lines else "(no output)")
    with _commit_lock, _repo(root) as repo:
        repo.commit(node.address, force=True)
    return {"stage": node.address, "cmd": node.cmd}


def describe(nodes: list[StageNode]) -> str:
    return "\n".join(f"{n.address}: {shlex.quote(n.cmd)} after {', '.join(n.upstream) or '-'}" for n in nodes)


def check_repo(root: str | Path) -> None:
    if not (Path(root) / "dvc.yaml").is_file() or not (Path(root) / ".dvc").is_dir():
        raise MergeflowError(f"{Path(root).resolve()}: not a DVC project with dvc.yaml (run from the repository root)")
