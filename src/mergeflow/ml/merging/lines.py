"""LiNeS: scale the merged task vector by layer depth, shallow layers least; theta = theta0 + lambda(l) tau_MTL.

Wang et al., "LiNeS: post-training layer scaling prevents forgetting and enhances model merging", ICLR 2025
(arXiv:2410.17146). With tau_MTL a merged task vector (``base``: task arithmetic's sum_t tau_t, or TIES' merged
vector at ``ties_k``) and L blocks, the tensors of block l (0-based) are scaled by
lambda(l) = alpha + beta l / (L - 1); tensors outside the blocks (embeddings, the final norm) by alpha. For
merging, the authors' code sets alpha = (|sum_t tau_t|_1 / |tau_MTL|_1) / T, which gives tau_MTL the L1 norm of
the mean task vector, and searches beta on validation (0.1, ..., 1.0). A tensor's block is the first integer in
its name (timm's ``blocks.<l>.``), L one more than the largest: a ViT's depth; in hierarchical models
(``stages.<s>.blocks.<b>``, ResNet's ``layer1.<b>``) that integer is not the depth. ``base: ties`` uses
mergeflow's TIES vector (the disjoint mean, global trim); the authors' code used the disjoint sum, which alpha's L1
scaling brings to the same overall size but which weights each entry by its count of agreeing tasks.
"""

from __future__ import annotations

import re

from mergeflow.ml.merging import ANY_NUMBER, POSITIVE_FRACTION, Choice, register

BLOCK = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def block_of(key: str) -> int | None:
    match = BLOCK.search(key)
    return int(match.group(1)) if match else None


def depths(keys) -> dict[str, float | None]:
    """{key: l / (L - 1)} for tensors in a block (0 when there is one block), None outside the blocks."""
    blocks = {k: block_of(k) for k in keys}
    last = max((b for b in blocks.values() if b is not None), default=0)
    return {k: (None if b is None else (b / last if last else 0.0)) for k, b in blocks.items()}


@register(
    "lines",
    paper="Wang et al. 2025, LiNeS (ICLR 2025, arXiv:2410.17146)",
    defaults={"base": "task_arithmetic", "ties_k": 0.2, "beta": 0.5},
    grid={"beta": [round(0.1 * i, 1) for i in range(1, 11)]},
    coefficient="beta",
    ranges={"base": Choice(("task_arithmetic", "ties")), "ties_k": POSITIVE_FRACTION, "beta": ANY_NUMBER},
)
def lines(pretrained, task_vectors, *, base, ties_k, beta):
    from mergeflow.ml.merging import REGISTRY
    from mergeflow.ml.merging._tensors import as_compute, map_tensors

    summed = map_tensors(pretrained, task_vectors, lambda key, theta0, taus: taus.sum(0), cast=False)
    if base == "task_arithmetic":
        mtl = summed
    else:
        merged = REGISTRY["ties"](pretrained, task_vectors, k=ties_k, lam=1.0)
        mtl = {k: as_compute(merged[k]) - as_compute(pretrained[k]) for k in pretrained}
    l1_sum = sum(float(v.abs().sum()) for v in summed.values())
    l1_mtl = sum(float(v.abs().sum()) for v in mtl.values())
    alpha = (l1_sum / l1_mtl if l1_mtl else 0.0) / len(task_vectors)
    depth = depths(pretrained)
    out = {}
    for key, theta0 in pretrained.items():
        scale = alpha if depth[key] is None else alpha + beta * depth[key]
        out[key] = (as_compute(theta0) + scale * mtl[key]).to(theta0.dtype)
    return out
