"""The single source of configuration: ``params.yaml``, validated when loaded.

Every field has a comment saying what it is. An unknown key, a wrong type or an out-of-range value raises
``MergeflowError`` with one line naming the key and what is allowed, before any stage writes anything.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mergeflow.errors import MergeflowError

DEFAULT_PARAMS = "params.yaml"

# A name that can reach a file path, a DVC stage name or a command line (a task, a backbone, a suite) is a plain
# word: letters, digits, '_', '.' and '-', starting with a letter or digit. Nothing a shell or a path treats specially.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$"
_NAME = re.compile(NAME_PATTERN)


def check_name(value: str, where: str) -> str:
    """``value`` if it is a plain name (NAME_PATTERN), else ValueError naming ``where``."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ValueError(f"{where}: {value!r} is not a plain name (letters, digits, '_', '.', '-'; first a letter or digit)")
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SuiteConfig(_Strict):
    name: str = Field("embedded", pattern=NAME_PATTERN)  # names the MLflow experiment: mergeflow/<name>
    source: Literal["embedded", "imagefolder", "torchvision"] = "embedded"
    root: str | None = None  # imagefolder: <root>/<task>/{train,val,test}/<class>/*; torchvision: dataset root (no download)
    tasks: list[str] = Field(min_length=1)  # downstream tasks, in report order
    image_size: int = Field(32, ge=8, le=1024)  # images are stored square, uint8, at this size
    n_train: int = Field(3000, ge=8)  # per task; embedded suite generates exactly this many, real data is capped by it
    n_val: int = Field(300, ge=4)
    n_test: int = Field(800, ge=4)
    pretrain_images: int = Field(50000, ge=0)  # size of the formula-driven pretraining corpus (embedded source)

    @field_validator("tasks")
    @classmethod
    def _unique(cls, tasks: list[str]) -> list[str]:
        for i, task in enumerate(tasks):
            check_name(task, f"task {i}")
        dup = sorted({t for t in tasks if tasks.count(t) > 1})
        if dup:
            raise ValueError(f"task '{dup[0]}' is listed twice")
        return tasks

    @model_validator(mode="after")
    def _root_needed(self) -> SuiteConfig:
        if self.source != "embedded" and not self.root:
            raise ValueError(f"source '{self.source}' needs 'root' (a directory)")
        return self


class BackboneConfig(_Strict):
    model: str = Field("vit_tiny_patch16_224", pattern=NAME_PATTERN)  # any timm model name
    kwargs: dict[str, Any] = Field(default_factory=dict)  # passed to timm.create_model (img_size, patch_size, embed_dim, ...)
    global_pool: str = "avg"
    input_norm: Literal["center", "per_image", "pretrained_cfg", "none"] = "center"  # per-image normalisation, or the weights' own mean/std
    pretrained: str | None = None  # None: pretrain on the corpus; "hub": timm's weights; a path: a local weights file


class ScheduleConfig(_Strict):
    steps: int = Field(1000, ge=0)  # optimiser steps (overridden by epochs when that is set)
    epochs: int | None = Field(None, ge=1)  # whole passes over the training split; 1 epoch of full-batch GD is one step
    batch_size: int = Field(128, ge=1)
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.05, ge=0)
    warmup_steps: int = Field(0, ge=0)  # linear warm-up, then cosine decay to zero


class PretrainConfig(ScheduleConfig):
    pass


class ProbeConfig(_Strict):
    c_grid: list[float] = Field(default_factory=lambda: [0.01, 0.1, 1.0, 10.0], min_length=1)  # inverse L2 strengths, chosen on val
    max_iter: int = Field(500, ge=10)


class PreserveFeaturesConfig(_Strict):
    """Keep the backbone's features on out-of-task images (the pretraining corpus) near theta0's while fine-tuning."""

    weight: float = Field(0.0, ge=0)  # beta of the relative squared feature change; 0 turns it off
    images: int = Field(2048, ge=1)  # corpus images drawn once (seeded); theta0's features on them are computed once
    batch_size: int = Field(32, ge=1)  # of them per step, beside the task's own batch


class FinetuneConfig(ScheduleConfig):
    optimizer: Literal["adamw", "sgd", "gd"] = "adamw"  # gd = full-batch gradient descent (batch = whole split)
    momentum: float = Field(0.0, ge=0, lt=1)  # sgd only
    checkpoint_every_epoch: bool = False  # also keep models/finetuned/<task>.epoch<k>.safetensors
    preserve_features: PreserveFeaturesConfig = PreserveFeaturesConfig()


class MergeConfig(BaseModel):
    """``methods`` lists the methods to run; every other key is a method name whose hyperparameters override its defaults.

    A scalar fixes a hyperparameter; a list is a grid searched on the validation split.
    """

    model_config = ConfigDict(extra="allow", frozen=True)
    methods: list[str] = Field(min_length=1)

    @model_validator(mode="after")
    def _known_methods(self) -> MergeConfig:
        from mergeflow.merging import REGISTRY, validate_overrides

        for name in list(self.methods) + list(self.model_extra or {}):
            if name not in REGISTRY:
                raise ValueError(f"unknown merge method {name!r} (registered: {', '.join(sorted(REGISTRY))})")
        for name, overrides in (self.model_extra or {}).items():
            validate_overrides(REGISTRY[name], overrides, where=f"merge.{name}")
        return self

    def overrides(self, method: str) -> dict[str, Any]:
        return dict((self.model_extra or {}).get(method) or {})


class RuntimeConfig(_Strict):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int | None = Field(None, ge=1)  # torch CPU threads; MERGEFLOW_THREADS overrides (the Prefect flow sets it)
    eval_batch_size: int = Field(512, ge=1)


class TrackingConfig(_Strict):
    log_checkpoints: bool = True  # copy checkpoints and merged models into MLflow artifacts


class Params(_Strict):
    seed: int = Field(0, ge=0)
    suite: SuiteConfig
    backbone: BackboneConfig = BackboneConfig()
    pretrain: PretrainConfig = PretrainConfig()
    probe: ProbeConfig = ProbeConfig()
    finetune: FinetuneConfig = FinetuneConfig(steps=250, batch_size=64, lr=3e-4, weight_decay=0.1, warmup_steps=25)
    merge: MergeConfig = MergeConfig(methods=["weight_averaging", "task_arithmetic", "ties"])
    runtime: RuntimeConfig = RuntimeConfig()
    tracking: TrackingConfig = TrackingConfig()

    def threads(self) -> int | None:
        env = os.environ.get("MERGEFLOW_THREADS")
        return int(env) if env else self.runtime.threads

    def check_task(self, task: str) -> None:
        if task not in self.suite.tasks:
            raise MergeflowError(f"params.yaml: suite.tasks has no task '{task}' (tasks: {', '.join(self.suite.tasks)})")

    def check_method(self, method: str) -> None:
        if method not in self.merge.methods:
            raise MergeflowError(f"params.yaml: merge.methods has no method '{method}' (methods: {', '.join(self.merge.methods)})")


def _model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None) if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def _one_line(err: ValidationError, source: str) -> str:
    first = err.errors()[0]
    loc = tuple(first["loc"])
    key = ".".join(str(p) for p in loc) or "(top level)"
    if first["type"] == "extra_forbidden":
        parent = _model_at(Params, loc)
        allowed = ", ".join(parent.model_fields) if parent else "see params.yaml"
        return f"{source}: unknown key '{key}' (allowed here: {allowed})"
    msg = first["msg"].removeprefix("Value error, ")
    got = first.get("input")
    shown = "" if isinstance(got, (dict, list)) or got is None else f" (got {got!r})"
    return f"{source}: {key}: {msg}{shown}"


def parse_params(raw: Any, source: str = DEFAULT_PARAMS) -> Params:
    if not isinstance(raw, dict):
        raise MergeflowError(f"{source}: expected a mapping of sections at the top level")
    try:
        return Params.model_validate(raw)
    except ValidationError as err:
        raise MergeflowError(_one_line(err, source)) from None


def load_params(path: str | os.PathLike = DEFAULT_PARAMS) -> Params:
    path = Path(path)
    if not path.is_file():
        raise MergeflowError(f"{path}: params file not found")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise MergeflowError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None
    return parse_params(raw, str(path))


def round_trip_yaml():
    """A YAML reader and writer that keeps comments, set up as DVC's own (``dvc exp run -S``) is: a list it writes
    is one item a line, None is an empty value, lines wrap at 80. params.yaml is kept in that form, so that either
    writer changes only the values it sets."""
    from ruamel.yaml import YAML

    rt = YAML()
    rt.default_flow_style = False
    rt.preserve_quotes = True
    return rt


def apply_overrides(path: str | os.PathLike, overrides: list[str], *, write: bool = True) -> Params:
    """Set ``key.path=value`` overrides in the params file, as ``dvc exp run -S`` does (the value read as YAML),
    keeping its comments and layout. The result is validated in full before the file is replaced (atomically):
    a bad override leaves the file untouched. Returns the new params (``write=False``: only checks them)."""
    import io

    path = Path(path)
    load_params(path)  # the file as it is must be valid too
    rt = round_trip_yaml()
    doc = rt.load(path.read_text())
    for override in overrides:
        key, sep, text = override.partition("=")
        parts = key.strip().split(".")
        try:
            for part in parts:
                check_name(part, f"override {override!r}: key")
            if not sep:
                raise ValueError(f"override {override!r}: expected KEY=VALUE, e.g. merge.ties.k=0.1")
            value = yaml.safe_load(text)
        except (ValueError, yaml.YAMLError) as err:
            raise MergeflowError(str(err).splitlines()[0]) from None
        node = doc
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    buffer = io.StringIO()
    rt.dump(doc, buffer)
    params = parse_params(yaml.safe_load(buffer.getvalue()), f"{path} with {' '.join(overrides)}")
    if not write:
        return params
    from mergeflow.io import atomic_path

    with atomic_path(path) as tmp:
        tmp.write_text(buffer.getvalue())
    return params
