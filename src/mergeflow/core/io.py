"""Tensors in files: validated safetensors state dicts, read whole or lazily, written atomically
(mergeflow.core.files)."""

from __future__ import annotations

import json
import os
import struct
import weakref
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mergeflow.core.errors import MergeflowError
from mergeflow.core.files import atomic_path
from mergeflow.core.reproducibility import stage_threads

StateDict = dict[str, torch.Tensor]


def check_finite(tensors: Mapping[str, torch.Tensor], source: str) -> None:
    """Raise naming the first tensor holding NaN or Inf."""
    for key, tensor in tensors.items():
        # one reduction: the sum is finite unless an entry is not (or it overflows: then check exactly). In
        # float32, not float64: 10x faster, and overflow only costs the exact check.
        if (
            tensor.is_floating_point()
            and not torch.isfinite(tensor.sum(dtype=torch.float32 if tensor.element_size() < 4 else None))
            and not torch.isfinite(tensor).all()
        ):
            raise MergeflowError(f"{source}: tensor '{key}' contains NaN or Inf")


# safetensors writes its metadata map in a random order per process, so the same tensors and metadata would hash
# differently on every run (and DVC would re-run everything downstream): mergeflow stores its metadata as one
# key holding sorted JSON.
METADATA_KEY = "mergeflow"


def save_state_dict(
    path: str | os.PathLike, state: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> None:
    """Save tensors as safetensors, atomically and byte-for-byte reproducibly; refuses non-finite weights."""
    check_finite(state, str(path))
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={METADATA_KEY: json.dumps(dict(metadata or {}), sort_keys=True)})


def load_state_dict(path: str | os.PathLike, *, check: bool = True) -> StateDict:
    """Load a safetensors file into memory, with one-line errors for missing, corrupt or non-finite files."""
    path = Path(path)
    if not path.is_file():
        raise MergeflowError(f"{path}: checkpoint not found")
    try:
        with safe_open(str(path), framework="pt") as f:
            state = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as err:
        raise MergeflowError(f"{path}: not a readable safetensors file ({str(err).splitlines()[0]})") from None
    if check:
        check_finite(state, str(path))
    return state


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


# a tensor larger than one chunk is read by several threads, at most the stage's torch threads and this many: on the
# 2-core VM, 1.5 GB of images from the page cache at 2.1 GB/s on one thread, 3.5-3.7 on two (2026-11-28)
READ_CHUNK_BYTES = 64 << 20
MAX_READ_THREADS = 8


class LazyStateDict(Mapping[str, torch.Tensor]):
    """A safetensors file read tensor by tensor: the header when opened, a tensor (checked for NaN/Inf) only when
    indexed, by pread straight into the destination's memory.

    pread copies out of the page cache without mapping the file into this process, so a merge's resident memory is
    the tensors it holds, not the files it has read; on this project's 2-core VM it also took a third of the CPU
    time of copying out of a memory map (0.5 against 1.3-1.6 CPU-s for 2.6 GB: no page faults, one thread). A tensor
    larger than READ_CHUNK_BYTES (a split's images) is read in chunks on the stage's threads.
    """

    def __init__(self, path: str | os.PathLike, *, check: bool = True):
        self.path = Path(path)
        if not self.path.is_file():
            raise MergeflowError(f"{self.path}: checkpoint not found")
        self._check = check
        try:
            self._fd = os.open(self.path, os.O_RDONLY)  # one descriptor: the header now, each tensor when indexed
            weakref.finalize(self, os.close, self._fd)
            size = os.fstat(self._fd).st_size
            (n,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
            if 8 + n > size:
                raise ValueError("header runs past the end of the file")
            header = json.loads(os.pread(self._fd, n, 8))
            header.pop("__metadata__", None)
            self._base = 8 + n
            self._entries = {
                k: (_SAFETENSORS_DTYPES[v["dtype"]], tuple(v["shape"]), tuple(v["data_offsets"]))
                for k, v in header.items()
            }
            if any(self._base + end > size for _, _, (_, end) in self._entries.values()):
                raise ValueError("tensor data runs past the end of the file")
        except (OSError, ValueError, KeyError, TypeError, struct.error) as err:
            raise MergeflowError(
                f"{self.path}: not a readable safetensors file "
                f"({str(err).splitlines()[0] if str(err) else type(err).__name__})"
            ) from None

    def __getitem__(self, key: str) -> torch.Tensor:
        dtype, shape, _ = self._entries[key]
        tensor = torch.empty(shape, dtype=dtype)
        self._read(key, tensor.view(-1))
        return tensor

    def read_into(self, key: str, out: torch.Tensor) -> None:
        """Copy tensor ``key``, flattened and converted to out's dtype, into ``out`` (a preallocated buffer)."""
        dtype, _, _ = self._entries[key]
        if out.dtype == dtype and out.is_contiguous():
            self._read(key, out.view(-1))
        else:
            out.copy_(self[key].reshape(-1))

    def _read(self, key: str, flat: torch.Tensor) -> None:
        """pread tensor ``key``'s bytes into ``flat`` (contiguous, its dtype and size), then check it."""
        _, _, (begin, end) = self._entries[key]
        view = memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
        if len(view) != end - begin:
            raise MergeflowError(
                f"{self.path}: tensor '{key}' holds {end - begin} bytes, not the {len(view)} its shape and dtype need"
            )
        starts = range(0, len(view), READ_CHUNK_BYTES)
        threads = min(len(starts), stage_threads(), MAX_READ_THREADS)
        if threads > 1:  # a split's images, gigabytes at 224 px: pread releases the GIL, and copying is per core
            with ThreadPoolExecutor(threads, thread_name_prefix="read") as pool:
                list(
                    pool.map(
                        lambda start: self._read_range(
                            key, view, start, min(start + READ_CHUNK_BYTES, len(view)), begin
                        ),
                        starts,
                    )
                )
        else:
            self._read_range(key, view, 0, len(view), begin)
        if self._check:
            check_finite({key: flat}, str(self.path))

    def _read_range(self, key: str, view: memoryview, start: int, end: int, begin: int) -> None:
        done = start
        while done < end:
            got = os.preadv(self._fd, [view[done:end]], self._base + begin + done)
            if not got:
                raise MergeflowError(f"{self.path}: file ends inside tensor '{key}' (changed since it was opened?)")
            done += got

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of every tensor, from the header alone."""
        return {k: (shape, dtype) for k, (dtype, shape, _) in self._entries.items()}


def load_metadata(path: str | os.PathLike) -> dict[str, str]:
    path = Path(path)
    if not path.is_file():
        raise MergeflowError(f"{path}: checkpoint not found")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
        return json.loads(metadata[METADATA_KEY]) if METADATA_KEY in metadata else metadata  # else: not mergeflow's
    except (SafetensorError, OSError, ValueError) as err:
        raise MergeflowError(f"{path}: not a readable safetensors file ({str(err).splitlines()[0]})") from None


def tensor_specs(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    if isinstance(state, LazyStateDict) or hasattr(
        state, "specs"
    ):  # a lazy file, or a LoRA task vector (mergeflow.ml.lora)
        return state.specs()
    return {k: (tuple(v.shape), v.dtype) for k, v in state.items()}


def check_compatible(
    reference: Mapping[str, torch.Tensor],
    other: Mapping[str, torch.Tensor],
    *,
    reference_name: str,
    other_name: str,
    dtypes: bool = True,
) -> None:
    """Same keys, shapes and dtypes (lazy files: from their headers, reading no tensor), or one line saying which
    tensor differs and how."""
    ref, got = tensor_specs(reference), tensor_specs(other)
    missing = sorted(set(ref) - set(got))
    extra = sorted(set(got) - set(ref))
    if missing:
        raise MergeflowError(
            f"{other_name}: missing tensor '{missing[0]}' present in {reference_name} ({len(missing)} missing)"
        )
    if extra:
        raise MergeflowError(
            f"{other_name}: unexpected tensor '{extra[0]}' absent from {reference_name} ({len(extra)} extra)"
        )
    for key, (shape, dtype) in ref.items():
        if got[key][0] != shape:
            raise MergeflowError(
                f"{other_name}: tensor '{key}' has shape {got[key][0]}, expected {shape} as in {reference_name}"
            )
        if dtypes and got[key][1] != dtype:
            raise MergeflowError(
                f"{other_name}: tensor '{key}' has dtype {got[key][1]}, expected {dtype} as in {reference_name}"
            )
