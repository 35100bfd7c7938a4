"""TIES-merging: trim, elect sign, disjoint merge.

Yadav et al., "TIES-Merging: Resolving interference when merging models", NeurIPS 2023 (arXiv:2306.01708).
1. trim: keep the top-k fraction of |tau_t| in each task vector, zero the rest;
2. elect: gamma = sgn(sum_t trimmed tau_t) (the sign of the total mass);
3. disjoint mean: per entry, the mean of the trimmed entries whose sign equals gamma;
theta = theta0 + lam * that.

``trim_scope='global'`` (the original code) makes one cut per task over the whole flattened model; it needs a
first pass over the model, done one task vector at a time (peak: one task vector's magnitudes). ``'tensor'``
(mergekit, PEFT) cuts each tensor separately and streams like every element-wise method.
"""

from collections.abc import Mapping
from math import prod

import numpy as np
import torch

from mergeflow.io import tensor_specs
from mergeflow.merging import register
from mergeflow.merging._kernels import disjoint_mean
from mergeflow.merging._tensors import kernel_vector, magnitudes_of, map_stacked, partition_magnitudes, plus_scaled, read_stack

LAMBDA_GRID = [round(0.8 + 0.1 * i, 2) for i in range(18)]  # 0.8, 0.9, ..., 2.5


def cut_in_place(mags: np.ndarray, k: float) -> np.float32:
    """The smallest of the top-k fraction of 1-D magnitudes ``mags``, exactly, reordering them in place: by
    introselect on their bit patterns (_tensors.partition_magnitudes), in linear time."""
    i = mags.size - min(mags.size, max(1, int(round(k * mags.size))))
    partition_magnitudes(mags, i)
    return mags[i]


def magnitude_cut(values: np.ndarray, k: float) -> np.float32:
    """cut_in_place of |values| (values unchanged; the magnitudes go to the thread's scratch buffer)."""
    return cut_in_place(magnitudes_of(values), k)


def topk_threshold(magnitudes: torch.Tensor, k: float) -> torch.Tensor:
    """magnitude_cut of a tensor's magnitudes (flattened)."""
    return torch.tensor(magnitude_cut(magnitudes.detach().float().reshape(-1).numpy(), k))


def global_thresholds(task_vectors: Mapping[str, Mapping[str, torch.Tensor]], k: float) -> list[float]:
    """Pass 1 of a global trim: each task's cut over its whole flattened vector, one task at a time."""
    cuts = []
    for tv in task_vectors.values():
        sizes = [prod(shape) for shape, _ in tensor_specs(tv).values()]
        flat = torch.empty(sum(sizes))  # one task's vector, read tensor by tensor (no list, no cat)
        for piece, key in zip(flat.split(sizes), tv):
            read_stack([tv], key, piece.unsqueeze(0))
        mags = np.abs(flat.numpy(), out=flat.numpy())
        cuts.append(float(cut_in_place(mags, k)))
    return cuts


def check_ties_args(k: float, trim_scope: str, where: str = "merge.ties") -> None:
    if trim_scope not in ("global", "tensor"):
        raise ValueError(f"{where}.trim_scope: expected 'global' or 'tensor', got {trim_scope!r}")
    if not 0 < k <= 1:
        raise ValueError(f"{where}.k: expected a fraction in (0, 1], got {k}")


def trim_cuts(task_vectors, k: float, trim_scope: str):
    """map_stacked's prepare for a trim: task t's magnitude cut of a tensor (global cuts: computed once)."""
    if trim_scope == "global":
        cuts = global_thresholds(task_vectors, k)
        return lambda key, t, tau: cuts[t]
    return lambda key, t, tau: float(magnitude_cut(tau, k))


def ties_vector(taus: tuple[np.ndarray, ...], cuts: list[float]) -> torch.Tensor:
    """The TIES-merged task vector (before scaling) of T flat tensors, trimming task t at |tau_t| >= cuts[t]."""
    return kernel_vector(disjoint_mean, taus, np.array(cuts, np.float32))


@register(
    "ties",
    paper="Yadav et al. 2023, TIES-Merging (arXiv:2306.01708)",
    defaults={"k": 0.2, "trim_scope": "global", "lam": 1.0},
    grid={"lam": LAMBDA_GRID},
    coefficient="lam",
)
def ties(pretrained, task_vectors, *, k, trim_scope, lam):
    check_ties_args(k, trim_scope)
    return map_stacked(pretrained, task_vectors, lambda theta0, taus, cuts: plus_scaled(theta0, lam, ties_vector(taus, cuts)), prepare=trim_cuts(task_vectors, k, trim_scope))
