"""Stages run without a shared file system: a Dask worker runs each stage in a checkout of its own, pulls the
stage's dependencies from the project's DVC remote before, pushes its outputs after, and sends back the stage's
dvc.lock entry (with the small outputs kept in git, which no remote holds); the flow writes both into its own
working tree and, at the end, pulls the outputs the run made (docs/scaling.md)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from mergeflow.core import lockfile
from mergeflow.core.errors import MergeflowError
from mergeflow.core.files import atomic_path
from mergeflow.runner.graph import StageNode
from mergeflow.runner.running import run_stage
from mergeflow.core.yaml_files import parse_yaml

CHECKOUT_ENV = "MERGEFLOW_CHECKOUT"  # where a worker keeps its checkout (default: its Dask local directory)
REPOSITORY_ENV = "MERGEFLOW_REPOSITORY"  # what workers clone (default: the flow's repository path)


@dataclass(frozen=True)
class Source:
    """What a worker's checkout is made of: the repository (a path or URL git clones) at ``commit``, with the
    flow's params.yaml and dvc.lock as they are when the stage is sent (the flow writes both during a run)."""

    repository: str
    commit: str
    params: str
    lock: str


def _git(args: list[str], cwd: str | Path, check: bool = True) -> str | None:
    """git's output; on failure a one-line error, or None when not ``check`` (a question git answers by failing)."""
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        if not check:
            return None
        raise MergeflowError(
            f"git {' '.join(args)} in {cwd}: {((proc.stderr or proc.stdout).strip().splitlines() or ['failed'])[-1]}"
        )
    return proc.stdout.strip()


def check_source(root: str | Path) -> str:
    """The commit workers check out, or a one-line error: the code and dvc.yaml must be committed (a worker sees
    the commit, not this working tree: a changed or new file is refused) and a DVC remote must be set in
    .dvc/config itself (it carries every output between machines; a clone has no .dvc/config.local)."""
    from mergeflow.runner.remote import default_remote

    root = Path(root)
    if default_remote(root, committed_only=True) is None:
        where = (
            " (this one is set in .dvc/config.local or the user's config, which the workers' clones lack)"
            if default_remote(root)
            else ""
        )
        raise MergeflowError(
            f"worker checkouts need a DVC remote in .dvc/config to carry outputs between machines{where}: set one with "
            "`mergeflow remote add URL`"
        )
    changed = _git(
        ["status", "--porcelain", "--untracked-files=all", "--", "dvc.yaml", "src", "flows", "tasks", ".dvc/config"],
        root,
    )
    if changed:
        path = changed.splitlines()[0].split(maxsplit=1)[1]  # "XY path" (stripped: " M" loses its space)
        raise MergeflowError(
            f"{root}: {path} differs from the last commit, which is what the workers check out: commit it first"
        )
    return _git(["rev-parse", "HEAD"], root)


def source(root: str | Path, commit: str) -> Source:
    """What a stage sent now is run from: $MERGEFLOW_REPOSITORY (a URL the workers clone, where the commit was
    pushed), else the flow's repository itself (a path the workers reach), with params.yaml and dvc.lock as now."""
    root = Path(root)
    lock = root / "dvc.lock"
    repository = os.environ.get(REPOSITORY_ENV) or str(root.resolve())
    return Source(repository, commit, (root / "params.yaml").read_text(), lock.read_text() if lock.exists() else "")


def checkout_dir() -> Path:
    """This worker's checkout: $MERGEFLOW_CHECKOUT, else inside its Dask local directory, else a temporary one."""
    if os.environ.get(CHECKOUT_ENV):
        return Path(os.environ[CHECKOUT_ENV])
    try:
        from distributed import get_worker

        return Path(get_worker().local_directory) / "mergeflow-checkout"
    except (ImportError, ValueError):
        return Path(tempfile.gettempdir()) / f"mergeflow-checkout-{os.getpid()}"


def prepare_checkout(src: Source, where: Path) -> Path:
    """Clone the repository into ``where`` once, move it to the commit, and write the flow's params.yaml and
    dvc.lock. Outputs already there from this worker's earlier stages stay: DVC checks them against dvc.lock."""
    fresh = not (where / ".git").exists()
    if fresh:
        where.parent.mkdir(parents=True, exist_ok=True)
        _git(["clone", "-q", "--no-checkout", src.repository, str(where)], where.parent)
    if fresh or _git(["rev-parse", "--verify", "-q", "HEAD"], where, check=False) != src.commit:
        if _git(["cat-file", "-e", f"{src.commit}^{{commit}}"], where, check=False) is None:
            _git(["fetch", "-q", "origin"], where)
        _git(["checkout", "-q", "--force", src.commit], where)
    (where / "params.yaml").write_text(src.params)
    if src.lock:
        (where / "dvc.lock").write_text(src.lock)
    return where


def _stage(repo, address: str):
    for stage in repo.index.stages:  # by name: the addressing is relative to this process's directory
        if stage.name == address:
            return stage
    raise MergeflowError(f"dvc.yaml: no stage {address}")


def pull_dependencies(repo, address: str) -> list[str]:
    """`dvc pull` of what the stage reads that another stage wrote: each cached output inside one of its
    dependencies, or the part of an output a dependency names. ``repo`` is opened from its root, which is the
    working directory (DVC resolves targets against it). Returns the paths pulled."""
    stage = _stage(repo, address)
    outs = [str(o.def_path) for s in repo.index.stages for o in s.outs if o.use_cache]
    targets: list[str] = []
    for dep in (str(d.def_path) for d in stage.deps):
        targets += [o for o in outs if o == dep or o.startswith(dep.rstrip("/") + "/")]
        targets += [dep for o in outs if dep.startswith(o.rstrip("/") + "/")]
    targets = sorted(set(targets))
    if targets:
        repo.pull(targets=targets)
    return targets


def run_in_checkout(node: StageNode, src: Source, env: dict[str, str] | None = None, where: Path | None = None) -> dict:
    """On a worker: the stage in its own checkout, its dependencies pulled first and its outputs pushed after.
    Returns run_stage's record with the checkout's path, the stage's dvc.lock entry ("lock_entry") and the text
    of its outputs kept in git ("uncached": {path: text}), for the flow to write (record_stage)."""
    from dvc.repo import Repo

    where = prepare_checkout(src, (where or checkout_dir()).resolve())
    # DVC resolves targets against the working directory: work from the checkout (a worker runs one stage at a time)
    with contextlib.chdir(where), Repo(str(where)) as repo:
        pull_dependencies(repo, node.address)
    started = time.time()
    result = run_stage(node, where, env)
    timings = [f for f in (where / "logs" / "timing").rglob("*.json") if f.stat().st_mtime >= started - 1]
    with contextlib.chdir(where), Repo(str(where)) as repo:
        target = f"dvc.yaml:{node.address}"
        repo.commit(target, force=True)
        repo.push(targets=[target])
        stage = _stage(repo, node.address)
        uncached = {}
        for out in (o for o in stage.outs if not o.use_cache):
            path = where / str(out.def_path)
            files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
            uncached |= {str(f.relative_to(where)): f.read_text() for f in files}
    # the stage's wall time (logs/timing: no output, `track` reads it), with its outputs kept in git
    uncached |= {str(f.relative_to(where)): f.read_text() for f in timings}
    entry = parse_yaml((where / "dvc.lock").read_text(), str(where / "dvc.lock"))["stages"][node.address]
    return result | {
        "checkout": str(where),
        "lock_entry": entry,
        "uncached": uncached,
        "uncached_outs": [str(o.def_path) for o in stage.outs if not o.use_cache],
    }


def record_stage(root: str | Path, address: str, result: dict) -> None:
    """In the flow (with DVC's repository lock held): a stage a worker ran, into this working tree: its outputs
    kept in git written (each folder replaced whole), its entry into dvc.lock, both atomically."""
    import yaml

    root = Path(root)
    folders = [p for p in result["uncached_outs"] if any(f.startswith(p.rstrip("/") + "/") for f in result["uncached"])]
    for folder in folders:
        with atomic_path(root / folder, directory=True) as tmp:
            for rel, text in result["uncached"].items():
                if rel.startswith(folder.rstrip("/") + "/"):
                    (tmp / rel[len(folder) + 1 :]).parent.mkdir(parents=True, exist_ok=True)
                    (tmp / rel[len(folder) + 1 :]).write_text(text)
    for rel, text in result["uncached"].items():
        if not any(rel.startswith(f.rstrip("/") + "/") for f in folders):
            with atomic_path(root / rel) as tmp:
                tmp.write_text(text)
    lock_path = root / "dvc.lock"
    lock = parse_yaml(lock_path.read_text(), str(lock_path)) if lock_path.exists() else {"schema": "2.0", "stages": {}}
    lock.setdefault("stages", {})[address] = result["lock_entry"]
    lockfile.write_atomically(lock_path, yaml.safe_dump(lock, sort_keys=False))
    lockfile.keep_good_copy(root, check=False)


def pull_outputs(repo, addresses: list[str]) -> None:
    """In the flow, after a run in worker checkouts (``repo``: its DVC repository, lock held): `dvc pull` of the
    stages' outputs into its working tree, so that it holds the whole run and `dvc status` is clean."""
    if addresses:
        repo.pull(targets=[f"{Path(repo.root_dir) / 'dvc.yaml'}:{a}" for a in addresses])
