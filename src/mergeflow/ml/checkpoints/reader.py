"""Reading a checkpoint file: the pickle's object tree (a ``torch.save`` zip or a plain pickle, storages read on
demand), then its module structure as a flat state dict (``read_tensors``)."""

from __future__ import annotations

import io
import math
import pickle
import sys
import zipfile
from pathlib import Path

import torch

from mergeflow.ml.checkpoints.unpickler import _Pickled, _printable, _Refused, _StorageRef, _TensorRef, _Unpickler, _why
from mergeflow.core.errors import MergeflowError
from mergeflow.core.io import StateDict, check_finite


class _Reader:
    """A torch.save zip or a plain pickle, unpickled by :class:`_Unpickler`; storages read on demand."""

    def __init__(self, path: Path):
        self.path = path
        self.zip: zipfile.ZipFile | None = None
        self.storages: dict[str, torch.Tensor] = {}
        if zipfile.is_zipfile(path):
            self.zip = zipfile.ZipFile(path)
            pickles = [n for n in self.zip.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
            if len(pickles) != 1:
                raise _Refused("a zip file that is not a torch.save checkpoint (no <archive>/data.pkl)")
            self.archive = pickles[0][: -len("/data.pkl")]
            names = set(self.zip.namelist())
            order = (
                self.zip.read(f"{self.archive}/byteorder").decode()
                if f"{self.archive}/byteorder" in names
                else "little"
            )
            if order not in ("little", "big"):
                raise _Refused(f"an unknown byte order '{_printable(order, 20)}'")
            self.byteorder = order
            file = io.BytesIO(self.zip.read(pickles[0]))
        else:
            file = open(path, "rb")  # noqa: SIM115  closed below
            if file.read(1) != pickle.PROTO:
                file.close()
                raise _Refused("neither a torch.save zip checkpoint nor a pickle")
            file.seek(0)
            self.byteorder = sys.byteorder
        try:
            self.root = _Unpickler(file, zipped=self.zip is not None).load()
            if self.zip is None and file.read(1):
                raise _Refused(
                    "a pickle followed by more data (the legacy torch.save format of PyTorch < 1.6, not read here)"
                )
        finally:
            file.close()

    def close(self) -> None:
        if self.zip is not None:
            self.zip.close()

    def tensor(self, ref: _TensorRef) -> torch.Tensor:
        """The tensor ``ref`` describes, as its own contiguous copy when it views part of a storage."""
        flat = self._storage(ref.storage)
        if ref.dtype != flat.dtype:
            if flat.dtype != torch.uint8 or flat.numel() % torch.empty(0, dtype=ref.dtype).element_size():
                raise _Refused(f"a {ref.dtype} tensor over a {flat.dtype} storage")
            flat = flat.view(ref.dtype)
        # as_strided checks the last element only: a stride-0 view of any size passes, and its copy below would
        # allocate all of it. Every element must lie in the storage, and there must be no more than it holds.
        count, numel = math.prod(ref.size), flat.numel()
        if count and ref.offset + sum((n - 1) * s for n, s in zip(ref.size, ref.stride)) >= numel:
            raise _Refused(
                f"a tensor of shape {_printable(ref.size, 60)} that runs past its storage of {numel} elements"
            )
        if count > numel:
            raise _Refused(f"a tensor of shape {_printable(ref.size, 60)} larger than its storage of {numel} elements")
        try:
            tensor = flat.as_strided(ref.size, ref.stride, ref.offset)
        except RuntimeError:
            raise _Refused(
                f"a tensor of shape {_printable(ref.size, 60)} that runs past its storage of {numel} elements"
            ) from None
        return tensor if tensor.numel() == flat.numel() and tensor.is_contiguous() else tensor.clone()

    def _storage(self, ref: _StorageRef) -> torch.Tensor:
        if ref.data is not None:
            return ref.data
        if ref.key not in self.storages:
            name = f"{self.archive}/data/{ref.key}"
            try:
                data = bytearray(self.zip.read(name))
            except KeyError:
                raise _Refused(f"a tensor whose storage '{_printable(name)}' is not in the file") from None
            itemsize = torch.empty(0, dtype=ref.dtype).element_size()
            if len(data) != ref.numel * itemsize:
                raise _Refused(
                    f"storage '{_printable(name)}' holds {len(data)} bytes, not the {ref.numel * itemsize} its "
                    f"{ref.numel} {ref.dtype} elements need"
                )
            flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
            if self.byteorder != sys.byteorder and itemsize > 1:
                flat = flat.view(-1, itemsize).flip(-1).reshape(-1)
            self.storages[ref.key] = flat.view(ref.dtype)
        return self.storages[ref.key]


def _is_module(obj) -> bool:
    """A pickled torch.nn.Module: its __dict__ state holds _parameters, _buffers and _modules."""
    return (
        isinstance(obj, _Pickled)
        and isinstance(obj.state, dict)
        and all(isinstance(obj.state.get(k), dict) for k in ("_parameters", "_buffers", "_modules"))
    )


# a module tree naming more tensors is refused (shared submodules, listed under each of their names, can name
# exponentially many in the tree's depth)
_MAX_NAMES = 1_000_000


def _module_tensors(root: _Pickled) -> dict[str, _TensorRef]:
    """``module.state_dict()``'s entries, from the pickled state: parameters, persistent buffers, then submodules
    in their registration order, with dotted names. A submodule registered under several names is listed under
    each, as state_dict() does, but walked once (its entries kept by id: the pickle's tree keeps it alive)."""
    done: dict[int, list[tuple[str, _TensorRef]]] = {}
    walking: set[int] = set()

    def entries(module: _Pickled, path: str) -> list[tuple[str, _TensorRef]]:
        if id(module) in done:
            return done[id(module)]
        if id(module) in walking:
            raise _Refused(f"a module that contains itself at '{_printable(path)}'")
        walking.add(id(module))
        state = module.state
        prefix = f"{path}." if path else ""
        non_persistent = state.get("_non_persistent_buffers_set") or ()
        out = []
        for name, value in [
            *state["_parameters"].items(),
            *((k, v) for k, v in state["_buffers"].items() if k not in non_persistent),
        ]:
            if value is None:
                continue
            if not isinstance(value, _TensorRef):
                raise _Refused(f"'{_printable(f'{prefix}{name}')}' is {_printable(type(value).__name__)}, not a tensor")
            out.append((f"{name}", value))
        for name, child in state["_modules"].items():
            if child is None:
                continue
            if not _is_module(child):
                raise _Refused(f"submodule '{_printable(f'{prefix}{name}')}' is not a module")
            below = entries(child, f"{prefix}{name}")
            if len(out) + len(below) > _MAX_NAMES:
                raise _Refused(
                    f"a module tree naming more than {_MAX_NAMES} tensors (submodules shared under many names)"
                )
            out.extend((f"{name}.{sub}", value) for sub, value in below)
        walking.discard(id(module))
        done[id(module)] = out
        return out

    return dict(entries(root, ""))


def _tensor_refs(root) -> dict[str, _TensorRef]:
    """A module's state dict, a state dict, or one inside the wrappers training scripts save."""
    if _is_module(root):
        return _module_tensors(root)
    if isinstance(root, dict):
        for key in ("state_dict_ema", "model_ema", "state_dict", "model"):
            if _is_module(root.get(key)) or isinstance(root.get(key), dict):
                return _tensor_refs(root[key])
        return {k: v for k, v in root.items() if isinstance(k, str) and isinstance(v, _TensorRef)}
    return {}


def read_tensors(path: str | Path, *, keep=None) -> StateDict:
    """Every tensor of a PyTorch checkpoint, named as ``module.state_dict()`` would name them, read WITHOUT running
    its pickle or importing what it names: a ``torch.save`` zip of a whole module (the task arithmetic papers'
    ``finetuned.pt``, ``zeroshot.pt``, ``head_<Dataset>.pt``) or of a state dict, or a plain pickle of either.

    ``keep(name) -> bool`` chooses the tensors to read (the others' storages are never read: a CLIP checkpoint's
    text tower). A file holding no tensors, or not a checkpoint, is one line naming it.
    """
    path = Path(path)
    if not path.is_file():
        raise MergeflowError(f"{path}: checkpoint not found")
    reader = None
    try:
        reader = _Reader(path)
        refs = _tensor_refs(reader.root)
        if not refs:
            found = reader.root.qualname if isinstance(reader.root, _Pickled) else type(reader.root).__name__
            raise _Refused(f"holds no tensors (its pickle makes {found}, neither a torch module nor a state dict)")
        state = {}
        for name, ref in refs.items():
            if keep is None or keep(name):
                try:
                    state[name] = reader.tensor(ref)
                except (RuntimeError, MemoryError) as err:  # torch's own refusal, or an allocation that failed
                    raise _Refused(f"tensor '{_printable(name)}' could not be built ({_why(err)})") from None
    except _Refused as err:
        raise MergeflowError(f"{path}: not a checkpoint mergeflow reads: {err}") from None
    except (
        pickle.UnpicklingError,
        zipfile.BadZipFile,
        EOFError,
        OSError,
        ValueError,
        TypeError,
        AttributeError,
        IndexError,
        KeyError,
        RecursionError,
        MemoryError,
    ) as err:
        # a corrupt or crafted pickle trips the unpickler somewhere: always a bad file
        raise MergeflowError(f"{path}: not a readable PyTorch checkpoint ({_why(err)})") from None
    finally:
        if reader is not None:
            reader.close()
    check_finite(state, str(path))
    return state
