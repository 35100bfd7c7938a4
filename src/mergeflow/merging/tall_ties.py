"""TALL mask + TIES (per-task models): one TIES-merged vector and a binary mask per task.

Wang et al., "Localizing task information for improved model merging and compression", ICML 2024
(arXiv:2405.07813). Store tau_TIES and the TALL masks m_t = 1{|tau_t| >= lambda_t |tau_TIES - tau_t|}; task t uses
theta0 + lam (m_t * tau_TIES), with lambda_t in {0.2, ..., 0.6} chosen per task on that task's validation split.
Storage: one model-sized vector plus one bit per weight and task, beside theta0.
"""

import torch

from mergeflow.merging import register
from mergeflow.merging._tensors import map_tensors
from mergeflow.merging.consensus import TALL_GRID, lambdas_of
from mergeflow.merging.ties import check_ties_args, disjoint_mean, global_thresholds, trim


def _ties_and_masks(pretrained, task_vectors, tall_lambda, ties_k, trim_scope):
    tasks = list(task_vectors)
    lambdas = lambdas_of(tall_lambda, tasks)
    cuts = global_thresholds(task_vectors, ties_k) if trim_scope == "global" else None
    store = {}

    def merge(key, theta0, taus):
        ties = disjoint_mean(trim(taus, ties_k, cuts))
        shape = (-1,) + (1,) * (taus.ndim - 1)
        masks = taus.abs() >= lambdas.view(shape) * (ties.unsqueeze(0) - taus).abs()
        for t, mask in zip(tasks, masks):
            store[f"mask/{t}/{key}"] = mask
        return ties

    store |= {f"shared/{k}": v for k, v in map_tensors(pretrained, task_vectors, merge, cast=False).items()}
    return store


def reconstruct(store, pretrained, task):
    return {k: (p.float() + store["lam"] * store[f"mask/{task}/{k}"] * store[f"shared/{k}"]).to(p.dtype) for k, p in pretrained.items()}


def task_model(pretrained, task_vectors, task, *, tall_lambda, ties_k, trim_scope, lam):
    store = _ties_and_masks(pretrained, task_vectors, {t: tall_lambda for t in task_vectors}, ties_k, trim_scope)
    store["lam"] = torch.tensor(float(lam))
    return reconstruct(store, pretrained, task)


@register(
    "tall_ties",
    paper="Wang et al. 2024, TALL masks (arXiv:2405.07813)",
    defaults={"tall_lambda": 0.4, "ties_k": 0.2, "trim_scope": "global", "lam": 1.0},
    kind="per_task",
    reconstruct=reconstruct,
    per_task_grid={"tall_lambda": TALL_GRID},
    task_model=task_model,
)
def tall_ties(pretrained, task_vectors, *, tall_lambda, ties_k, trim_scope, lam):
    check_ties_args(ties_k, trim_scope, "merge.tall_ties")
    store = _ties_and_masks(pretrained, task_vectors, tall_lambda, ties_k, trim_scope)
    store["lam"] = torch.tensor(float(lam))
    return store
