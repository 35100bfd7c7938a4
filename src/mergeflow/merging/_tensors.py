"""The per-tensor engine every method uses, and small shared helpers (pure functions, no I/O).

``map_tensors`` walks the keys of the pretrained state dict and, for each, hands the method theta0's tensor and
the [T, ...] stack of that tensor across task vectors. ``map_blocks`` does the same for element-wise methods one
block of rows at a time, never stacking a whole tensor. With lazy (memory-mapped) inputs only T + 1 tensors are in
memory at a time, plus the growing output.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
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


# Elements per task in one block of map_blocks: a [T, rows, ...] float32 block (T = 8: 2 MiB) and its temporaries
# stay in cache. The same ops over a whole [T, *shape] stack run several times slower, out of cache and on fresh
# pages for every temporary.
BLOCK_ELEMENTS = 1 << 16


def map_blocks(
    pretrained: Mapping[str, torch.Tensor],
    task_vectors: Mapping[str, Mapping[str, torch.Tensor]],
    fn: Callable[[torch.Tensor, list[torch.Tensor], slice, list[Any]], torch.Tensor],
    *,
    prepare: Callable[[str, int, torch.Tensor], Any] | None = None,
    cast: bool = True,
) -> StateDict:
    """map_tensors for element-wise methods, by blocks of rows (slices of dim 0) instead of whole stacks.

    For each key, ``states[t] = prepare(key, t, tau_t)`` sees task t's whole float32 tensor (for per-tensor
    quantities: thresholds, random masks); then ``fn(theta0[rows], [tau[rows] for tau in taus], rows, states)``
    merges each block. A block holds whole rows of every dim but the first, so wherever fn is element-wise along
    dim 0 of the tensor (rows of the last dim may be ranked), the result is map_tensors' with
    fn(theta0, torch.stack(taus)). Scalars are handled as 1-element vectors.

    prepare runs for the T tasks on torch.get_num_threads() threads: it is meant for numpy work (selections,
    random bits), which runs single-threaded and releases the GIL. Blocks use torch's own threads.
    """
    sources = list(task_vectors.values())

    def merge_key(key: str, pool: ThreadPoolExecutor) -> torch.Tensor:  # its tensors are freed on return
        theta0 = pretrained[key]
        base, *taus = (t.float().reshape(1) if t.ndim == 0 else t.float() for t in (theta0, *(tv[key] for tv in sources)))
        # after the reads, not during them: reads use torch's threads, whose barriers spin when cores are taken
        states = list(pool.map(lambda t: prepare(key, t, taus[t]), range(len(taus)))) if prepare else [None] * len(taus)
        merged = torch.empty(base.shape)
        step = max(1, BLOCK_ELEMENTS // max(1, math.prod(base.shape[1:])))
        for start in range(0, len(base), step):
            rows = slice(start, min(start + step, len(base)))
            merged[rows] = fn(base[rows], [tau[rows] for tau in taus], rows, states)
        merged = merged.reshape(theta0.shape)
        return merged.to(theta0.dtype) if cast else merged

    with ThreadPoolExecutor(torch.get_num_threads()) as pool:
        return {key: merge_key(key, pool) for key in pretrained}


def partition_magnitudes(mags: np.ndarray, i: int, axis: int = -1) -> None:
    """mags.partition(i, axis), in place, for non-negative magnitudes. numpy's introselect runs in linear time,
    ~10x faster than torch's kthvalue, topk or sort; on float32 it selects on the bit patterns, which order
    non-negative floats exactly as their values do, as integers compare ~1.7x faster than floats."""
    (mags.view(np.int32) if mags.dtype == np.float32 else mags).partition(i, axis=axis)


def count_true(mask: torch.Tensor) -> torch.Tensor:
    """mask.sum(0) (int64) of a [T, ...] boolean mask, summed as bytes when T < 256: ~10x faster."""
    if len(mask) < 256:
        return mask.view(torch.uint8).sum(0, dtype=torch.uint8).long()
    return mask.sum(0)


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


def seed_of(seed: int, *parts: str | int) -> int:
    """A 32-bit seed that depends only on (seed, parts), so results do not depend on the order tensors stream in."""
    return zlib.crc32("/".join(map(str, (seed, *parts))).encode())


def store_bytes(store: Mapping[str, torch.Tensor]) -> int:
    """Bytes a per-task store needs: boolean masks count one bit an entry, as they would packed."""
    return sum((t.numel() + 7) // 8 if t.dtype == torch.bool else t.numel() * t.element_size() for t in store.values())


# A per-task store that holds its own base model keeps it under "base/" (CART-Indexing keeps theta_avg);
# every other store needs theta0 beside it to rebuild a task's model.
BASE_PREFIX = "base/"
