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

import torch

from mergeflow.merging import register
from mergeflow.merging._tensors import map_tensors

LAMBDA_GRID = [round(0.8 + 0.1 * i, 2) for i in range(18)]  # 0.8, 0.9, ..., 2.5


def kth_largest(magnitudes: torch.Tensor, n_keep: int) -> torch.Tensor:
    """The n_keep-th largest of non-negative float32 ``magnitudes`` (1-D), exactly, by radix selection.

    Non-negative floats order like their int32 bit patterns: a histogram of the top 16 bits finds the bucket that
    holds the answer, and only that bucket is searched exactly (kthvalue over millions of entries is slow).
    """
    bits = magnitudes.contiguous().view(torch.int32)
    bucket = bits >> 16
    counts = torch.bincount(bucket, minlength=1 << 15)
    above = counts.flip(0).cumsum(0)  # above[i]: entries in the top i + 1 buckets
    top = int(torch.searchsorted(above, torch.tensor(n_keep)))  # the first top-i prefix holding n_keep entries
    b = (1 << 15) - 1 - top
    in_bucket = magnitudes[bucket == b]
    rank_in_bucket = n_keep - (int(above[top - 1]) if top > 0 else 0)  # rank from the top within the bucket
    return in_bucket.kthvalue(in_bucket.numel() - rank_in_bucket + 1).values


def topk_threshold(magnitudes: torch.Tensor, k: float) -> torch.Tensor:
    """The smallest magnitude kept when keeping the top-k fraction of ``magnitudes`` (flattened)."""
    flat = magnitudes.flatten().float()
    n_keep = max(1, int(round(k * flat.numel())))
    if n_keep >= flat.numel():
        return flat.min()
    return kth_largest(flat, n_keep)


def global_thresholds(task_vectors: Mapping[str, Mapping[str, torch.Tensor]], k: float) -> torch.Tensor:
    """Pass 1 of a global trim: each task's cut over its whole flattened vector, one task at a time."""
    cuts = []
    for tv in task_vectors.values():
        cuts.append(topk_threshold(torch.cat([tv[key].float().abs().flatten() for key in tv]), k))
    return torch.stack(cuts)


def row_thresholds(magnitudes: torch.Tensor, k: float) -> torch.Tensor:
    """topk_threshold of each row of [T, n] magnitudes, in one batched selection."""
    return torch.stack([topk_threshold(row, k) for row in magnitudes])


def trim(taus: torch.Tensor, k: float, thresholds: torch.Tensor | None = None) -> torch.Tensor:
    """Zero all but the top-k magnitudes of each task's slice of ``taus`` [T, ...] (per tensor unless thresholds given)."""
    magnitudes = taus.abs()
    if thresholds is None:
        thresholds = row_thresholds(magnitudes.flatten(1), k)
    shape = (-1,) + (1,) * (taus.ndim - 1)
    return taus * (magnitudes >= thresholds.view(shape))


def disjoint_mean(trimmed: torch.Tensor) -> torch.Tensor:
    """trimmed: [T, ...]. Elect the sign of the total mass, then average the agreeing non-zero entries."""
    elected = torch.sign(trimmed.sum(0))
    agree = trimmed * elected > 0  # same sign as elected, and non-zero
    return (trimmed * agree).sum(0) / agree.sum(0).clamp(min=1)


def check_ties_args(k: float, trim_scope: str, where: str = "merge.ties") -> None:
    if trim_scope not in ("global", "tensor"):
        raise ValueError(f"{where}.trim_scope: expected 'global' or 'tensor', got {trim_scope!r}")
    if not 0 < k <= 1:
        raise ValueError(f"{where}.k: expected a fraction in (0, 1], got {k}")


def ties_vector(pretrained, task_vectors, *, k: float, trim_scope: str) -> dict[str, torch.Tensor]:
    """The TIES-merged task vector (before scaling), one tensor at a time."""
    cuts = global_thresholds(task_vectors, k) if trim_scope == "global" else None
    return map_tensors(pretrained, task_vectors, lambda key, theta0, taus: disjoint_mean(trim(taus, k, cuts)))


@register(
    "ties",
    paper="Yadav et al. 2023, TIES-Merging (arXiv:2306.01708)",
    defaults={"k": 0.2, "trim_scope": "global", "lam": 1.0},
    grid={"lam": LAMBDA_GRID},
    coefficient="lam",
)
def ties(pretrained, task_vectors, *, k, trim_scope, lam):
    check_ties_args(k, trim_scope)
    cuts = global_thresholds(task_vectors, k) if trim_scope == "global" else None
    return map_tensors(pretrained, task_vectors, lambda key, theta0, taus: theta0 + lam * disjoint_mean(trim(taus, k, cuts)))
