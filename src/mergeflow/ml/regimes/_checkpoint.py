"""A regime's per-round ``Checkpoint`` as one safetensors file: ``save_checkpoint`` / ``load_checkpoint``.

Tensors (the task states, the next start, the records' states, the optimiser carries' tensors) are stored under
flattened keys (their path in the checkpoint, joined by '/'); everything else (round numbers, the optimiser's ints,
floats and bools, the records' norms and cosines, the caller's ``identity``) is JSON in the file's metadata, where
each tensor's place holds its key. No pickle anywhere. A tensor object met twice (a round's combination is the next
round's start) is stored once. Written through io.save_state_dict (a temporary sibling, then a rename), so a run
killed mid-write leaves the previous checkpoint in place.

JSON encoding of the non-tensor tree: None, bools, ints, floats (NaN and infinities included) and strings as
themselves, lists as lists; anything else is a one-key object: {"tensor": key}, {"tuple": [...]},
{"dict": [[key, value], ...]} (keys of any encodable type: an optimiser's state is keyed by int).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mergeflow.core.errors import MergeflowError
from mergeflow.core.io import load_metadata, load_state_dict, save_state_dict
from mergeflow.ml.regimes._types import Checkpoint, RoundRecord

if TYPE_CHECKING:
    from mergeflow.config import Params
    from mergeflow.core.layout import Layout

FORMAT = "mergeflow.ml.regimes.checkpoint"
VERSION = 1


class _Encoder:
    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self._seen: dict[int, tuple[str, torch.Tensor]] = {}  # id -> (key, the tensor, kept alive)

    def encode(self, value: Any, path: str) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, torch.Tensor):
            seen = self._seen.get(id(value))
            if seen is not None and seen[1] is value:
                return {"tensor": seen[0]}
            key, n = path, 1
            while key in self.tensors:
                n += 1
                key = f"{path}#{n}"
            self.tensors[key] = value.detach()
            self._seen[id(value)] = (key, value)
            return {"tensor": key}
        if isinstance(value, list):
            return [self.encode(v, f"{path}/{i}") for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return {"tuple": [self.encode(v, f"{path}/{i}") for i, v in enumerate(value)]}
        if isinstance(value, dict):
            return {
                "dict": [
                    [self.encode(k, f"{path}/key{i}"), self.encode(v, f"{path}/{_name(k, i)}")]
                    for i, (k, v) in enumerate(value.items())
                ]
            }
        raise TypeError(f"cannot store a {type(value).__name__} in a checkpoint (at {path})")


def _name(key: Any, i: int) -> str:
    return (
        key
        if isinstance(key, str)
        else str(key)
        if isinstance(key, (int, float, bool)) or key is None
        else "|".join(map(str, key))
        if isinstance(key, tuple)
        else str(i)
    )


def _decode(value: Any, tensors: dict[str, torch.Tensor], path: Path) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_decode(v, tensors, path) for v in value]
    if isinstance(value, dict) and len(value) == 1:
        ((tag, body),) = value.items()
        if tag == "tensor":
            if body not in tensors:
                raise MergeflowError(f"{path}: not a valid regime checkpoint (tensor '{body}' is missing)")
            return tensors[body]
        if tag == "tuple":
            return tuple(_decode(v, tensors, path) for v in body)
        if tag == "dict":
            return {_decode(k, tensors, path): _decode(v, tensors, path) for k, v in body}
    raise MergeflowError(f"{path}: not a valid regime checkpoint (unexpected entry {json.dumps(value)[:80]})")


def _normalised(identity: dict) -> dict:
    try:
        return json.loads(json.dumps(identity, sort_keys=True))
    except (TypeError, ValueError) as err:
        raise TypeError(f"a checkpoint's identity must be JSON-serialisable: {err}") from None


def save_checkpoint(path: str | os.PathLike, checkpoint: Checkpoint, *, identity: dict) -> None:
    """Write ``checkpoint`` to ``path`` (one .safetensors file) atomically, with ``identity`` (what the run is: the
    regime, its hyperparameters, the tasks, a hash of theta0; JSON-serialisable) for ``load_checkpoint`` to check."""
    encoder = _Encoder()
    body = {
        "round": checkpoint.round,
        "task_states": encoder.encode(checkpoint.task_states, "task_states"),
        "next_start": encoder.encode(checkpoint.next_start, "next_start"),
        "carries": encoder.encode(checkpoint.carries, "carries"),
        "records": [
            {
                f.name: encoder.encode(getattr(r, f.name), f"records/{r.round}/{f.name}")
                for f in dataclasses.fields(RoundRecord)
            }
            for r in checkpoint.records
        ],
    }
    save_state_dict(
        path,
        encoder.tensors,
        {"format": FORMAT, "version": VERSION, "identity": _normalised(identity), "checkpoint": body},
    )


def load_checkpoint(path: str | os.PathLike, *, identity: dict) -> Checkpoint:
    """Read a checkpoint ``save_checkpoint`` wrote; one-line MergeflowError naming the file if it is missing,
    corrupt or truncated, or if its identity differs from ``identity`` (naming the first differing key)."""
    path = Path(path)
    metadata = load_metadata(path)
    if (
        metadata.get("format") != FORMAT
        or metadata.get("version") != VERSION
        or not isinstance(metadata.get("checkpoint"), dict)
    ):
        raise MergeflowError(
            f"{path}: not a mergeflow regime checkpoint (format {metadata.get('format')!r}, version "
            f"{metadata.get('version')!r})"
        )
    stored, expected = metadata.get("identity"), _normalised(identity)
    if stored != expected:
        stored = stored if isinstance(stored, dict) else {}
        key = next(
            (k for k in sorted(set(stored) | set(expected)) if stored.get(k, ...) != expected.get(k, ...)), "identity"
        )
        have = json.dumps(stored[key]) if key in stored else "absent"
        want = json.dumps(expected[key]) if key in expected else "absent"
        raise MergeflowError(
            f"{path}: checkpoint of a different run: identity key '{key}' is {_short(have)} in the file, "
            f"{_short(want)} in this run"
        )
    tensors = load_state_dict(path)
    body = metadata["checkpoint"]
    try:
        records = []
        for r in body["records"]:
            fields = {name: _decode(v, tensors, path) for name, v in r.items()}
            records.append(RoundRecord(**fields))
        return Checkpoint(
            round=body["round"],
            task_states=_decode(body["task_states"], tensors, path),
            next_start=_decode(body["next_start"], tensors, path),
            carries=_decode(body["carries"], tensors, path),
            records=records,
        )
    except (KeyError, TypeError, ValueError) as err:
        raise MergeflowError(
            f"{path}: not a valid regime checkpoint ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''})"
        ) from None


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------- the resume rule of the regime stage
def regime_identity(params: Params, regime: str, variant: str, kwargs: dict, layout: Layout) -> dict:
    """What a checkpoint must match to be resumed: the settings and inputs every round depends on."""
    inputs = [
        layout.pretrained,
        *(layout.task_data(t) for t in params.suite.tasks),
        *(layout.head(t) for t in params.suite.tasks),
    ]
    if params.finetune.preserve_features.weight:
        inputs.append(layout.pretrain_corpus)
    stamps = {str(p): [p.stat().st_size, p.stat().st_mtime_ns] for p in inputs}
    return {
        "regime": regime,
        "variant": variant,
        "hyperparameters": kwargs,
        "seed": params.seed,
        "tasks": params.suite.tasks,
        "backbone": params.backbone.model_dump(mode="json"),
        "finetune": params.finetune.model_dump(mode="json"),
        "inputs": stamps,
    }


def resume_from(path: Path, identity: dict):
    """The checkpoint at ``path`` when it belongs to this run, else None (a stale one is left for the new run to
    overwrite after its first round)."""
    if not path.is_file():
        return None
    try:
        return load_checkpoint(path, identity=identity)
    except MergeflowError as err:
        print(f"regime: not resuming from {path}: {err}", flush=True)
        return None
