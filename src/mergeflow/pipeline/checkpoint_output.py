"""Where `mergeflow merge-checkpoints` writes: one safetensors file, or a Hugging Face model folder in the input's
format (the base folder's config and tokenizer files, the weights as ``model.safetensors`` or as shards with
``model.safetensors.index.json``, laid out as Hugging Face's ``split_state_dict_into_shards`` and
``save_pretrained`` lay them out).

A folder is written into a temporary sibling, shard by shard as the merge produces them, and renamed into place
at the end: an error part-way leaves no folder behind.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from mergeflow.core.errors import MergeflowError
from mergeflow.core.files import atomic_path
from mergeflow.core.io import check_finite

SHARD_INDEX = "model.safetensors.index.json"
SINGLE_WEIGHTS = "model.safetensors"
RECORD_FILE = "mergeflow.json"  # what was merged (method, options, inputs): a shard's metadata is Hugging Face's
DEFAULT_SHARD_SIZE = "5GB"  # huggingface_hub's MAX_SHARD_SIZE (transformers 5's save_pretrained says 50GB)
SIZE_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}  # decimal, as huggingface_hub parses them
# files of a model folder that are weights (or their index) or say nothing about the merge: not copied
WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx"}
NOT_COPIED = {"README.md", ".gitattributes", RECORD_FILE}


def is_folder_output(out: str | Path) -> bool:
    """The rule: an output not named ``*.safetensors`` is a Hugging Face model folder."""
    return Path(out).suffix != ".safetensors"


def parse_size(text: str | int, where: str = "--max-shard-size") -> int:
    """Bytes from an integer or a number with a unit (``5GB``, ``500MB``: decimal units, as huggingface_hub)."""
    if isinstance(text, int) and not isinstance(text, bool):
        size = text
    else:
        text = str(text).strip()
        unit = text[-2:].upper()
        try:
            size = int(float(text[:-2]) * SIZE_UNITS[unit]) if unit in SIZE_UNITS else int(text)
        except ValueError:
            raise MergeflowError(f"{where} {text}: expected bytes or a size such as 5GB, 500MB") from None
    if size <= 0:
        raise MergeflowError(f"{where} {text}: expected a positive size")
    return size


def shard_plan(sizes: Mapping[str, int], max_shard_size: int) -> dict[str, list[str]]:
    """file name -> its tensors, as huggingface_hub's split_state_dict_into_shards_factory assigns them: in order, a
    new shard when the next tensor would pass the limit, a tensor larger than it alone; one shard is
    model.safetensors, several model-0000i-of-0000N.safetensors."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for key, size in sizes.items():
        if size > max_shard_size:
            shards.append([key])
            continue
        if current_size + size > max_shard_size and current:
            shards.append(current)
            current, current_size = [], 0
        current.append(key)
        current_size += size
    if current:
        shards.append(current)
    if len(shards) <= 1:
        return {SINGLE_WEIGHTS: shards[0] if shards else []}
    n = len(shards)
    return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": keys for i, keys in enumerate(shards)}


def shard_index(plan: Mapping[str, list[str]], specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> str:
    """model.safetensors.index.json's text as transformers' save_pretrained writes it (sorted keys, indent 2)."""
    total_size = sum(math.prod(shape) * dtype.itemsize for shape, dtype in specs.values())
    index = {
        "metadata": {
            "total_parameters": sum(math.prod(shape) for shape, _ in specs.values()),
            "total_size": total_size,
        },
        "weight_map": {key: name for name, keys in plan.items() for key in keys},
    }
    return json.dumps(index, indent=2, sort_keys=True) + "\n"


def model_files(folder: Path) -> list[Path]:
    """A model folder's files that are not weights: config.json, generation_config.json, the tokenizer's."""
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_file()
        and p.suffix not in WEIGHT_SUFFIXES
        and not p.name.endswith(".index.json")
        and not p.name.startswith(".")
        and p.name not in NOT_COPIED
    )


def write_folder(
    out: Path,
    base: Path,
    specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    produce: Callable[[list[str]], dict[str, torch.Tensor]],
    record: Mapping,
    max_shard_size: int,
) -> list[str]:
    """Write the model folder ``out`` atomically: the base folder's model files, then each shard as ``produce(its
    keys)`` gives its tensors (in ``specs``' dtypes; one shard held at a time), the index when sharded, and
    ``record`` as mergeflow.json. Returns the weight files' names."""
    if out.exists() and not out.is_dir():
        raise MergeflowError(f"{out}: exists and is not a folder (a .safetensors name writes one file)")
    sizes = {key: math.prod(shape) * dtype.itemsize for key, (shape, dtype) in specs.items()}
    plan = shard_plan(sizes, max_shard_size)
    with atomic_path(out, directory=True) as tmp:
        for path in model_files(base) if base.is_dir() else []:
            shutil.copy2(path, tmp / path.name)
        for name, keys in plan.items():
            tensors = produce(keys)
            check_finite(tensors, str(out / name))
            # {"format": "pt"}: transformers refuses a safetensors file without it
            save_file({k: tensors[k].contiguous() for k in keys}, str(tmp / name), metadata={"format": "pt"})
            del tensors
        if len(plan) > 1:
            (tmp / SHARD_INDEX).write_text(shard_index(plan, specs))
        (tmp / RECORD_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return list(plan)
