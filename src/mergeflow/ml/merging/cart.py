"""CART: centre the task vectors on the weight average and keep a low rank.

Choi et al., "Revisiting weight averaging for model merging" (seed 002, arXiv:2411.12153). Per matrix:
    theta = theta_avg + lam sum_t SVD_k(theta_t - theta_avg),  k = ceil(rank_ratio x min(m, n)) (Algorithm 1);
non-matrix tensors (embeddings, norms, biases, the patch-embedding conv): theta_avg. Since
theta_t - theta_avg = tau_t - mean_s tau_s, the centred vectors sum to zero: rank 0 or full rank gives theta_avg.
Defaults: rank_ratio 0.08 from {0.04, 0.08, 0.16, 0.32}, lam from {0.2, 0.4, ..., 3.0} (the authors' 8-task
config: 0.12 / 2.0).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mergeflow.ml.merging import ANY_NUMBER, FRACTION, register

if TYPE_CHECKING:
    import torch

RANK_GRID = [0.04, 0.08, 0.16, 0.32]
LAMBDA_GRID = [round(0.2 * i, 1) for i in range(1, 16)]


def centred(taus: torch.Tensor) -> torch.Tensor:
    """theta_t - theta_avg = tau_t - mean(tau), stacked [T, ...]."""
    return taus - taus.mean(0, keepdim=True)


@register(
    "cart",
    paper="Choi et al. 2024, CART: Revisiting weight averaging for model merging (arXiv:2411.12153)",
    defaults={"rank_ratio": 0.08, "lam": 2.0},
    grid={"rank_ratio": RANK_GRID, "lam": LAMBDA_GRID},
    coefficient="lam",
    ranges={"rank_ratio": FRACTION, "lam": ANY_NUMBER},
)
def cart(pretrained, task_vectors, *, rank_ratio, lam):
    import torch

    from mergeflow.ml.merging._tensors import is_matrix, low_rank, map_tensors, rank_of_ratio

    def merge(key, theta0, taus):
        theta_avg = theta0 + taus.mean(0)
        if not is_matrix(key, theta0):
            return theta_avg
        k = rank_of_ratio(theta0, rank_ratio)
        return theta_avg + lam * torch.stack([low_rank(c, k) for c in centred(taus)]).sum(0)

    return map_tensors(pretrained, task_vectors, merge)
