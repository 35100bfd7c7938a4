"""MagMax: for each entry keep the task-vector value of largest magnitude across tasks; theta0 + lam * that.

Marczak et al., "MagMax: leveraging model merging for seamless continual learning", ECCV 2024 (arXiv:2407.06322).
The paper uses lam = 1.
"""

import numpy as np
import torch

from mergeflow.merging import register
from mergeflow.merging._tensors import map_blocks


def max_magnitude(taus) -> torch.Tensor:
    """Per entry, the tau_t of largest |tau_t|, the first task on ties (argmax's rule), for a [T, ...] stack or a
    list: a running maximum over tasks (argmax + gather over the stack is ~10x slower), in numpy (vectorized
    comparisons; a branch-free select, where torch.where and masked copies branch on every entry)."""
    best = taus[0].float().clone()
    b = best.numpy()
    top = np.abs(b)
    for tau in taus[1:]:
        x = tau.float().numpy()
        mag = np.abs(x)
        wins = np.greater(mag, top)  # strictly: an earlier task keeps a tie
        np.maximum(top, mag, out=top)
        b *= ~wins  # b = x where wins else b, exactly for finite values
        b += x * wins
    return best


@register("magmax", paper="Marczak et al. 2024, MagMax (arXiv:2407.06322)", defaults={"lam": 1.0}, grid={"lam": [0.5, 0.75, 1.0, 1.25, 1.5]}, coefficient="lam")
def magmax(pretrained, task_vectors, *, lam):
    return map_blocks(pretrained, task_vectors, lambda theta0, taus, rows, _: theta0 + lam * max_magnitude(taus))
