"""The registry of studies: the papers' analyses, each a DVC stage ``study@<name>`` that writes a Markdown report
with plots and a verdict per claim, computed from the measurements.

A study is one module in this package: a function ``(context: StudyContext) -> StudyResult`` decorated with
``@register``, which records its paper and its settings (a pydantic model: every field a setting with its
default; ``studies.<name>`` in params.yaml overrides them). Modules are discovered by name, as the merge methods
and regimes are, so adding a study means adding one file. A study reads the pipeline's outputs through
``context.layout`` (mergeflow.core.layout.Layout) and may compute its own measurements; it writes its figures into
``context.out_dir`` and returns its claims and the report's body. ``mergeflow.pipeline.merge.study`` writes
``studies/<name>/report.md`` (title, verdict table, body) and ``metrics/studies/<name>.json`` atomically.
As the merge methods do, study modules import torch inside their functions (``no_grad`` below for a decorator),
so that params.yaml's ``studies`` are validated without it.

A claim's verdict is ``holds`` or ``fails`` from the numbers beside it, or ``not measured`` when what it needs was
not run (a regime or round count not in params.yaml): never written by hand.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError


class StudySettings(BaseModel):
    """Base of a study's settings: unknown keys, NaN and infinity are refused, values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


@dataclass(frozen=True)
class Claim:
    id: str  # e.g. "000.1"
    text: str  # the paper's claim, in one sentence
    holds: bool | None  # None: not measured (what it needs was not run)
    numbers: Mapping[str, Any]  # the measurements the verdict is computed from
    detail: str = ""  # one line: the comparison made, with its numbers
    margin: float | None = (
        None  # the accuracy difference the verdict rests on (a fraction), set against the seeds' spread
    )

    @property
    def verdict(self) -> str:
        return "not measured" if self.holds is None else "holds" if self.holds else "fails"

    def record(self) -> dict:
        return {
            "id": self.id,
            "claim": self.text,
            "verdict": self.verdict,
            "detail": self.detail,
            "numbers": dict(self.numbers),
        }


@dataclass
class StudyResult:
    claims: list[Claim]
    body: str  # Markdown after the verdict table: tables, figures (relative links to files in out_dir)
    figures: list[str] = field(default_factory=list)  # file names written into out_dir


@dataclass(frozen=True)
class StudyContext:
    params: Any  # mergeflow.config.Params
    layout: Any  # mergeflow.core.layout.Layout
    settings: StudySettings
    out_dir: Path  # where figures go (a temporary directory, renamed into place when the study succeeds)
    device: Any  # torch.device


StudyFn = Callable[[StudyContext], StudyResult]


@dataclass(frozen=True)
class Study:
    name: str
    fn: StudyFn
    paper: str
    title: str
    settings_model: type[StudySettings]
    claims: Mapping[str, str] = field(default_factory=dict)  # claim id -> its short name (MLflow's verdict.<name>)

    def claim_name(self, claim_id: str) -> str:
        if claim_id not in self.claims:
            raise KeyError(f"study {self.name}: claim {claim_id} has no short name (register(..., claims=...))")
        return self.claims[claim_id]

    def settings(self, overrides: Mapping[str, Any], *, where: str) -> StudySettings:
        try:
            return self.settings_model.model_validate(dict(overrides))
        except ValidationError as err:
            first = err.errors()[0]
            key = "".join(f".{p}" for p in first["loc"])  # empty for a check across the settings
            raise ValueError(f"{where}{key}: {first['msg'].removeprefix('Value error, ')}") from None


REGISTRY: dict[str, Study] = {}


def register(
    name: str,
    *,
    paper: str,
    title: str,
    settings: type[StudySettings] = StudySettings,
    claims: Mapping[str, str] | None = None,
):
    """``claims``: each claim's id -> a short name, unique among all studies' claims (the name a verdict has in
    MLflow, where the studies' runs share one table)."""

    def wrap(fn: StudyFn) -> StudyFn:
        if name in REGISTRY:
            raise RuntimeError(f"study '{name}' registered twice")
        REGISTRY[name] = Study(name, fn, paper, title, settings, dict(claims or {}))
        return fn

    return wrap


def no_grad(fn: Callable) -> Callable:
    """``@torch.no_grad()`` with torch imported when ``fn`` is called, not when its module is."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import torch

        with torch.no_grad():
            return fn(*args, **kwargs)

    return wrapper


def against_spread(claim: Claim, sd: float | None, seeds: int, sds: float) -> Claim:
    """The claim with its margin set against the spread over seeds (``sd``: the pooled standard deviation of a
    method's test average, points, over ``seeds`` seeds): inside it when |margin| < ``sds`` x sd."""
    if claim.margin is None or claim.holds is None:
        return claim
    points = 100 * claim.margin
    if sd is None:
        note = f"margin {points:+.1f} points; the spread over seeds is not measured (params.yaml's seeds: none)"
        return dataclasses.replace(
            claim, detail=f"{claim.detail}; {note}", numbers={**claim.numbers, "margin_points": round(points, 2)}
        )
    inside = abs(points) < sds * sd
    note = (
        f"margin {points:+.1f} points {'inside' if inside else 'outside'} the "
        f"spread over {seeds} seeds ({sds:g} x sd {sd:.2f} = {sds * sd:.2f})"
    )
    return dataclasses.replace(
        claim,
        detail=f"{claim.detail}; {note}",
        numbers={**claim.numbers, "margin_points": round(points, 2), "seed_sd": sd, "inside_spread": inside},
    )


def verdict_table(claims: list[Claim]) -> str:
    lines = ["| claim | verdict | measured |", "|---|---|---|"]
    for c in claims:
        lines.append(f"| {c.id} {c.text} | **{c.verdict}** | {c.detail} |")
    return "\n".join(lines) + "\n"


def _discover() -> None:
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")


_discover()

__all__ = [
    "REGISTRY",
    "Claim",
    "Study",
    "StudyContext",
    "StudyResult",
    "StudySettings",
    "against_spread",
    "no_grad",
    "register",
    "verdict_table",
]
