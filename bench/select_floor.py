"""Floor of Breadcrumbs per row on this machine: the read of every input plus only the exact per-row cuts
(numpy's introselect, as the merge computes them), without the banded sum or any output, against the read alone.

If this ratio is already above 3, no merge that selects at numpy's speed can be within 3x of the read.
Runs on bench/merge.py's inputs (generate them first with it), in one process, alternating read and read + cuts:

    python bench/select_floor.py --rounds 5 --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "mergeflow-bench")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--gamma", type=float, default=0.1)
    parser.add_argument("--beta", type=float, default=0.2)
    args = parser.parse_args()
    if not (args.dir / "done.json").is_file():
        raise SystemExit(f"error: no inputs in {args.dir}: run bench/merge.py --dir {args.dir} first")

    import mergeflow  # noqa: F401, I001  (first, as in the merges: it sets OpenMP's spin count before torch loads)
    import torch

    from mergeflow.core.io import LazyStateDict, tensor_specs
    from mergeflow.ml.merging._tensors import read_stacks
    from mergeflow.ml.merging.breadcrumbs import row_cuts

    torch.set_num_threads(args.threads)
    theta0 = LazyStateDict(args.dir / "theta0.safetensors")
    vectors = {p.stem: LazyStateDict(p) for p in sorted(args.dir.glob("task*.safetensors"))}
    shapes = {key: shape for key, (shape, _) in tensor_specs(theta0).items()}
    for _ in read_stacks(theta0, vectors):  # warm the page cache
        pass
    ratios = []
    with ThreadPoolExecutor(args.threads) as pool:  # as map_stacked runs the per-task cuts
        for round_ in range(args.rounds):
            start = time.perf_counter()
            for _ in read_stacks(theta0, vectors):
                pass
            read_s = time.perf_counter() - start
            start = time.perf_counter()
            for key, stack in read_stacks(theta0, vectors):
                taus = stack[1:].numpy()
                list(
                    pool.map(
                        lambda t: row_cuts(taus[t].reshape(shapes[key]), args.gamma, args.beta, "row"),
                        range(len(vectors)),
                    )
                )  # noqa: B023
            cuts_s = time.perf_counter() - start
            ratios.append(cuts_s / read_s)
            print(
                f"round {round_}: read {read_s:.2f} s, read + cuts {cuts_s:.2f} s, ratio {ratios[-1]:.2f}", flush=True
            )
    print(
        f"median ratio {statistics.median(ratios):.2f} (range "
        f"{min(ratios):.2f}-{max(ratios):.2f}), {args.threads} threads"
    )


if __name__ == "__main__":
    main()
