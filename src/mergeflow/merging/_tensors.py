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
    *,
    cast: bool = True,
) -> StateDict:
    """{key: fn(key, theta0[key] as float32, stack of tau_t[key])}, one key at a time; cast back to theta0's dtype
    unless ``cast`` is False (a store of float32 vectors)."""
    out = {}
    for key in pretrained:
        theta0 = pretrained[key]
        merged = fn(key, theta0.float(), stack(task_vectors, key))
        out[key] = merged.to(theta0.dtype) if cast else merged
    return out


def is_matrix(key: str, tensor: torch.Tensor) -> bool:
    """A 2-D weight (attention and MLP projections, heads); embeddings, norms, biases, convs are not."""
    return tensor.ndim == 2 and key.endswith("weight") and min(tensor.shape) > 1


def svd_device() -> torch.device:
    """SVD-based methods run on the GPU when there is one, always in float32."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def svd(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD in float32 on the SVD device: (U [m, r], S [r], Vh [r, n])."""
    return torch.linalg.svd(matrix.float().to(svd_device()), full_matrices=False)


def low_rank(matrix: torch.Tensor, k: int) -> torch.Tensor:
    """The best rank-k approximation (truncated SVD); k = 0 gives zeros."""
    if k <= 0:
        return torch.zeros_like(matrix, dtype=torch.float32)
    u, s, vh = svd(matrix)
    return ((u[:, :k] * s[:k]) @ vh[:k]).to(matrix.device)


def rank_of_ratio(matrix: torch.Tensor, ratio: float) -> int:
    """k = ratio x min(m, n), rounded, within [0, min(m, n)]."""
    r = min(matrix.shape)
    return max(0, min(r, int(round(ratio * r))))


def polar(matrix: torch.Tensor) -> torch.Tensor:
    """The orthogonal polar factor: M = P S Q^T -> P Q^T (the nearest matrix with orthonormal columns)."""
    u, _, vh = svd(matrix)
    return u @ vh


def seeded_generator(seed: int, *parts: str | int) -> torch.Generator:
    """A generator that depends only on (seed, parts), so results do not depend on the order tensors stream in."""
    import zlib

    return torch.Generator().manual_seed(zlib.crc32("/".join(map(str, (seed, *parts))).encode()))


def store_bytes(store: Mapping[str, torch.Tensor]) -> int:
    """Bytes a per-task store needs: boolean masks count one bit an entry, as they would packed."""
    return sum((t.numel() + 7) // 8 if t.dtype == torch.bool else t.numel() * t.element_size() for t in store.values())


# A per-task store that holds its own base model keeps it under "base/" (CART-Indexing keeps theta_avg);
# every other store needs theta0 beside it to rebuild a task's model.
BASE_PREFIX = "base/"
