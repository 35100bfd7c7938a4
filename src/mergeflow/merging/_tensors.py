"""The per-tensor engine every method uses, and small shared helpers (pure functions, no I/O).

``map_tensors`` walks the keys of the pretrained state dict and, for each, hands the method theta0's tensor and
the [T, ...] stack of that tensor across task vectors. With lazy (memory-mapped) inputs only T + 1 tensors are in
memory at a time, plus the growing output.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from mergeflow.io import StateDict


def stack(task_vectors: Mapping[str, Mapping[str, torch.Tensor]], key: str) -> torch.Tensor:
    """[T, *shape] float32 stack of one tensor across tasks."""
    return torch.stack([tv[key].float() for tv in task_vectors.values()])


def map_tensors(
    pretrained: Mapping[str, torch.Tensor],
    task_vectors: Mapping[str, Mapping[str, torch.Tensor]],
    fn: Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor],
) -> StateDict:
    """{key: fn(key, theta0[key] as float32, stack of tau_t[key])}, cast back to theta0's dtype, one key at a time."""
    out = {}
    for key in pretrained:
        theta0 = pretrained[key]
        out[key] = fn(key, theta0.float(), stack(task_vectors, key)).to(theta0.dtype)
    return out


def is_matrix(key: str, tensor: torch.Tensor) -> bool:
    """A 2-D weight (attention and MLP projections, heads); embeddings, norms, biases, convs are not."""
    return tensor.ndim == 2 and key.endswith("weight") and min(tensor.shape) > 1
