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

from collections.abc import Mapping, Sequence
from math import prod

import numpy as np
import torch

from mergeflow.io import tensor_specs
from mergeflow.merging import register
from mergeflow.merging._tensors import map_blocks, partition_magnitudes

LAMBDA_GRID = [round(0.8 + 0.1 * i, 2) for i in range(18)]  # 0.8, 0.9, ..., 2.5


def select(values: np.ndarray, i: int) -> np.float32:
    """The i-th smallest entry (0-based) of 1-D non-negative ``values``, exactly, reordering it in place."""
    partition_magnitudes(values, i)
    return values[i]


def magnitude_cut(mags: np.ndarray, k: float) -> torch.Tensor:
    """The smallest magnitude kept when keeping the top-k fraction of 1-D ``mags`` (reordered in place)."""
    n_keep = max(1, int(round(k * mags.size)))
    return torch.tensor(mags.min() if n_keep >= mags.size else select(mags, mags.size - n_keep))


def topk_threshold(magnitudes: torch.Tensor, k: float) -> torch.Tensor:
    """magnitude_cut of a tensor's magnitudes (flattened), leaving them unchanged."""
    return magnitude_cut(magnitudes.detach().float().flatten().numpy().copy(), k)


def tensor_threshold(tau: torch.Tensor, k: float) -> torch.Tensor:
    """topk_threshold(|tau|, k), selecting in place in its one fresh array of magnitudes."""
    return magnitude_cut(np.abs(tau.reshape(-1).float().numpy()), k)


def global_thresholds(task_vectors: Mapping[str, Mapping[str, torch.Tensor]], k: float) -> torch.Tensor:
    """Pass 1 of a global trim: each task's cut over its whole flattened vector, one task at a time."""
    cuts = []
    for tv in task_vectors.values():
        sizes = [prod(shape) for shape, _ in tensor_specs(tv).values()]
        flat = torch.empty(sum(sizes))  # one task's magnitudes, written tensor by tensor (no list, no cat)
        for piece, key in zip(flat.split(sizes), tv):
            torch.abs(tv[key].float().reshape(-1), out=piece)
        cuts.append(magnitude_cut(flat.numpy(), k))
    return torch.stack(cuts)


def shrink_limits(thresholds: torch.Tensor) -> list[float]:
    """hardshrink(x, l) zeroes |x| <= l: l, the float32 just below a cut, keeps exactly |x| >= cut."""
    cuts = thresholds.float().reshape(-1)
    return torch.nextafter(cuts, torch.zeros_like(cuts)).tolist()


def trimmed_stack(taus: Sequence[torch.Tensor], limits: Sequence[float]) -> torch.Tensor:
    """[T, ...] stack of tau_t with |tau_t| < its cut zeroed (limits from shrink_limits): one pass that stacks and
    trims, without magnitudes or boolean masks."""
    out = torch.empty((len(taus), *taus[0].shape))
    for i, (tau, limit) in enumerate(zip(taus, limits)):
        torch.hardshrink(tau, limit, out=out[i])
    return out


def disjoint_mean(trimmed: torch.Tensor) -> torch.Tensor:
    """trimmed: [T, ...]. Elect the sign of the total mass, then average the agreeing non-zero entries.

    That is (trimmed * agree).sum(0) / agree.sum(0).clamp(min=1) with agree = trimmed * elected > 0, in float ops
    only: aligned = trimmed * elected is |tau| where the sign agrees, <= 0 elsewhere, so relu(aligned) sums the
    agreeing magnitudes and its signs count them (summing magnitudes and restoring the sign after is exact).
    """
    elected = torch.sign(trimmed.sum(0))
    aligned = (trimmed * elected).clamp_(min=0)
    total = aligned.sum(0)
    count = aligned.sign_().sum(0)
    return total * elected / count.clamp_(min=1)


def check_ties_args(k: float, trim_scope: str, where: str = "merge.ties") -> None:
    if trim_scope not in ("global", "tensor"):
        raise ValueError(f"{where}.trim_scope: expected 'global' or 'tensor', got {trim_scope!r}")
    if not 0 < k <= 1:
        raise ValueError(f"{where}.k: expected a fraction in (0, 1], got {k}")


def trim_limits(task_vectors, k: float, trim_scope: str):
    """map_blocks' prepare for a trim: task t's hardshrink limit for a tensor (global cuts: computed once)."""
    if trim_scope == "global":
        limits = shrink_limits(global_thresholds(task_vectors, k))
        return lambda key, t, tau: limits[t]
    return lambda key, t, tau: shrink_limits(tensor_threshold(tau, k))[0]


def ties_vector(pretrained, task_vectors, *, k: float, trim_scope: str) -> dict[str, torch.Tensor]:
    """The TIES-merged task vector (before scaling), one block at a time."""
    return map_blocks(pretrained, task_vectors, lambda theta0, taus, rows, limits: disjoint_mean(trimmed_stack(taus, limits)), prepare=trim_limits(task_vectors, k, trim_scope))


@register(
    "ties",
    paper="Yadav et al. 2023, TIES-Merging (arXiv:2306.01708)",
    defaults={"k": 0.2, "trim_scope": "global", "lam": 1.0},
    grid={"lam": LAMBDA_GRID},
    coefficient="lam",
)
def ties(pretrained, task_vectors, *, k, trim_scope, lam):
    check_ties_args(k, trim_scope)
    return map_blocks(pretrained, task_vectors, lambda theta0, taus, rows, limits: theta0 + lam * disjoint_mean(trimmed_stack(taus, limits)), prepare=trim_limits(task_vectors, k, trim_scope))
