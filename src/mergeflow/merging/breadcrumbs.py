"""Model Breadcrumbs: mask out both the outliers and the small entries of each task vector, then add.

Davari & Belilovsky, "Model Breadcrumbs: scaling multi-task model merging with sparse masks", ECCV 2024
(arXiv:2312.06795). Per row (last dimension) of each tensor of tau_t, rank entries by |tau|: the largest gamma
fraction is zeroed (outliers), the next beta fraction is kept, the rest zeroed. theta = theta0 + alpha sum_t m_t * tau_t.
Reference code: gamma = 0.1, beta = 0.2, alpha = 0.4 (alpha in [0.1, 1]). ``scope='tensor'`` ranks over the
whole tensor instead, as mergekit does (its defaults: gamma = 0.01, density beta = its own choice).
"""

import numpy as np
import torch

from mergeflow.merging import register
from mergeflow.merging._tensors import map_blocks, partition_magnitudes


def check_args(gamma: float, beta: float, scope: str) -> None:
    if scope not in ("row", "tensor"):
        raise ValueError(f"merge.breadcrumbs.scope: expected 'row' or 'tensor', got {scope!r}")
    if not (0 <= gamma < 1 and 0 < beta <= 1 - gamma):
        raise ValueError(f"merge.breadcrumbs: need 0 <= gamma < 1 and 0 < beta <= 1 - gamma, got gamma={gamma}, beta={beta}")


def rank_cuts(mags: np.ndarray, gamma: float, beta: float) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(upper, lower) along the last dim of ``mags`` [..., n] (reordered in place), keepdim: the values ranked
    lo = gamma n and hi = (gamma + beta) n from the top (0-based); None where there is no cut (lo = 0, hi = n).

    By introselect (_tensors.partition_magnitudes): partition at the lower cut, then only the
    part above it for the upper one.
    """
    n = mags.shape[-1]
    lo, hi = int(round(gamma * n)), int(round((gamma + beta) * n))
    upper = lower = None
    above, offset = mags, 0
    if hi < n:
        partition_magnitudes(mags, n - hi - 1)
        lower = mags[..., n - hi - 1 : n - hi].copy()
        above, offset = mags[..., n - hi :], n - hi
    if lo > 0:
        i = n - lo - 1 - offset  # < 0 only when lo = hi: the upper cut is the lower one
        if i < 0:
            upper = lower
        else:
            partition_magnitudes(above, i)
            upper = above[..., i : i + 1].copy()
    return upper, lower


def band(mags: np.ndarray, upper: np.ndarray | None, lower: np.ndarray | None) -> np.ndarray:
    """lower < mags <= upper (a missing cut: no bound). Tied values at a cut all fall on the same side of it.
    numpy: its comparisons into bool are vectorized, torch's CPU ones are not (~3x slower)."""
    keep = np.less_equal(mags, upper) if upper is not None else np.ones(mags.shape, bool)
    if lower is not None:
        keep &= np.greater(mags, lower)
    return keep


def task_mask(tau: torch.Tensor, gamma: float, beta: float, scope: str) -> np.ndarray:
    """One task's keep mask for a tensor: cuts per row (of the last dim), or over the whole tensor."""
    mags = np.abs(tau.float().numpy())
    ranked = mags.reshape(-1) if scope == "tensor" or tau.ndim <= 1 else mags
    return band(ranked, *rank_cuts(ranked.copy(), gamma, beta)).reshape(tau.shape)


def breadcrumb_mask(taus: torch.Tensor, gamma: float, beta: float, scope: str) -> torch.Tensor:
    """Boolean mask [T, ...] keeping ranks [gamma n, (gamma + beta) n) of |tau| in each row (or whole tensor).

    By thresholds, not ranks: keep |tau| <= the value ranked gamma n from the top and > the one ranked
    (gamma + beta) n (two selections; sorting every row costs far more). Tied values at a cut all fall on the same
    side of it.
    """
    check_args(gamma, beta, scope)
    return torch.from_numpy(np.stack([task_mask(tau, gamma, beta, scope) for tau in taus]))


@register(
    "breadcrumbs",
    paper="Davari & Belilovsky 2024, Model Breadcrumbs (arXiv:2312.06795)",
    defaults={"gamma": 0.1, "beta": 0.2, "scope": "row", "alpha": 0.4},
    grid={"alpha": [round(0.1 * i, 1) for i in range(1, 11)]},
    coefficient="alpha",
)
def breadcrumbs(pretrained, task_vectors, *, gamma, beta, scope, alpha):
    check_args(gamma, beta, scope)

    def prepare(key, t, tau):
        return task_mask(tau, gamma, beta, scope)

    def merge(theta0, taus, rows, keep):
        stacked = torch.stack(taus)
        for x, mask in zip(stacked.numpy(), keep):
            np.multiply(x, mask[rows], out=x)  # numpy's product with a bool mask is branch-free; torch's is not
        return theta0 + alpha * stacked.sum(0)

    return map_blocks(pretrained, task_vectors, merge, prepare=prepare)
