"""Small tensor helpers shared by the methods (pure functions over state dicts)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mergeflow.io import StateDict


def stack(task_vectors: Mapping[str, StateDict], key: str) -> torch.Tensor:
    """[T, *shape] float32 stack of one tensor across tasks."""
    return torch.stack([tv[key].float() for tv in task_vectors.values()])


def keys_of(task_vectors: Mapping[str, StateDict]) -> list[str]:
    return list(next(iter(task_vectors.values())))


def add_scaled(pretrained: StateDict, direction: Mapping[str, torch.Tensor], scale: float) -> StateDict:
    """theta0 + scale * direction, in each pretrained tensor's dtype."""
    return {k: (p.float() + scale * direction[k]).to(p.dtype) for k, p in pretrained.items()}
