"""TALL mask + TIES (per-task models): one TIES-merged vector and a binary mask per task.

Wang et al., "Localizing task information for improved model merging and compression", ICML 2024
(arXiv:2405.07813). Store tau_TIES and the TALL masks m_t = 1{|tau_t| >= lambda_t |tau_TIES - tau_t|}; task t uses
theta0 + lam (m_t * tau_TIES), with lambda_t in {0.2, ..., 0.6} chosen per task on that task's validation split.
Storage: one model-sized vector plus one bit per weight and task, beside theta0.
"""

import torch

from mergeflow.merging import register
from mergeflow.merging._tensors import map_blocks
from mergeflow.merging.consensus import TALL_GRID, lambdas_of, tall_masks
from mergeflow.merging.ties import check_ties_args, disjoint_mean, trim_limits, trimmed_stack


def _ties_and_masks(pretrained, task_vectors, tall_lambda, ties_k, trim_scope):
    tasks = list(task_vectors)
    lambdas = lambdas_of(tall_lambda, tasks)
    limit_of = trim_limits(task_vectors, ties_k, trim_scope)
    masks = {}

    def prepare(key, t, tau):
        masks[f"mask/{tasks[t]}/{key}"] = mask = torch.empty(tau.shape, dtype=torch.bool)  # filled block by block
        return limit_of(key, t, tau), mask

    def merge(theta0, taus, rows, states):
        ties = disjoint_mean(trimmed_stack(taus, [limit for limit, _ in states]))
        for (_, mask), block in zip(states, tall_masks(taus, ties, lambdas)):
            mask[rows] = block
        return ties

    shared = map_blocks(pretrained, task_vectors, merge, prepare=prepare, cast=False)
    # in key order, each in its tensor's shape (map_blocks handles scalars as 1-element vectors)
    store = {f"mask/{t}/{k}": masks[f"mask/{t}/{k}"].reshape(v.shape) for k, v in shared.items() for t in tasks}
    return store | {f"shared/{k}": v for k, v in shared.items()}


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
