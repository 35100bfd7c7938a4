"""AdaMerging's adaptation loop on the default pipeline's models: Adam steps per second, layer-wise and task-wise,
on the CPU and (when there is one) the GPU, with a batch of 16 inputs of each of the 8 tasks per step, as the
merge stage runs it (merging._adaptive). Also times one step's merge alone (theta(lambda) built from the stacked
task vectors) against the forward and backward. Needs the default pipeline's outputs (data/, models/, vectors/).

    python bench/adamerging.py                   # 50 steps each, every available device
    python bench/adamerging.py --steps 100 --device cuda
"""

from __future__ import annotations

import argparse
import time

import torch

from mergeflow.pipeline import stages
from mergeflow.params import load_params
from mergeflow.ml.merging import REGISTRY
from mergeflow.ml.merging._adaptive import MergedParameters
from mergeflow.pipeline.binding import bind_data
from mergeflow.ml.models import build_backbone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--device", choices=["cpu", "cuda"], action="append")
    args = parser.parse_args()
    params = load_params("params.yaml")
    layout = stages.Layout()
    tasks = stages._load_tasks(params, layout)
    heads = stages._load_heads(params, layout, build_backbone(params.backbone).num_features, tasks)
    theta0, taus = stages._load_task_vectors(params, layout)
    devices = args.device or ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print(f"threads {torch.get_num_threads()}, {len(tasks)} tasks x batch 16, {args.steps} steps")
    for device in devices:
        for method in ("adamerging", "adamerging_task"):
            data = bind_data(params, REGISTRY[method], layout, tasks, heads, torch.device(device))
            REGISTRY[method].with_data(data)(theta0, taus, steps=3)  # warm-up (allocator, kernels)
            REGISTRY[method].with_data(data)(theta0, taus, steps=args.steps)
            print(f"{device:>4} {method:<16} {data.timing[-1]['steps_per_second']:7.1f} steps/s")
        merged = MergedParameters(theta0, taus, layer_wise=True, init=0.3, device=torch.device(device))
        start = time.perf_counter()
        for _ in range(args.steps):
            merged()
        if device == "cuda":
            torch.cuda.synchronize()
        print(f"{device:>4} theta(lambda) alone     {args.steps / (time.perf_counter() - start):7.1f} builds/s")


if __name__ == "__main__":
    main()
