"""Where a stage's time goes besides its work: process start, imports, data loading and writing, with and without
the stage server (mergeflow.runner.stage_server).

Run it after a pipeline run (the stages re-run on a copy of the project's outputs, so the workspace is untouched):

    .venv/bin/python bench/stage_overhead.py                 # the repository's own outputs (after make pipeline)
    .venv/bin/python bench/stage_overhead.py --root PATH     # another project's
    .venv/bin/python bench/stage_overhead.py --stages vectors report merge@task_arithmetic

For each stage it prints the wall time of `mergeflow <stage>` in a process of its own and through a stage server,
the stage's own timer (its work, logs/timing), and the difference: the fixed cost of starting the stage. Below
it, the parts of that cost: the interpreter's start, the CLI's, and the imports a stage's process pays.
Each figure is the minimum of --repeat runs (the least disturbed by other work on the machine).
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

REPO = Path(__file__).resolve().parents[1]
OUTPUTS = ("data", "models", "vectors", "statistics", "merged", "metrics", "results", "logs", "regimes", "studies")
DEFAULT_STAGES = (
    "vectors",
    "merge@weight_averaging",
    "merge@task_arithmetic",
    "finetune@digits",
)  # stages with a timer (logs/timing)


def _wall(cmd: list[str], cwd: Path, env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return time.perf_counter() - start


def _inside(root: Path, address: str) -> float:
    stage, _, item = address.partition("@")
    path = root / "logs" / "timing" / (f"{stage}/{item}.json" if item else f"{stage}.json")
    timing = json.loads(path.read_text())
    return float(timing["wall_time_s"])  # a merge's evaluation is inside its timer (evaluate_wall_time_s: its share)


def _copy_project(src: Path, dst: Path) -> Path:
    files = subprocess.run(["git", "ls-files"], cwd=src, capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if (src / f).is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / f, dst / f)
    for folder in OUTPUTS:
        if (src / folder).is_dir():
            shutil.copytree(src / folder, dst / folder, dirs_exist_ok=True)
    return dst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--root", type=Path, default=REPO, help="a project whose stages have run (default: this repository)"
    )
    parser.add_argument("--stages", nargs="+", default=list(DEFAULT_STAGES), help="stage addresses to time")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "src"))
    from mergeflow.runner.stage_server import SERVER_ENV, running_server

    mergeflow = str(Path(sys.executable).parent / "mergeflow")
    env = {k: v for k, v in os.environ.items() if k != SERVER_ENV} | {"HF_HUB_OFFLINE": "1"}
    rows = []
    with tempfile.TemporaryDirectory(prefix="stage-overhead-") as tmp:
        root = _copy_project(args.root.resolve(), Path(tmp) / "project")
        parts = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "mergeflow --version": [mergeflow, "--version"],
            "mergeflow --help": [mergeflow, "--help"],
            "mergeflow check": [mergeflow, "check"],
            "import torch": [sys.executable, "-c", "import torch"],
            "import torch, timm": [sys.executable, "-c", "import torch, timm"],
            "import mergeflow.pipeline.stages": [sys.executable, "-c", "import mergeflow.pipeline.stages"],
        }
        start_up = {name: min(_wall(cmd, root, env) for _ in range(args.repeat)) for name, cmd in parts.items()}
        with running_server(env) as address:
            served_env = env | {SERVER_ENV: address}
            _wall([mergeflow, "--version"], root, served_env)
            time.sleep(0.1)
            for address_ in args.stages:
                stage, _, item = address_.partition("@")
                flag = {
                    "finetune": ["--task", item],
                    "merge": ["--method", item],
                    "regime": ["--regime", item],
                    "regime_merge": ["--regime", item],
                    "study": [item],
                }.get(stage, [])
                cmd = [mergeflow, stage, *flag]
                own, served = [], []
                for _ in range(args.repeat):
                    own.append((_wall(cmd, root, env), _inside(root, address_)))
                    served.append((_wall(cmd, root, served_env), _inside(root, address_)))
                best_own, best_served = min(own), min(served)
                rows.append((address_, best_own, best_served))
    print(f"{'stage':<28}{'own process':>13}{'(work)':>9}{'fixed':>8}{'server':>10}{'(work)':>9}{'fixed':>8}")
    for address_, (own_total, own_work), (srv_total, srv_work) in rows:
        print(
            f"{address_:<28}{own_total:>12.2f}s{own_work:>8.2f}s{own_total - own_work:>7.2f}s{srv_total:>9.2f}s"
            f"{srv_work:>8.2f}s{srv_total - srv_work:>7.2f}s"
        )
    print("\nstart-up parts (each in a new process):")
    for name, seconds in start_up.items():
        print(f"  {name:<26}{seconds:>7.2f} s  ({seconds / start_up['python -c pass']:.0f}x python -c pass)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
