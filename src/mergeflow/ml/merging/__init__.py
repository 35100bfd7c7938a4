"""The registry of merging methods.

A method is one module in this package: a pure function ``(pretrained, task_vectors, **hyperparameters) ->
state dict`` decorated with ``@register``, which records its paper, defaults and validation grid as data.
Modules are discovered by name, so adding a method means adding one file. No method does I/O.
Method modules import torch, numpy and the tensor helpers (``_tensors``, ``_kernels``, ``_adaptive``) inside their
functions, so that the registry loads without them: ``mergeflow check`` validates params.yaml in well under a second.

Kinds of method:
- ``model``: the function returns the one merged model;
- ``per_task``: it returns a shared store (a flat state dict) from which ``reconstruct(store, pretrained, task)``
  rebuilds each task's own model (TALL masks, EMR, CART-Indexing, TSV-C);
  ``features(store, task)``, where given, is a map on that task's features before its head (Representation
  Surgery's correction), applied wherever the task's model is evaluated;
- ``routed``: it returns a store from which ``network(store, backbone)`` builds one network whose weights depend on
  its input (WEMoE's per-sample routing): uint8 images -> features, every task through it with its own head;
- ``negation``: ``fn(pretrained, {task: tau}, lam)`` removes one task (theta0 - lam * tau), judged as forgetting.
A routed method registered with ``merged=False`` is no merge (an ensemble keeps and runs every task's model): the
report shows it as a reference beside the merges and does not rank it among them.
What a method reads besides the weights (``reads``, see ``DATA``): nothing (data-free), per-task statistics of the
labelled training split (Fisher diagonals, layer-input Grams; the stage ``statistics`` computes them once),
unlabelled training examples run through the model as it is merged (RegMean++), or unlabelled test inputs
(test-time adaptation, not comparable with data-free merging). A data-aware method's function
takes ``data`` (a ``MergeData``) as well; the merge stage binds it (``MergeMethod.with_data``), so that the search
calls every method alike.
Every hyperparameter declares its allowed values in ``ranges`` (a ``Range`` of numbers or a ``Choice`` of names),
checked on every value of a grid when params.yaml is loaded (``validate_overrides``) and on every call through the
registry (``REGISTRY[name](...)``, ``task_models``), so a bad value fails before any merge with
``merge.<method>.<key>: expected ..., got ...``; ``joint`` checks a rule that ties several hyperparameters together
(Breadcrumbs' gamma + beta <= 1).
Hyperparameters in ``per_task_grid`` are chosen separately for each task on its own validation split, on the
models that ``task_models(pretrained, task_vectors, **hyperparameters)`` gives: it merges what every choice
shares once, and returns ``(task, {name: value}) -> that task's model``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import pkgutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mergeflow.ml.merging import search

if TYPE_CHECKING:
    from mergeflow.core.io import StateDict

MergeFn = Callable[..., "StateDict"]

# what a method reads besides the weights: reads -> how the summary's "data" column shows it
DATA = {
    None: "none",
    "train_statistics": "train stats",  # per-task Fisher diagonals and layer-input Grams on labelled train examples
    "test_inputs": "test inputs (TTA)",  # unlabelled inputs of each task's test split: test-time adaptation
    "train_inputs": "train inputs",  # unlabelled training examples run through the model while it is merged (RegMean++)
    # labelled training examples: the loss of the model while it is merged (FW-Merging)
    "train_examples": "train examples",
}


@dataclass
class MergeData:
    """The data a data-aware method reads, supplied by the merge stage.

    ``statistics``: {task: {"fisher_sampled" | "fisher_empirical" | "gram": state dict}} (mergeflow.ml.statistics);
    ``objective``: AdaMerging's entropy objective (merging._adaptive.EntropyObjective);
    ``learned``: where a method that learns its coefficients records them, one record per call, in the order the
    search calls it (the stage writes the chosen candidate's with its choice); ``timing``: its wall times, kept
    apart from its outputs (they differ from run to run)."""

    statistics: Mapping[str, Mapping[str, Mapping[str, Any]]] | None = None
    objective: Any = None
    backbone: Any = None  # reads="train_inputs": the backbone's architecture (its weights are replaced)
    train_inputs: Mapping[str, Any] | None = (
        None  # {task: uint8 images}, the first statistics.examples of its train split
    )
    train_labels: Mapping[str, Any] | None = None  # reads="train_examples": {task: labels} of objective.inputs["train"]
    learned: list[dict] = field(default_factory=list)
    timing: list[dict] = field(default_factory=list)


@dataclass(frozen=True)
class Range:
    """The numbers a hyperparameter accepts: ``low``/``high`` None is unbounded, ``*_open`` excludes that end."""

    what: str  # what the number is, for the message: "a fraction", "a drop probability"
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def admits(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def __str__(self) -> str:
        if self.low is not None and self.high is not None:
            return (
                f"{self.what} in {'(' if self.low_open else '['}{self.low:g}, "
                f"{self.high:g}{')' if self.high_open else ']'}"
            )
        if self.low is not None:
            return f"{self.what} {'>' if self.low_open else '>='} {self.low:g}"
        if self.high is not None:
            return f"{self.what} {'<' if self.high_open else '<='} {self.high:g}"
        return self.what


@dataclass(frozen=True)
class Choice:
    """The names a hyperparameter accepts."""

    options: tuple[str, ...]

    def admits(self, value: Any) -> bool:
        return value in self.options

    def __str__(self) -> str:
        return "one of " + ", ".join(map(repr, self.options))


@dataclass(frozen=True)
class PerTask:
    """A mapping task -> value, each value admitted by ``each`` (a per-model weight); {} names no task."""

    each: Range

    def admits(self, value: Any) -> bool:
        return isinstance(value, Mapping) and all(isinstance(k, str) and self.each.admits(v) for k, v in value.items())

    def __str__(self) -> str:
        return f"a mapping task -> {self.each}"


Constraint = Range | Choice | PerTask
ANY_NUMBER = Range("a number")  # a coefficient: any finite real (the search merges at 0 and 1 to interpolate)
FRACTION = Range("a fraction", 0, 1)  # [0, 1]
POSITIVE_FRACTION = Range("a fraction", 0, 1, low_open=True)  # (0, 1]
SEED = Range("a seed", 0)


@dataclass(frozen=True)
class MergeMethod:
    name: str
    fn: MergeFn  # (pretrained: StateDict, task_vectors: Mapping[task, StateDict], **hyperparameters) -> StateDict
    paper: str  # citation
    defaults: Mapping[str, Any]  # every hyperparameter, at the value used without validation data
    grid: Mapping[str, Sequence[Any]] = field(default_factory=dict)  # hyperparameters searched on validation
    # the hyperparameter the merged model is affine in (theta = base + c * direction): a sweep over it merges
    # twice (c = 0 and c = 1) and interpolates instead of merging once per value
    coefficient: str | None = None
    kind: str = "model"  # "model" | "per_task" | "routed" | "negation"
    reconstruct: Callable[..., StateDict] | None = None  # per_task: (store, pretrained, task) -> that task's model
    per_task_grid: Mapping[str, Sequence[Any]] = field(default_factory=dict)  # chosen per task, on that task's val
    # (pretrained, task_vectors, **hp) -> ((task, per-task hp) -> the model a per-task choice is made on)
    task_models: Callable[..., Callable[[str, Mapping[str, Any]], StateDict]] | None = None
    ranges: Mapping[str, Constraint] = field(default_factory=dict)  # every hyperparameter's allowed values
    # a rule across hyperparameters: (all hyperparameters) -> what is wrong with them, or None
    joint: Callable[[Mapping[str, Any]], str | None] | None = None
    reads: str | None = None  # a key of DATA: what the method reads besides the weights
    tasks: int | None = None  # the number of task vectors the method merges, when it takes only that many (SLERP: 2)
    data: MergeData | None = None  # bound by with_data
    # per_task: (store, task) -> a map on that task's features before its head (Surgery), or None
    features: Callable[..., Callable[[Any], Any]] | None = None
    network: Callable[..., Any] | None = None  # routed: (store, backbone) -> the network, images -> features
    merged: bool = True  # False: not a merge (every task's model kept and run): a reference, not ranked

    def feature_maps(self, store: StateDict) -> Callable[[str], Callable[[Any], Any]] | None:
        """(task) -> the map on that task's features before its head, for a method that corrects them; else None."""
        return None if self.features is None else (lambda task: self.features(store, task))

    def with_data(self, data: MergeData) -> MergeMethod:
        """This method with its data bound: called as every other method is, (pretrained, task_vectors, **hp)."""
        return dataclasses.replace(self, data=data)

    def __call__(self, pretrained: StateDict, task_vectors: Mapping[str, StateDict], **hyperparameters) -> StateDict:
        hyperparameters = {**self.defaults, **hyperparameters}
        self.check(hyperparameters)
        if self.reads is None:
            return self.fn(pretrained, task_vectors, **hyperparameters)
        if self.data is None:
            raise ValueError(f"merge method '{self.name}' reads {DATA[self.reads]}: call it through with_data")
        return self.fn(pretrained, task_vectors, data=self.data, **hyperparameters)

    def check(self, hyperparameters: Mapping[str, Any], where: str | None = None, *, joint: bool = True) -> None:
        """ValueError naming the key (``where.key``) for a value outside its range, or (``joint``: ``hyperparameters``
        holds them all) the joint rule broken. A per-task value (a mapping task -> value) is checked value by value."""
        where = where or f"merge.{self.name}"
        for key, value in hyperparameters.items():
            constraint = self.ranges.get(key)
            # a per-task choice (a mapping) is checked value by value; a PerTask hyperparameter is one mapping
            for v in value.values() if isinstance(value, Mapping) and not isinstance(constraint, PerTask) else [value]:
                if constraint is not None and not constraint.admits(v):
                    raise ValueError(f"{where}.{key}: expected {constraint}, got {v!r}")
        problem = self.joint(hyperparameters) if joint and self.joint else None
        if problem:
            raise ValueError(f"{where}: {problem}")

    # the validation search's view of the method (its grids after overrides): mergeflow.ml.merging.search
    def search_space(self, overrides: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, list[Any]]]:
        """(fixed hyperparameters, grid) after ``overrides``: a list value is a grid, a scalar fixes the value."""
        return search.search_space(self, overrides)

    def per_task_space(self, overrides: Mapping[str, Any] | None = None) -> dict[str, list[Any]]:
        """Hyperparameters chosen per task, with their grids; a scalar override fixes one value for every task."""
        return search.per_task_space(self, overrides)

    def candidates(self, overrides: Mapping[str, Any] | None = None) -> Iterator[dict[str, Any]]:
        return search.candidates(self, overrides)

    def describe(self) -> str:
        def one(k, v):
            grid = self.grid.get(k) or self.per_task_grid.get(k)
            allowed = self.ranges.get(k)
            shown = f" ({allowed})" if allowed is not None and allowed != ANY_NUMBER else ""
            return f"{k}={v!r}{shown}" + (
                f" {'per-task ' if k in self.per_task_grid else ''}grid={list(grid)}" if grid else ""
            )

        hp = ", ".join(one(k, v) for k, v in self.defaults.items())
        kind = "" if self.kind == "model" else f" ({self.kind}{'' if self.merged else ', not merged'})"
        reads = f" (reads {DATA[self.reads]})" if self.reads else ""
        return f"{self.name:<22}{kind}{reads} {hp or '(no hyperparameters)'}  [{self.paper}]"


REGISTRY: dict[str, MergeMethod] = {}


def register(
    name: str,
    *,
    paper: str,
    defaults: Mapping[str, Any] | None = None,
    grid: Mapping[str, Sequence[Any]] | None = None,
    coefficient: str | None = None,
    kind: str = "model",
    reconstruct: Callable[..., StateDict] | None = None,
    per_task_grid: Mapping[str, Sequence[Any]] | None = None,
    task_models: Callable[..., Callable[[str, Mapping[str, Any]], StateDict]] | None = None,
    ranges: Mapping[str, Constraint] | None = None,
    joint: Callable[[Mapping[str, Any]], str | None] | None = None,
    reads: str | None = None,
    tasks: int | None = None,
    features: Callable[..., Callable[[Any], Any]] | None = None,
    network: Callable[..., Any] | None = None,
    merged: bool = True,
):
    def wrap(fn: MergeFn) -> MergeFn:
        if name in REGISTRY:
            raise RuntimeError(f"merge method '{name}' registered twice")
        if coefficient is not None and coefficient not in (defaults or {}):
            raise RuntimeError(f"merge method '{name}': coefficient '{coefficient}' is not a hyperparameter")
        if (kind == "per_task") != (reconstruct is not None) or kind not in ("model", "per_task", "routed", "negation"):
            raise RuntimeError(f"merge method '{name}': a per_task method, and only one, needs reconstruct")
        if (kind == "routed") != (network is not None):
            raise RuntimeError(f"merge method '{name}': a routed method, and only one, needs network")
        if not merged and kind != "routed":
            raise RuntimeError(f"merge method '{name}': only a routed method can be marked not merged")
        if bool(per_task_grid) != (task_models is not None) or not set(per_task_grid or {}) <= set(defaults or {}):
            raise RuntimeError(f"merge method '{name}': per_task_grid needs task_models, and names hyperparameters")
        if set(ranges or {}) != set(defaults or {}):
            raise RuntimeError(f"merge method '{name}': ranges must name every hyperparameter, and only those")
        if reads not in DATA or (reads is not None and kind == "negation"):
            raise RuntimeError(f"merge method '{name}': reads must be one of {list(DATA)[1:]} (not a negation)")
        if features is not None and kind != "per_task":
            raise RuntimeError(
                f"merge method '{name}': features (a map on each task's features) is a per_task method's"
            )
        method = MergeMethod(
            name,
            fn,
            paper,
            dict(defaults or {}),
            dict(grid or {}),
            coefficient,
            kind,
            reconstruct,
            dict(per_task_grid or {}),
            _checked(name, task_models),
            dict(ranges or {}),
            joint,
            reads,
            tasks,
            features=features,
            network=network,
            merged=merged,
        )
        method.check(method.defaults)  # a default outside its own range is a bug of the method's module
        REGISTRY[name] = method
        return fn

    return wrap


def _checked(name: str, task_models: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """task_models called as the method is: its defaults filled in, every value checked against its range."""
    if task_models is None:
        return None

    @functools.wraps(task_models)
    def checked(pretrained, task_vectors, **hyperparameters):
        method = REGISTRY[name]
        hyperparameters = {**method.defaults, **hyperparameters}
        method.check(hyperparameters)
        return task_models(pretrained, task_vectors, **hyperparameters)

    return checked


def _same_type(default: Any, value: Any) -> bool:
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(default, bool) and isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float))
    return isinstance(value, type(default))


def validate_overrides(method: MergeMethod, overrides: Any, *, where: str) -> None:
    """Raise ValueError naming the key when an override is unknown, of the wrong type, or outside its range (every
    value of a grid), or when a combination the search would merge breaks the method's joint rule."""
    if not isinstance(overrides, Mapping):
        raise ValueError(f"{where}: expected a mapping of hyperparameters")
    for key, value in overrides.items():
        if key not in method.defaults:
            allowed = ", ".join(method.defaults) or "none"
            raise ValueError(f"{where}.{key}: unknown hyperparameter (allowed: {allowed})")
        values = value if isinstance(value, list) else [value]
        if not values:
            raise ValueError(f"{where}.{key}: an empty grid")
        for v in values:
            if not _same_type(method.defaults[key], v):
                raise ValueError(f"{where}.{key}: expected {type(method.defaults[key]).__name__}, got {v!r}")
            method.check({key: v}, where, joint=False)
    if method.joint:
        for candidate in method.candidates(overrides):
            method.check(candidate, where)


# the package's modules that are not methods (imported above): every other public module registers one or more
NOT_METHODS = frozenset({"search"})


def _discover() -> None:
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_") and info.name not in NOT_METHODS:
            importlib.import_module(f"{__name__}.{info.name}")


_discover()

# the tensor engine's names that code above the merging layer uses (the stages, plan's measurements, the studies),
# imported when first asked for: the registry itself loads no torch (mergeflow check)
_ENGINE = {
    "BASE_PREFIX": "_tensors",
    "store_bytes": "_tensors",
    "svd": "_tensors",
    "is_matrix": "_tensors",
    "EntropyObjective": "_adaptive",
}


def __getattr__(name: str) -> Any:
    if name in _ENGINE:
        return getattr(importlib.import_module(f"{__name__}.{_ENGINE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
