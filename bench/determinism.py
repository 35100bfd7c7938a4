"""The deterministic mode's cost: every stage of the pipeline timed with runtime.deterministic true and false, side
by side in one run on this machine.

Two scratch copies of the repository (sources only) differ in that one setting; the stages run in dvc.yaml's order,
each in the deterministic copy, then at once in the other, so that both of a stage's times are taken minutes apart
at most (this machine's speed drifts by a third within an hour). A stage's time is its own record
(logs/timing/<stage>.json: the stage's work, not the process's start). Prints a row per stage and the totals.

    python bench/determinism.py                      # the default pipeline (about 25 minutes on 2 cores)
    python bench/determinism.py --stages prepare,pretrain,finetune@digits --steps 300
    python bench/determinism.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _copy_sources(dst: Path, deterministic: bool, steps: int | None) -> None:
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for rel in files:
        if (ROOT / rel).is_file() and not rel.startswith("tests/") and rel != "dvc.lock":
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dst / rel)
    text = (
        (dst / "params.yaml")
        .read_text()
        .replace("  deterministic: true", f"  deterministic: {str(deterministic).lower()}")
    )
    if steps is not None:  # a shorter pretraining (the rest as configured)
        text = text.replace("pretrain:\n  steps: 900", f"pretrain:\n  steps: {steps}")
    (dst / "params.yaml").write_text(text)
    subprocess.run(
        "git init -q && git add -A && git -c user.name=bench -c user.email=bench@localhost commit -qm bench",
        shell=True,
        cwd=dst,
        check=True,
    )


def _timing(root: Path, address: str) -> float | None:
    stage, _, item = address.partition("@")
    path = root / "logs" / "timing" / (f"{stage}/{item}.json" if item else f"{stage}.json")
    try:
        return json.loads(path.read_text())["wall_time_s"]
    except (OSError, ValueError, KeyError):
        return None


def _run(root: Path, address: str) -> float:
    started = time.perf_counter()
    env = os.environ | {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "HF_HUB_OFFLINE": "1",
    }  # the stages' `mergeflow`
    proc = subprocess.run(
        [sys.executable, "-m", "mergeflow.cli", "repro", "--single-item", address],
        cwd=root,
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        sys.exit(f"{address} failed in {root}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--stages", help="comma-separated stages (with what they need upstream, run first); default: every stage"
    )
    ap.add_argument("--steps", type=int, help="pretrain.steps for both copies (default: params.yaml's)")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--keep", action="store_true", help="keep the two copies (printed)")
    args = ap.parse_args()

    sys.path.insert(0, str(ROOT / "src"))
    from mergeflow.runner.graph import stage_graph

    base = Path(tempfile.mkdtemp(prefix="mergeflow-bench-det-"))
    copies = {mode: base / ("deterministic" if mode else "machine") for mode in (True, False)}
    for mode, path in copies.items():
        path.mkdir()
        _copy_sources(path, mode, args.steps)
    nodes = stage_graph(copies[True])
    # the graph of another folder names its stages path:dvc.yaml:stage
    name = lambda address: address.rpartition(":")[2]  # noqa: E731
    nodes = [type(n)(name(n.address), n.argv, tuple(name(u) for u in n.upstream), n.outs) for n in nodes]
    wanted = set(args.stages.split(",")) if args.stages else {n.address for n in nodes}
    by_address = {n.address: n for n in nodes}
    needed, frontier = set(), list(wanted)
    while frontier:  # a stage and everything upstream of it
        address = frontier.pop()
        if address not in needed:
            needed.add(address)
            frontier.extend(by_address[address].upstream)
    rows = []
    for node in nodes:
        if node.address not in needed or node.address == "track":
            continue
        walls = {mode: _run(path, node.address) for mode, path in copies.items()}
        times = {mode: _timing(path, node.address) for mode, path in copies.items()}
        rows.append(
            {"stage": node.address, "deterministic_s": times[True], "machine_s": times[False], "process_s": walls}
        )
        if not (times[True] and times[False]):  # the report keeps no timing record: its process, start included
            print(
                f"{node.address:<32} {walls[True]:8.1f} {walls[False]:8.1f} "
                " (its process's wall time, not in the total)",
                flush=True,
            )
            continue
        print(
            f"{node.address:<32} {times[True]:8.1f} {times[False]:8.1f}  x{times[True] / times[False]:.2f}", flush=True
        )
    timed = [r for r in rows if r["deterministic_s"] and r["machine_s"]]  # the report keeps no timing record
    det = sum(r["deterministic_s"] for r in timed)
    fast = sum(r["machine_s"] for r in timed)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "?")
    print(
        f"{'total (' + str(len(timed)) + ' stages)':<32} {det:8.1f} {fast:8.1f}  x{det / fast:.3f}  ({model}, "
        f"{len(os.sched_getaffinity(0))} cores)"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "cpu": model,
                    "cores": len(os.sched_getaffinity(0)),
                    "rows": rows,
                    "total": {"deterministic_s": det, "machine_s": fast},
                },
                indent=2,
            )
        )
    if args.keep:
        print(f"copies kept: {base}")
    else:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
