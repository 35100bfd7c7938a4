"""EMR-merging (elect, mask, rescale): one unified task vector, a mask and a scale per task.

Huang et al., "EMR-Merging: tuning-free high-performance model merging", NeurIPS 2024 (arXiv:2405.17461).
    gamma = sgn(sum_t tau_t);  tau_uni = gamma * max over tasks t with sgn(tau_t) = gamma of |tau_t|;
    M_t = 1{tau_t gamma > 0};  lambda_t = sum |tau_t| / sum |M_t * tau_uni| (sums over the whole model);
    task t: theta0 + lambda_t (M_t * tau_uni).
``rescale``: ``'model_sums'`` (the paper's formula, above) or ``'tensor_means'`` (the authors' scripts and
FusionBench: lambda_t = sum over tensors of mean |tau_t| / sum over tensors of mean |M_t * tau_uni|, which weights
each tensor by 1 / its size). FusionBench also elects - where sum_t tau_t is exactly 0; here such an entry elects
no sign. Nothing is searched. Storage: one model-sized vector, one bit per weight and task, one scalar per task,
beside theta0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mergeflow.ml.merging import Choice, register

if TYPE_CHECKING:
    import torch


def elect(taus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tau_uni, masks [T, ...])."""
    import torch

    gamma = torch.sign(taus.sum(0))
    agree = taus * gamma > 0
    tau_uni = gamma * (taus.abs() * agree).amax(0)
    return tau_uni, agree


def reconstruct(store, pretrained, task):
    """theta0 + lambda_t (M_t * tau_uni) in each tensor's compute dtype (lambda_t is stored in float64)."""
    from mergeflow.ml.merging._tensors import as_compute

    scale = store[f"scale/{task}"]
    out = {}
    for k, p in pretrained.items():
        shared = store[f"shared/{k}"]
        out[k] = (as_compute(p) + scale.to(shared.dtype) * (store[f"mask/{task}/{k}"] * shared)).to(p.dtype)
    return out


@register(
    "emr",
    paper="Huang et al. 2024, EMR-Merging (arXiv:2405.17461)",
    kind="per_task",
    reconstruct=reconstruct,
    defaults={"rescale": "model_sums"},
    ranges={"rescale": Choice(("model_sums", "tensor_means"))},
)
def emr(pretrained, task_vectors, *, rescale):
    import torch

    from mergeflow.ml.merging._tensors import map_tensors

    tasks = list(task_vectors)
    total = torch.zeros(len(tasks), dtype=torch.float64)  # sum |tau_t|
    kept = torch.zeros(len(tasks), dtype=torch.float64)  # sum |M_t * tau_uni|
    store = {}

    def merge(key, theta0, taus):
        tau_uni, masks = elect(taus)
        per = 1.0 / taus[0].numel() if rescale == "tensor_means" else 1.0
        total.add_(taus.abs().flatten(1).sum(1).double() * per)
        kept.add_((masks * tau_uni.abs()).flatten(1).sum(1).double() * per)
        for t, mask in zip(tasks, masks):
            store[f"mask/{t}/{key}"] = mask
        return tau_uni

    store |= {f"shared/{k}": v for k, v in map_tensors(pretrained, task_vectors, merge, cast=False).items()}
    for i, t in enumerate(tasks):
        store[f"scale/{t}"] = torch.tensor(float(total[i] / kept[i]) if kept[i] > 0 else 1.0, dtype=torch.float64)
    return store
