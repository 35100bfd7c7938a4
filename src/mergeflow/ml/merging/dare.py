"""DARE (drop and rescale): drop each entry of tau_t with probability p, rescale survivors by 1/(1 - p), then
merge with task arithmetic (``dare_linear``: theta0 + lam sum_t tau~_t) or TIES' sign election and disjoint mean
(``dare_ties``: theta0 + lam disjoint_mean(tau~)).

Yu et al., "Language models are super Mario: absorbing abilities from homologous models as a free lunch",
ICML 2024 (arXiv:2311.03099). p = 0.9 follows seed 000's code (FusionBench uses 0.5). The drop mask of each
(task, tensor) comes from a generator seeded by (seed, task, tensor), so it does not depend on streaming order:
entry i is dropped when a uniform u_i < p, u_i having 24 random bits as torch.rand's float32 does. The bits come
from a counter-based generator (_kernels.drop_and_rescale: entry i's word is a hash of (stream, i)), computed in
the same pass that drops: a stored array of random words (numpy's SFC64) made DARE 2x slower.
"""

import math

from mergeflow.ml.merging import ANY_NUMBER, SEED, Range, register
from mergeflow.ml.merging.task_arithmetic import LAMBDA_GRID as TA_GRID
from mergeflow.ml.merging.ties import LAMBDA_GRID as TIES_GRID

PAPER = "Yu et al. 2024, DARE: Language models are super Mario (arXiv:2311.03099)"
RANGES = {"p": Range("a drop probability", 0, 1, high_open=True), "seed": SEED, "lam": ANY_NUMBER}


def keep_cut(p: float) -> int:
    """The 32-bit word cut of the keep rule u >= p, the law of torch.rand(shape) >= p: u = m / 2^24 for m
    uniform on 24 bits, and m >= cut <=> the word m * 2^8 + (8 more bits) >= cut * 2^8 (2^32: keep nothing)."""
    import numpy as np

    cut = math.ceil(float(np.float32(p)) * 2**24)  # u >= p (p as float32, as torch compares) <=> m >= cut
    return min(cut, 2**24) << 8


def prepare_drop(task_vectors, p: float, seed: int):
    """map_stacked's prepare: drop and rescale task t's tensor in place, tau~ = tau * keep / (1 - p), 1 - p in
    tau's dtype."""
    from mergeflow.ml.merging._kernels import drop_and_rescale
    from mergeflow.ml.merging._tensors import seed_of

    tasks = list(task_vectors)

    def drop(key, t, tau):
        if p > 0:
            drop_and_rescale(tau.reshape(-1), seed_of(seed, tasks[t], key), keep_cut(p), tau.dtype.type(1 - p))

    return drop


@register(
    "dare_linear",
    paper=PAPER,
    defaults={"p": 0.9, "seed": 0, "lam": 0.4},
    grid={"lam": TA_GRID},
    coefficient="lam",
    ranges=RANGES,
)
def dare_linear(pretrained, task_vectors, *, p, seed, lam):
    from mergeflow.ml.merging._kernels import task_sum
    from mergeflow.ml.merging._tensors import kernel_vector, map_stacked, plus_scaled

    return map_stacked(
        pretrained,
        task_vectors,
        lambda theta0, taus, _: plus_scaled(theta0, lam, kernel_vector(task_sum, taus)),
        prepare=prepare_drop(task_vectors, p, seed),
    )


@register(
    "dare_ties",
    paper=PAPER,
    defaults={"p": 0.9, "seed": 0, "lam": 1.0},
    grid={"lam": TIES_GRID},
    coefficient="lam",
    ranges=RANGES,
)
def dare_ties(pretrained, task_vectors, *, p, seed, lam):
    import numpy as np

    from mergeflow.ml.merging._kernels import disjoint_mean
    from mergeflow.ml.merging._tensors import kernel_vector, map_stacked, plus_scaled

    # the random drop replaces TIES' trim (no top-k, so no rounding): cuts of 0 keep every surviving entry
    def merge(theta0, taus, _):
        return plus_scaled(theta0, lam, kernel_vector(disjoint_mean, taus, np.zeros(len(taus), taus[0].dtype)))

    return map_stacked(pretrained, task_vectors, merge, prepare=prepare_drop(task_vectors, p, seed))
