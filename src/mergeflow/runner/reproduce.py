"""``mergeflow reproduce``: chosen stages run again in a scratch copy of the workspace, and a report of what came
back: per output, the same bytes as dvc.lock records or not; per headline metric, the recorded value, the re-run's
and the difference; where bytes differ, the machine that wrote them beside this one (provenance.json).

By default it re-runs the pretraining, the first task's fine-tune and one merge (task_arithmetic where it runs),
with whatever upstream stages the scratch copy lacks (a fresh clone: the data, every fine-tune the merge reads).
The workspace is left as it was: its sources and dvc.lock are copied, and the outputs the chosen stages read are
copied from it where it has them (their objects read from its DVC cache, which the re-run's outputs join); DVC's
run-cache is not used, so every chosen stage runs.

The exit status is 1 past the tolerance: when the deterministic mode wrote the recorded outputs and runs here, on
the CPU both times, any output whose bytes differ (the promise is the same bytes); else any headline metric that
moved more than ``tolerance`` points (``CROSS_DEVICE_TOLERANCE`` unless given: the GPU's kernels, or the machine's
own kernels without the deterministic mode, give other last bits, which training turns into other accuracies).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from mergeflow.core import lockfile
from mergeflow.core.errors import MergeflowError

# test accuracy points a re-run may differ by when the bytes are not expected to be the same (another GPU model,
# the CPU against a GPU, runtime.deterministic: false). Other last bits act as another seed would: over 3 seeds
# the default suite's task arithmetic (the merge this checks by default, and one of its noisiest) has sd 1.17
# points, so two runs differ by 2 x sqrt(2) x 1.17 = 3.3 at two standard deviations of their difference; the
# methods' pooled sd, 0.72, gives 2.0 (docs/benchmarks.md, 2026-11-28)
CROSS_DEVICE_TOLERANCE = 3.0
DEFAULT_MERGE = "task_arithmetic"


@dataclass
class Report:
    scratch: Path
    ran: list[str]
    outputs: list[tuple[str, str, bool]] = field(default_factory=list)  # (stage, path, same bytes)
    metrics: list[tuple[str, float, float]] = field(default_factory=list)  # (name, recorded, re-run), points
    machines: list[str] = field(default_factory=list)
    expect_bytes: bool = True
    tolerance: float = 0.0

    def failures(self) -> list[str]:
        out = []
        if self.expect_bytes:
            out += [f"{path} (stage {stage}): other bytes" for stage, path, same in self.outputs if not same]
        out += [
            f"{name}: {new - old:+.2f} points"
            for name, old, new in self.metrics
            if abs(new - old) > self.tolerance + 1e-9
        ]
        return out

    def lines(self) -> list[str]:
        width = max([len(p) for _, p, _ in self.outputs] + [len(n) for n, _, _ in self.metrics] + [10])
        lines = [
            f"re-ran {len(self.ran)} stage{'s' if len(self.ran) != 1 else ''} in {self.scratch}: {', '.join(self.ran)}",
            "",
            f"{'output':<{width}}  bytes",
        ]
        lines += [f"{path:<{width}}  {'same' if same else 'DIFFER'}" for _, path, same in self.outputs]
        if self.metrics:
            lines += ["", f"{'metric (%)':<{width}}  {'recorded':>9}  {'re-run':>9}  {'difference':>10}"]
            lines += [
                f"{name:<{width}}  {old:>9.2f}  {new:>9.2f}  {new - old:>+10.2f}" for name, old, new in self.metrics
            ]
        lines += ["", *self.machines] if self.machines else []
        return lines


def default_stages(params) -> list[str]:
    """The pretraining, the first task's fine-tune and one merge (task_arithmetic where merge.methods has it)."""
    methods = params.merge.methods
    merge = DEFAULT_MERGE if DEFAULT_MERGE in methods else methods[0] if methods else None
    return ["pretrain", f"finetune@{params.suite.tasks[0]}", *([f"merge@{merge}"] if merge else [])]


def _sources(root: Path) -> list[str]:
    """The workspace's sources: git's tracked files and its untracked ones that are not ignored."""
    proc = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=root,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise MergeflowError(
            f"{root}: not a git repository (git ls-files: "
            f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode})"
        )
    return [f for f in proc.stdout.split("\0") if f]


def _upstream(nodes, targets: list[str]) -> set[str]:
    by_address = {n.address: n for n in nodes}
    seen, frontier = set(), [u for t in targets for u in by_address[t].upstream]
    while frontier:
        address = frontier.pop()
        if address not in seen:
            seen.add(address)
            frontier.extend(by_address[address].upstream)
    return seen - set(targets)


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_dir():
        shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True)
    elif src.exists():
        shutil.copy2(src, dst, follow_symlinks=False)


def prepare_scratch(root: Path, scratch: Path, targets: list[str], nodes) -> None:
    """``scratch``: the workspace's sources and dvc.lock, the outputs of the targets' upstream stages that the
    workspace has, none of the targets' own; a git repository of its own (DVC needs one)."""
    for rel in _sources(root):
        if (root / rel).is_file() or (root / rel).is_symlink():
            _copy(root / rel, scratch / rel)
    _copy(root / lockfile.LOCKFILE, scratch / lockfile.LOCKFILE)
    upstream = _upstream(nodes, targets)
    for node in nodes:
        if node.address in upstream:
            for out in node.outs:
                _copy(root / out, scratch / out)
    env = os.environ | {
        "GIT_AUTHOR_NAME": "mergeflow",
        "GIT_AUTHOR_EMAIL": "mergeflow@localhost",
        "GIT_COMMITTER_NAME": "mergeflow",
        "GIT_COMMITTER_EMAIL": "mergeflow@localhost",
    }
    subprocess.run(
        "git init -q && git add -A && git commit -qm scratch",
        shell=True,
        cwd=scratch,
        env=env,
        check=True,
        capture_output=True,
    )
    # the workspace's DVC cache, where the upstream outputs' objects are (DVC runs a stage again whose outputs are
    # not in its cache); the re-run's outputs join it, content-addressed: nothing already there changes
    cache = subprocess.run(
        [sys.executable, "-m", "dvc", "cache", "dir"], cwd=root, capture_output=True, text=True
    ).stdout.strip() or str(root / ".dvc" / "cache")
    subprocess.run(
        [sys.executable, "-m", "dvc", "config", "--local", "cache.dir", cache],
        cwd=scratch,
        check=True,
        capture_output=True,
    )


def _outs(lock: dict, stage: str) -> dict[str, str]:
    # wall times differ run to run; everything else a stage writes must not
    return {
        o["path"]: o["md5"]
        for o in (lock.get("stages", {}).get(stage, {}).get("outs") or [])
        if not o["path"].startswith("logs/timing")
    }


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _recorded_json(root: Path, rel: str, md5: str | None):
    """The workspace's copy of a metrics file, when its bytes are the ones dvc.lock records (else None)."""
    from mergeflow.runner.verify import _file_md5

    path = root / rel
    return _json(path) if md5 and path.is_file() and _file_md5(path, "md5") == md5 else None


def _metrics(root: Path, scratch: Path, stage: str, recorded_lock: dict) -> list[tuple[str, float, float]]:
    """The headline numbers of one re-run stage beside their recorded values, in points: a merge's test average
    (the committed metrics/headline), a fine-tune's individual and probe test accuracies."""
    from mergeflow.report.summary import percent

    kind, _, item = stage.partition("@")
    out = []
    if kind == "merge":
        new, old = _json(scratch / f"metrics/evaluate/{item}.json"), _json(root / f"metrics/headline/{item}.json")
        if new and old and isinstance(new.get("average"), (int, float)) and old.get("test_avg") is not None:
            out.append((f"{stage} test_avg", float(old["test_avg"]), percent(new["average"])))
    elif kind == "finetune":
        rel = f"metrics/finetune/{item}.json"
        new, old = _json(scratch / rel), _recorded_json(root, rel, _outs(recorded_lock, stage).get(rel))
        for part in ("individual", "probe"):
            if new and old and new.get(part, {}).get("test") is not None and old.get(part, {}).get("test") is not None:
                out.append((f"{stage} {part} test", percent(old[part]["test"]), percent(new[part]["test"])))
    return out


def _check_targets(targets: list[str], nodes, recorded_lock: dict) -> None:
    """One line unless every target is a stage of dvc.yaml with a run recorded in dvc.lock to compare with."""
    known = {n.address for n in nodes}
    for t in targets:
        if t not in known:
            raise MergeflowError(
                f"mergeflow reproduce: dvc.yaml has no stage '{t}' (stages: "
                f"{', '.join(sorted(known)[:12])}{', ...' if len(known) > 12 else ''})"
            )
        if t not in (recorded_lock.get("stages") or {}):
            raise MergeflowError(
                f"mergeflow reproduce: {lockfile.LOCKFILE} records no run of '{t}' to compare with (run it first)"
            )


def _rerun(scratch: Path, targets: list[str], nodes, echo) -> list[str]:
    """Run the targets in ``scratch``, forced, and the upstream stages the copy lacks (DVC would restore the targets
    from the cache); returns the stages that ran, in order. One line when the re-run fails."""
    status = subprocess.run(
        [sys.executable, "-m", "dvc", "status", "--json"], cwd=scratch, capture_output=True, text=True
    )
    stale = set(json.loads(status.stdout or "{}")) if status.returncode == 0 else set()
    upstream = _upstream(nodes, targets)
    order = [n.address for n in nodes if n.address in targets or (n.address in upstream and n.address in stale)]
    echo(f"re-running {', '.join(order)} in {scratch}")
    env = os.environ | {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    }  # the stages' `mergeflow`
    proc = subprocess.run(
        [sys.executable, "-m", "mergeflow.cli", "repro", "--force", "--single-item", "--no-run-cache", *order],
        cwd=scratch,
        capture_output=True,
        text=True,
        env=env,
    )
    ran = re.findall(r"^Running stage '([^']+)'", proc.stdout, flags=re.M)
    if proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or [f"exit status {proc.returncode}"]
        raise MergeflowError(f"mergeflow reproduce: the re-run failed in {scratch}: {tail[0]}")
    return ran


def reproduce(
    root: str | Path = ".",
    stages: list[str] | None = None,
    tolerance: float | None = None,
    scratch: str | Path | None = None,
    echo=print,
) -> Report:
    """Re-run ``stages`` (default: default_stages) in a scratch copy of the workspace at ``root`` and compare; the
    report is printed through ``echo`` and returned. The scratch copy is removed afterwards unless given."""
    from mergeflow.params import load_params
    from mergeflow.runner.graph import stage_graph
    from mergeflow.core.reproducibility.machine import describe, explain, recorded

    root = Path(root).resolve()
    try:
        recorded_lock = lockfile.parse((root / lockfile.LOCKFILE).read_text(encoding="utf-8")) or {}
    except OSError:
        raise MergeflowError(f"{root / lockfile.LOCKFILE}: not found (nothing recorded to reproduce)") from None
    params = load_params(root / "params.yaml")
    targets = stages or default_stages(params)
    nodes = stage_graph(root)
    _check_targets(targets, nodes, recorded_lock)
    keep = scratch is not None
    scratch = Path(scratch) if scratch else Path(tempfile.mkdtemp(prefix="mergeflow-reproduce-"))
    try:
        scratch.mkdir(parents=True, exist_ok=True)
        prepare_scratch(root, scratch, targets, nodes)
        ran = _rerun(scratch, targets, nodes, echo)
        rerun_lock = lockfile.parse((scratch / lockfile.LOCKFILE).read_text(encoding="utf-8")) or {}
        report = Report(scratch=scratch, ran=ran)
        for stage in ran:
            old, new = _outs(recorded_lock, stage), _outs(rerun_lock, stage)
            report.outputs += [(stage, path, new.get(path) == md5) for path, md5 in old.items()]
            report.metrics += _metrics(root, scratch, stage, recorded_lock)
        entries, here = recorded(root), describe()
        written = [entries.get(s) for s in ran]
        from mergeflow.core.devices import cuda_devices

        on_gpu = params.runtime.device != "cpu" and cuda_devices() > 0
        exact = (
            all(w is not None and w.get("deterministic") and "gpu" not in w for w in written)
            and here["deterministic"]
            and not on_gpu
        )
        report.expect_bytes = exact
        report.tolerance = tolerance if tolerance is not None else (0.0 if exact else CROSS_DEVICE_TOLERANCE)
        for stage in sorted({s for s, _, same in report.outputs if not same}):
            report.machines += explain(stage, entries, here)
        for line in report.lines():
            echo(line)
        return report
    finally:
        if not keep:
            shutil.rmtree(scratch, ignore_errors=True)
