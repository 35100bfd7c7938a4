"""The SVD family's merge (TSV-M, Iso-C, Iso-CTS) against FusionBench's way of computing it, on one thread.

FusionBench 0.2.33 computes each of these with full LAPACK SVDs (torch.linalg.svd): TSV-M one per task and one for
each concatenated basis' polar factor (T + 2), Iso-C one of the summed matrix, Iso-CTS one of the sum, one per
task's residual and two polar factors (T + 3). That sequence is written out below from their code; mergeflow's own
functions (merging/tsv_m.py, merging/iso.py) run beside it on the same float32 inputs: task vectors of one ViT-B/16
block (qkv 2304x768, proj 768x768, fc1 3072x768, fc2 768x3072), 8 tasks, each with singular values i^-0.7 plus a
1e-3 noise floor (a decaying spectrum, as fine-tuned task vectors have). CPU seconds are the best of --repeat runs;
"error" is each result's distance to the same algorithm in float64, relative to its norm.

    python bench/svd_family.py              # one block's four matrices, 8 tasks
    python bench/svd_family.py --tasks 14 --repeat 5
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = {"qkv": (2304, 768), "proj": (768, 768), "fc1": (3072, 768), "fc2": (768, 3072)}


def task_vectors(shape: tuple[int, int], tasks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    m, n = shape
    r = min(m, n)
    out = []
    for _ in range(tasks):
        q1, _ = torch.linalg.qr(torch.randn(m, r, generator=g, dtype=torch.float64))
        q2, _ = torch.linalg.qr(torch.randn(n, r, generator=g, dtype=torch.float64))
        spectrum = torch.arange(1, r + 1, dtype=torch.float64) ** -0.7
        out.append((q1 * spectrum) @ q2.T + 1e-3 * torch.randn(m, n, generator=g, dtype=torch.float64) / r**0.5)
    return torch.stack(out).float()


# ------------------------------------------------------------------ FusionBench's sequence of full SVDs
def _svd(x):
    return torch.linalg.svd(x, full_matrices=False)


def _polar(x):
    u, _, vh = _svd(x)
    return u @ vh


def fusionbench_tsv_m(taus):
    k = min(taus.shape[1:]) // len(taus)
    parts = [_svd(tau) for tau in taus]
    u = torch.cat([p[0][:, :k] for p in parts], 1)
    s = torch.cat([p[1][:k] for p in parts])
    vh = torch.cat([p[2][:k] for p in parts], 0)
    return (_polar(u) * s) @ _polar(vh.T).T


def fusionbench_iso_c(taus):
    u, s, vh = _svd(taus.sum(0))
    return s.mean() * (u @ vh)


def fusionbench_iso_cts(taus, fraction=0.8):
    from mergeflow.ml.merging.iso import subspace_sizes

    c, per_task = subspace_sizes(min(taus.shape[1:]), len(taus), fraction)
    u, s, vh = _svd(taus.sum(0))
    us, vs, kept = [u[:, :c]], [vh[:c].T], [s[:c]]
    for tau in taus:
        ut, st, vht = _svd(tau - u[:, :c] @ (u[:, :c].T @ tau))
        us.append(ut[:, :per_task]), vs.append(vht[:per_task].T), kept.append(st[:per_task])
    return torch.cat(kept).mean() * (_polar(torch.cat(us, 1)) @ _polar(torch.cat(vs, 1)).T)


def mergeflow_functions():
    from mergeflow.ml.merging.iso import iso_c_matrix, iso_cts_matrix
    from mergeflow.ml.merging.tsv_m import tsv_merge_matrix

    return {"tsv_m": tsv_merge_matrix, "iso_c": iso_c_matrix, "iso_cts": lambda taus: iso_cts_matrix(taus, 0.8)}


REFERENCE = {"tsv_m": fusionbench_tsv_m, "iso_c": fusionbench_iso_c, "iso_cts": fusionbench_iso_cts}


def cpu_seconds(fn, taus, repeat: int) -> tuple[float, torch.Tensor]:
    best, out = float("inf"), None
    for _ in range(repeat):
        start = time.process_time()
        out = fn(taus)
        best = min(best, time.process_time() - start)
    return best, out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    import scipy.linalg  # noqa: F401  (loaded before the limit, which applies to the libraries loaded by then)
    import threadpoolctl

    torch.set_num_threads(1)
    threadpoolctl.threadpool_limits(1)  # scipy's LAPACK (mergeflow's eigendecompositions) on one thread too
    ours = mergeflow_functions()
    totals = {name: [0.0, 0.0] for name in REFERENCE}
    print(
        f"{'method':<8} {'matrix':<6} {'FusionBench s':>13} "
        f"{'mergeflow s':>11} {'ratio':>6} {'error FB':>9} {'error ours':>10}"
    )
    for i, (label, shape) in enumerate(SHAPES.items()):
        taus = task_vectors(shape, args.tasks, seed=i)
        for name, reference in REFERENCE.items():
            exact = reference(taus.double())
            fb_s, fb = cpu_seconds(reference, taus, args.repeat)
            our_s, our = cpu_seconds(ours[name], taus, args.repeat)
            totals[name][0] += fb_s
            totals[name][1] += our_s
            errors = [float((x.double() - exact).norm() / exact.norm()) for x in (fb, our)]
            print(
                f"{name:<8} {label:<6} {fb_s:>13.3f} {our_s:>11.3f} "
                f"{our_s / fb_s:>6.2f} {errors[0]:>9.1e} {errors[1]:>10.1e}"
            )
    for name, (fb_s, our_s) in totals.items():
        print(f"{name:<8} {'block':<6} {fb_s:>13.3f} {our_s:>11.3f} {our_s / fb_s:>6.2f}")
    fb_all, our_all = (sum(t[i] for t in totals.values()) for i in (0, 1))
    print(f"{'family':<8} {'block':<6} {fb_all:>13.3f} {our_all:>11.3f} {our_all / fb_all:>6.2f}")


if __name__ == "__main__":
    main()
