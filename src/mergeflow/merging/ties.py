"""TIES-merging: trim, elect sign, disjoint merge.

Yadav et al., "TIES-Merging: Resolving interference when merging models", NeurIPS 2023.
1. trim: keep the top-k fraction of |tau_t| in each task vector, zero the rest;
2. elect: gamma = sgn(sum_t trimmed tau_t) (the sign of the total mass);
3. disjoint mean: per entry, the mean of the trimmed entries whose sign equals gamma;
theta = theta0 + lam * that. The original code trims over the whole flattened model (``trim_scope='global'``);
mergekit and PEFT trim each tensor separately (``trim_scope='tensor'``).
"""

import torch

from mergeflow.merging import register
from mergeflow.merging._tensors import add_scaled, stack

LAMBDA_GRID = [round(0.8 + 0.1 * i, 2) for i in range(18)]  # 0.8, 0.9, ..., 2.5


def topk_threshold(magnitudes: torch.Tensor, k: float) -> torch.Tensor:
    """The smallest magnitude kept when keeping the top-k fraction of ``magnitudes`` (flattened)."""
    flat = magnitudes.flatten()
    n_keep = max(1, int(round(k * flat.numel())))
    if n_keep >= flat.numel():
        return flat.min()
    return flat.kthvalue(flat.numel() - n_keep + 1).values


def disjoint_mean(trimmed: torch.Tensor) -> torch.Tensor:
    """trimmed: [T, ...]. Elect the sign of the total mass, then average the agreeing non-zero entries."""
    elected = torch.sign(trimmed.sum(0))
    agree = (torch.sign(trimmed) == elected) & (trimmed != 0)
    count = agree.sum(0).clamp(min=1)
    return (trimmed * agree).sum(0) / count


@register(
    "ties",
    paper="Yadav et al. 2023, TIES-Merging (arXiv:2306.01708)",
    defaults={"k": 0.2, "trim_scope": "global", "lam": 1.0},
    grid={"lam": LAMBDA_GRID},
)
def ties(pretrained, task_vectors, *, k, trim_scope, lam):
    if trim_scope not in ("global", "tensor"):
        raise ValueError(f"merge.ties.trim_scope: expected 'global' or 'tensor', got {trim_scope!r}")
    if not 0 < k <= 1:
        raise ValueError(f"merge.ties.k: expected a fraction in (0, 1], got {k}")
    keys = list(pretrained)
    stacks = {key: stack(task_vectors, key) for key in keys}
    if trim_scope == "global":
        # one cut per task over the whole flattened model
        flat = torch.cat([stacks[key].flatten(1) for key in keys], dim=1).abs()
        thresholds = torch.stack([topk_threshold(row, k) for row in flat])
    merged = {}
    for key in keys:
        s = stacks[key]
        if trim_scope == "tensor":
            thresholds = torch.stack([topk_threshold(row.abs(), k) for row in s])
        shape = (-1,) + (1,) * (s.ndim - 1)
        trimmed = torch.where(s.abs() >= thresholds.view(shape), s, torch.zeros_like(s))
        merged[key] = disjoint_mean(trimmed)
    return add_scaled(pretrained, merged, lam)
