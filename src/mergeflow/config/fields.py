"""The building blocks of params.yaml's schema: plain names, the bounds on counts and sizes, and pydantic's errors
as one line naming the key."""

from __future__ import annotations

import math
import re
from typing import Any

from pydantic import BaseModel, BeforeValidator, ValidationError


# A name that can reach a file path, a DVC stage name or a command line (a task, a backbone, a suite) is a plain
# word: letters, digits, '_', '.' and '-', starting with a letter or digit. Nothing a shell or a path treats specially.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$"
_NAME = re.compile(NAME_PATTERN)


def check_name(value: str, where: str) -> str:
    """``value`` if it is a plain name (NAME_PATTERN), else ValueError naming ``where``."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ValueError(
            f"{where}: {value!r} is not a plain name (letters, digits, '_', '.', '-'; first a letter or digit)"
        )
    return value


def unique_names(values: list[str], what: str) -> list[str]:
    """``values`` unless one is listed twice (the work would be done twice); ValueError naming it."""
    dup = next((v for i, v in enumerate(values) if v in values[:i]), None)
    if dup is not None:
        raise ValueError(f"{what} {dup!r} is listed twice")
    return values


# Upper bounds on counts and sizes: generous for any machine this runs on (two cores or a GPU node), low enough
# that a slip (1e29 for 100) is refused at once instead of running until killed or overflowing a seed.
MAX_STEPS = 10**7  # optimiser steps, warm-up steps, epochs, solver iterations, rounds
MAX_IMAGES = 10**8  # images or examples: a split, the corpus, a statistic
MAX_BATCH = 10**6  # examples in one batch
MAX_THREADS = 4096
MAX_SEED = 2**32 - 1  # numpy's and scikit-learn's seed range
MAX_GRID = 1000  # values in a searched grid
MAX_LR = 100.0  # a learning rate: far above any that trains (a slip, 1e3 for 1e-3, diverges in one step)


def at_most(bound: int, unit: str) -> BeforeValidator:
    """Refuse a number above ``bound``, saying the bound, before pydantic reads it as an integer (1e29 would
    become a 30-digit step count, 1e30 fails with no bound named)."""

    def check(value: Any) -> Any:
        number = value
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                return value  # not a number: pydantic's own message
        if isinstance(number, (int, float)) and not isinstance(number, bool) and number > bound:
            raise ValueError(f"at most {bound:,} {unit}".rstrip())
        return value

    return BeforeValidator(check)


def non_finite(raw: Any, path: str = "") -> tuple[str, float] | None:
    """The first NaN or infinity in parsed YAML (any section: merge and study settings too), by key path."""
    if isinstance(raw, float) and not math.isfinite(raw):
        return path, raw
    items = raw.items() if isinstance(raw, dict) else enumerate(raw) if isinstance(raw, list) else ()
    for key, value in items:
        found = non_finite(value, f"{path}.{key}" if path else str(key))
        if found:
            return found
    return None


def model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None) if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def first_error(err: ValidationError) -> tuple[str, str]:
    """pydantic's first error as (dotted key, message with the value given where it is a scalar)."""
    first = err.errors()[0]
    key = ".".join(str(p) for p in first["loc"])
    msg = first["msg"].removeprefix("Value error, ")
    got = first.get("input")
    shown = (
        "" if isinstance(got, (dict, list)) or got is None or first["type"] == "extra_forbidden" else f" (got {got!r})"
    )
    return key, msg + shown


def one_line(err: ValidationError, source: str, schema: type[BaseModel]) -> str:
    """pydantic's first error as one line: the key, and for an unknown key the keys allowed there."""
    first = err.errors()[0]
    loc = tuple(first["loc"])
    key, msg = first_error(err)
    key = key or "(top level)"
    if first["type"] == "extra_forbidden":
        parent = model_at(schema, loc)
        allowed = ", ".join(parent.model_fields) if parent else "see params.yaml"
        return f"{source}: unknown key '{key}' (allowed here: {allowed})"
    if not loc or msg.startswith(f"{key}."):  # a check across keys names its own
        return f"{source}: {msg}"
    return f"{source}: {key}: {msg}"
