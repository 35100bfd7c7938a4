"""Merge benchmark: T random ViT-B/32-sized task vectors (timm vit_base_patch32_224, ~88M parameters each),
merged with every method at its defaults, each in a fresh process; prints wall time and peak resident memory.
Each worker first runs its method on a tiny model with as many tasks, and times that apart as the process's
start-up (loading the compiled kernels, creating CUDA or LAPACK handles): a constant per process, which does not
grow with the model. 'wall s' is the merge itself; 'x read with' adds the start-up back.

    python bench/merge.py                       # every method, 8 tasks
    python bench/merge.py --methods ties,cart   # a subset
    python bench/merge.py --repeat 5            # 5 interleaved rounds: the fastest run of each method, and the
                                                # median over rounds of its ratio to that round's read

The element-wise methods' target: peak RSS <= 1.5 GB against ~2.8 GB of inputs, wall time within 3x of reading
every input once (the 'read' row). Inputs are generated once into --dir and reused.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ELEMENT_WISE = [
    "task_arithmetic",
    "ties_tensor",
    "dare_linear",
    "dare_ties",
    "breadcrumbs",
    "magmax",
    "consensus_ta",
    "consensus_ties_tensor",
]
# variants benchmarked beside a method's defaults: name -> (method, hyperparameters)
VARIANTS = {
    "ties_tensor": ("ties", {"trim_scope": "tensor"}),
    "consensus_ties_tensor": ("consensus_ties", {"trim_scope": "tensor"}),
}


def _peak_rss_gb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024**2
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def make_inputs(directory: Path, tasks: int, model: str, seed: int) -> None:
    import timm
    import torch

    from mergeflow.core.io import save_state_dict

    if (directory / "done.json").is_file():
        return
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    theta0 = {k: v.float() for k, v in timm.create_model(model, pretrained=False).state_dict().items()}
    save_state_dict(directory / "theta0.safetensors", theta0)
    for t in range(tasks):
        g = torch.Generator().manual_seed(seed + 1 + t)
        save_state_dict(
            directory / f"task{t}.safetensors", {k: 1e-3 * torch.randn(v.shape, generator=g) for k, v in theta0.items()}
        )
    (directory / "done.json").write_text(json.dumps({"tasks": tasks, "model": model}))


def worker(directory: Path, method: str, threads: int) -> dict:
    # mergeflow first, as in the pipeline's stages: it sets OpenMP's spin count before torch loads
    import mergeflow  # noqa: F401, I001
    import torch

    from mergeflow.core.io import LazyStateDict
    from mergeflow.ml.merging import REGISTRY
    from mergeflow.ml.merging._tensors import read_stacks

    torch.set_num_threads(threads)
    theta0 = LazyStateDict(directory / "theta0.safetensors")
    tvs = {p.stem: LazyStateDict(p) for p in sorted(directory.glob("task*.safetensors"))}
    baseline = _peak_rss_gb()
    start = time.perf_counter()
    startup = 0.0
    if method == "read":
        # every byte of every input, as the merges read them: map_stacked's reader (read_stacks: pread into one
        # reused buffer, with the finite check). Reading into fresh memory instead took longer and varied more
        # (medians 0.86 and 1.08 s against 0.71 and 0.71, range 0.58-1.92 against 0.61-0.77, 5 alternations in
        # each of two processes): it pays first-touch faults on 2.8 GB that a merge does not. A first pass warms the
        # page cache, so the baseline is as fast as the merges' own reads can be.
        for _ in read_stacks(theta0, tvs):
            pass
        start = time.perf_counter()
        n_read = sum(stack.numel() for _, stack in read_stacks(theta0, tvs))
        kind = f"{n_read / 1e6:.0f}M"
    else:
        name, hp = VARIANTS.get(method, (method, {}))
        spec = REGISTRY[name]
        kind = spec.kind

        def run(theta, vectors):
            if spec.kind == "negation":
                first = next(iter(vectors))
                return spec(theta, {first: vectors[first]}, **hp)
            if name == "slerp":
                return spec(theta, dict(list(vectors.items())[:2]), **hp)
            return spec(theta, vectors, **hp)

        # the same merge on a tiny model with as many tasks first: a process's one-time start-up (loading the
        # compiled kernels for T tasks, creating the CUDA or LAPACK handles) is timed apart from the merge
        tiny0 = {"w.weight": torch.zeros(4, 3), "b": torch.zeros(5)}
        gen = torch.Generator().manual_seed(0)
        run(tiny0, {t: {k: torch.randn(v.shape, generator=gen) for k, v in tiny0.items()} for t in tvs})
        startup = time.perf_counter() - start
        start = time.perf_counter()
        run(theta0, tvs)
    return {
        "method": method,
        "kind": kind,
        "wall_s": time.perf_counter() - start,
        "startup_s": startup,
        "peak_rss_gb": _peak_rss_gb(),
        "rss_before_gb": baseline,
    }


def main() -> None:
    from mergeflow.ml.merging import REGISTRY

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--model", default="vit_base_patch32_224")
    parser.add_argument("--dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "mergeflow-bench")
    parser.add_argument("--methods", default=None, help="comma-separated (default: every method, variants included)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds over every method; a row keeps its fastest run, its "
        "highest peak, and its median ratio to each round's read",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        print(json.dumps(worker(args.dir, args.worker, args.threads)))
        return
    start = time.perf_counter()
    make_inputs(args.dir, args.tasks, args.model, args.seed)
    input_gb = sum(p.stat().st_size for p in args.dir.glob("task*.safetensors")) / 1024**3
    print(
        f"inputs: {args.tasks} task vectors of {args.model}, {input_gb:.2f} GB (+ theta0), ready in "
        f"{time.perf_counter() - start:.0f} s; {args.threads} threads"
    )
    methods = args.methods.split(",") if args.methods else sorted(set(REGISTRY) | set(VARIANTS))
    rows = []
    print(
        f"{'method':<24}{'kind':<10}{'wall s':>8}{'x read':>8}{'start-up s':>12}"
        f"{'x read with':>13}{'peak RSS GB':>13}{'(at start)':>12}  target"
    )
    rounds: dict[str, list[dict]] = {}
    for round_ in range(args.repeat):
        read_s = math.nan  # this round's read: the machine drifts between quiet and slow spells (a warm read took
        # 0.38-0.76 s on one day), so a ratio of two minima from different rounds is noise
        for method in ["read", *methods]:
            cmd = [sys.executable, __file__, "--worker", method, "--dir", str(args.dir), "--threads", str(args.threads)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{method:<24}failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
                continue
            run = json.loads(proc.stdout.strip().splitlines()[-1])
            if method == "read":
                read_s = run["wall_s"]
            run["x_read"] = run["wall_s"] / read_s
            run["x_read_with_startup"] = (run["wall_s"] + run["startup_s"]) / read_s
            rounds.setdefault(method, []).append(run)
            if round_ < args.repeat - 1:
                continue
            runs = rounds[method]
            row = {
                **min(runs, key=lambda r: r["wall_s"]),
                "startup_s": min(r["startup_s"] for r in runs),
                "peak_rss_gb": max(r["peak_rss_gb"] for r in runs),
            }
            for ratio in ("x_read", "x_read_with_startup"):
                row[ratio] = statistics.median(r[ratio] for r in runs)
            target = ""
            if method in ELEMENT_WISE:
                ok = row["peak_rss_gb"] <= 1.5 and row["x_read"] <= 3.0
                target = f"{'met' if ok else 'MISSED'} (<= 1.5 GB, merge <= 3x read)"
            rows.append(row)
            print(
                f"{method:<24}{row['kind']:<10}{row['wall_s']:>8.2f}{row['x_read']:>8.1f}"
                f"{row['startup_s']:>12.2f}{row['x_read_with_startup']:>13.1f}"
                f"{row['peak_rss_gb']:>13.2f}{row['rss_before_gb']:>12.2f}  {target}",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
