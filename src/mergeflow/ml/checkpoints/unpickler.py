"""The restricted unpickler: tensors rebuilt by its own functions, every other global an inert record
(:class:`_Pickled`); nothing a checkpoint's pickle names is imported or run."""

from __future__ import annotations

import _compat_pickle
import collections
import io
import pickle
import types
import warnings

import torch


class _Refused(Exception):
    """A pickle that is not a checkpoint this reader accepts; the message becomes the one-line error."""


def _printable(text, limit: int = 120) -> str:
    """``text`` (a name the pickle chose: a global, a module attribute, a tensor's) fit for a one-line message:
    printable ASCII, anything else (a newline, a terminal escape) as a Python escape; cut at ``limit``."""
    text = str(text)
    if not (text.isascii() and text.isprintable()):
        text = ascii(text)[1:-1]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _why(err: BaseException) -> str:
    """An exception as one printable line: its type and its message's first line."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {_printable(lines[0])}" if lines else type(err).__name__


class _NoBuild:
    """This reader's own objects that a pickle can reach (allowed functions, storage types, tensor and storage
    references): pickle's BUILD, which sets attributes on whatever it is applied to, is refused on them. Only
    :class:`_Pickled` records (and the dicts the pickle makes itself) take a state."""

    __slots__ = ()

    def __setstate__(self, state):
        raise _Refused(
            f"a pickle BUILD (setting attributes) on {type(self).__name__.strip('_')}, not on a recorded object"
        )


class _Call(_NoBuild):
    """An allowed function as one pickle gets it. The function itself never reaches the pickle: a BUILD on it
    would set its ``__defaults__`` or ``__code__`` for the rest of the process."""

    __slots__ = ("func",)

    def __init__(self, func):
        self.func = func

    def __call__(self, *args, **kwargs):
        return self.func(*args, **kwargs)


class _Pickled:
    """An object of a class (or the result of a function) that the pickle names and this reader never imports.

    Calling the class, pickle's NEWOBJ and BUILD, and list or dict filling only record their arguments: nothing
    named in the file runs. Subclasses are made per global, named after it (:meth:`_Unpickler.find_class`).
    """

    qualname = "?"

    def __new__(cls, *args, **kwargs):
        self = object.__new__(cls)
        self.args, self.kwargs, self.state, self.items = args, kwargs, None, []
        return self

    def __init__(self, *args, **kwargs):  # object.__init__ would refuse the arguments __new__ recorded
        pass

    def __setstate__(self, state):  # BUILD: a module's __dict__, a transform's attributes
        self.state = state

    def append(self, item):  # APPEND(S) on a pickled list subclass
        self.items.append(item)

    def extend(self, items):
        self.items.extend(items)

    def __setitem__(self, key, value):  # SETITEM(S) on a pickled dict subclass
        self.items.append((key, value))

    def __repr__(self):
        return f"<pickled {self.qualname}>"


class _StorageRef(_NoBuild):
    """A storage the pickle points at: in the zip by key (read only when a kept tensor needs it), or already read
    (``data``: plain pickles carry their storages inline)."""

    __slots__ = ("key", "dtype", "numel", "data")

    def __init__(self, key, dtype, numel, data=None):
        self.key, self.dtype, self.numel, self.data = key, dtype, numel, data


class _TensorRef(_NoBuild):
    """A tensor as the pickle describes it (a strided view of a storage); materialised by :meth:`_Reader.tensor`."""

    __slots__ = ("storage", "offset", "size", "stride", "dtype")

    def __init__(self, storage, offset, size, stride, dtype=None):
        if not isinstance(storage, _StorageRef):
            raise _Refused(f"a tensor rebuilt from {_printable(type(storage).__name__)}, not from a storage")
        if not all(isinstance(n, int) and n >= 0 for n in (offset, *size, *stride)) or len(size) != len(stride):
            raise _Refused("a tensor with an invalid offset, size or stride")
        self.storage, self.offset, self.size, self.stride = storage, offset, tuple(size), tuple(stride)
        self.dtype = dtype or storage.dtype


class _StorageType(_NoBuild):
    """``torch.FloatStorage`` and its kin, as the pickle names them: only their dtype matters."""

    __slots__ = ("dtype",)

    def __init__(self, dtype):
        self.dtype = dtype


# tensor rebuild functions, the signatures of torch/_utils.py's (torch 1.x-2.x): they only record
def _rebuild_tensor(storage, storage_offset, size, stride):
    return _TensorRef(storage, storage_offset, size, stride)


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    return _TensorRef(storage, storage_offset, size, stride)


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype, metadata=None):
    if not isinstance(dtype, torch.dtype):  # dtypes without a storage type (float8...) over an untyped storage
        raise _Refused("a tensor whose dtype is not a torch dtype")
    return _TensorRef(storage, storage_offset, size, stride, dtype)


def _rebuild_parameter(data, requires_grad=True, backward_hooks=None, state=None):
    if not isinstance(data, _TensorRef):
        raise _Refused(f"a parameter holding {_printable(type(data).__name__)}, not a tensor")
    return data


def _rebuild_from_type_v2(func, new_type, args, state):  # tensor subclasses: the plain tensor is enough
    if not (isinstance(func, _Call) and func.func in _REBUILDERS) or not isinstance(args, tuple):
        raise _Refused("a tensor subclass rebuilt by an unknown function")
    return func.func(*args)


def _load_from_bytes(data):
    """Plain pickles (``pickle.dump`` of a model) carry each storage as a nested legacy ``torch.save``, which
    holds a storage and nothing else: torch's own weights-only loader reads it."""
    if not isinstance(data, bytes):
        raise _Refused("a storage that is not bytes")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            storage = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001  torch's loader raises anything on a crafted payload
            raise _Refused(f"an embedded storage torch refused ({type(err).__name__})") from None
    if not isinstance(storage, (torch.storage.TypedStorage, torch.UntypedStorage)):
        raise _Refused(f"an embedded storage holding {_printable(type(storage).__name__)}")
    dtype = storage.dtype if isinstance(storage, torch.storage.TypedStorage) else torch.uint8
    flat = (
        torch.empty(0, dtype=dtype).set_(storage)
        if isinstance(storage, torch.storage.TypedStorage)
        else torch.frombuffer(bytearray(bytes(storage)), dtype=torch.uint8)
    )
    return _StorageRef(None, dtype, flat.numel(), flat)


def _encode(text, encoding="utf-8"):  # how protocol 2 pickles bytes: _codecs.encode(str, 'latin1')
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise _Refused("a _codecs.encode call that does not make bytes")
    return text.encode(encoding)


def _reconstructor(cls, base, state=None):  # protocols 0 and 1: copyreg's way of making a plain object
    if not (isinstance(cls, type) and issubclass(cls, _Pickled)):
        raise _Refused("copyreg._reconstructor of a class that is not recorded")
    return cls()


def _device(kind, index=None):  # torch.device('cuda', 0): only a name (tensors are read onto the CPU)
    return f"{kind}:{index}" if index is not None else str(kind)


_REBUILDERS = {_rebuild_tensor, _rebuild_tensor_v2, _rebuild_tensor_v3, _rebuild_parameter}


# the only globals a pickle gets as themselves (or as these stand-ins); any other becomes a _Pickled record
_ALLOWED = {
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch.nn.parameter", "Parameter"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch.tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,  # its module before torch 1.9
    ("torch.storage", "_load_from_bytes"): _load_from_bytes,
    ("torch", "Size"): tuple,
    ("torch", "device"): _device,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("_codecs", "encode"): _encode,
    ("copyreg", "_reconstructor"): _reconstructor,
    **{("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)},
}


_STORAGE_DTYPES = {name: dtype for dtype, name in torch.storage._dtype_to_storage_type_map().items()} | {
    "UntypedStorage": torch.uint8,
    "ByteStorage": torch.uint8,
}


class _Unpickler(pickle.Unpickler):
    """pickle's C unpickler with every global resolved by :meth:`find_class`, storages by :meth:`persistent_load`."""

    def __init__(self, file, *, zipped: bool):
        super().__init__(file)
        self.zipped = zipped
        self.records: dict[tuple[str, str], type] = {}

    def find_class(self, module, name):
        # protocol 2 (torch.save's) names Python 2's modules: __builtin__.set, copy_reg._reconstructor
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        if (module, name) in _ALLOWED:  # functions wrapped (see _Call); the types and dtypes are immutable
            found = _ALLOWED[(module, name)]
            return _Call(found) if isinstance(found, types.FunctionType) else found
        # torch.save names UntypedStorage (float8's and other dtypes without a storage type) by its torch.storage
        if (module in ("torch", "torch.cuda") and name in _STORAGE_DTYPES) or (module, name) == (
            "torch.storage",
            "UntypedStorage",
        ):
            return _StorageType(_STORAGE_DTYPES[name])
        # anything else: a class named after the global, that records and runs nothing
        if (module, name) not in self.records:
            qualname = _printable(f"{module}.{name}")  # what error messages show of it
            self.records[(module, name)] = type(
                _printable(name), (_Pickled,), {"qualname": qualname, "__module__": "mergeflow.ml.checkpoints.pickled"}
            )
        return self.records[(module, name)]

    def persistent_load(self, pid):
        # torch.save's zip format: ('storage', storage type, key, location, numel)
        if not (self.zipped and isinstance(pid, tuple) and len(pid) == 5 and pid[0] in ("storage", b"storage")):
            raise _Refused(f"an unknown persistent id {str(pid)[:60]!r}")
        _, storage_type, key, _, numel = pid
        if (
            not isinstance(storage_type, _StorageType)
            or not isinstance(key, str)
            or not isinstance(numel, int)
            or numel < 0
        ):
            raise _Refused(f"a storage reference of unknown form {str(pid)[:60]!r}")
        return _StorageRef(key, storage_type.dtype, numel)
