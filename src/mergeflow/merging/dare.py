"""DARE (drop and rescale): drop each entry of tau_t with probability p, rescale survivors by 1/(1 - p), then
merge with task arithmetic (``dare_linear``: theta0 + lam sum_t tau~_t) or TIES' sign election and disjoint mean
(``dare_ties``: theta0 + lam disjoint_mean(tau~)).

Yu et al., "Language models are super Mario: absorbing abilities from homologous models as a free lunch",
ICML 2024 (arXiv:2311.03099). p = 0.9 follows seed 000's code (FusionBench uses 0.5). The drop mask of each
(task, tensor) comes from a generator seeded by (seed, task, tensor), so it does not depend on streaming order:
entry i is dropped when a uniform u_i < p, u_i having 24 random bits as torch.rand's float32 does; the bits come
from a numpy SFC64 generator (3x faster than torch.rand with a torch.Generator, and free of the GIL).
"""

import math

import numpy as np
import torch

from mergeflow.merging import register
from mergeflow.merging._tensors import map_blocks, seed_of
from mergeflow.merging.task_arithmetic import LAMBDA_GRID as TA_GRID
from mergeflow.merging.ties import LAMBDA_GRID as TIES_GRID, disjoint_mean

PAPER = "Yu et al. 2024, DARE: Language models are super Mario (arXiv:2311.03099)"


def check_p(p: float) -> None:
    if not 0 <= p < 1:
        raise ValueError(f"merge.dare.p: expected a drop probability in [0, 1), got {p}")


def keep_mask(shape: torch.Size, p: float, seed: int, task: str, key: str) -> np.ndarray:
    """Boolean keep mask of (task, key): u >= p for u = m / 2^24, m uniform on 24 bits, the law of
    torch.rand(shape) >= p; m >= cut <=> the 32-bit word m * 2^8 + (8 more bits) >= cut * 2^8."""
    n = math.prod(shape)
    cut = math.ceil(float(np.float32(p)) * 2**24)  # u >= p (p as float32, as torch compares) <=> m >= cut
    if cut >= 2**24:  # p rounds to 1 in float32: u >= p never holds
        return np.zeros(shape, bool)
    words = np.random.SFC64(seed_of(seed, task, key)).random_raw((n + 1) // 2).view(np.uint32)[:n]
    return (words >= cut << 8).reshape(shape)


def drop_and_rescale(taus: torch.Tensor, keep: list[np.ndarray] | None, p: float) -> torch.Tensor:
    """tau~ = tau * keep / (1 - p), in place on a [T, ...] stack (keep: each task's mask; None when p = 0)."""
    if keep is None:
        return taus
    for x, mask in zip(taus.numpy(), keep):
        np.multiply(x, mask, out=x)  # numpy's product with a bool mask is branch-free; torch's ~3x slower
    return taus.div_(1 - p)


def prepare_masks(task_vectors, p: float, seed: int):
    """map_blocks' prepare: task t's keep mask of a tensor (none when p = 0)."""
    check_p(p)
    tasks = list(task_vectors)
    return lambda key, t, tau: keep_mask(tau.shape, p, seed, tasks[t], key) if p > 0 else None


def rows_of(keep: list[np.ndarray | None], rows: slice) -> list[np.ndarray] | None:
    return None if keep[0] is None else [mask[rows] for mask in keep]


@register("dare_linear", paper=PAPER, defaults={"p": 0.9, "seed": 0, "lam": 0.4}, grid={"lam": TA_GRID}, coefficient="lam")
def dare_linear(pretrained, task_vectors, *, p, seed, lam):
    def merge(theta0, taus, rows, keep):
        return theta0 + lam * drop_and_rescale(torch.stack(taus), rows_of(keep, rows), p).sum(0)

    return map_blocks(pretrained, task_vectors, merge, prepare=prepare_masks(task_vectors, p, seed))


@register("dare_ties", paper=PAPER, defaults={"p": 0.9, "seed": 0, "lam": 1.0}, grid={"lam": TIES_GRID}, coefficient="lam")
def dare_ties(pretrained, task_vectors, *, p, seed, lam):
    def merge(theta0, taus, rows, keep):
        return theta0 + lam * disjoint_mean(drop_and_rescale(torch.stack(taus), rows_of(keep, rows), p))

    return map_blocks(pretrained, task_vectors, merge, prepare=prepare_masks(task_vectors, p, seed))
