"""The per-tensor engine every method uses, and small shared helpers (pure functions, no I/O).

``map_tensors`` walks the keys of the pretrained state dict and, for each, hands the method theta0's tensor and
the [T, ...] stack of that tensor across task vectors. ``map_stacked`` does the same for element-wise methods, whose
compiled kernels take the stack flattened, read into one buffer reused for every key. With lazy inputs
(io.LazyStateDict) only T + 1 tensors are in memory at a time, plus the growing output.

Merges compute in their inputs' precision (``compute_dtype``): float64 tensors in float64, every other float
(float32, bf16, fp16) in float32, then cast back to theta0's dtype. An entry that no task changes is theta0 + 0,
which is theta0 exactly (a -0.0 entry of theta0 comes back +0.0).
"""

from __future__ import annotations

import math
import threading
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numba
import numpy as np
import torch

from mergeflow.core.io import StateDict, tensor_specs
from mergeflow.ml.merging._kernels import add_scaled
from mergeflow.core.reproducibility import stage_threads


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision a merge computes a tensor of ``dtype`` in: float64 stays float64; float32, bf16 and fp16 (whose
    arithmetic would round every step) compute in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def as_compute(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in its compute_dtype (no copy when it already is)."""
    return tensor.to(compute_dtype(tensor.dtype))


def stack(task_vectors: Mapping[str, Mapping[str, torch.Tensor]], key: str) -> torch.Tensor:
    """[T, *shape] stack of one tensor across tasks, in its compute_dtype."""
    return torch.stack([as_compute(tv[key]) for tv in task_vectors.values()])


def map_tensors(
    pretrained: Mapping[str, torch.Tensor],
    task_vectors: Mapping[str, Mapping[str, torch.Tensor]],
    fn: Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    cast: bool = True,
) -> StateDict:
    """{key: fn(key, theta0[key], stack of tau_t[key])}, both in the compute_dtype, one key at a time; cast back to
    theta0's dtype unless ``cast`` is False (a store of vectors in the compute dtype)."""
    out = {}
    for key in pretrained:
        theta0 = pretrained[key]
        merged = fn(key, as_compute(theta0), stack(task_vectors, key))
        out[key] = merged.to(theta0.dtype) if cast else merged
    return out


def read_stack(task_vectors: Sequence[Mapping[str, torch.Tensor]], key: str, out: torch.Tensor) -> None:
    """out[t] = tau_t[key] flattened, in out's dtype: lazy files copy straight from their map into ``out``."""
    for row, tv in zip(out, task_vectors):
        if hasattr(tv, "read_into"):
            tv.read_into(key, row)
        else:
            row.copy_(tv[key].reshape(-1))


def read_stacks(
    pretrained: Mapping[str, torch.Tensor], task_vectors: Mapping[str, Mapping[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, stack) for every key of theta0: ``stack`` [T + 1, n] holds theta0's and the T task vectors' tensor
    ``key``, flattened, in its compute_dtype, in one buffer reused for every key of that dtype (a stack is
    overwritten by the next).

    theta0 goes to the buffer too, not to a fresh tensor per key: fresh memory costs first-touch page faults,
    and a merge in a fresh process spent 0.3-0.4 s of its ~1.2 s on them for theta0's 352 MB (ViT-B/32).
    Overlapping the reads with compute was slower on 2 cores, not faster: starting each task's cuts on the pool
    as soon as its row was read took TIES per tensor 2.02 -> 2.22 s and Breadcrumbs 2.83 -> 3.15 s (medians of 8
    merges alternated in one process), and reading the next key ahead on a thread of its own 1.85 -> 2.09 s (5).
    """
    sources = [pretrained, *task_vectors.values()]
    specs = tensor_specs(pretrained)
    largest: dict[torch.dtype, int] = {}  # compute dtype -> its largest tensor (one buffer each: float32 models, one)
    for shape, dtype in specs.values():
        largest[compute_dtype(dtype)] = max(largest.get(compute_dtype(dtype), 0), math.prod(shape))
    buffers = {dtype: torch.empty(len(sources) * n, dtype=dtype) for dtype, n in largest.items()}
    for key, (shape, dtype) in specs.items():
        n = math.prod(shape)
        stack = buffers[compute_dtype(dtype)][: len(sources) * n].view(len(sources), n)
        read_stack(sources, key, stack)
        yield key, stack


def map_stacked(
    pretrained: Mapping[str, torch.Tensor],
    task_vectors: Mapping[str, Mapping[str, torch.Tensor]],
    fn: Callable[[torch.Tensor, tuple[np.ndarray, ...], list[Any]], torch.Tensor],
    *,
    prepare: Callable[[str, int, np.ndarray], Any] | None = None,
    cast: bool = True,
) -> StateDict:
    """map_tensors for element-wise methods, whose compiled kernels (_kernels) take the [T, n] stack flattened.

    For each key, theta0's and the T task vectors' tensors are read into one reused buffer (read_stacks, in the
    key's compute_dtype: numba compiles each kernel once per dtype);
    ``states[t] = prepare(key, t, tau_t)`` sees task t's tensor in its shape (for per-tensor quantities:
    thresholds, random masks), on the stage's threads (reproducibility.stage_threads) (kernels and numpy release the
    GIL); then
    ``fn(theta0 flattened, taus, states)``, taus a tuple of the T flat tensors (numpy views of the buffer), returns
    the merged tensor, flattened, in memory of its own.
    """
    specs = tensor_specs(pretrained)
    tasks = range(len(task_vectors))

    def merge_key(key: str, stack: torch.Tensor, pool: ThreadPoolExecutor) -> torch.Tensor:
        shape, dtype = specs[key]
        taus = stack[1:].numpy()
        states = (
            list(pool.map(lambda t: prepare(key, t, taus[t].reshape(shape)), tasks)) if prepare else [None] * len(tasks)
        )
        merged = fn(stack[0], tuple(taus), states)
        if merged.untyped_storage().data_ptr() == stack.untyped_storage().data_ptr():
            raise RuntimeError(
                f"map_stacked: the merge of '{key}' returned a view of the reused buffer (theta0 or a tau)"
            )
        merged = merged.reshape(shape)
        return merged.to(dtype) if cast else merged

    threads = stage_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))  # for the parallel kernels
    with ThreadPoolExecutor(threads) as pool:
        return {key: merge_key(key, stack, pool) for key, stack in read_stacks(pretrained, task_vectors)}


def kernel_vector(kernel: Callable[..., Any], taus: tuple[np.ndarray, ...], *args: Any) -> torch.Tensor:
    """kernel(taus, *args, out) into a fresh flat vector of taus' size and dtype.

    Allocated by torch, not numpy: numpy asks for huge pages for arrays over 4 MB, whose first-touch faults took
    the merge kernels 0.39 s against 0.27 s (a TIES merge of 8 ViT-B/32 task vectors, 3 runs each)."""
    out = empty_flat(taus[0].size, taus[0].dtype)
    kernel(taus, *args, out.numpy())
    return out


def empty_flat(size: int, dtype: np.dtype) -> torch.Tensor:
    """A fresh flat tensor of numpy ``dtype`` (float32 or float64), allocated by torch (see kernel_vector)."""
    return torch.empty(
        size, dtype={np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64}[np.dtype(dtype)]
    )


def plus_scaled(theta0: torch.Tensor, scale: float, vector: torch.Tensor) -> torch.Tensor:
    """theta0 + scale * vector (flat, one dtype), in place in ``vector``: one pass, no temporaries. ``scale`` is
    rounded to that dtype, so a float32 merge stays float32 arithmetic."""
    values = vector.numpy()
    add_scaled(theta0.numpy(), values.dtype.type(scale), values)
    return vector


_scratch = threading.local()


def magnitudes_of(values: np.ndarray) -> np.ndarray:
    """|values|, flat, in values' dtype, in this thread's scratch buffer for that dtype (reused: overwritten by the
    thread's next call).

    A fresh array per task and tensor would cost page faults on every call: 0.62-0.65 against 0.84-0.91 ns an
    entry for the cuts of 8 ViT-B-sized tensors on 2 threads (two runs each).
    """
    size = values.size
    buffers = getattr(_scratch, "magnitudes", None)
    if buffers is None:
        buffers = _scratch.magnitudes = {}
    buffer = buffers.get(values.dtype)
    if buffer is None or buffer.size < size:
        buffer = buffers[values.dtype] = empty_flat(size, values.dtype).numpy()
    return np.abs(values.reshape(-1), out=buffer[:size])


def partition_magnitudes(mags: np.ndarray, i: int, axis: int = -1) -> None:
    """mags.partition(i, axis), in place, for non-negative magnitudes. numpy's introselect runs in linear time,
    ~10x faster than torch's kthvalue, topk or sort; it selects on the bit patterns (int32 for float32, int64 for
    float64), which order non-negative floats exactly as their values do, as integers compare ~1.7x faster than
    floats."""
    bits = {np.dtype(np.float32): np.int32, np.dtype(np.float64): np.int64}.get(mags.dtype)
    (mags.view(bits) if bits else mags).partition(i, axis=axis)


def is_matrix(key: str, tensor: torch.Tensor) -> bool:
    """A 2-D weight (attention and MLP projections, heads); embeddings, norms, biases, convs are not. A text model's
    embedding tables are 2-D weights too (transformers: ``*embeddings.*``, ``embed_tokens``, T5's ``shared``): as
    seed 002 merges RoBERTa, only the attention and MLP matrices are low-rank, the rest averaged."""
    if tensor.ndim != 2 or not key.endswith("weight") or min(tensor.shape) <= 1:
        return False
    module = key.rsplit(".", 1)[0]
    return not ("embeddings" in module.split(".") or module.endswith("embed_tokens") or module == "shared")


def svd_device() -> torch.device:
    """SVD-based methods run on the GPU when there is one; they return their inputs' compute_dtype either way."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def svd(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD in the matrix's compute_dtype on the SVD device: (U [m, r], S [r] descending, Vh [r, n]),
    r = min(m, n).

    On the CPU, LAPACK's through torch. On CUDA in float32, ``gram_svd``: torch's default CUDA driver (cuSOLVER's
    gesvdj) took 35-38 ms per ViT-B matrix on an H100 and returned U and V 4e-4 away from orthonormal, where gram_svd
    took 12-14 ms and is within float32 rounding (measured: docs/benchmarks.md). Float64 on CUDA takes cuSOLVER's
    QR-based gesvd: gram_svd would square the condition number in the precision it returns."""
    matrix = as_compute(matrix).to(svd_device())
    if matrix.is_cuda:
        return (
            gram_svd(matrix)
            if matrix.dtype == torch.float32
            else torch.linalg.svd(matrix, full_matrices=False, driver="gesvd")
        )
    return torch.linalg.svd(matrix, full_matrices=False)


def gram_svd(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD through the float64 eigendecomposition of the smaller Gram matrix, returned in float32.

    For X [m, n] with m <= n (else on X^T): X X^T = Q diag(w) Q^T gives U = Q; then X^T U = V S, and the QR
    factorisation of X^T U gives V, orthonormal even where S is ~0 (it completes the basis: rank-deficient and
    zero matrices come out right), with S = |diag R|. Float64 keeps the squared condition number harmless: U and V
    are orthonormal and U S Vh = X to float32 rounding.
    """
    x = matrix.double()
    wide = x.shape[0] <= x.shape[1]
    if not wide:
        x = x.T
    q = torch.linalg.eigh(x @ x.T).eigenvectors.flip(-1)  # largest eigenvalue first
    v, r = torch.linalg.qr(x.T @ q)
    d = r.diagonal()
    s, order = d.abs().sort(descending=True)
    u, v = q[:, order], (v * torch.where(d < 0, -1.0, 1.0))[:, order]
    if not wide:
        u, v = v, u
    return u.float(), s.float(), v.T.float()


# The float32 CPU route through the smaller Gram, for the SVD family's two cheap cases: a few top singular triplets
# (TSV's top r/T of each task, Iso-CTS's per-task directions: ``top_singular``) and the polar factor of a
# well-conditioned matrix (TSV's and Iso-CTS's concatenated bases, where long and thin: ``polar``). The Gram A^T A
# and its top eigenpairs in float64 (LAPACK through scipy: syevr for a subset, syevd for all), the other side from
# A V / S in float32. It is taken only where the smallest eigenvalue it uses is at least GRAM_FLOOR of the largest
# (singular values within a factor 100 of the top), so that A V / S stays within float32 rounding, and for a polar
# factor only at condition number 10 or less (POLAR_FLOOR; then a float32 Gram is accurate enough); otherwise, and
# for float64, for more than half the spectrum (Iso-C, Iso-CTS's common space) and on CUDA, ``svd``.
# On one ViT-B/16 block with one thread: bench/svd_family.py, docs/benchmarks.md.
GRAM_FLOOR = 1e-4
POLAR_FLOOR = 1e-2  # polar factors by the route: condition number at most 10 (concatenated orthonormal bases: ~3)


def _gram_eigh(
    matrix: torch.Tensor, k: int, floor: float = GRAM_FLOOR
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool] | None:
    """(A, w, Q, tall): A = X or X^T made tall, and the top k eigenpairs of A^T A, w descending, in float64; None
    where the route does not apply (not float32 on the CPU) or its k-th eigenvalue is below ``floor`` of the top.
    The Gram is float64 (a float32 one loses the small end: U off orthonormal by 5e-5 near GRAM_FLOOR), except for
    ``floor`` >= POLAR_FLOOR, where float32 rounding stays below LAPACK float32's own error."""
    if matrix.dtype != torch.float32 or matrix.device.type != "cpu" or k <= 0:
        return None
    import scipy.linalg
    import threadpoolctl

    tall = matrix.shape[0] >= matrix.shape[1]
    a = matrix if tall else matrix.T
    x = a if floor >= POLAR_FLOOR else a.double()
    gram = (x.T @ x).double().numpy()
    n = gram.shape[0]
    with threadpoolctl.threadpool_limits(stage_threads(), user_api="blas"):  # scipy's BLAS: the stage's share
        if 2 * k > n:
            w, q = scipy.linalg.eigh(gram, driver="evd", overwrite_a=True, check_finite=False)
        else:
            w, q = scipy.linalg.eigh(
                gram, subset_by_index=[n - k, n - 1], driver="evr", overwrite_a=True, check_finite=False
            )
    w, q = torch.from_numpy(w[::-1][:k].copy()), torch.from_numpy(q[:, ::-1][:, :k].copy())
    return (a, w, q, tall) if w[-1] >= floor * w[0] > 0 else None


def top_singular(matrix: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top k singular triplets (U [m, k], S [k] descending, Vh [k, n]) in the matrix's compute_dtype, on the SVD
    device: the Gram route for a float32 CPU matrix when k is at most half its rank and resolved, else ``svd``."""
    matrix = as_compute(matrix).to(svd_device())
    k = min(k, *matrix.shape)
    route = _gram_eigh(matrix, k) if 2 * k <= min(matrix.shape) else None
    if route is None:
        u, s, vh = svd(matrix)
        return u[:, :k], s[:k], vh[:k]
    a, w, q, tall = route
    s, v = w.sqrt().float(), q.float()
    u = (a @ v) / s
    return (u, s, v.T) if tall else (v, s, u.T)


def polar(matrix: torch.Tensor) -> torch.Tensor:
    """The orthogonal polar factor: M = P S Q^T -> P Q^T (the nearest matrix with orthonormal columns); for a
    well-conditioned float32 CPU matrix, A (A^T A)^-1/2 by the Gram route. Tried only on matrices at least twice as
    long as wide: a concatenation of orthonormal blocks is well-conditioned there, and seldom when square."""
    matrix = as_compute(matrix).to(svd_device())
    route = _gram_eigh(matrix, min(matrix.shape), POLAR_FLOOR) if max(matrix.shape) >= 2 * min(matrix.shape) else None
    if route is None:
        u, _, vh = svd(matrix)
        return u @ vh
    a, w, q, tall = route
    p = a @ ((q / w.sqrt()) @ q.T).float()
    return p if tall else p.T


def low_rank(matrix: torch.Tensor, k: int) -> torch.Tensor:
    """The best rank-k approximation (truncated SVD); k = 0 gives zeros."""
    if k <= 0:
        return torch.zeros_like(matrix, dtype=compute_dtype(matrix.dtype))
    u, s, vh = top_singular(matrix, k)
    return ((u * s) @ vh).to(matrix.device)


def rank_of_ratio(matrix: torch.Tensor, ratio: float) -> int:
    """k = ceil(ratio x min(m, n)) (seed 002's Algorithm 1: k = ceil(r gamma)), within [0, min(m, n)].

    ratio x r is taken 1e-9 down before the ceiling, so that float noise above an integer (0.07 x 100 =
    7.000000000000001) does not add a rank: 0.25 x 768 gives 192, 0.08 x 768 = 61.44 gives 62."""
    r = min(matrix.shape)
    return max(0, min(r, math.ceil(ratio * r - 1e-9)))


def divide_or_zero(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """numerator / denominator, 0 where the denominator is not positive (a disjoint mean no task agrees on, a zero
    task vector's scale)."""
    positive = denominator > 0
    return torch.where(
        positive,
        numerator / torch.where(positive, denominator, torch.ones_like(denominator)),
        torch.zeros_like(numerator),
    )


def seed_of(seed: int, *parts: str | int) -> int:
    """A 32-bit seed that depends only on (seed, parts), so results do not depend on the order tensors stream in."""
    return zlib.crc32("/".join(map(str, (seed, *parts))).encode())


def store_bytes(store: Mapping[str, torch.Tensor]) -> int:
    """Bytes a per-task store needs: boolean masks count one bit an entry, as they would packed."""
    return sum((t.numel() + 7) // 8 if t.dtype == torch.bool else t.numel() * t.element_size() for t in store.values())


# A per-task store that holds its own base model keeps it under "base/" (CART-Indexing keeps theta_avg);
# every other store needs theta0 beside it to rebuild a task's model.
BASE_PREFIX = "base/"
