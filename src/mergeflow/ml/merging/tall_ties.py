"""TALL mask + TIES (per-task models): one TIES-merged vector and a binary mask per task.

Wang et al., "Localizing task information for improved model merging and compression", ICML 2024
(arXiv:2405.07813). Store tau_TIES and the TALL masks m_t = 1{|tau_t| >= lambda_t |tau_TIES - tau_t|}; task t uses
theta0 + lam (m_t * tau_TIES), with lambda_t in {0.2, ..., 0.6} chosen per task on that task's validation split.
Storage: one model-sized vector plus one bit per weight and task, beside theta0. The trim follows TIES (``ties_k``,
``trim_scope``, ``rounding``: see ties; default 'ties_original', the rule of the TIES code the authors build on).
"""

from mergeflow.ml.merging import ANY_NUMBER, POSITIVE_FRACTION, register
from mergeflow.ml.merging.consensus import TALL_GRID, TALL_LAMBDA, lambdas_of, tall_task_models, task_masks
from mergeflow.ml.merging.ties import TRIM_RANGES, ties_vector, trim_cuts


def _ties_and_masks(pretrained, task_vectors, tall_lambda, ties_k, trim_scope, rounding):
    import torch

    from mergeflow.ml.merging._tensors import map_stacked

    tasks = list(task_vectors)
    lambdas = lambdas_of(tall_lambda, tasks)
    masks = []  # one [T, n] array per key, in key order

    def merge(theta0, taus, cuts):
        ties = ties_vector(taus, cuts)
        masks.append(torch.from_numpy(task_masks(taus, ties, lambdas.astype(taus[0].dtype))))
        return ties

    shared = map_stacked(
        pretrained, task_vectors, merge, prepare=trim_cuts(task_vectors, ties_k, trim_scope, rounding), cast=False
    )
    store = {
        f"mask/{t}/{k}": key_masks[i].reshape(v.shape)
        for key_masks, (k, v) in zip(masks, shared.items())
        for i, t in enumerate(tasks)
    }
    return store | {f"shared/{k}": v for k, v in shared.items()}


def reconstruct(store, pretrained, task):
    """theta0 + lam (m_t * tau_TIES) in each tensor's compute dtype (lam is stored in float64)."""
    from mergeflow.ml.merging._tensors import as_compute

    out = {}
    for k, p in pretrained.items():
        shared = store[f"shared/{k}"]
        out[k] = (as_compute(p) + store["lam"].to(shared.dtype) * (store[f"mask/{task}/{k}"] * shared)).to(p.dtype)
    return out


def task_models(pretrained, task_vectors, *, ties_k, trim_scope, rounding, lam, **_):
    return tall_task_models(
        pretrained, task_vectors, base="ties", scale=lam, ties_k=ties_k, trim_scope=trim_scope, rounding=rounding
    )


@register(
    "tall_ties",
    paper="Wang et al. 2024, TALL masks (arXiv:2405.07813)",
    defaults={"tall_lambda": 0.4, "ties_k": 0.2, "trim_scope": "global", "rounding": "ties_original", "lam": 1.0},
    kind="per_task",
    reconstruct=reconstruct,
    per_task_grid={"tall_lambda": TALL_GRID},
    task_models=task_models,
    ranges={"tall_lambda": TALL_LAMBDA, "ties_k": POSITIVE_FRACTION, **TRIM_RANGES, "lam": ANY_NUMBER},
)
def tall_ties(pretrained, task_vectors, *, tall_lambda, ties_k, trim_scope, rounding, lam):
    import torch

    store = _ties_and_masks(pretrained, task_vectors, tall_lambda, ties_k, trim_scope, rounding)
    store["lam"] = torch.tensor(float(lam), dtype=torch.float64)
    return store
