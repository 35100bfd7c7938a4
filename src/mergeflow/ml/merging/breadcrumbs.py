"""Model Breadcrumbs: mask out both the outliers and the small entries of each task vector, then add.

Davari & Belilovsky, "Model Breadcrumbs: scaling multi-task model merging with sparse masks", ECCV 2024
(arXiv:2312.06795). Per row (last dimension) of each tensor of tau_t, rank entries by |tau|: the largest gamma
fraction is zeroed (outliers), the next beta fraction is kept, the rest zeroed. theta = theta0 + alpha sum_t m_t *
tau_t. Reference code: gamma = 0.1, beta = 0.2, alpha = 0.4 (alpha in [0.1, 1]). ``scope='tensor'`` ranks over the
whole tensor instead, as mergekit does (its defaults: gamma = 0.01, density beta = its own choice).

``rounding`` is which ranks the band holds of n entries (_rounding.band_ranks): ``'floor'`` (default: the authors'
code and mergekit, [floor(gamma n), floor(gamma n) + floor(beta n))) or ``'round'`` (mergeflow's earlier rule,
[round(gamma n), round((gamma + beta) n))). Entries tied with a cut fall on the same side of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mergeflow.ml.merging import ANY_NUMBER, Choice, Range, register
from mergeflow.ml.merging._rounding import BAND, band_ranks

if TYPE_CHECKING:
    import numpy as np


def gamma_plus_beta_at_most_one(hp) -> str | None:
    if hp["gamma"] + hp["beta"] > 1 + 1e-12:  # 1e-12: 0.7 + 0.3 is 1.0000000000000002 in floats
        return f"need gamma + beta <= 1, got gamma={hp['gamma']}, beta={hp['beta']}"
    return None


def rank_cuts(mags: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """(upper, lower), one per row of ``mags`` [rows, n] (reordered in place): the values ranked lo and hi from the
    top (0-based). A row keeps lower < |tau| <= upper, the ranks [lo, hi); a missing cut (lo = 0, hi = n) is inf or
    -1, which keeps everything. Tied values at a cut all fall on the same side of it.

    By introselect (_tensors.partition_magnitudes): partition at the lower cut, then only the
    part above it for the upper one.
    """
    import numpy as np

    from mergeflow.ml.merging._tensors import partition_magnitudes

    rows, n = mags.shape
    upper, lower = np.full(rows, np.inf, mags.dtype), np.full(rows, -1, mags.dtype)
    above, offset = mags, 0
    if hi < n:
        partition_magnitudes(mags, n - hi - 1)
        lower = mags[:, n - hi - 1].copy()
        above, offset = mags[:, n - hi :], n - hi
    if lo > 0:
        i = n - lo - 1 - offset  # < 0 only when lo = hi: the upper cut is the lower one
        if i < 0:
            upper = lower
        else:
            partition_magnitudes(above, i)
            upper = above[:, i].copy()
    return upper, lower


def row_cuts(
    tau: np.ndarray, gamma: float, beta: float, scope: str, rounding: str = "floor"
) -> tuple[np.ndarray, np.ndarray]:
    """One task's rank_cuts of a tensor: one per row of its last dim, or one for the whole tensor. (``rounding``'s
    default, the method's, is for callers outside the registry: bench/select_floor.py.)"""
    from mergeflow.ml.merging._tensors import magnitudes_of

    mags = magnitudes_of(tau)
    rows = mags.reshape(1, -1) if scope == "tensor" or tau.ndim <= 1 else mags.reshape(-1, tau.shape[-1])
    return rank_cuts(rows, *band_ranks(rows.shape[1], gamma, beta, rounding))


# the mask's hyperparameters, shared with breadcrumbs_ties
MASK_RANGES = {
    "gamma": Range("a fraction", 0, 1, high_open=True),
    "beta": Range("a fraction", 0, 1, low_open=True),
    "scope": Choice(("row", "tensor")),
    "rounding": BAND,
}


@register(
    "breadcrumbs",
    paper="Davari & Belilovsky 2024, Model Breadcrumbs (arXiv:2312.06795)",
    defaults={"gamma": 0.1, "beta": 0.2, "scope": "row", "rounding": "floor", "alpha": 0.4},
    grid={"alpha": [round(0.1 * i, 1) for i in range(1, 11)]},
    coefficient="alpha",
    ranges={**MASK_RANGES, "alpha": ANY_NUMBER},
    joint=gamma_plus_beta_at_most_one,
)
def breadcrumbs(pretrained, task_vectors, *, gamma, beta, scope, rounding, alpha):
    import numpy as np

    from mergeflow.ml.merging._kernels import banded_sum
    from mergeflow.ml.merging._tensors import kernel_vector, map_stacked, plus_scaled

    def merge(theta0, taus, cuts):
        uppers, lowers = (np.stack(side) for side in zip(*cuts))
        return plus_scaled(theta0, alpha, kernel_vector(banded_sum, taus, uppers, lowers))

    return map_stacked(
        pretrained, task_vectors, merge, prepare=lambda key, t, tau: row_cuts(tau, gamma, beta, scope, rounding)
    )
