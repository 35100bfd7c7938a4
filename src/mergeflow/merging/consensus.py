"""Consensus merging with TALL masks: keep only the weights that at least k tasks rely on.

Wang et al., "Localizing task information for improved model merging and compression", ICML 2024
(arXiv:2405.07813). With tau_MTL = sum_t tau_t (``consensus_ta``) or the TIES-merged vector (``consensus_ties``):
    TALL mask    m_t = 1{|tau_t| >= lambda_t |tau_MTL - tau_t|}, lambda_t in {0.2, ..., 0.6} chosen per task on
                 that task's validation split with the model theta0 + alpha0 (m_t * tau_MTL);
    consensus    c = 1{sum_t m_t >= k}, k = 2;
    theta = theta0 + alpha (c * tau_MTL), alpha in {0.1, ..., 1.0}.
Uses |tau_t| = |theta_t - theta0| (one public port compares |theta0 - tau_t|, a bug). alpha0, the scaling of the
per-task models used to choose lambda_t, is the method's default alpha.
"""

from collections.abc import Mapping

import numpy as np
import torch

from mergeflow.merging import register
from mergeflow.merging._tensors import count_true, map_blocks
from mergeflow.merging.ties import check_ties_args, disjoint_mean, trim_limits, trimmed_stack

PAPER = "Wang et al. 2024, TALL masks / Consensus merging (arXiv:2405.07813)"
TALL_GRID = [0.2, 0.3, 0.4, 0.5, 0.6]
ALPHA_GRID = [round(0.1 * i, 1) for i in range(1, 11)]


def tall_masks(taus, mtl: torch.Tensor, lambdas: torch.Tensor) -> torch.Tensor:
    """[T, ...] boolean: m_t = |tau_t| >= lambda_t |tau_MTL - tau_t|, for a [T, ...] stack or a list.

    One task at a time, in numpy: its temporaries stay in cache, and its comparisons into bool are vectorized
    (torch's CPU ones are not, ~3x slower).
    """
    m = mtl.numpy()
    masks = np.empty((len(taus), *m.shape), bool)
    scaled, mags = np.empty_like(m), np.empty_like(m)
    for tau, lam, mask in zip(taus, lambdas.tolist(), masks):
        x = tau.numpy()
        np.abs(np.subtract(m, x, out=scaled), out=scaled)
        scaled *= np.float32(lam)
        np.greater_equal(np.abs(x, out=mags), scaled, out=mask)
    return torch.from_numpy(masks)


def lambdas_of(tall_lambda, tasks: list[str]) -> torch.Tensor:
    """One lambda_t per task: a dict chosen per task, or one value for all."""
    if isinstance(tall_lambda, Mapping):
        return torch.tensor([float(tall_lambda[t]) for t in tasks])
    return torch.full((len(tasks),), float(tall_lambda))


def mtl_vector(taus: list[torch.Tensor], base: str, limits) -> torch.Tensor:
    """tau_MTL of a block: the sum, or TIES with the trim's hardshrink limits (ties.trim_limits)."""
    return torch.stack(taus).sum(0) if base == "ta" else disjoint_mean(trimmed_stack(taus, limits))


def _prepare(task_vectors, base: str, ties_k: float, trim_scope: str):
    return trim_limits(task_vectors, ties_k, trim_scope) if base == "ties" else None


def _consensus(pretrained, task_vectors, *, base, tall_lambda, min_tasks, alpha, ties_k=0.2, trim_scope="global"):
    tasks = list(task_vectors)
    lambdas = lambdas_of(tall_lambda, tasks)

    def merge(theta0, taus, rows, limits):
        mtl = mtl_vector(taus, base, limits)
        consensus = count_true(tall_masks(taus, mtl, lambdas)) >= min_tasks
        return theta0 + alpha * consensus * mtl

    return map_blocks(pretrained, task_vectors, merge, prepare=_prepare(task_vectors, base, ties_k, trim_scope))


def _tall_task_model(base: str):
    """theta0 + alpha (m_t * tau_MTL): the per-task model lambda_t is chosen on."""

    def task_model(pretrained, task_vectors, task, *, tall_lambda, alpha, ties_k=0.2, trim_scope="global", **_):
        tasks = list(task_vectors)
        i = tasks.index(task)

        def merge(theta0, taus, rows, limits):
            mtl = mtl_vector(taus, base, limits)
            mask = tall_masks([taus[i]], mtl, torch.tensor([float(tall_lambda)]))[0]
            return theta0 + alpha * mask * mtl

        return map_blocks(pretrained, task_vectors, merge, prepare=_prepare(task_vectors, base, ties_k, trim_scope))

    return task_model


@register(
    "consensus_ta",
    paper=PAPER,
    defaults={"tall_lambda": 0.4, "min_tasks": 2, "alpha": 0.4},
    grid={"alpha": ALPHA_GRID},
    coefficient="alpha",
    per_task_grid={"tall_lambda": TALL_GRID},
    task_model=_tall_task_model("ta"),
)
def consensus_ta(pretrained, task_vectors, *, tall_lambda, min_tasks, alpha):
    return _consensus(pretrained, task_vectors, base="ta", tall_lambda=tall_lambda, min_tasks=min_tasks, alpha=alpha)


@register(
    "consensus_ties",
    paper=PAPER,
    defaults={"tall_lambda": 0.4, "min_tasks": 2, "ties_k": 0.2, "trim_scope": "global", "alpha": 1.0},
    grid={"alpha": ALPHA_GRID + [1.2, 1.5, 2.0]},
    coefficient="alpha",
    per_task_grid={"tall_lambda": TALL_GRID},
    task_model=_tall_task_model("ties"),
)
def consensus_ties(pretrained, task_vectors, *, tall_lambda, min_tasks, ties_k, trim_scope, alpha):
    check_ties_args(ties_k, trim_scope, "merge.consensus_ties")
    return _consensus(pretrained, task_vectors, base="ties", tall_lambda=tall_lambda, min_tasks=min_tasks, alpha=alpha, ties_k=ties_k, trim_scope=trim_scope)
