"""DELLA: drop each entry of tau_t with a probability that falls with its magnitude's rank (MagPrune), rescale the
survivors by 1 / (1 - p_i), then merge: TIES' sign election and disjoint mean (``della``) or the plain sum
(``della_linear``); theta = theta0 + lam * that.

Deep, Bhardwaj and Majumder, "DELLA-Merging: reducing interference in model merging through magnitude-based
sampling" (arXiv:2406.11617). Per row (the last dim; a 1-D tensor is one row) of n entries, rank r_i in [0, 1]
((position in ascending |tau| order) / (n - 1); stable, so tied magnitudes rank by position): the keep
probability is k_i = (1 - p) - epsilon / 2 + epsilon r_i, the drop probability p_i = 1 - k_i spans a window of
width epsilon centred on p, smallest magnitudes dropped most; a row of one entry keeps it with 1 - p.
Defaults: the authors' command (drop rate p = 0.3, window 0.14, lambda 1.1); ``della_linear`` starts at lambda 0.4
as ``dare_linear`` does (a sum of T vectors, not a mean).

Conventions. ``epsilon`` is the paper's (and the authors' code's ``window_size``) full window; mergekit's
``epsilon`` is half of it (its keep probabilities span density +- epsilon), so mergekit's epsilon e is
``epsilon: 2e`` here. ``rescale``: ``'keep_probability'`` (the paper and the authors' code: tau_i / k_i) or
``'l1'`` (mergekit's default: the kept entries scaled together so each tensor keeps its L1 norm). ``rank_axis``:
``'last'`` (the authors' rows, the default) or ``'dim1'`` (mergekit's della_magprune: the ranks along dim 1, every
other axis indexing the rows); the two agree on matrices and 1-D tensors and differ on a conv kernel or ViT's
pos_embed. Each (task, tensor)'s draw comes from a generator seeded by (seed, task, tensor), so it does not depend
on the order tensors stream in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mergeflow.ml.merging import ANY_NUMBER, SEED, Choice, Range, register
from mergeflow.ml.merging.task_arithmetic import LAMBDA_GRID as TA_GRID
from mergeflow.ml.merging.ties import LAMBDA_GRID as TIES_GRID

if TYPE_CHECKING:
    import torch

PAPER = "Deep et al. 2024, DELLA-Merging (arXiv:2406.11617)"
RESCALE = Choice(("keep_probability", "l1"))
RANGES = {
    "p": Range("a drop probability", 0, 1, high_open=True),
    "epsilon": Range("a window width", 0, 1),
    "rescale": RESCALE,
    "rank_axis": Choice(("last", "dim1")),
    "seed": SEED,
    "lam": ANY_NUMBER,
}
DEFAULTS = {"p": 0.3, "epsilon": 0.14, "rescale": "keep_probability", "rank_axis": "last", "seed": 0}


def window_inside(hp) -> str | None:
    """Every drop probability p +- epsilon / 2 must be a probability that keeps something: [0, 1)."""
    low, high = hp["p"] - hp["epsilon"] / 2, hp["p"] + hp["epsilon"] / 2
    if low < -1e-12 or high >= 1:
        return f"need 0 <= p - epsilon/2 and p + epsilon/2 < 1, got p={hp['p']}, epsilon={hp['epsilon']}"
    return None


def keep_probabilities(tau: torch.Tensor, p: float, epsilon: float, rank_axis: str = "last") -> torch.Tensor:
    """k_i for every entry of ``tau``, in its shape: (1 - p) - epsilon/2 + epsilon r_i, r_i the entry's magnitude
    rank in its row scaled to [0, 1] (largest: 1); a row runs along the last axis, or along dim 1 (``rank_axis``
    "dim1", mergekit's)."""
    import torch

    if rank_axis == "dim1" and tau.dim() > 2:  # dim 1 moved last, ranked there, moved back
        return keep_probabilities(tau.movedim(1, -1), p, epsilon).movedim(-1, 1)
    rows = tau.reshape(-1, tau.shape[-1]) if tau.dim() > 1 else tau.reshape(1, -1)
    n = rows.shape[1]
    order = torch.argsort(rows.abs(), dim=1, stable=True)
    ranks = torch.empty_like(rows)
    ranks.scatter_(1, order, torch.arange(n, dtype=rows.dtype).expand_as(rows).contiguous())
    scaled = ranks / (n - 1) if n > 1 else torch.full_like(rows, 0.5)
    return ((1 - p) - epsilon / 2 + epsilon * scaled).reshape(tau.shape)


def magprune(
    tau: torch.Tensor, p: float, epsilon: float, rescale: str, seed: int, rank_axis: str = "last"
) -> torch.Tensor:
    """MagPrune of one task's tensor: entry i kept when u_i < k_i (u_i uniform from a generator seeded ``seed``),
    then rescaled."""
    import torch

    keep = keep_probabilities(tau, p, epsilon, rank_axis)
    u = torch.rand(tau.shape, generator=torch.Generator().manual_seed(seed), dtype=tau.dtype)
    kept = torch.where(u < keep, tau, torch.zeros_like(tau))
    if rescale == "keep_probability":
        return kept / keep
    before, after = tau.abs().sum(), kept.abs().sum()
    return kept if after == 0 else kept * (before / after)  # mergekit leaves a tensor it emptied as it is


def pruned(task_vectors, p, epsilon, rescale, seed, rank_axis):
    """(key, taus [T, ...]) -> the stack with each task's tensor MagPruned."""
    import torch

    from mergeflow.ml.merging._tensors import seed_of

    tasks = list(task_vectors)
    return lambda key, taus: torch.stack(
        [magprune(tau, p, epsilon, rescale, seed_of(seed, t, key), rank_axis) for t, tau in zip(tasks, taus)]
    )


@register(
    "della",
    paper=PAPER,
    defaults={**DEFAULTS, "lam": 1.1},
    grid={"lam": TIES_GRID},
    coefficient="lam",
    ranges=RANGES,
    joint=window_inside,
)
def della(pretrained, task_vectors, *, p, epsilon, rescale, rank_axis, seed, lam):
    from mergeflow.ml.merging._sign import elect_and_fuse
    from mergeflow.ml.merging._tensors import map_tensors

    drop = pruned(task_vectors, p, epsilon, rescale, seed, rank_axis)
    return map_tensors(
        pretrained, task_vectors, lambda key, theta0, taus: theta0 + lam * elect_and_fuse(drop(key, taus))
    )


@register(
    "della_linear",
    paper=PAPER,
    defaults={**DEFAULTS, "lam": 0.4},
    grid={"lam": TA_GRID},
    coefficient="lam",
    ranges=RANGES,
    joint=window_inside,
)
def della_linear(pretrained, task_vectors, *, p, epsilon, rescale, rank_axis, seed, lam):
    from mergeflow.ml.merging._tensors import map_tensors

    drop = pruned(task_vectors, p, epsilon, rescale, seed, rank_axis)
    return map_tensors(pretrained, task_vectors, lambda key, theta0, taus: theta0 + lam * drop(key, taus).sum(0))
