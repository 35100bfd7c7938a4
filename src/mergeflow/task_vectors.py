"""Task vectors tau_t = theta_t - theta0 over the backbone, and their statistics (norms, cosine similarities)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mergeflow.io import StateDict, check_compatible


def task_vector(pretrained: StateDict, finetuned: StateDict, *, pretrained_name: str, finetuned_name: str) -> StateDict:
    check_compatible(pretrained, finetuned, reference_name=pretrained_name, other_name=finetuned_name)
    return {k: finetuned[k].float() - pretrained[k].float() for k in pretrained}


def flatten(state: StateDict) -> torch.Tensor:
    return torch.cat([v.float().flatten() for v in state.values()])


def _cosine_matrix(vectors: list[torch.Tensor]) -> list[list[float]]:
    mat = torch.stack(vectors)
    norms = mat.norm(dim=1, keepdim=True).clamp(min=1e-12)
    unit = mat / norms
    return (unit @ unit.T).tolist()


def statistics(pretrained: StateDict, task_vectors: Mapping[str, StateDict]) -> dict:
    """Per-task norms (and relative to ||theta0||), whole-vector cosines, and per-tensor cosines."""
    tasks = list(task_vectors)
    flat = [flatten(task_vectors[t]) for t in tasks]
    theta0_norm = float(flatten(pretrained).norm())
    per_layer = {key: _cosine_matrix([task_vectors[t][key].flatten() for t in tasks]) for key in pretrained}
    return {
        "tasks": tasks,
        "pretrained_norm": theta0_norm,
        "norms": {t: float(v.norm()) for t, v in zip(tasks, flat)},
        "relative_norms": {t: float(v.norm()) / theta0_norm for t, v in zip(tasks, flat)},
        "cosine": _cosine_matrix(flat),
        "cosine_per_layer": per_layer,
    }
