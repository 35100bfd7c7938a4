"""Task vectors tau_t = theta_t - theta0 over the backbone, their statistics (norms, cosine similarities), and
reading them back for a merge (``load_task_vectors``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import torch

from mergeflow.config import Params
from mergeflow.io import LazyStateDict, StateDict, check_compatible, tensor_specs
from mergeflow.layout import Layout

# Inputs up to this size are read (and checked) once and held in memory: a search reads every tensor once per
# candidate, and re-reading a small model costs more than holding it. Larger inputs are read tensor by tensor.
IN_MEMORY_INPUT_BYTES = 1 << 30


def task_vector(pretrained: StateDict, finetuned: StateDict, *, pretrained_name: str, finetuned_name: str) -> StateDict:
    """theta_t - theta0 per tensor, in float32, or float64 where either model's tensor is float64 (a float64 run stays
    exact: the merges compute float64 in float64)."""
    check_compatible(pretrained, finetuned, reference_name=pretrained_name, other_name=finetuned_name)

    def dtype(k: str) -> torch.dtype:
        return torch.float64 if torch.float64 in (pretrained[k].dtype, finetuned[k].dtype) else torch.float32

    return {k: finetuned[k].to(dtype(k)) - pretrained[k].to(dtype(k)) for k in pretrained}


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


def materialise(state) -> dict:
    """A state dict's tensors in memory (a lazy file's, read)."""
    return {k: state[k] for k in state}


def state_bytes(state) -> int:
    """Size from shapes and dtypes (a lazy file's header): no tensor is read."""
    return sum(math.prod(shape) * torch.empty(0, dtype=dtype).element_size() for shape, dtype in tensor_specs(state).values())


def load_task_vectors(params: Params, layout: Layout, directory: Path | None = None):
    """The task vectors in ``directory`` (default: the standard regime's, vectors/), and theta0. Lazy
    (io.LazyStateDict): a merge reads one tensor of each at a time. Keys and shapes are checked from the headers."""
    pretrained = LazyStateDict(layout.pretrained)
    vectors = {t: LazyStateDict((directory or layout.vectors) / f"{t}.safetensors") for t in params.suite.tasks}
    for tv in vectors.values():
        # task vectors are float32 whatever the checkpoint's dtype: keys and shapes must agree
        check_compatible(pretrained, tv, reference_name=str(pretrained.path), other_name=str(tv.path), dtypes=False)
    if state_bytes(pretrained) + sum(state_bytes(tv) for tv in vectors.values()) <= IN_MEMORY_INPUT_BYTES:
        return materialise(pretrained), {t: materialise(tv) for t, tv in vectors.items()}
    return pretrained, vectors
