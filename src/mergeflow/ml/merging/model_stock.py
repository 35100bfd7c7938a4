"""Model Stock: the merged layer on the line from the pretrained weights through the fine-tuned models' average,
at the ratio the angle between their task vectors gives.

Jang, Yun and Han, "Model Stock: All we need is just a few fine-tuned models", ECCV 2024 (arXiv:2403.19522).
Per layer (tensor), with cos the cosine between the T task vectors,

    t = T cos / (1 + (T - 1) cos),    theta = t theta_avg + (1 - t) theta0 = theta0 + t mean_t tau_t.

The paper merges two fine-tunes and speaks of one angle; for more, the references differ (``average``):
mergekit takes the mean of the pairwise cosines ("cosines", the default), FusionBench the cosine of the mean of
the pairwise angles ("angles"; fusion_bench/method/model_stock). A norm below 1e-6 counts as 1e-6 (mergekit's
clamp; FusionBench adds 1e-8 to the norms' product, the same to float32's precision), so a zero task vector gives
cos 0 and theta0; cosines clamped to [-1, 1]. No hyperparameter is searched: the ratio comes from the weights.
``scope``: "tensor" (the paper's and FusionBench's layer-wise ratio), "filter" (one ratio per output row of a
tensor, its other axes flattened) or "last_axis" (mergekit's filter_wise exactly: the cosines along the last axis
only, one ratio per index of the others; a 1-D tensor is one row). "filter" and "last_axis" agree on matrices and
differ on tensors of more than 2 axes (a conv kernel, ViT's pos_embed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mergeflow.ml.merging import Choice, register

if TYPE_CHECKING:
    import torch

NORM_FLOOR = 1e-6  # mergekit's clamp of the norms' product


def mean_pairwise_cosine(taus: torch.Tensor, average: str = "cosines") -> torch.Tensor:
    """taus [T, rows, n] -> [rows]: over the pairs t < s of rows tau_t[row], tau_s[row], the mean of their cosines
    (``average`` "cosines"), or the cosine of the mean of their angles ("angles")."""
    import torch

    norms = taus.norm(dim=-1)
    pairs = [(a, b) for a in range(len(taus)) for b in range(a + 1, len(taus))]
    cosines = torch.stack(
        [((taus[a] * taus[b]).sum(-1) / (norms[a] * norms[b]).clamp(min=NORM_FLOOR)).clamp(-1, 1) for a, b in pairs]
    )
    return cosines.mean(0) if average == "cosines" else torch.cos(torch.acos(cosines).mean(0))


def stock_ratio(cos: torch.Tensor, n_models: int) -> torch.Tensor:
    return n_models * cos / (1 + (n_models - 1) * cos)


@register(
    "model_stock",
    paper="Jang et al. 2024, Model Stock (ECCV 2024, arXiv:2403.19522)",
    defaults={"scope": "tensor", "average": "cosines"},
    ranges={"scope": Choice(("tensor", "filter", "last_axis")), "average": Choice(("cosines", "angles"))},
)
def model_stock(pretrained, task_vectors, *, scope, average):
    from mergeflow.ml.merging._tensors import map_tensors

    if len(task_vectors) < 2:
        raise ValueError(
            f"merge.model_stock: the angle between task vectors needs at least two tasks, got {len(task_vectors)}"
        )

    def merge(key, theta0, taus):
        if scope == "last_axis":
            flat = taus.reshape(len(taus), -1, taus.shape[-1])  # [T, every index of the other axes, last axis]
        else:
            flat = taus.reshape(len(taus), taus.shape[1] if scope == "filter" and taus.dim() > 2 else 1, -1)
        t = stock_ratio(mean_pairwise_cosine(flat, average), len(taus))  # [rows]
        return theta0 + (t[:, None] * flat.mean(0)).reshape(theta0.shape)

    return map_tensors(pretrained, task_vectors, merge)
