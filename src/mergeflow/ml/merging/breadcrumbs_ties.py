"""Breadcrumbs-TIES: Model Breadcrumbs' masks (drop the outliers and the small entries of each task vector), then
TIES' sign election and disjoint merge; theta = theta0 + lam * that.

mergekit's ``breadcrumbs_ties`` (no paper of its own): the masks of Davari & Belilovsky, "Model Breadcrumbs",
ECCV 2024 (arXiv:2312.06795; see ``breadcrumbs`` for the band of ranks kept: the largest gamma fraction zeroed,
the next beta kept, per row or per tensor) with the sign election of Yadav et al., "TIES-Merging", NeurIPS 2023
(arXiv:2306.01708). ``fuse``: ``'sum'`` (mergekit's default, normalize: false: the agreeing entries added) or
``'mean'`` (TIES' disjoint mean). Defaults: Breadcrumbs' paper for the mask (gamma 0.1, beta 0.2, per row);
mergekit masks per tensor (``scope: tensor``), with gamma 0.01.
"""

from __future__ import annotations

from mergeflow.ml.merging import ANY_NUMBER, register
from mergeflow.ml.merging._sign import FUSE
from mergeflow.ml.merging.breadcrumbs import MASK_RANGES, gamma_plus_beta_at_most_one


def band_mask(tau, gamma: float, beta: float, scope: str, rounding: str):
    """Breadcrumbs' mask of one task's tensor, in its shape: lower < |tau| <= upper, by row or by tensor."""
    import torch

    from mergeflow.ml.merging.breadcrumbs import row_cuts

    upper, lower = (torch.from_numpy(c) for c in row_cuts(tau.contiguous().numpy(), gamma, beta, scope, rounding))
    rows = tau.abs().reshape(len(upper), -1)
    return ((rows > lower[:, None]) & (rows <= upper[:, None])).reshape(tau.shape)


@register(
    "breadcrumbs_ties",
    paper="mergekit's breadcrumbs_ties: Breadcrumbs' masks "
    "(arXiv:2312.06795) with TIES' sign election (arXiv:2306.01708)",
    defaults={"gamma": 0.1, "beta": 0.2, "scope": "row", "rounding": "floor", "fuse": "sum", "lam": 0.4},
    grid={"lam": [round(0.1 * i, 1) for i in range(1, 11)]},
    coefficient="lam",
    ranges={**MASK_RANGES, "fuse": FUSE, "lam": ANY_NUMBER},
    joint=gamma_plus_beta_at_most_one,
)
def breadcrumbs_ties(pretrained, task_vectors, *, gamma, beta, scope, rounding, fuse, lam):
    import torch

    from mergeflow.ml.merging._sign import elect_and_fuse
    from mergeflow.ml.merging._tensors import map_tensors

    def merge(key, theta0, taus):
        masked = torch.stack(
            [torch.where(band_mask(tau, gamma, beta, scope, rounding), tau, torch.zeros_like(tau)) for tau in taus]
        )
        return theta0 + lam * elect_and_fuse(masked, fuse)

    return map_tensors(pretrained, task_vectors, merge)
