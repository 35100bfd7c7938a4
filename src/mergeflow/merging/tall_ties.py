"""TALL mask + TIES (per-task models): one TIES-merged vector and a binary mask per task.

Wang et al., "Localizing task information for improved model merging and compression", ICML 2024
(arXiv:2405.07813). Store tau_TIES and the TALL masks m_t = 1{|tau_t| >= lambda_t |tau_TIES - tau_t|}; task t uses
theta0 + lam (m_t * tau_TIES), with lambda_t in {0.2, ..., 0.6} chosen per task on that task's validation split.
Storage: one model-sized vector plus one bit per weight and task, beside theta0.
"""

import torch

from mergeflow.merging import register
from mergeflow.merging._tensors import map_stacked
from mergeflow.merging.consensus import TALL_GRID, lambdas_of, tall_task_models, task_masks
from mergeflow.merging.ties import check_ties_args, ties_vector, trim_cuts


def _ties_and_masks(pretrained, task_vectors, tall_lambda, ties_k, trim_scope):
    tasks = list(task_vectors)
    lambdas = lambdas_of(tall_lambda, tasks)
    masks = []  # one [T, n] array per key, in key order

    def merge(theta0, taus, cuts):
        ties = ties_vector(taus, cuts)
        masks.append(torch.from_numpy(task_masks(taus, ties, lambdas)))
        return ties

    shared = map_stacked(pretrained, task_vectors, merge, prepare=trim_cuts(task_vectors, ties_k, trim_scope), cast=False)
    store = {f"mask/{t}/{k}": key_masks[i].reshape(v.shape) for key_masks, (k, v) in zip(masks, shared.items()) for i, t in enumerate(tasks)}
    return store | {f"shared/{k}": v for k, v in shared.items()}


def reconstruct(store, pretrained, task):
    return {k: (p.float() + store["lam"] * store[f"mask/{task}/{k}"] * store[f"shared/{k}"]).to(p.dtype) for k, p in pretrained.items()}


def task_models(pretrained, task_vectors, *, ties_k, trim_scope, lam, **_):
    return tall_task_models(pretrained, task_vectors, base="ties", scale=lam, ties_k=ties_k, trim_scope=trim_scope)


@register(
    "tall_ties",
    paper="Wang et al. 2024, TALL masks (arXiv:2405.07813)",
    defaults={"tall_lambda": 0.4, "ties_k": 0.2, "trim_scope": "global", "lam": 1.0},
    kind="per_task",
    reconstruct=reconstruct,
    per_task_grid={"tall_lambda": TALL_GRID},
    task_models=task_models,
)
def tall_ties(pretrained, task_vectors, *, tall_lambda, ties_k, trim_scope, lam):
    check_ties_args(ties_k, trim_scope, "merge.tall_ties")
    store = _ties_and_masks(pretrained, task_vectors, tall_lambda, ties_k, trim_scope)
    store["lam"] = torch.tensor(float(lam))
    return store
