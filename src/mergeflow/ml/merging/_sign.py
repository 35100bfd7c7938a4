"""TIES' sign election and disjoint merge on stacks of task vectors, for the methods that sparsify each task vector
their own way first (DELLA, Breadcrumbs-TIES, SCE). The element-wise kernel (_kernels.ties_entry) does the same
for TIES' own trim in one pass; these methods build their masks in torch, so the merge is in torch too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mergeflow.ml.merging import Choice

if TYPE_CHECKING:
    import torch

FUSE = Choice(("mean", "sum"))


def elect_and_fuse(taus: torch.Tensor, fuse: str = "mean", weights: torch.Tensor | None = None) -> torch.Tensor:
    """taus [T, ...] (dropped or trimmed entries 0) -> [...]: gamma = sgn(sum_t tau_t), elected on the unweighted
    sum as TIES (and mergekit's SCE) do; then over the entries whose sign is gamma, ``'mean'``: sum_t w_t tau_t /
    sum_t w_t (TIES' disjoint mean; 0 where none agrees) or ``'sum'``: sum_t w_t tau_t (mergekit's normalize:
    false). ``weights`` [T]: w_t, 1 when None. A total of exactly 0 elects no sign, as in TIES' kernel."""
    import torch

    shape = (len(taus),) + (1,) * (taus.dim() - 1)
    w = torch.ones(shape, dtype=taus.dtype) if weights is None else weights.to(taus.dtype).reshape(shape)
    elected = torch.sign(taus.sum(0))
    agree = (torch.sign(taus) == elected) & (taus != 0)
    total = (taus * w * agree).sum(0)
    if fuse == "sum":
        return total
    from mergeflow.ml.merging._tensors import divide_or_zero

    return divide_or_zero(total, (w * agree).sum(0))
