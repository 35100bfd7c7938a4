"""One MIMA round of the default pipeline's fine-tunes (every task, K steps from theta0), timed two ways:
in this process one task after another with all the CPU threads, and on a pool of worker processes with one thread
each (what stage regime@<name> does on a CPU). Prints the wall time of each way and the steps per second.
Needs the default pipeline's outputs (data/, models/pretrained.safetensors, models/heads/).

    python bench/regime_round.py                 # K = 50 (MIMA N = 4 of 200 steps), 2 workers
    python bench/regime_round.py --steps 25 --workers 4
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from mergeflow.pipeline import stages
from mergeflow.params import load_params
from mergeflow.core.io import load_state_dict
from mergeflow.ml.regimes import Budget
from mergeflow.ml.regimes._pool import PoolTrainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    params = load_params("params.yaml")
    layout = stages.Layout()
    theta0 = load_state_dict(layout.pretrained)
    tasks = params.suite.tasks
    calls = [(t, dict(theta0), Budget.of_steps(args.steps, schedule_length=params.finetune.steps), None) for t in tasks]
    steps = args.steps * len(tasks)

    build = functools.partial(stages.regime_trainer, params, layout, "cpu")
    t0 = time.perf_counter()
    train = build()
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    for call in calls:
        train(*call)
    alone = time.perf_counter() - t0
    print(
        f"in process, {torch.get_num_threads()} threads: {alone:.1f} s "
        f"({steps / alone:.1f} steps/s), trainer built in {setup:.1f} s"
    )

    t0 = time.perf_counter()
    with PoolTrainer(build, args.workers, max(1, torch.get_num_threads() // args.workers)) as pool:
        pool.map(calls[: args.workers])  # the workers' start: spawn, imports, the trainer built once each
        started = time.perf_counter() - t0
        t0 = time.perf_counter()
        pool.map(calls)
        pooled = time.perf_counter() - t0
    print(
        f"pool of {args.workers} x {max(1, torch.get_num_threads() // args.workers)} threads: {pooled:.1f} s "
        f"({steps / pooled:.1f} steps/s), workers started (and one call each) in {started:.1f} s"
    )


if __name__ == "__main__":
    main()
