"""Task vectors tau_t = theta_t - theta0 over the backbone, their statistics (norms, cosine similarities), and
reading them back for a merge (``load_task_vectors``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import torch

from mergeflow.config import Params
from mergeflow.core.io import LazyStateDict, StateDict, check_compatible, save_state_dict, tensor_specs
from mergeflow.core.layout import Layout
from mergeflow.ml.lora import (
    AdapterSpec,
    LoraTaskVector,
    factor_bytes,
    is_adapter,
    load_adapter,
    save_adapter,
    split_factors,
)

# Inputs up to this size are read (and checked) once and held in memory: a search reads every tensor once per
# candidate, and re-reading a small model costs more than holding it. Larger inputs are read tensor by tensor.
IN_MEMORY_INPUT_BYTES = 1 << 30


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """What a task vector is computed in: float64 where any of ``dtypes`` is, else float32."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def task_vector(pretrained: StateDict, finetuned: StateDict, *, pretrained_name: str, finetuned_name: str) -> StateDict:
    """theta_t - theta0 per tensor, in float32, or float64 where either model's tensor is float64 (a float64 run stays
    exact: the merges compute float64 in float64)."""
    check_compatible(pretrained, finetuned, reference_name=pretrained_name, other_name=finetuned_name)

    def dtype(k: str) -> torch.dtype:
        return compute_dtype(pretrained[k].dtype, finetuned[k].dtype)

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
    return sum(
        math.prod(shape) * torch.empty(0, dtype=dtype).element_size() for shape, dtype in tensor_specs(state).values()
    )


def read_task_vector(path: Path, pretrained) -> Mapping[str, torch.Tensor]:
    """One task vector file, lazily: a dense one tensor by tensor (io.LazyStateDict), a LoRA one (mergeflow.ml.lora's
    factors) as its factors, each adapted weight's s B A formed when it is read."""
    if is_adapter(path):
        factors, scale = load_adapter(path)
        return LoraTaskVector(factors, scale, tensor_specs(pretrained), source=str(path))
    return LazyStateDict(path)


def load_task_vectors(params: Params, layout: Layout, directory: Path | None = None):
    """The task vectors in ``directory`` (default: the standard regime's, vectors/), and theta0. Lazy
    (io.LazyStateDict, lora.LoraTaskVector): a merge reads one tensor of each at a time. Keys and shapes are checked
    from the headers."""
    pretrained = LazyStateDict(layout.pretrained)
    paths = {t: (directory or layout.vectors) / f"{t}.safetensors" for t in params.suite.tasks}
    vectors = {t: read_task_vector(path, pretrained) for t, path in paths.items()}
    for t, tv in vectors.items():
        # task vectors are float32 whatever the checkpoint's dtype: keys and shapes must agree
        check_compatible(pretrained, tv, reference_name=str(pretrained.path), other_name=str(paths[t]), dtypes=False)
    if state_bytes(pretrained) + sum(state_bytes(tv) for tv in vectors.values()) <= IN_MEMORY_INPUT_BYTES:
        return materialise(pretrained), {t: materialise(tv) for t, tv in vectors.items()}
    return pretrained, vectors


def save_task_vectors(
    directory: Path,
    pretrained: StateDict,
    states: Mapping[str, StateDict],
    *,
    adapter: AdapterSpec | None,
    meta: Mapping[str, str],
    pretrained_name: str,
) -> tuple[dict[str, StateDict], dict[str, float]]:
    """Write each task model's vector into ``directory`` as ``<task>.safetensors``: theta_t - theta0, or, for a LoRA
    trainer's states (factors beside the weights), the factors themselves (lora.save_adapter, with ``adapter``'s
    scale). Returns the dense vectors (for the statistics) and the bytes a task vector takes on disk, with a full
    one's beside it."""
    dense_bytes = sum(
        v.numel() * (8 if v.dtype == torch.float64 else 4) for v in pretrained.values()
    )  # task_vector's dtypes
    vectors, stored = {}, []
    for task, state in states.items():
        weights, factors = split_factors(state)
        if factors:
            if adapter is None:
                raise ValueError(f"task {task}: LoRA factors without their adapter's scale")
            save_adapter(directory / f"{task}.safetensors", factors, adapter, dict(meta) | {"task": task})
            vectors[task] = materialise(
                LoraTaskVector(
                    factors, adapter.scale, tensor_specs(pretrained), source=f"{dict(meta).get('variant', '')} {task}"
                )
            )
            stored.append(factor_bytes(factors))
        else:
            vectors[task] = task_vector(
                pretrained,
                weights,
                pretrained_name=pretrained_name,
                finetuned_name=f"{dict(meta).get('variant', '')} {task}",
            )
            save_state_dict(directory / f"{task}.safetensors", vectors[task], dict(meta) | {"task": task})
            stored.append(state_bytes(vectors[task]))
    return vectors, {"task_vector": sum(stored) / len(stored), "full_task_vector": dense_bytes}
