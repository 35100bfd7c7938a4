"""Low-rank task arithmetic: theta = theta0 + lam sum_t SVD_k(tau_t) on matrices, full tau_t elsewhere.

The baseline of seed 002 (Choi et al., "Revisiting weight averaging for model merging", arXiv:2411.12153):
k = ceil(rank_ratio x min(m, n)) (_tensors.rank_of_ratio, as seed 002's Algorithm 1 takes CART's rank). Matrices are 2-D
weights (attention and MLP projections); embeddings, norms, biases
and the patch-embedding conv keep their full task vectors. rank_ratio = 1 is task arithmetic.
"""

from mergeflow.ml.merging import ANY_NUMBER, FRACTION, register
from mergeflow.ml.merging.task_arithmetic import LAMBDA_GRID


@register(
    "low_rank_ta",
    paper="Choi et al. 2024, Revisiting weight averaging (CART paper) baseline (arXiv:2411.12153)",
    defaults={"rank_ratio": 0.08, "lam": 0.4},
    grid={"lam": LAMBDA_GRID},
    coefficient="lam",
    ranges={"rank_ratio": FRACTION, "lam": ANY_NUMBER},
)
def low_rank_ta(pretrained, task_vectors, *, rank_ratio, lam):
    import torch

    from mergeflow.ml.merging._tensors import is_matrix, low_rank, map_tensors, rank_of_ratio

    def merge(key, theta0, taus):
        if not is_matrix(key, theta0):
            return theta0 + lam * taus.sum(0)
        k = rank_of_ratio(theta0, rank_ratio)
        return theta0 + lam * torch.stack([low_rank(tau, k) for tau in taus]).sum(0)

    return map_tensors(pretrained, task_vectors, merge)
