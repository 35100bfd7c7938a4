"""The registry of continual merging methods: tasks arrive one at a time, and after each arrival the merged model is
updated from the previous merged model and the new task's vector alone.

A method is one module in this package: a pure function ``(pretrained, merged, state, tau, **hyperparameters) ->
(merged, state)`` decorated with ``@register``. ``merged`` and ``state`` are None at the first arrival; ``state`` is
the method's bounded summary of what it has seen (a count, a norm, a running vector: never the earlier task vectors),
returned for the next arrival. Modules are discovered by name, as the merge methods are (mergeflow.ml.merging: those
see every task vector at once); no method does I/O, and torch is imported inside the functions.

Every call through the registry (``REGISTRY[name](...)``) fills in the defaults, checks each hyperparameter against
its range and the task vector against theta0 (keys, shapes: one line naming the key), and hands the method the
floating-point tensors only: any other tensor (an integer buffer) keeps theta0's value. ``arrivals`` runs a method
over an arrival order and yields the merged model after each arrival.
"""

from __future__ import annotations

import importlib
import math
import pkgutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

UpdateFn = Callable[..., tuple[dict, Any]]


@dataclass(frozen=True)
class Interval:
    """The numbers a hyperparameter accepts, ``low`` to ``high`` (None: unbounded), both ends included."""

    low: float | None = None
    high: float | None = None
    integer: bool = False  # a count: an int

    def admits(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        if self.integer and not isinstance(value, int):
            return False
        return (self.low is None or value >= self.low) and (self.high is None or value <= self.high)

    def __str__(self) -> str:
        return (
            f"{'an integer' if self.integer else 'a number'} in [{'-inf' if self.low is None else f'{self.low:g}'}, "
            + ("inf]" if self.high is None else f"{self.high:g}]")
        )


@dataclass(frozen=True)
class OneOf:
    """The values a hyperparameter accepts (names, or True / False)."""

    options: tuple[Any, ...]

    def admits(self, value: Any) -> bool:
        return any(value == o and type(value) is type(o) for o in self.options)

    def __str__(self) -> str:
        return "one of " + ", ".join(map(repr, self.options))


@dataclass(frozen=True)
class ContinualMethod:
    name: str
    fn: UpdateFn
    paper: str  # citation
    reference: str  # the reference code it follows (FusionBench's module)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    ranges: Mapping[str, Interval | OneOf] = field(default_factory=dict)

    def check(self, hyperparameters: Mapping[str, Any], where: str) -> None:
        """ValueError naming ``where.key`` for an unknown hyperparameter or a value outside its range."""
        for key, value in hyperparameters.items():
            if key not in self.defaults:
                raise ValueError(
                    f"{where}.{key}: unknown hyperparameter (allowed: {', '.join(self.defaults) or 'none'})"
                )
            if not self.ranges[key].admits(value):
                raise ValueError(f"{where}.{key}: expected {self.ranges[key]}, got {value!r}")

    def __call__(self, pretrained, merged, state, tau, *, where: str = "task vector", **hyperparameters):
        """(merged, state) after one arrival; ``where`` names the task vector in an error."""
        self.check(hyperparameters, f"continual.{self.name}")
        hyperparameters = {**self.defaults, **hyperparameters}
        check_task_vector(pretrained, tau, where)
        if merged is not None:
            check_task_vector(pretrained, merged, "the merged model")
        floating = [k for k, v in pretrained.items() if v.is_floating_point()]
        new, state = self.fn(
            {k: pretrained[k] for k in floating},
            None if merged is None else {k: merged[k] for k in floating},
            state,
            {k: tau[k] for k in floating},
            **hyperparameters,
        )
        return {k: new[k] if k in new else pretrained[k] for k in pretrained}, state


def check_task_vector(pretrained: Mapping[str, Any], other: Mapping[str, Any], where: str) -> None:
    """ValueError in one line naming the key when ``other`` lacks one of theta0's keys, has one more, has another
    shape, or holds a value that is not finite."""
    import torch

    for key, ref in pretrained.items():
        if key not in other:
            raise ValueError(f"{where}: key {key!r} of theta0 is missing")
        value = other[key]
        if tuple(value.shape) != tuple(ref.shape):
            raise ValueError(f"{where}: {key!r} has shape {tuple(value.shape)}, theta0's is {tuple(ref.shape)}")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise ValueError(f"{where}: {key!r} holds a value that is not finite")
    extra = sorted(set(other) - set(pretrained))
    if extra:
        raise ValueError(f"{where}: key {extra[0]!r} is not in theta0")


def arrivals(
    method: ContinualMethod, pretrained, stream: Iterable[tuple[str, Mapping[str, Any]]], **hyperparameters
) -> Iterator[tuple[str, dict]]:
    """(task, merged model after it arrived) for each (task, tau) of ``stream``, in its order."""
    merged, state = None, None
    for task, tau in stream:
        merged, state = method(pretrained, merged, state, tau, where=f"task vector of {task!r}", **hyperparameters)
        yield task, merged


REGISTRY: dict[str, ContinualMethod] = {}


def register(
    name: str,
    *,
    paper: str,
    reference: str,
    defaults: Mapping[str, Any] | None = None,
    ranges: Mapping[str, Interval | OneOf] | None = None,
):
    def wrap(fn: UpdateFn) -> UpdateFn:
        if name in REGISTRY:
            raise RuntimeError(f"continual method '{name}' registered twice")
        if set(ranges or {}) != set(defaults or {}):
            raise RuntimeError(f"continual method '{name}': ranges must name every hyperparameter, and only those")
        method = ContinualMethod(name, fn, paper, reference, dict(defaults or {}), dict(ranges or {}))
        method.check(method.defaults, f"continual.{name}")  # a default outside its range is the module's bug
        REGISTRY[name] = method
        return fn

    return wrap


def _discover() -> None:
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")


_discover()

__all__ = ["REGISTRY", "ContinualMethod", "Interval", "OneOf", "arrivals", "check_task_vector", "register"]
