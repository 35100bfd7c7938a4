"""Merging checkpoint files outside the pipeline (`mergeflow merge-checkpoints`): a base and N fine-tuned checkpoints
merged with a registered method at fixed options, no data and no DVC.

The same can be written as a YAML file (``read_config``). A checkpoint is a safetensors file, or a folder holding
``model.safetensors`` or Hugging Face's shards (``model.safetensors.index.json`` and the files its ``weight_map``
names), read lazily. The task vectors are theta_t - theta0 in float32 (float64 where a tensor is), as the
pipeline's; the merged tensors are written in the base's dtypes: as one safetensors file with the method, its
options and the inputs in its metadata, or (an output not named ``*.safetensors``) as a Hugging Face model folder
(checkpoint_output), written shard by shard as a tensor-local method produces them. Methods that read data
(statistics, inputs), give one model per task or route inputs refuse in one line: they need the pipeline.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from mergeflow.core.errors import MergeflowError, did_you_mean
from mergeflow.core.io import LazyStateDict, check_compatible, check_finite, save_state_dict, tensor_specs
from mergeflow.ml.merging import DATA, REGISTRY, MergeMethod, validate_overrides
from mergeflow.ml.task_vectors import compute_dtype
from mergeflow.pipeline.checkpoint_output import (
    DEFAULT_SHARD_SIZE,
    SHARD_INDEX,
    is_folder_output,
    parse_size,
    write_folder,
)


class ShardedStateDict(Mapping[str, torch.Tensor]):
    """Hugging Face's sharded safetensors (an index whose weight_map names each tensor's file), read lazily."""

    def __init__(self, index: Path):
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError("an empty weight_map")
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise MergeflowError(f"{index}: not a shard index ({str(err).splitlines()[0]})") from None
        self.path = index
        shards = sorted(set(weight_map.values()))
        self._shards = {name: LazyStateDict(index.parent / name, check=False) for name in shards}
        self._where = {key: self._shards[name] for key, name in weight_map.items()}
        for key, shard in self._where.items():
            if key not in shard.specs():
                raise MergeflowError(f"{index}: tensor '{key}' is not in {shard.path.name}, where weight_map puts it")

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._where[key][key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {key: shard.specs()[key] for key, shard in self._where.items()}

    def file_of(self, key: str) -> Path:
        return self._where[key].path

    def read_into(self, key: str, out: torch.Tensor) -> None:
        self._where[key].read_into(key, out)


def _file_of(state: Mapping[str, torch.Tensor], key: str) -> str:
    return str(state.file_of(key) if hasattr(state, "file_of") else state.path)


class _Specced(Mapping[str, torch.Tensor]):
    """A lazy mapping over the tensors its ``_specs`` name ({key: (shape, dtype)})."""

    _specs: dict[str, tuple[tuple[int, ...], torch.dtype]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return dict(self._specs)


class InComputeDtype(_Specced):
    """A checkpoint's tensors in their compute dtype (task_vectors.compute_dtype), each read when asked and checked
    for NaN/Inf there: a float32 sum is several times faster than the bfloat16 file's (13 of a merge's 67 s)."""

    def __init__(self, state: Mapping[str, torch.Tensor]):
        self._state = state
        self._specs = {k: (shape, compute_dtype(dtype)) for k, (shape, dtype) in tensor_specs(state).items()}

    def __getitem__(self, key: str) -> torch.Tensor:
        tensor = self._state[key].to(self._specs[key][1])
        check_finite({key: tensor}, _file_of(self._state, key))
        return tensor

    def read_into(self, key: str, out: torch.Tensor) -> None:
        """tensor ``key`` flattened into ``out`` (a row of the merge's buffer): read straight into it, or converted in
        the copy."""
        if hasattr(self._state, "read_into"):
            self._state.read_into(key, out)
        else:
            out.copy_(self._state[key].reshape(-1))
        check_finite({key: out}, _file_of(self._state, key))


class KeySubset(_Specced):
    """Some of a lazy state's tensors (its specs for those keys): a tensor-local method merged a chunk at a time."""

    def __init__(self, state: InComputeDtype, keys: list[str]):
        self._state = state
        every = state.specs()
        self._specs = {k: every[k] for k in keys}

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._specs:
            raise KeyError(key)
        return self._state[key]

    def read_into(self, key: str, out: torch.Tensor) -> None:
        self._state.read_into(key, out)


class LastTensor:
    """theta0's tensors for the task vectors, the last one kept: the T task vectors of a key read theta0 once, not
    T times (the merge reads its own copy, which it may change)."""

    def __init__(self, theta0: InComputeDtype):
        self._theta0 = theta0
        self._key: str | None = None
        self._tensor: torch.Tensor | None = None

    def __getitem__(self, key: str) -> torch.Tensor:
        if key != self._key:
            self._key, self._tensor = None, None  # the previous one freed before the next is read
            self._tensor, self._key = self._theta0[key], key
        return self._tensor


class TaskVector(InComputeDtype):
    """tau = theta_t - theta0 in the compute dtype, each tensor formed when asked (read from both files)."""

    def __init__(self, theta0: LastTensor, finetuned: Mapping[str, torch.Tensor]):
        super().__init__(finetuned)
        self._theta0 = theta0

    def __getitem__(self, key: str) -> torch.Tensor:
        return super().__getitem__(key) - self._theta0[key]

    def read_into(self, key: str, out: torch.Tensor) -> None:
        super().read_into(key, out)
        out.sub_(self._theta0[key].reshape(-1))


def read_checkpoint(path: str | Path) -> Mapping[str, torch.Tensor]:
    """A checkpoint, lazily and unchecked: a safetensors file, or a folder with model.safetensors or a shard index."""
    path = Path(path)
    if path.is_dir():
        if (path / SHARD_INDEX).is_file():
            return ShardedStateDict(path / SHARD_INDEX)
        if (path / "model.safetensors").is_file():
            return LazyStateDict(path / "model.safetensors", check=False)
        raise MergeflowError(f"{path}: a folder without model.safetensors or {SHARD_INDEX}")
    return LazyStateDict(path, check=False)  # checked as read, in the compute dtype (InComputeDtype)


def parse_options(pairs: list[str]) -> dict[str, Any]:
    """``key=value`` pairs, each value read as YAML (0.3, true, global); a key given twice is refused."""
    import yaml

    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise MergeflowError(f"--set {pair}: expected key=value")
        if key in options:
            raise MergeflowError(f"--set {key}: given twice")
        try:
            options[key] = yaml.safe_load(text)
        except yaml.YAMLError:
            options[key] = text
    return options


def checked_method(name: str, n_models: int, options: Mapping[str, Any]) -> MergeMethod:
    """The registered method, refused in one line where files alone cannot feed it; ``options`` checked."""
    if name not in REGISTRY:
        raise MergeflowError(
            f"--method {name}: not a registered method; {did_you_mean(name, sorted(REGISTRY))}"
            "`mergeflow methods --list` lists them"
        )
    spec = REGISTRY[name]
    if spec.reads is not None:
        raise MergeflowError(
            f"--method {name}: reads {DATA[spec.reads]}, which checkpoint files do not hold; run it "
            "in the pipeline (merge.methods)"
        )
    if spec.kind in ("per_task", "routed"):
        what = "one model per task" if spec.kind == "per_task" else "a network that routes each input"
        raise MergeflowError(f"--method {name}: gives {what}, not one merged checkpoint; run it in the pipeline")
    if spec.kind == "negation" and n_models != 1:
        raise MergeflowError(f"--method {name}: negates one fine-tune's task vector, given {n_models} fine-tunes")
    if spec.tasks is not None and n_models != spec.tasks:
        raise MergeflowError(f"--method {name}: merges exactly {spec.tasks} fine-tuned models, given {n_models}")
    grids = sorted(k for k, v in options.items() if isinstance(v, list))
    if grids:
        raise MergeflowError(f"--set {grids[0]}: a list is a grid, searched on validation data; give one value")
    try:
        validate_overrides(spec, dict(options), where="--set")
    except ValueError as err:
        raise MergeflowError(str(err).replace("--set.", "--set ", 1)) from None
    return spec


CONFIG_KEYS = {"method": str, "base": str, "models": list, "options": dict, "output": str, "max_shard_size": (str, int)}
OPTIONAL_KEYS = {"options": {}, "max_shard_size": None}


def read_config(path: str | Path) -> dict[str, Any]:
    """A merge written as YAML (mergekit's way): method, base, models (a list), options (a mapping, optional),
    output and max_shard_size (optional); relative paths are the file's folder's. Each missing, unknown or mistyped
    key refused in one line."""
    from mergeflow.core.yaml_files import read_yaml

    path = Path(path)
    config = read_yaml(path)
    if not isinstance(config, dict):
        raise MergeflowError(f"{path}: expected a mapping of {', '.join(CONFIG_KEYS)}")
    for key in config:
        if key not in CONFIG_KEYS:
            raise MergeflowError(
                f"{path}: {key}: unknown key; {did_you_mean(key, list(CONFIG_KEYS))}expected {', '.join(CONFIG_KEYS)}"
            )
    config = OPTIONAL_KEYS | config
    for key, kind in CONFIG_KEYS.items():
        if key not in config:
            raise MergeflowError(f"{path}: {key}: missing")
        if key in OPTIONAL_KEYS and config[key] is None:
            continue
        if not isinstance(config[key], kind) or (kind is list and not all(isinstance(m, str) for m in config[key])):
            what = {list: "a list of paths", (str, int): "a size such as 5GB"}.get(kind) or kind.__name__
            raise MergeflowError(f"{path}: {key}: expected {what}")
    here = path.parent
    return config | {
        "base": here / config["base"],
        "models": [here / m for m in config["models"]],
        "output": here / config["output"],
    }


def _task_names(paths: list[Path]) -> list[str]:
    """A fine-tune's name: its file's stem or folder's name, else its position (names that repeat)."""
    names = [p.stem if p.suffix == ".safetensors" else p.name for p in paths]
    return names if len(set(names)) == len(names) else [f"model{i + 1}" for i in range(len(paths))]


def merge_checkpoints(
    method: str,
    base: str | Path,
    finetuned: list[str | Path],
    options: Mapping[str, Any],
    out: str | Path,
    *,
    max_shard_size: int | str | None = None,
) -> dict:
    """Merge ``finetuned`` onto ``base`` with ``method`` at ``options`` (the rest at its defaults) and write ``out``
    atomically: a ``.safetensors`` file, or else a Hugging Face model folder (checkpoint_output) whose weights are
    sharded past ``max_shard_size`` (default 5GB). Returns what was merged (the metadata written)."""
    paths, out = [Path(p) for p in finetuned], Path(out)
    if not paths:
        raise MergeflowError("merge-checkpoints: no fine-tuned checkpoint given")
    folder = is_folder_output(out)
    if max_shard_size is not None and not folder:
        raise MergeflowError(f"--max-shard-size: {out} is one .safetensors file; shards are written to a folder")
    shard_bytes = parse_size(DEFAULT_SHARD_SIZE if max_shard_size is None else max_shard_size)
    if any(out.resolve() == Path(p).resolve() for p in [base, *paths]):
        raise MergeflowError(f"{out}: is one of the inputs; write the merge elsewhere")
    spec = checked_method(method, len(paths), options)
    theta0_lazy = read_checkpoint(base)
    models = {}
    for name, path in zip(_task_names(paths), paths):
        model = read_checkpoint(path)
        check_compatible(theta0_lazy, model, reference_name=str(base), other_name=str(path), dtypes=False)
        models[name] = model
    specs = tensor_specs(theta0_lazy)
    # read tensor by tensor as the method asks: an element-wise merge holds a few tensors at a time, not the models
    theta0 = InComputeDtype(theta0_lazy)
    last_theta0 = LastTensor(theta0)
    taus = {name: TaskVector(last_theta0, model) for name, model in models.items()}
    produce = _producer(spec, theta0, taus, options, {k: dtype for k, (_, dtype) in specs.items()})
    record = {
        "method": method,
        "options": {**spec.defaults, **options},
        "base": str(base),
        "finetuned": dict(zip(models, map(str, paths))),
    }
    if folder:
        write_folder(out, Path(base), specs, produce, record, shard_bytes)
    else:
        save_state_dict(out, produce(list(specs)), record)  # the record as JSON in the file's metadata
    return record


# methods whose every merged tensor depends on that tensor alone (DARE: its drop mask is seeded by the tensor's
# name): merged a chunk of tensors at a time, as the output is written (tests/test_checkpoint_output.py holds
# each to the whole merge's bytes); any other method merges the whole model first
TENSOR_LOCAL = {"weight_averaging", "task_arithmetic", "dare_linear", "dare_ties", "slerp", "magmax", "breadcrumbs"}
CHUNK_BYTES = 256 * 2**20  # a chunk's merged tensors in the compute dtype, before the cast to the base's dtypes


def tensor_local(spec: MergeMethod, options: Mapping[str, Any]) -> bool:
    """Whether ``spec`` at ``options`` merges each tensor from that tensor alone (TIES: when it trims per tensor)."""
    if spec.name == "ties":
        return {**spec.defaults, **options}["trim_scope"] == "tensor"
    return spec.name in TENSOR_LOCAL


def _producer(
    spec: MergeMethod,
    theta0: InComputeDtype,
    taus: Mapping[str, TaskVector],
    options: Mapping[str, Any],
    dtypes: Mapping[str, torch.dtype],
):
    """keys -> their merged tensors in the base's dtypes: merged chunk by chunk where the method is tensor-local
    (peak: the asked keys in the base's dtypes plus one chunk in the compute dtype), else out of one whole merge."""

    def merge(keys: list[str] | None) -> Mapping[str, torch.Tensor]:
        subset = (lambda state: state) if keys is None else (lambda state: KeySubset(state, keys))
        try:
            return spec(subset(theta0), {name: subset(tau) for name, tau in taus.items()}, **options)
        except ValueError as err:  # what the method itself refuses in these inputs
            raise MergeflowError(f"--method {spec.name}: {str(err).splitlines()[0]}") from None

    if not tensor_local(spec, options):
        merged = merge(None)
        return lambda keys: {k: _as_base(merged[k], dtypes[k]) for k in keys}

    specs = theta0.specs()

    def produce(keys: list[str]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for chunk in _chunks(keys, {k: math.prod(specs[k][0]) * specs[k][1].itemsize for k in keys}):
            merged = merge(chunk)
            out.update({k: _as_base(merged[k], dtypes[k]) for k in chunk})
            del merged
        return out

    return produce


def _chunks(keys: list[str], sizes: Mapping[str, int]) -> Iterator[list[str]]:
    """``keys`` in order, cut into runs of at most CHUNK_BYTES (a larger tensor alone)."""
    chunk: list[str] = []
    total = 0
    for key in keys:
        if chunk and total + sizes[key] > CHUNK_BYTES:
            yield chunk
            chunk, total = [], 0
        chunk.append(key)
        total += sizes[key]
    if chunk:
        yield chunk


def _as_base(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A merged tensor in the base's dtype (integers rounded: a buffer such as position ids stays exact)."""
    if dtype.is_floating_point:
        return tensor.to(dtype)
    return tensor.round().to(dtype) if tensor.is_floating_point() else tensor.to(dtype)
