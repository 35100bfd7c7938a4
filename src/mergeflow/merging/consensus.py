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

import torch

from mergeflow.merging import register
from mergeflow.merging._tensors import map_tensors
from mergeflow.merging.ties import check_ties_args, disjoint_mean, global_thresholds, trim

PAPER = "Wang et al. 2024, TALL masks / Consensus merging (arXiv:2405.07813)"
TALL_GRID = [0.2, 0.3, 0.4, 0.5, 0.6]
ALPHA_GRID = [round(0.1 * i, 1) for i in range(1, 11)]


def tall_masks(taus: torch.Tensor, mtl: torch.Tensor, lambdas: torch.Tensor) -> torch.Tensor:
    """[T, ...] boolean: m_t = |tau_t| >= lambda_t |tau_MTL - tau_t|."""
    shape = (-1,) + (1,) * (taus.ndim - 1)
    return taus.abs() >= lambdas.view(shape) * (mtl.unsqueeze(0) - taus).abs()


def lambdas_of(tall_lambda, tasks: list[str]) -> torch.Tensor:
    """One lambda_t per task: a dict chosen per task, or one value for all."""
    if isinstance(tall_lambda, Mapping):
        return torch.tensor([float(tall_lambda[t]) for t in tasks])
    return torch.full((len(tasks),), float(tall_lambda))


def mtl_vector(taus: torch.Tensor, base: str, k: float, cuts) -> torch.Tensor:
    return taus.sum(0) if base == "ta" else disjoint_mean(trim(taus, k, cuts))


def _consensus(pretrained, task_vectors, *, base, tall_lambda, min_tasks, alpha, ties_k=0.2, trim_scope="global"):
    tasks = list(task_vectors)
    lambdas = lambdas_of(tall_lambda, tasks)
    cuts = global_thresholds(task_vectors, ties_k) if base == "ties" and trim_scope == "global" else None

    def merge(key, theta0, taus):
        mtl = mtl_vector(taus, base, ties_k, cuts)
        consensus = tall_masks(taus, mtl, lambdas).sum(0) >= min_tasks
        return theta0 + alpha * consensus * mtl

    return map_tensors(pretrained, task_vectors, merge)


def _tall_task_model(base: str):
    """theta0 + alpha (m_t * tau_MTL): the per-task model lambda_t is chosen on."""

    def task_model(pretrained, task_vectors, task, *, tall_lambda, alpha, ties_k=0.2, trim_scope="global", **_):
        tasks = list(task_vectors)
        i = tasks.index(task)
        cuts = global_thresholds(task_vectors, ties_k) if base == "ties" and trim_scope == "global" else None

        def merge(key, theta0, taus):
            mtl = mtl_vector(taus, base, ties_k, cuts)
            mask = taus[i].abs() >= float(tall_lambda) * (mtl - taus[i]).abs()
            return theta0 + alpha * mask * mtl

        return map_tensors(pretrained, task_vectors, merge)

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
