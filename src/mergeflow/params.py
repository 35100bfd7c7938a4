"""params.yaml as every command loads it: its schema (mergeflow.config), then its names and settings checked against
the registries that own them (merge methods, regimes, studies), each regime's and study's settings attached.

This is the one module that knows all three registries: config names no method, regime or study, and a new one
needs no line here. None of the registries imports torch, so `mergeflow check` answers in well under a second.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import yaml

from mergeflow.config import DEFAULT_PARAMS, Params, check_written_out, parse_schema
from mergeflow.config.fields import check_name
from mergeflow.core.errors import MergeflowError, did_you_mean
from mergeflow.core.yaml_files import duplicate_key, parse_yaml, read_yaml, round_trip_yaml


def _shown(value: Any) -> str:
    return repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."


# where each kind of name is listed in full, for a refusal that shows only the closest ones
LISTED_BY = {"merge method": "mergeflow methods", "regime": "mergeflow regimes", "study": "mergeflow regimes"}


def unknown_name(where: str, what: str, name: Any, registered: list[str]) -> str:
    """One short line for a name not registered: the key, the closest registered names and the command that lists
    them all (45 methods in one line would bury the answer)."""
    return (
        f"{where}: unknown {what} {_shown(name)} "
        f"({did_you_mean(name, registered)}`{LISTED_BY[what]}` lists all {len(registered)})"
    )


def _known(named: list[tuple[str, str]], registered: list[str], what: str) -> None:
    """ValueError for the first (key, name) whose name is not registered, naming the key and the closest names."""
    for where, name in named:
        if name not in registered:
            raise ValueError(unknown_name(where, what, name, registered))


def _mapping(overrides: Any, where: str, whose: str) -> dict:
    """A registered item's settings in params.yaml: a mapping, or empty (its defaults)."""
    if overrides is not None and not isinstance(overrides, dict):
        raise ValueError(
            f"{where}: expected a mapping of the {whose} settings (key: value lines), got {_shown(overrides)}"
        )
    return overrides or {}


def _check_merge(params: Params) -> None:
    from mergeflow.ml.merging import REGISTRY, validate_overrides

    merge = params.merge
    _known(
        [("merge.methods", n) for n in merge.methods] + [(f"merge.{n}", n) for n in merge.model_extra or {}],
        sorted(REGISTRY),
        "merge method",
    )
    for name, overrides in (merge.model_extra or {}).items():
        validate_overrides(REGISTRY[name], overrides, where=f"merge.{name}")
    for name in merge.methods:  # a method that merges only so many task vectors (SLERP: two)
        if REGISTRY[name].tasks not in (None, len(params.suite.tasks)):
            raise ValueError(
                f"merge.methods: {name} merges exactly {REGISTRY[name].tasks} task models, and suite.tasks has "
                f"{len(params.suite.tasks)}"
            )


def statistics_readers(params: Params) -> list[str]:
    """The methods of merge.methods that read the statistics stage's outputs (Fisher merging, RegMean, ...)."""
    from mergeflow.ml.merging import REGISTRY

    return [m for m in params.merge.methods if m in REGISTRY and REGISTRY[m].reads == "train_statistics"]


def _regime_methods(regime: str, methods: list[str], own_model: bool) -> None:
    from mergeflow.ml.merging import REGISTRY

    where = f"regimes.methods.{regime}"
    for method in methods:
        if method not in REGISTRY and not (own_model and method == regime):
            allowed = sorted(m for m, spec in REGISTRY.items() if spec.kind != "negation") + (
                [regime] if own_model else []
            )
            raise ValueError(unknown_name(where, "merge method", method, allowed))
        if method in REGISTRY and REGISTRY[method].reads == "train_statistics":
            raise ValueError(
                f"{where}: {method!r} reads the standard fine-tunes' statistics "
                "(stage statistics), which a regime's task models do not have"
            )
        if method in REGISTRY and REGISTRY[method].kind == "negation":
            raise ValueError(f"{where}: {method!r} is task negation, which does not merge a multi-task model")


def _resolve_regimes(params: Params) -> None:
    from mergeflow.ml.regimes import REGISTRY

    regimes = params.regimes
    runnable = sorted(n for n, r in REGISTRY.items() if r.settings_model is not None)
    named = (
        [("regimes.run", n) for n in regimes.run]
        + [("regimes.methods", n) for n in regimes.methods]
        + [(f"regimes.{n}", n) for n in regimes.model_extra or {}]
    )
    _known(named, runnable, "regime")
    resolved = {}
    for name in runnable:
        regime = REGISTRY[name]
        settings = regime.settings(
            _mapping(regimes.overrides(name), f"regimes.{name}", "regime's"), where=f"regimes.{name}"
        )
        methods = list(regimes.methods.get(name, regime.methods))
        _regime_methods(name, methods, regime.own_model)
        settings.check_backbone(name, params.backbone, selected=name in regimes.run)
        if name in regimes.run:
            settings.check_budget(name, params.finetune.steps)
        resolved[name] = (settings, methods)
    regimes.attach(resolved)


def _resolve_studies(params: Params) -> None:
    from mergeflow.studies import REGISTRY

    studies = params.studies
    _known(
        [("studies.run", n) for n in studies.run] + [(f"studies.{n}", n) for n in studies.model_extra or {}],
        sorted(REGISTRY),
        "study",
    )
    overrides = {
        name: _mapping(studies.overrides(name), f"studies.{name}", "study's") for name in studies.model_extra or {}
    }
    studies.attach(
        {name: REGISTRY[name].settings(overrides.get(name, {}), where=f"studies.{name}") for name in REGISTRY}
    )


def resolve(params: Params, source: str = DEFAULT_PARAMS) -> Params:
    """``params`` with its names and settings checked against the registries and each regime's and study's
    settings attached; MergeflowError naming the file and the key otherwise."""
    try:
        _check_merge(params)
        _resolve_regimes(params)
        _resolve_studies(params)
    except ValueError as err:
        raise MergeflowError(f"{source}: {err}") from None
    return params


def parse_params(raw: Any, source: str = DEFAULT_PARAMS) -> Params:
    return resolve(parse_schema(raw, source), source)


def load_params(path: str | os.PathLike = DEFAULT_PARAMS) -> Params:
    path = Path(path)
    if not path.is_file():
        raise MergeflowError(f"{path}: params file not found")
    raw = read_yaml(path)
    check_written_out(raw, str(path))
    return parse_params(raw, str(path))


def apply_overrides(path: str | os.PathLike, overrides: list[str], *, write: bool = True) -> Params:
    """Set ``key.path=value`` overrides in the params file, as ``dvc exp run -S`` does (the value read as YAML),
    keeping its comments and layout. The result is validated in full before the file is replaced (atomically):
    a bad override leaves the file untouched. Returns the new params (``write=False``: only checks them)."""
    path = Path(path)
    load_params(path)  # the file as it is must be valid too
    rt = round_trip_yaml()
    text = path.read_bytes().decode("utf-8", errors="replace")
    try:  # the file loaded above, so no duplicate key or bad byte reaches this reader; any refusal is still one line
        doc = rt.load(text)
    except Exception as err:  # noqa: BLE001 - ruamel's errors (DuplicateKeyError, ...) share no base with PyYAML's
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        try:  # a duplicate key named by its full path, as parse_yaml names it
            why = duplicate_key(yaml.compose(text, Loader=yaml.SafeLoader))
        except yaml.YAMLError:
            why = None
        why = why or next(
            (line for line in lines if line.startswith("found")), lines[0] if lines else type(err).__name__
        )
        raise MergeflowError(f"{path}: the round-trip YAML reader refuses it: {why}") from None
    for override in overrides:
        key, sep, text = override.partition("=")
        parts = key.strip().split(".")
        try:
            for part in parts:
                check_name(part, f"override {override!r}: key")
            if not sep:
                raise ValueError(f"override {override!r}: expected KEY=VALUE, e.g. merge.ties.k=0.1")
            value = parse_yaml(text, f"override {override!r}")
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
    from mergeflow.core.files import atomic_path

    with atomic_path(path) as tmp:
        tmp.write_text(buffer.getvalue())
    return params
