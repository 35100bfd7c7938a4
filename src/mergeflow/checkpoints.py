"""Published fine-tuned CLIP image towers as the pipeline's timm state dicts, read without running their pickles.

Three namings reach the same timm ``VisionTransformer`` (e.g. ``vit_base_patch32_clip_quickgelu_224`` built with
``num_classes`` = CLIP's embedding dim and ``global_pool="token"``, so that timm's ``head`` is CLIP's visual
projection):

- open_clip's (``visual.conv1.weight``, ..., ``visual.proj``), as in the task arithmetic papers' checkpoints
  (github:mlfoundations/task_vectors): ``torch.save`` of a whole ``src.modeling.ImageEncoder`` module. Such a file
  is a pickle that names the authors' classes, open_clip's and torchvision's; ``torch.load`` would import them and
  run whatever the pickle says. Here a restricted unpickler (:class:`_Unpickler`) rebuilds tensors with its own
  functions and turns every other global into an inert :class:`_Pickled` record, from which the module tree's
  parameters and buffers are read back as ``module.state_dict()`` would name them.
- Hugging Face transformers' ``CLIPVisionModel`` / ``CLIPVisionModelWithProjection`` / ``CLIPModel``
  (``vision_model.encoder.layers.{i}.self_attn.q_proj``, ...), as FusionBench publishes its fine-tunes on the hub.
- timm's own, passed through.

FusionBench's fine-tunes are ``CLIPVisionModel`` files without ``visual_projection``: CLIP's projection was not
fine-tuned there, so it is taken from the pretrained backbone (``projection_from``) and its task vector is zero.
"""

from __future__ import annotations

import _compat_pickle
import collections
import io
import math
import pickle
import sys
import types
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path

import torch

from mergeflow.errors import MergeflowError
from mergeflow.io import StateDict, check_compatible, check_finite, load_state_dict
from mergeflow.weights_header import clip_naming

# ---------------------------------------------------------------------------------------------------------------
# The restricted unpickler


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
        raise _Refused(f"a pickle BUILD (setting attributes) on {type(self).__name__.strip('_')}, not on a recorded object")


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
    flat = torch.empty(0, dtype=dtype).set_(storage) if isinstance(storage, torch.storage.TypedStorage) else torch.frombuffer(bytearray(bytes(storage)), dtype=torch.uint8)
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
_STORAGE_DTYPES = {name: dtype for dtype, name in torch.storage._dtype_to_storage_type_map().items()} | {"UntypedStorage": torch.uint8, "ByteStorage": torch.uint8}


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
        if (module in ("torch", "torch.cuda") and name in _STORAGE_DTYPES) or (module, name) == ("torch.storage", "UntypedStorage"):
            return _StorageType(_STORAGE_DTYPES[name])
        # anything else: a class named after the global, that records and runs nothing
        if (module, name) not in self.records:
            qualname = _printable(f"{module}.{name}")  # what error messages show of it
            self.records[(module, name)] = type(_printable(name), (_Pickled,), {"qualname": qualname, "__module__": "mergeflow.checkpoints.pickled"})
        return self.records[(module, name)]

    def persistent_load(self, pid):
        # torch.save's zip format: ('storage', storage type, key, location, numel)
        if not (self.zipped and isinstance(pid, tuple) and len(pid) == 5 and pid[0] in ("storage", b"storage")):
            raise _Refused(f"an unknown persistent id {str(pid)[:60]!r}")
        _, storage_type, key, _, numel = pid
        if not isinstance(storage_type, _StorageType) or not isinstance(key, str) or not isinstance(numel, int) or numel < 0:
            raise _Refused(f"a storage reference of unknown form {str(pid)[:60]!r}")
        return _StorageRef(key, storage_type.dtype, numel)


# ---------------------------------------------------------------------------------------------------------------
# Reading a file: the pickle's object tree, then its module structure as a flat state dict


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
            order = self.zip.read(f"{self.archive}/byteorder").decode() if f"{self.archive}/byteorder" in names else "little"
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
                raise _Refused("a pickle followed by more data (the legacy torch.save format of PyTorch < 1.6, not read here)")
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
            raise _Refused(f"a tensor of shape {_printable(ref.size, 60)} that runs past its storage of {numel} elements")
        if count > numel:
            raise _Refused(f"a tensor of shape {_printable(ref.size, 60)} larger than its storage of {numel} elements")
        try:
            tensor = flat.as_strided(ref.size, ref.stride, ref.offset)
        except RuntimeError:
            raise _Refused(f"a tensor of shape {_printable(ref.size, 60)} that runs past its storage of {numel} elements") from None
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
                raise _Refused(f"storage '{_printable(name)}' holds {len(data)} bytes, not the {ref.numel * itemsize} its {ref.numel} {ref.dtype} elements need")
            flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
            if self.byteorder != sys.byteorder and itemsize > 1:
                flat = flat.view(-1, itemsize).flip(-1).reshape(-1)
            self.storages[ref.key] = flat.view(ref.dtype)
        return self.storages[ref.key]


def _is_module(obj) -> bool:
    """A pickled torch.nn.Module: its __dict__ state holds _parameters, _buffers and _modules."""
    return isinstance(obj, _Pickled) and isinstance(obj.state, dict) and all(isinstance(obj.state.get(k), dict) for k in ("_parameters", "_buffers", "_modules"))


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
        for name, value in [*state["_parameters"].items(), *((k, v) for k, v in state["_buffers"].items() if k not in non_persistent)]:
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
                raise _Refused(f"a module tree naming more than {_MAX_NAMES} tensors (submodules shared under many names)")
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
    except (pickle.UnpicklingError, zipfile.BadZipFile, EOFError, OSError, ValueError, TypeError, AttributeError, IndexError, KeyError, RecursionError, MemoryError) as err:
        # a corrupt or crafted pickle trips the unpickler somewhere: always a bad file
        raise MergeflowError(f"{path}: not a readable PyTorch checkpoint ({_why(err)})") from None
    finally:
        if reader is not None:
            reader.close()
    check_finite(state, str(path))
    return state


# ---------------------------------------------------------------------------------------------------------------
# CLIP namings -> timm's


def _from_open_clip(state: StateDict, prefix: str) -> StateDict:
    """open_clip's image tower (``<prefix>visual.*``) in timm's naming, by timm's own converter (the one timm
    loads OpenAI's CLIP weights with): ``visual.proj`` [D, E] becomes ``head.weight`` [E, D] and a zero bias."""
    from timm.models.vision_transformer import _convert_openai_clip

    return _convert_openai_clip(state, None, prefix=prefix + "visual.")


def _from_hugging_face(state: StateDict, vm: str, projection: str) -> StateDict:
    """transformers' CLIP image tower (its names under ``vm``: 'vision_model.' in CLIPVisionModelWithProjection,
    CLIPModel and transformers 4's CLIPVisionModel files, '' in transformers 5's CLIPVisionModel) -> timm's
    VisionTransformer: the separate q, k, v projections concatenated into timm's qkv; ``projection``
    (``visual_projection.weight`` [E, D], no bias), when present, becomes the head."""
    enc = vm + "encoder.layers."
    out = {
        "cls_token": state[vm + "embeddings.class_embedding"].reshape(1, 1, -1),
        "pos_embed": state[vm + "embeddings.position_embedding.weight"].unsqueeze(0),
        "patch_embed.proj.weight": state[vm + "embeddings.patch_embedding.weight"],
    }
    used = {vm + "embeddings.class_embedding", vm + "embeddings.position_embedding.weight", vm + "embeddings.patch_embedding.weight", vm + "embeddings.position_ids", projection}
    renames = {vm + "pre_layrnorm.": "norm_pre.", vm + "post_layernorm.": "norm."}
    for i in sorted({int(k[len(enc):].split(".")[0]) for k in state if k.startswith(enc)}):
        src, dst = f"{enc}{i}.", f"blocks.{i}."
        renames |= {src + "layer_norm1.": dst + "norm1.", src + "layer_norm2.": dst + "norm2.", src + "self_attn.out_proj.": dst + "attn.proj.", src + "mlp.fc1.": dst + "mlp.fc1.", src + "mlp.fc2.": dst + "mlp.fc2."}
        for kind in ("weight", "bias"):
            qkv = [f"{src}self_attn.{p}_proj.{kind}" for p in "qkv"]
            out[f"{dst}attn.qkv.{kind}"] = torch.cat([state[k] for k in qkv])
            used |= set(qkv)
    for key, value in state.items():
        for src, dst in renames.items():
            if key.startswith(src):
                out[dst + key[len(src):]] = value
                used.add(key)
    left = sorted(k for k in state if k.startswith(vm) and k not in used and not k.startswith(("text_model.", "text_projection.", "logit_scale")))
    if left:  # a tensor this conversion does not know would otherwise vanish without a word
        raise MergeflowError(f"tensor '{_printable(left[0])}' has no place in timm's CLIP image tower ({len(left)} such)")
    if projection in state:
        out["head.weight"] = state[projection]
        out["head.bias"] = torch.zeros(state[projection].shape[0], dtype=state[projection].dtype)
    return out


# the parts of a whole CLIP's names that only its text tower has (open_clip's, Hugging Face's)
_TEXT_TOWER = {"transformer", "token_embedding", "positional_embedding", "ln_final", "text_projection", "logit_scale", "attn_mask", "text_model"}


def _keep_image_tower(name: str) -> bool:
    """Whether tensor ``name`` may belong to the image tower (read_tensors then skips the text tower's storages)."""
    parts = name.split(".")
    return "visual" in parts or "vision_model" in parts or not _TEXT_TOWER & set(parts)


def to_timm_clip(state: StateDict, *, source: str) -> StateDict:
    """``state`` (open_clip, Hugging Face or timm naming, under any prefix) as timm's CLIP image tower; text tower
    tensors dropped. Raises one line when the naming is none of these (``weights_header.clip_naming``, which
    ``mergeflow check`` reads from a file's header)."""
    kind, prefix = clip_naming(state) or (None, None)
    if kind == "open_clip":
        return _from_open_clip(state, prefix)
    if kind == "hugging_face":
        try:
            return _from_hugging_face(state, prefix, prefix.removesuffix("vision_model.") + "visual_projection.weight")
        except KeyError as err:
            raise MergeflowError(f"{source}: Hugging Face CLIP naming, but tensor {err} is missing") from None
        except MergeflowError as err:
            raise MergeflowError(f"{source}: {err}") from None
    if kind == "timm":  # under DistributedDataParallel's 'module.' prefix, or none
        return {k.removeprefix(prefix): v for k, v in state.items()} if prefix else dict(state)
    first = ", ".join(f"'{_printable(k)}'" for k in list(state)[:3])
    raise MergeflowError(
        f"{source}: not a CLIP image tower: found neither open_clip's 'visual.class_embedding', Hugging Face's "
        f"'[vision_model.]embeddings.class_embedding' nor timm's 'cls_token' (first tensors: {first})"
    )


def read_checkpoint(
    path_or_state: str | Path | Mapping[str, torch.Tensor],
    *,
    source: str | None = None,
    reference: Mapping[str, torch.Tensor] | None = None,
    projection_from: Mapping[str, torch.Tensor] | None = None,
) -> StateDict:
    """A fine-tuned (or pretrained) CLIP image tower in timm's naming, ready to be a task's backbone.

    ``path_or_state``: a safetensors file, a PyTorch checkpoint (read by :func:`read_tensors`, never unpickled by
    torch), or tensors already in memory; the naming (open_clip, Hugging Face, timm) is told by the keys.
    ``projection_from``: a timm CLIP state (the pretrained backbone's) whose ``head`` stands in for a missing
    projection (FusionBench's ``CLIPVisionModel`` files: the projection was frozen, its task vector is zero).
    ``reference``: the pipeline's pretrained timm state; the result must match its keys and shapes, and takes
    its floating dtypes. ``source`` names the checkpoint in errors (its path by default).
    """
    if isinstance(path_or_state, Mapping):
        source = source or "checkpoint"
        state = dict(path_or_state)
    else:
        path = Path(path_or_state)
        source = source or str(path)
        if path.suffix == ".safetensors":
            state = load_state_dict(path)
        else:
            state = read_tensors(path, keep=_keep_image_tower)
    state = to_timm_clip(state, source=source)
    if "head.weight" not in state and projection_from is not None:
        if "head.weight" not in projection_from:
            raise MergeflowError(f"{source}: holds no visual projection, and projection_from has no 'head.weight' to take it from")
        state["head.weight"] = projection_from["head.weight"].clone()
        state["head.bias"] = projection_from["head.bias"].clone() if "head.bias" in projection_from else torch.zeros(state["head.weight"].shape[0])
    elif "head.weight" not in state and reference is not None and "head.weight" in reference:
        raise MergeflowError(f"{source}: holds no visual projection (a CLIPVisionModel without visual_projection); pass the pretrained backbone's state as projection_from")
    if reference is not None:
        state = {k: v.to(reference[k].dtype) if k in reference and v.is_floating_point() and reference[k].is_floating_point() else v for k, v in state.items()}
        check_compatible(reference, state, reference_name="the pretrained backbone", other_name=source)
    return state


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face hub repositories


def resolve_source(spec: str, *, download: bool) -> Path:
    """The weights file of ``spec``: ``hf:<owner>/<repo>[@<revision>]`` (the hub's safetensors, from the local
    cache, or fetched when ``download``) or a local path. Only ``*.safetensors`` and ``*.json`` are fetched:
    pickled ``.bin`` weights are never downloaded (a local ``.bin`` goes through :func:`read_tensors`)."""
    if not spec.startswith("hf:"):
        path = Path(spec)
        if not path.is_file():
            raise MergeflowError(f"{spec}: checkpoint not found")
        return path
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    repo_id, _, revision = spec[3:].partition("@")
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise MergeflowError(f"{spec}: a hub checkpoint is hf:<owner>/<repo>[@<revision>]")
    try:
        folder = Path(snapshot_download(repo_id, revision=revision or None, allow_patterns=["*.safetensors", "*.json"], local_files_only=not download))
    except LocalEntryNotFoundError:
        if not download:
            raise MergeflowError(f"{spec}: not in the local Hugging Face cache; run with --download to fetch it (or `hf download {repo_id}`)") from None
        why = "HF_HUB_OFFLINE=1 forbids downloading (run with --download)" if constants.HF_HUB_OFFLINE else "the hub could not be reached"
        raise MergeflowError(f"{spec}: could not download it: {why} (fetch it once with network access: `hf download {repo_id}`)") from None
    except RevisionNotFoundError:
        raise MergeflowError(f"{spec}: the hub repository has no revision '{revision}'") from None
    except RepositoryNotFoundError:
        raise MergeflowError(f"{spec}: no such hub repository (or a private or gated one without access)") from None
    except (HfHubHTTPError, OSError) as err:
        raise MergeflowError(f"{spec}: could not get it from the hub ({type(err).__name__}: {str(err).splitlines()[0] if str(err).strip() else ''})") from None
    files = sorted(folder.glob("*.safetensors"))
    if (folder / "model.safetensors").is_file():
        return folder / "model.safetensors"
    if len(files) == 1:
        return files[0]
    found = ", ".join(f.name for f in files) or "none"
    raise MergeflowError(f"{spec}: expected one safetensors weights file (model.safetensors), found {found} (sharded or pickled .bin weights are not read from the hub)")
