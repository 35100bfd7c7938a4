"""Study mima: its settings, and the measurements per round count N read from the pipeline's outputs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from mergeflow.studies import StudyContext, StudySettings

REGIME = "mima"
ROLES = {"ua": "weight_averaging", "ta": "task_arithmetic", "ties": "ties"}  # UA = uniform average of the theta_t
ROLE_NAMES = {"ua": "UA", "ta": "TA", "ties": "TIES", "individual": "individual"}

# Seed 001, Table 1, ViT-B/32 (8 tasks), average absolute test
# accuracy (fractions), and Table 2 (task arithmetic's lambda)
PAPER_VIT_B32 = {
    1: {"individual": 0.902, "ua": 0.658, "ta": 0.706, "ties": 0.736, "ta_lam": 0.25},
    2: {"individual": 0.898, "ua": 0.742, "ta": 0.772, "ties": 0.781, "ta_lam": 0.2},
    4: {"individual": 0.886, "ua": 0.818, "ta": 0.830, "ties": 0.833, "ta_lam": 0.15},
    8: {"individual": 0.878, "ua": 0.858, "ta": 0.859, "ties": 0.864, "ta_lam": 0.15},
    16: {"individual": 0.880, "ua": 0.876, "ta": 0.873, "ties": 0.881, "ta_lam": 0.15},
    20: {"individual": 0.881, "ua": 0.880, "ta": 0.876, "ties": 0.884, "ta_lam": 0.15},
}
PAPER_T = 8


class MimaSettings(StudySettings):
    # claim 1: the N = 1 median pairwise cosine of the tau_t must lie in this range (the seed: "very low, typically
    # centred around 0.0 to 0.1")
    n1_cosine_range: tuple[float, float] = (-0.05, 0.10)
    # claim 2: the related pair (the seed's MNIST / SVHN); its N = 1 cosine must exceed the median of the other pairs
    related_pair: tuple[str, str] = ("digits", "house_numbers")
    # claim 3: the individual models' average test accuracy may span (max - min over N) at most this, a fraction:
    # 0.024 = 2.4 points, the seed's ViT-B/32 span (90.2 at N = 1 to 87.8 at N = 8)
    individual_tolerance: float = Field(0.024, ge=0)
    # "rises" / "shrinks" over N for accuracies and accuracy gaps (fractions): a step may go the wrong way by at most
    # this much (0: monotone), and the last value must beat the first
    accuracy_slack: float = Field(0.0, ge=0)
    # the same for cosine medians (claims 1 and 5)
    cosine_slack: float = Field(0.0, ge=0)
    # claim 5: every round's median pairwise cosine of the incremental updates delta_t(i) must lie within +- this
    # ("near-orthogonal"; the seed's Fig. 11 boxes sit near 0)
    update_cosine_bound: float = Field(0.1, gt=0)

    @model_validator(mode="after")
    def _check(self) -> MimaSettings:
        lo, hi = self.n1_cosine_range
        if lo > hi:
            raise ValueError(f"n1_cosine_range: low {lo} above high {hi}")
        if self.related_pair[0] == self.related_pair[1]:
            raise ValueError("related_pair: two different tasks")
        return self


# ---------------------------------------------------------------- reading the pipeline's outputs
@dataclass
class Point:
    """Everything measured for one round count N."""

    n: int
    source: str  # "standard fine-tune" or the regime variant's name
    tasks: list[str] | None = None  # the order of ``cosine``
    cosine: list[list[float]] | None = None
    individual: dict[str, float] | None = None  # per task, test
    accuracy: dict[str, float] = field(default_factory=dict)  # role -> average test accuracy
    lam: dict[str, float] = field(default_factory=dict)  # role -> chosen lambda
    rounds: list[dict] | None = None  # the regime's per-round records
    missing: list[str] = field(default_factory=list)

    @property
    def individual_average(self) -> float | None:
        return None if not self.individual else sum(self.individual.values()) / len(self.individual)

    def pairs(self) -> dict[tuple[str, str], float]:
        if self.cosine is None or self.tasks is None:
            return {}
        t = self.tasks
        return {
            (t[i], t[j]): float(self.cosine[i][j])
            for i in range(len(t))
            for j in range(i + 1, len(t))
            if math.isfinite(self.cosine[i][j])
        }


def _json(path: Path) -> Any | None:
    from mergeflow.core.files import read_json

    return read_json(path) if Path(path).is_file() else None


def _rel(layout, path: Path) -> str:
    try:
        return str(Path(path).relative_to(layout.root))
    except ValueError:
        return str(path)


def _read_stats(point: Point, layout, path: Path) -> None:
    stats = _json(path)
    if stats is None:
        point.missing.append(_rel(layout, path))
    else:
        point.tasks, point.cosine = list(stats["tasks"]), stats["cosine"]


def _read_merges(point: Point, layout, runs: dict) -> None:
    for role, run in runs.items():
        evaluation = _json(run.evaluation)
        if evaluation is None:
            if role != "ua" or "ua" not in point.accuracy:
                point.missing.append(_rel(layout, run.evaluation))
            continue
        point.accuracy[role] = float(evaluation["average"])
        choice = _json(run.choice) or evaluation
        lam = (choice.get("hyperparameters") or {}).get("lam")
        if isinstance(lam, (int, float)):
            point.lam[role] = float(lam)


def _standard(context: StudyContext) -> Point:
    layout, params = context.layout, context.params
    point = Point(1, "standard fine-tune")
    _read_stats(point, layout, layout.vectors / "stats.json")
    individual = {}
    for t in params.suite.tasks:
        ft = _json(layout.metrics("finetune", t))
        if ft is None:
            point.missing.append(_rel(layout, layout.metrics("finetune", t)))
        else:
            individual[t] = float(ft["individual"]["test"])
    point.individual = individual if len(individual) == len(params.suite.tasks) else None
    _read_merges(point, layout, {role: layout.merge_run(method) for role, method in ROLES.items()})
    return point


def _variant(context: StudyContext, n: int, record: dict) -> Point:
    layout, params = context.layout, context.params
    name = f"{REGIME}_n{n}"
    point = Point(n, name, rounds=record.get("rounds"))
    _read_stats(point, layout, layout.regime_vectors(REGIME, name) / "stats.json")
    individual = {t: float(v["test"]) for t, v in (record.get("individual") or {}).items()}
    if all(t in individual for t in params.suite.tasks):
        point.individual = {t: individual[t] for t in params.suite.tasks}
    else:
        point.missing.append(f"individual accuracies of {name} in metrics/regime/{REGIME}.json")
    model = record.get("model") or {}
    if isinstance((model.get("average") or {}).get("test"), (int, float)):
        point.accuracy["ua"] = float(
            model["average"]["test"]
        )  # MIMA's last uniform average; the weight_averaging merge, when run, replaces it
    _read_merges(point, layout, {role: layout.merge_run(method, REGIME, name) for role, method in ROLES.items()})
    return point


def collect(context: StudyContext) -> tuple[list[Point], list[str]]:
    """One Point per round count N (1 first), and notes on what is missing."""
    params, layout = context.params, context.layout
    notes: list[str] = []
    ran = REGIME in params.regimes.run
    rounds = sorted(set(params.regimes.config("mima").rounds)) if ran else []
    if not ran:
        notes.append(
            "regime mima is not in regimes.run: only N = 1 (the standard fine-tune) is available; run e.g. `dvc exp "
            "run -S 'regimes.run=[mima]' -S 'regimes.mima.rounds=[2,4,8]'`"
        )
    regime_path = layout.metrics("regime", REGIME)
    variants = ((_json(regime_path) or {}).get("variants") or {}) if ran else {}
    if ran and not variants:
        notes.append(f"{_rel(layout, regime_path)} is missing: run `dvc repro regime@{REGIME}`")
    points = []
    if 1 in rounds and f"{REGIME}_n1" in variants:
        points.append(_variant(context, 1, variants[f"{REGIME}_n1"]))
    else:
        points.append(_standard(context))
    for n in rounds:
        if n == 1:
            continue
        if f"{REGIME}_n{n}" in variants:
            points.append(_variant(context, n, variants[f"{REGIME}_n{n}"]))
        elif variants:
            notes.append(
                f"variant {REGIME}_n{n} is missing from {_rel(layout, regime_path)}: run `dvc repro regime@{REGIME}`"
            )
    for p in points:
        if p.missing:
            notes.append(f"N = {p.n} ({p.source}): missing " + ", ".join(p.missing))
    return points, notes
