"""AdaMerging + CART: theta = theta_avg + sum_t sum_l lam_t,l SVD_k(theta_t,l - theta_avg,l), lam learned at test time.

Choi et al., "Revisiting weight averaging for model merging" (seed 002, arXiv:2411.12153), its Eq. (5) and
Algorithms 1-2: CART's centred rank-k task vectors (merging.cart; k = ceil(rank_ratio x min(m, n)), non-matrix
tensors at theta_avg) with AdaMerging's layer-wise coefficients learned on the entropy of unlabelled test inputs
(merging.adamerging). The centred vectors sum to zero, so equal coefficients give CART at that lam: they start at
``init`` = 2.0, the authors' 8-task lam for CART (AdaMerging's 0.3 would start near weight averaging).
``rank_ratio``: a fixed value, 0.08 (the seed's ~8%) by default.
"""

from mergeflow.ml.merging import FRACTION, register
from mergeflow.ml.merging.adamerging import ADAPTIVE_DEFAULTS, ADAPTIVE_RANGES
from mergeflow.ml.merging.cart import centred


@register(
    "adamerging_cart",
    paper="Choi et al. 2024, CART: Revisiting weight averaging for model merging (arXiv:2411.12153), with AdaMerging",
    defaults={**ADAPTIVE_DEFAULTS, "init": 2.0, "rank_ratio": 0.08},
    ranges={**ADAPTIVE_RANGES, "rank_ratio": FRACTION},
    reads="test_inputs",
)
def adamerging_cart(pretrained, task_vectors, *, data, init, lr, steps, batch_size, split, seed, rank_ratio):
    import torch

    from mergeflow.ml.merging._adaptive import adapt
    from mergeflow.ml.merging._tensors import as_compute, is_matrix, low_rank, rank_of_ratio

    tasks = list(task_vectors)
    theta_avg, directions = {}, {t: {} for t in tasks}
    for key, theta0 in pretrained.items():
        taus = [as_compute(task_vectors[t][key]) for t in tasks]
        theta_avg[key] = (as_compute(theta0) + sum(taus) / len(taus)).to(theta0.dtype)
        if is_matrix(key, theta0):
            k = rank_of_ratio(theta0, rank_ratio)
            for t, c in zip(tasks, centred(torch.stack(taus))):
                directions[t][key] = low_rank(c, k)
    return adapt(
        theta_avg,
        directions,
        data.objective,
        layer_wise=True,
        init=init,
        lr=lr,
        steps=steps,
        batch_size=batch_size,
        split=split,
        seed=seed,
        data=data,
    )
