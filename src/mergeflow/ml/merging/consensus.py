"""Consensus merging with TALL masks: keep only the weights that at least k tasks rely on.

Wang et al., "Localizing task information for improved model merging and compression", ICML 2024
(arXiv:2405.07813). With tau_MTL = sum_t tau_t (``consensus_ta``) or the TIES-merged vector (``consensus_ties``):
    TALL mask    m_t = 1{|tau_t| >= lambda_t |tau_MTL - tau_t|}, lambda_t in {0.2, ..., 0.6} chosen per task on
                 that task's validation split with the model theta0 + alpha0 (m_t * tau_MTL);
    consensus    c = 1{sum_t m_t >= k}, k = 2;
    theta = theta0 + alpha (c * tau_MTL), alpha in {0.1, ..., 1.0}.
Uses |tau_t| = |theta_t - theta0| (one public port compares |theta0 - tau_t|, a bug). alpha0, the scaling of the
per-task models used to choose lambda_t, is the method's default alpha. ``consensus_ties`` trims as TIES does
(``ties_k``, ``trim_scope``, ``rounding``: see ties; default 'ties_original', the rule of the TIES code the TALL
masks authors build on).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import TYPE_CHECKING

from mergeflow.ml.merging import ANY_NUMBER, POSITIVE_FRACTION, Range, register
from mergeflow.ml.merging.ties import TRIM_RANGES, cuts_array, ties_vector, trim_cuts

if TYPE_CHECKING:
    import numpy as np
    import torch

PAPER = "Wang et al. 2024, TALL masks / Consensus merging (arXiv:2405.07813)"
TALL_GRID = [0.2, 0.3, 0.4, 0.5, 0.6]
ALPHA_GRID = [round(0.1 * i, 1) for i in range(1, 11)]
TALL_LAMBDA = Range("a TALL mask threshold", 0)
MIN_TASKS = Range("a task count", 0)


def lambdas_of(tall_lambda, tasks: list[str]) -> np.ndarray:
    """One float64 lambda_t per task: a dict chosen per task, or one value for all (the kernels take them in the
    taus' dtype: astype)."""
    import numpy as np

    if isinstance(tall_lambda, Mapping):
        return np.array([float(tall_lambda[t]) for t in tasks])
    return np.full(len(tasks), float(tall_lambda))


def mtl_vector(taus: tuple[np.ndarray, ...], base: str, cuts) -> torch.Tensor:
    """tau_MTL of T flat tensors: the sum, or TIES with the trim's cuts (ties.trim_cuts)."""
    from mergeflow.ml.merging._kernels import task_sum
    from mergeflow.ml.merging._tensors import kernel_vector

    return kernel_vector(task_sum, taus) if base == "ta" else ties_vector(taus, cuts)


def task_masks(taus: tuple[np.ndarray, ...], mtl: torch.Tensor, lambdas: np.ndarray) -> np.ndarray:
    """[T, n] boolean TALL masks m_t = |tau_t| >= lambda_t |tau_MTL - tau_t| of T flat tensors."""
    import numpy as np

    from mergeflow.ml.merging._kernels import tall_masks

    masks = np.empty((len(taus), mtl.numel()), bool)
    tall_masks(taus, mtl.numpy(), lambdas, tuple(masks))
    return masks


def _prepare(task_vectors, base: str, ties_k: float, trim_scope: str, rounding: str):
    return trim_cuts(task_vectors, ties_k, trim_scope, rounding) if base == "ties" else None


def _consensus(
    pretrained, task_vectors, *, base, tall_lambda, min_tasks, alpha, ties_k=None, trim_scope=None, rounding=None
):
    from mergeflow.ml.merging._kernels import consensus_of_sum, consensus_of_ties
    from mergeflow.ml.merging._tensors import kernel_vector, map_stacked, plus_scaled

    lambdas = lambdas_of(tall_lambda, list(task_vectors))

    def merge(theta0, taus, cuts):
        # tau_MTL entry by entry inside the kernel: one pass over the taus, no tau_MTL array
        dtype_lambdas = lambdas.astype(taus[0].dtype)
        if base == "ta":
            vector = kernel_vector(consensus_of_sum, taus, dtype_lambdas, min_tasks)
        else:
            vector = kernel_vector(consensus_of_ties, taus, cuts_array(cuts, taus[0].dtype), dtype_lambdas, min_tasks)
        return plus_scaled(theta0, alpha, vector)

    return map_stacked(
        pretrained, task_vectors, merge, prepare=_prepare(task_vectors, base, ties_k, trim_scope, rounding)
    )


def tall_task_models(
    pretrained, task_vectors, *, base: str, scale: float, ties_k: float, trim_scope: str, rounding: str
):
    """(task, {"tall_lambda": lambda_t}) -> theta0 + scale (m_t * tau_MTL), m_t = 1{|tau_t| >= lambda_t |tau_MTL -
    tau_t|}:
    the per-task models lambda_t is chosen on. tau_MTL (the sum, or TIES' vector) is merged once here for the whole
    search, so each of the T x |grid| models costs one element-wise pass, not a merge."""
    import numpy as np
    import torch

    from mergeflow.ml.merging._tensors import as_compute, map_stacked

    mtl = map_stacked(
        pretrained,
        task_vectors,
        lambda theta0, taus, cuts: mtl_vector(taus, base, cuts),
        prepare=_prepare(task_vectors, base, ties_k, trim_scope, rounding),
        cast=False,
    )

    @lru_cache(maxsize=1)  # the search asks for one task's models in a row: its vector is read once, not per lambda_t
    def flat_vector(task):
        return {key: as_compute(task_vectors[task][key]).reshape(-1).numpy() for key in pretrained}

    def model_of(task, per_task):
        tau_t = flat_vector(task)
        model = {}
        for key, p in pretrained.items():
            vector = mtl[key]
            lambdas = np.full(1, float(per_task["tall_lambda"]), tau_t[key].dtype)
            mask = torch.from_numpy(task_masks((tau_t[key],), vector.reshape(-1), lambdas)[0]).reshape(p.shape)
            model[key] = (as_compute(p) + scale * (mask * vector)).to(p.dtype)  # scale * mask would be float32
        return model

    return model_of


def _tall_task_models(base: str):
    # the registry passes every hyperparameter of the method (its defaults filled in); consensus_ta has no trim
    def task_models(pretrained, task_vectors, *, alpha, ties_k=None, trim_scope=None, rounding=None, **_):
        return tall_task_models(
            pretrained, task_vectors, base=base, scale=alpha, ties_k=ties_k, trim_scope=trim_scope, rounding=rounding
        )

    return task_models


@register(
    "consensus_ta",
    paper=PAPER,
    defaults={"tall_lambda": 0.4, "min_tasks": 2, "alpha": 0.4},
    grid={"alpha": ALPHA_GRID},
    coefficient="alpha",
    per_task_grid={"tall_lambda": TALL_GRID},
    task_models=_tall_task_models("ta"),
    ranges={"tall_lambda": TALL_LAMBDA, "min_tasks": MIN_TASKS, "alpha": ANY_NUMBER},
)
def consensus_ta(pretrained, task_vectors, *, tall_lambda, min_tasks, alpha):
    return _consensus(pretrained, task_vectors, base="ta", tall_lambda=tall_lambda, min_tasks=min_tasks, alpha=alpha)


@register(
    "consensus_ties",
    paper=PAPER,
    defaults={
        "tall_lambda": 0.4,
        "min_tasks": 2,
        "ties_k": 0.2,
        "trim_scope": "global",
        "rounding": "ties_original",
        "alpha": 1.0,
    },
    grid={"alpha": ALPHA_GRID + [1.2, 1.5, 2.0]},
    coefficient="alpha",
    per_task_grid={"tall_lambda": TALL_GRID},
    task_models=_tall_task_models("ties"),
    ranges={
        "tall_lambda": TALL_LAMBDA,
        "min_tasks": MIN_TASKS,
        "ties_k": POSITIVE_FRACTION,
        **TRIM_RANGES,
        "alpha": ANY_NUMBER,
    },
)
def consensus_ties(pretrained, task_vectors, *, tall_lambda, min_tasks, ties_k, trim_scope, rounding, alpha):
    return _consensus(
        pretrained,
        task_vectors,
        base="ties",
        tall_lambda=tall_lambda,
        min_tasks=min_tasks,
        alpha=alpha,
        ties_k=ties_k,
        trim_scope=trim_scope,
        rounding=rounding,
    )
