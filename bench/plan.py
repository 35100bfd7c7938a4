"""`mergeflow plan`'s wall time, cold (nothing cached: it measures this device) and cached, per profile; then where
a cold plan's time goes. Run from the repository root:

    python bench/plan.py                                   # params.yaml and profiles/ta8.yaml
    python bench/plan.py --params params.yaml --repeat 3   # one profile, 3 rounds (the fastest and the slowest)

Each round uses a fresh cache folder (XDG_CACHE_HOME in a temporary directory: the user's cache is left alone).
The machine's 1-minute load average is printed beside each figure: on a shared machine it moves the cold times,
and the estimates' totals show how much it moved the measured throughputs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# run in a child process: each phase of a cold plan timed apart (the CLI's imports, DVC's status, the measuring,
# the estimates)
BREAKDOWN = r"""
import json, sys, time
t0 = time.perf_counter()
import mergeflow.cli  # noqa: F401 - what the command imports before it runs (torch, the method registry)
from mergeflow.params import load_params
params = load_params(sys.argv[1])
t1 = time.perf_counter()
from mergeflow.runner.graph import stage_graph, stale_stages
nodes = stage_graph(".")
stale = stale_stages(".", nodes)
t2 = time.perf_counter()
from mergeflow.runner.plan.cache import cached_throughput
from mergeflow.runner.plan.measure import this_process_start
tp, _ = cached_throughput(params, process_start=this_process_start())
t3 = time.perf_counter()
from mergeflow.runner.plan import make_plan
make_plan(params, nodes, stale, tp)
t4 = time.perf_counter()
print(json.dumps({"imports and params": t1 - t0, "DVC status": t2 - t1, "measuring": t3 - t2, "estimates": t4 - t3}))
"""


def _run(argv: list[str], env: dict) -> tuple[float, dict]:
    start = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(
            f"error: {' '.join(argv)} failed: "
            f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}"
        )
    return wall, json.loads(proc.stdout)


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--params", action="append", help="a params file (repeatable; default: params.yaml and profiles/ta8.yaml)"
    )
    parser.add_argument("--repeat", type=int, default=1, help="rounds per profile, each with a fresh cache (default 1)")
    parser.add_argument("--no-breakdown", action="store_true", help="skip the per-phase breakdown of a cold plan")
    args = parser.parse_args()
    if not Path("dvc.yaml").is_file():
        sys.exit("error: run from the repository root (no dvc.yaml here)")
    profiles = args.params or ["params.yaml", "profiles/ta8.yaml"]
    mergeflow = [sys.executable, "-m", "mergeflow.cli"]
    print(f"{'profile':<22} {'round':>5} {'cold s':>7} {'load':>5} {'cached s':>9} {'load':>5} {'total estimated':>16}")
    for profile in profiles:
        for round_ in range(1, args.repeat + 1):
            with tempfile.TemporaryDirectory() as cache:
                env = os.environ | {"XDG_CACHE_HOME": cache, "HF_HUB_OFFLINE": "1"}
                load_cold = os.getloadavg()[0]
                cold, plan = _run([*mergeflow, "--params", profile, "plan", "--json"], env)
                load_cached = os.getloadavg()[0]
                cached, again = _run([*mergeflow, "--params", profile, "plan", "--json"], env)
                # a cold plan measured on a busy machine is measured again by the first plan on an idle one
                hit = "" if again["throughput_source"]["cached"] else " (measured again: idle now)"
                print(
                    f"{profile:<22} {round_:>5} {cold:>7.1f} {load_cold:>5.1f} {cached:>9.1f} {load_cached:>5.1f} "
                    f"{_hours(plan['total_seconds']):>16}{hit}"
                )
        if not args.no_breakdown:
            with tempfile.TemporaryDirectory() as cache:
                env = os.environ | {"XDG_CACHE_HOME": cache, "HF_HUB_OFFLINE": "1"}
                _, phases = _run([sys.executable, "-c", BREAKDOWN, profile], env)
            print(f"  cold breakdown ({profile}): " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
