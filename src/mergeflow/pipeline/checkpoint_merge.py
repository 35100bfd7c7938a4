"""Merging checkpoint files outside the pipeline (`mergeflow merge-checkpoints`): a base and N fine-tuned checkpoints
merged with a registered method at fixed options, no data and no DVC.

The same can be written as a YAML file (``read_config``). A checkpoint is a safetensors file, or a folder holding
``model.safetensors`` or Hugging Face's shards (``model.safetensors.index.json`` and the files its ``weight_map``
names), read lazily. The task vectors are theta_t - theta0 in float32 (float64 where a tensor is), as the
pipeline's; the merged tensors are written in the base's dtypes, as one safetensors file with the method, its
options and the inputs in its metadata. Methods that read data (statistics, inputs), give one model per task or
route inputs refuse in one line: they need the pipeline.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from mergeflow.core.errors import MergeflowError, did_you_mean
from mergeflow.core.io import LazyStateDict, check_compatible, save_state_dict, tensor_specs
from mergeflow.ml.merging import DATA, REGISTRY, MergeMethod, validate_overrides
from mergeflow.ml.task_vectors import compute_dtype

SHARD_INDEX = "model.safetensors.index.json"


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
        self._shards = {name: LazyStateDict(index.parent / name) for name in sorted(set(weight_map.values()))}
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


class InComputeDtype(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors in their compute dtype (task_vectors.compute_dtype), each read when asked."""

    def __init__(self, state: Mapping[str, torch.Tensor]):
        self._state = state
        self._specs = {k: (shape, compute_dtype(dtype)) for k, (shape, dtype) in tensor_specs(state).items()}

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._state[key].to(self._specs[key][1])

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return dict(self._specs)


class TaskVector(InComputeDtype):
    """tau = theta_t - theta0 in the compute dtype, each tensor formed when asked (read from both files)."""

    def __init__(self, theta0: InComputeDtype, finetuned: Mapping[str, torch.Tensor]):
        super().__init__(finetuned)
        self._theta0 = theta0

    def __getitem__(self, key: str) -> torch.Tensor:
        return super().__getitem__(key) - self._theta0[key]


def read_checkpoint(path: str | Path) -> Mapping[str, torch.Tensor]:
    """A checkpoint, lazily: a safetensors file, or a folder with model.safetensors or a shard index."""
    path = Path(path)
    if path.is_dir():
        if (path / SHARD_INDEX).is_file():
            return ShardedStateDict(path / SHARD_INDEX)
        if (path / "model.safetensors").is_file():
            return LazyStateDict(path / "model.safetensors")
        raise MergeflowError(f"{path}: a folder without model.safetensors or {SHARD_INDEX}")
    return LazyStateDict(path)


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


CONFIG_KEYS = {"method": str, "base": str, "models": list, "options": dict, "output": str}


def read_config(path: str | Path) -> dict[str, Any]:
    """A merge written as YAML (mergekit's way): method, base, models (a list), options (a mapping, optional) and
    output; relative paths are the file's folder's. Each missing, unknown or mistyped key refused in one line."""
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
    config.setdefault("options", {})
    for key, kind in CONFIG_KEYS.items():
        if key not in config:
            raise MergeflowError(f"{path}: {key}: missing")
        if not isinstance(config[key], kind) or (kind is list and not all(isinstance(m, str) for m in config[key])):
            raise MergeflowError(f"{path}: {key}: expected {'a list of paths' if kind is list else kind.__name__}")
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
    method: str, base: str | Path, finetuned: list[str | Path], options: Mapping[str, Any], out: str | Path
) -> dict:
    """Merge ``finetuned`` onto ``base`` with ``method`` at ``options`` (the rest at its defaults) and write ``out``
    atomically; returns what was merged (the metadata written)."""
    paths = [Path(p) for p in finetuned]
    if not paths:
        raise MergeflowError("merge-checkpoints: no fine-tuned checkpoint given")
    spec = checked_method(method, len(paths), options)
    theta0_lazy = read_checkpoint(base)
    models = {}
    for name, path in zip(_task_names(paths), paths):
        model = read_checkpoint(path)
        check_compatible(theta0_lazy, model, reference_name=str(base), other_name=str(path), dtypes=False)
        models[name] = model
    dtypes = {k: dtype for k, (_, dtype) in tensor_specs(theta0_lazy).items()}
    # read tensor by tensor as the method asks: an element-wise merge holds a few tensors at a time, not the models
    theta0 = InComputeDtype(theta0_lazy)
    taus = {name: TaskVector(theta0, model) for name, model in models.items()}
    try:
        merged = spec(theta0, taus, **options)
    except ValueError as err:  # what the method itself refuses in these inputs
        raise MergeflowError(f"--method {method}: {str(err).splitlines()[0]}") from None
    written = {k: _as_base(merged[k], dtypes[k]) for k in dtypes}
    record = {
        "method": method,
        "options": {**spec.defaults, **options},
        "base": str(base),
        "finetuned": dict(zip(models, map(str, paths))),
    }
    save_state_dict(out, written, record)  # the record as JSON in the file's metadata
    return record


def _as_base(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A merged tensor in the base's dtype (integers rounded: a buffer such as position ids stays exact)."""
    if dtype.is_floating_point:
        return tensor.to(dtype)
    return tensor.round().to(dtype) if tensor.is_floating_point() else tensor.to(dtype)
