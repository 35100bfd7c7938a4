"""Model Breadcrumbs: mask out both the outliers and the small entries of each task vector, then add.

Davari & Belilovsky, "Model Breadcrumbs: scaling multi-task model merging with sparse masks", ECCV 2024
(arXiv:2312.06795). Per row (last dimension) of each tensor of tau_t, rank entries by |tau|: the largest gamma
fraction is zeroed (outliers), the next beta fraction is kept, the rest zeroed. theta = theta0 + alpha sum_t m_t * tau_t.
Reference code: gamma = 0.1, beta = 0.2, alpha = 0.4 (alpha in [0.1, 1]). ``scope='tensor'`` ranks over the
whole tensor instead, as mergekit does (its defaults: gamma = 0.01, density beta = its own choice).
"""

import torch

from mergeflow.merging import register
from mergeflow.merging._tensors import map_tensors


def breadcrumb_mask(taus: torch.Tensor, gamma: float, beta: float, scope: str) -> torch.Tensor:
    """Boolean mask [T, ...] keeping ranks [gamma n, (gamma + beta) n) of |tau| in each row (or whole tensor).

    By thresholds, not ranks: keep |tau| <= the value ranked gamma n from the top and > the one ranked
    (gamma + beta) n (two batched selections; sorting every row costs far more). Tied values at a cut all
    fall on the same side of it.
    """
    if scope not in ("row", "tensor"):
        raise ValueError(f"merge.breadcrumbs.scope: expected 'row' or 'tensor', got {scope!r}")
    if not (0 <= gamma < 1 and 0 < beta <= 1 - gamma):
        raise ValueError(f"merge.breadcrumbs: need 0 <= gamma < 1 and 0 < beta <= 1 - gamma, got gamma={gamma}, beta={beta}")
    mags = taus.abs().reshape(taus.shape[0], -1) if (scope == "tensor" or taus.ndim <= 2) else taus.abs().reshape(taus.shape[0], -1, taus.shape[-1])
    n = mags.shape[-1]
    lo, hi = int(round(gamma * n)), int(round((gamma + beta) * n))
    keep = torch.ones_like(mags, dtype=torch.bool)
    if lo > 0:  # drop the lo largest: keep values <= the one ranked lo from the top (0-based)
        keep &= mags <= mags.kthvalue(n - lo, dim=-1, keepdim=True).values
    if hi < n:  # keep the next ones down to rank hi: values > the one ranked hi
        keep &= mags > mags.kthvalue(n - hi, dim=-1, keepdim=True).values
    return keep.reshape(taus.shape)


@register(
    "breadcrumbs",
    paper="Davari & Belilovsky 2024, Model Breadcrumbs (arXiv:2312.06795)",
    defaults={"gamma": 0.1, "beta": 0.2, "scope": "row", "alpha": 0.4},
    grid={"alpha": [round(0.1 * i, 1) for i in range(1, 11)]},
    coefficient="alpha",
)
def breadcrumbs(pretrained, task_vectors, *, gamma, beta, scope, alpha):
    def merge(key, theta0, taus):
        return theta0 + alpha * (taus * breadcrumb_mask(taus, gamma, beta, scope)).sum(0)

    return map_tensors(pretrained, task_vectors, merge)
