"""Study ``mima`` (seed 001, MIMA: iterative model averaging and fine-tuning): do the seed's measurements hold on
our suite? It reads the pipeline's outputs only (no training): the standard fine-tune as N = 1 (or the regime's
``mima_n1`` variant when it ran; the two are the same run bit for bit), and regime@mima's variants ``mima_n<N>``
for the round counts in ``regimes.mima.rounds``.

Claims (the seed's numbers are its Table 1, Figure 5 and Appendix C):

1. At N = 1 the pairwise cosines of the task vectors tau_t are near 0-0.1, and their median rises with N (Fig. 5).
2. Related tasks (MNIST / SVHN there, digits / house_numbers here) have a higher N = 1 cosine than the other pairs (Fig. 10).
3. UA accuracy rises with N while the individual models' accuracy changes little (Table 1, Fig. 8).
4. The gap individual - UA shrinks with N (Fig. 6); task arithmetic's and TIES' advantage over UA shrinks with N
   (Fig. 4a); task arithmetic's chosen lambda falls toward 1/T (Table 2; lambda = 1/T is UA).
5. The per-round updates delta_t(i) of different tasks stay near-orthogonal while cos(tau_t(i)) rises with round i
   (Appendix C.2, Fig. 11), from the per-round records of the largest N.

"Rises" over a sequence (N ascending, or rounds): no step goes down by more than the slack setting and the last
value is above the first; "shrinks" is the mirror. A claim needs two round counts (two rounds for claim 5) with
its numbers, else it is not measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

from pydantic import Field, model_validator

from mergeflow.studies import Claim, StudyContext, StudyResult, StudySettings, register

REGIME = "mima"
ROLES = {"ua": "weight_averaging", "ta": "task_arithmetic", "ties": "ties"}  # UA = uniform average of the theta_t
ROLE_NAMES = {"ua": "UA", "ta": "TA", "ties": "TIES", "individual": "individual"}

# Seed 001, Table 1, ViT-B/32 (8 tasks), average absolute test accuracy (fractions), and Table 2 (task arithmetic's lambda)
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
        return {(t[i], t[j]): float(self.cosine[i][j]) for i in range(len(t)) for j in range(i + 1, len(t)) if math.isfinite(self.cosine[i][j])}


def _json(path: Path) -> Any | None:
    from mergeflow.core.io import read_json

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
        point.accuracy["ua"] = float(model["average"]["test"])  # MIMA's last uniform average; the weight_averaging merge, when run, replaces it
    _read_merges(point, layout, {role: layout.merge_run(method, REGIME, name) for role, method in ROLES.items()})
    return point


def collect(context: StudyContext) -> tuple[list[Point], list[str]]:
    """One Point per round count N (1 first), and notes on what is missing."""
    params, layout = context.params, context.layout
    notes: list[str] = []
    ran = REGIME in params.regimes.run
    rounds = sorted(set(params.regimes.config("mima").rounds)) if ran else []
    if not ran:
        notes.append("regime mima is not in regimes.run: only N = 1 (the standard fine-tune) is available; run e.g. `dvc exp run -S 'regimes.run=[mima]' -S 'regimes.mima.rounds=[2,4,8]'`")
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
            notes.append(f"variant {REGIME}_n{n} is missing from {_rel(layout, regime_path)}: run `dvc repro regime@{REGIME}`")
    for p in points:
        if p.missing:
            notes.append(f"N = {p.n} ({p.source}): missing " + ", ".join(p.missing))
    return points, notes


# ---------------------------------------------------------------- rules
def rises(values: list[float], slack: float = 0.0) -> bool:
    """No step down by more than ``slack``, and the last value above the first."""
    return len(values) >= 2 and all(b >= a - slack for a, b in zip(values, values[1:])) and values[-1] > values[0]


def shrinks(values: list[float], slack: float = 0.0) -> bool:
    return rises([-v for v in values], slack)


def _series(points: list[Point], value) -> tuple[list[int], list[float]]:
    ns, vs = [], []
    for p in points:
        v = value(p)
        if v is not None and math.isfinite(v):
            ns.append(p.n)
            vs.append(float(v))
    return ns, vs


def _pct(v: float | None, digits: int = 1) -> str:
    return "—" if v is None else f"{100 * v:.{digits}f}"


def _fmt(vs: list[float], scale: float = 1.0, digits: int = 3) -> str:
    return ", ".join(f"{scale * v:.{digits}f}" for v in vs)


def _by_n(ns: list[int], vs: list[float], scale: float = 100.0, digits: int = 1) -> str:
    return ", ".join(f"N={n}: {scale * v:.{digits}f}" for n, v in zip(ns, vs))


def _ns(ns: list[int]) -> str:
    return ", ".join(map(str, ns)) or "none"


def _r(v: float) -> float:
    return round(float(v), 6)


def _rule(slack: float, unit: str) -> str:
    return "monotone" if slack == 0 else f"monotone within {slack:g}{unit}"


NOT_ENOUGH_N = "needs two round counts N with these numbers: run e.g. `dvc exp run -S 'regimes.run=[mima]' -S 'regimes.mima.rounds=[2,4,8]'`"


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    s = sorted(values)

    def q(p):
        k = (len(s) - 1) * p
        lo, hi = math.floor(k), math.ceil(k)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return q(0.25), q(0.5), q(0.75)


# ---------------------------------------------------------------- claims
def claim_cosines(points: list[Point], s: MimaSettings) -> Claim:
    text = "At N = 1 the pairwise cosines of the task vectors are near 0–0.1, and their median rises with N"
    ns, medians = _series(points, lambda p: median(p.pairs().values()) if p.pairs() else None)
    numbers = {"n": ns, "median_cosine": [_r(v) for v in medians], "n1_range": list(s.n1_cosine_range)}
    if not ns or ns[0] != 1:
        return Claim("001.1", text, None, numbers, "no N = 1 task-vector cosines (vectors/stats.json): run `dvc repro vectors`")
    lo, hi = s.n1_cosine_range
    near = lo <= medians[0] <= hi
    head = f"N=1 median {medians[0]:.3f} {'in' if near else 'outside'} [{lo:g}, {hi:g}]"
    if len(ns) < 2:
        return Claim("001.1", text, None, numbers, f"{head}; the rise with N {NOT_ENOUGH_N}")
    up = rises(medians, s.cosine_slack)
    numbers |= {"n1_near_zero": near, "median_rises": up}
    detail = f"{head}; median by N ({', '.join(f'N={n}: {m:.3f}' for n, m in zip(ns, medians))}) {'rises' if up else 'does not rise'} ({_rule(s.cosine_slack, '')}, last > first)"
    return Claim("001.1", text, near and up, numbers, detail)


def claim_related(points: list[Point], s: MimaSettings) -> Claim:
    a, b = s.related_pair
    text = f"Related tasks ({a} / {b}) have a higher N = 1 task-vector cosine than the median of the other pairs"
    pairs = points[0].pairs() if points and points[0].n == 1 else {}
    numbers: dict[str, Any] = {"pair": [a, b]}
    if not pairs:
        return Claim("001.2", text, None, numbers, "no N = 1 task-vector cosines (vectors/stats.json): run `dvc repro vectors`")
    key = (a, b) if (a, b) in pairs else (b, a) if (b, a) in pairs else None
    if key is None:
        return Claim("001.2", text, None, numbers, f"task {a!r} or {b!r} not in the N = 1 task vectors (suite.tasks: {', '.join(points[0].tasks or [])})")
    others = [v for k, v in pairs.items() if k != key]
    if not others:
        return Claim("001.2", text, None, numbers, "needs a third task for other pairs to compare with")
    pair, med = pairs[key], median(others)
    numbers |= {"pair_cosine": _r(pair), "others_median": _r(med), "others_max": _r(max(others)), "rank": 1 + sum(v > pair for v in others), "pairs": len(pairs)}
    rank = numbers["rank"]
    detail = f"cos({a}, {b}) = {pair:.3f} {'>' if pair > med else '≤'} median of the other {len(others)} pairs {med:.3f} (rank {rank} of {len(pairs)}; their max {max(others):.3f})"
    return Claim("001.2", text, pair > med, numbers, detail)


def claim_ua_individual(points: list[Point], s: MimaSettings) -> Claim:
    text = f"UA accuracy rises with N while the individual models' accuracy changes little (within {100 * s.individual_tolerance:.1f} points)"
    both = [p for p in points if p.accuracy.get("ua") is not None and p.individual_average is not None]
    ns, ua = _series(both, lambda p: p.accuracy["ua"])
    _, ind = _series(both, lambda p: p.individual_average)
    numbers: dict[str, Any] = {"n": ns, "ua": [_r(v) for v in ua], "individual": [_r(v) for v in ind], "individual_tolerance": s.individual_tolerance}
    if len(ns) < 2:
        return Claim("001.3", text, None, numbers, f"UA and individual accuracy at N = {_ns(ns)}; {NOT_ENOUGH_N}")
    up = rises(ua, s.accuracy_slack)
    span = max(ind) - min(ind)
    little = span <= s.individual_tolerance + 1e-12
    numbers |= {"ua_rises": up, "individual_span": _r(span), "individual_little_change": little}
    detail = (f"UA {_by_n(ns, ua)} {'rises' if up else 'does not rise'} ({_rule(100 * s.accuracy_slack, ' points')}, last > first); "
              f"individual {_by_n(ns, ind)}: span {100 * span:.1f} {'≤' if little else '>'} {100 * s.individual_tolerance:.1f} points")
    return Claim("001.3", text, up and little, numbers, detail, margin=ua[-1] - ua[0])


def claim_gap(points: list[Point], s: MimaSettings) -> Claim:
    text = "The gap between the individual models and UA shrinks with N"
    both = [p for p in points if p.accuracy.get("ua") is not None and p.individual_average is not None]
    ns, gap = _series(both, lambda p: p.individual_average - p.accuracy["ua"])
    numbers: dict[str, Any] = {"n": ns, "gap": [_r(v) for v in gap]}
    if len(ns) < 2:
        return Claim("001.4a", text, None, numbers, f"individual − UA at N = {_ns(ns)}; {NOT_ENOUGH_N}")
    down = shrinks(gap, s.accuracy_slack)
    return Claim("001.4a", text, down, numbers, f"individual − UA {_by_n(ns, gap)} points {'shrinks' if down else 'does not shrink'} ({_rule(100 * s.accuracy_slack, ' points')}, last < first)", margin=gap[0] - gap[-1])


def claim_advantage(points: list[Point], s: MimaSettings, role: str, cid: str) -> Claim:
    name = ROLE_NAMES[role]
    method = ROLES[role]
    text = f"{'Task arithmetic’s' if role == 'ta' else 'TIES’'} advantage over UA shrinks with N"
    both = [p for p in points if p.accuracy.get("ua") is not None and p.accuracy.get(role) is not None]
    ns, adv = _series(both, lambda p: p.accuracy[role] - p.accuracy["ua"])
    numbers: dict[str, Any] = {"n": ns, "advantage": [_r(v) for v in adv]}
    if len(ns) < 2:
        return Claim(cid, text, None, numbers, f"{name} − UA at N = {_ns(ns)}; {NOT_ENOUGH_N} (and {method} in merge.methods / regimes.mima.methods)")
    down = shrinks(adv, s.accuracy_slack)
    return Claim(cid, text, down, numbers, f"{name} − UA {_by_n(ns, adv)} points {'shrinks' if down else 'does not shrink'} ({_rule(100 * s.accuracy_slack, ' points')}, last < first)", margin=adv[0] - adv[-1])


def claim_lambda(points: list[Point], s: MimaSettings, n_tasks: int) -> Claim:
    text = "Task arithmetic’s chosen λ falls toward 1/T with N"
    target = 1.0 / n_tasks
    ns, lams = _series(points, lambda p: p.lam.get("ta"))
    numbers: dict[str, Any] = {"n": ns, "lam": lams, "one_over_t": _r(target)}
    if len(ns) < 2:
        return Claim("001.4d", text, None, numbers, f"task arithmetic's λ at N = {_ns(ns)}; {NOT_ENOUGH_N} (and task_arithmetic in merge.methods / regimes.mima.methods)")
    falls = all(b <= a for a, b in zip(lams, lams[1:]))
    closer = abs(lams[-1] - target) < abs(lams[0] - target)
    numbers |= {"never_rises": falls, "closer_to_one_over_t": closer}
    detail = (f"λ {', '.join(f'N={n}: {v:g}' for n, v in zip(ns, lams))}; 1/T = {target:.3f}: "
              f"{'never rises' if falls else 'rises at some step'}, distance to 1/T {abs(lams[0] - target):.3f} → {abs(lams[-1] - target):.3f} ({'closer' if closer else 'not closer'})")
    return Claim("001.4d", text, falls and closer, numbers, detail)


def round_medians(point: Point) -> tuple[list[int], list[float], list[float]]:
    rounds, upd, tv = [], [], []
    for r in point.rounds or []:
        u = [v for v in (r.get("update_cosines") or {}).values() if isinstance(v, (int, float)) and math.isfinite(v)]
        t = [v for v in (r.get("task_vector_cosines") or {}).values() if isinstance(v, (int, float)) and math.isfinite(v)]
        if u and t:
            rounds.append(int(r["round"]))
            upd.append(median(u))
            tv.append(median(t))
    return rounds, upd, tv


def claim_rounds(points: list[Point], s: MimaSettings) -> tuple[Claim, Point | None]:
    text = "The per-round updates δ_t(i) of different tasks stay near-orthogonal while cos(τ_t(i)) rises with round i"
    with_rounds = [p for p in points if p.n >= 2 and len(round_medians(p)[0]) >= 2]
    if not with_rounds:
        return Claim("001.5", text, None, {}, f"no per-round records of a MIMA variant with N ≥ 2 (metrics/regime/{REGIME}.json): run e.g. `dvc exp run -S 'regimes.run=[mima]' -S 'regimes.mima.rounds=[2,4,8]'`"), None
    point = max(with_rounds, key=lambda p: p.n)
    rounds, upd, tv = round_medians(point)
    bound = s.update_cosine_bound
    orth = all(abs(u) <= bound for u in upd)
    up = rises(tv, s.cosine_slack)
    numbers = {"n": point.n, "round": rounds, "update_median_cosine": [_r(v) for v in upd], "task_vector_median_cosine": [_r(v) for v in tv], "update_bound": bound, "updates_orthogonal": orth, "task_vectors_rise": up}
    detail = (f"N = {point.n}: median cos(δ) by round {_fmt(upd)} {'all within' if orth else 'not all within'} ±{bound:g}; "
              f"median cos(τ) by round {_fmt(tv)} {'rises' if up else 'does not rise'} ({_rule(s.cosine_slack, '')}, last > first)")
    return Claim("001.5", text, orth and up, numbers, detail), point


# ---------------------------------------------------------------- figures
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


COLOURS = {"ua": "#1f77b4", "ta": "#ff7f0e", "ties": "#2ca02c", "individual": "#444444"}


def plot_cosines(points: list[Point], s: MimaSettings, path: Path) -> bool:
    data = [(p, p.pairs()) for p in points if p.pairs()]
    if not data:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(min(max(4.8, 2.4 + 1.1 * len(data)), 12.0), 4.6), layout="constrained")
    values = [list(pairs.values()) for _, pairs in data]
    ax.boxplot(values, positions=range(len(data)), widths=0.55, showfliers=False, medianprops={"color": "black"})
    a, b = s.related_pair
    related_label = f"{a} / {b}"
    shown_related = False
    for x, (p, pairs) in enumerate(data):
        k = len(pairs)
        for j, (key, v) in enumerate(pairs.items()):
            related = set(key) == {a, b}
            dx = (j / max(k - 1, 1) - 0.5) * 0.3
            ax.scatter(x + dx, v, s=26 if related else 12, color="#d62728" if related else "#7f7f7f", zorder=3, alpha=1 if related else 0.6,
                       label=related_label if related and not shown_related else None)
            shown_related |= related
    lo, hi = s.n1_cosine_range
    ax.axhspan(lo, hi, color="#1f77b4", alpha=0.08, label=f"claim 1's N = 1 range [{lo:g}, {hi:g}]")
    ax.axhline(0, color="#999999", lw=0.8)
    ax.set_xticks(range(len(data)), [f"N = {p.n}" + ("\n(standard)" if p.source == "standard fine-tune" else "") for p, _ in data])
    ax.set_xlabel("MIMA rounds N (same total steps)")
    ax.set_ylabel("pairwise cosine of task vectors τ_t")
    ax.set_title("Pairwise task-vector cosines per N\n(as the seed's Fig. 5; dots: the pairs)")
    fig.legend(loc="outside lower center", fontsize=8, frameon=False, ncol=2)
    fig.savefig(path, dpi=130, format="png")
    plt.close(fig)
    return True


def plot_accuracy(points: list[Point], path: Path) -> bool:
    series = {role: _series(points, (lambda p, r=role: p.individual_average if r == "individual" else p.accuracy.get(r))) for role in ("individual", "ua", "ta", "ties")}
    if not any(ns for ns, _ in series.values()):
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.4, 4.2), layout="constrained")
    for role, (ns, vs) in series.items():
        if ns:
            ax.plot(ns, [100 * v for v in vs], marker="o", color=COLOURS[role], label=f"{ROLE_NAMES[role]} (ours)")
        pn = sorted(PAPER_VIT_B32)
        ax.plot(pn, [100 * PAPER_VIT_B32[n][role] for n in pn], ls=":", marker=".", color=COLOURS[role], alpha=0.7, label=f"{ROLE_NAMES[role]} (seed, ViT-B/32)")
    ax.set_xscale("log", base=2)
    ticks = sorted({p.n for p in points} | set(PAPER_VIT_B32))
    ax.set_xticks(ticks, [str(n) for n in ticks])
    ax.minorticks_off()
    ax.set_xlabel("MIMA rounds N (same total steps)")
    ax.set_ylabel("average test accuracy (%)")
    ax.set_title("Accuracy against N: ours (solid) and the seed's Table 1 (dotted)")
    ax.legend(fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=130, format="png")
    plt.close(fig)
    return True


def plot_rounds(point: Point, s: MimaSettings, path: Path) -> bool:
    records = [r for r in point.rounds or [] if r.get("update_cosines") and r.get("task_vector_cosines")]
    if not records:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(min(2.0 + 0.9 * len(records), 12.0), 4.0), layout="constrained")
    xs = list(range(len(records)))
    upd = [list(r["update_cosines"].values()) for r in records]
    tv = [list(r["task_vector_cosines"].values()) for r in records]
    b1 = ax.boxplot(upd, positions=[x - 0.18 for x in xs], widths=0.3, showfliers=False, patch_artist=True, medianprops={"color": "black"})
    b2 = ax.boxplot(tv, positions=[x + 0.18 for x in xs], widths=0.3, showfliers=False, patch_artist=True, medianprops={"color": "black"})
    for box in b1["boxes"]:
        box.set_facecolor("#9ecae1")
    for box in b2["boxes"]:
        box.set_facecolor("#fdae6b")
    ax.axhspan(-s.update_cosine_bound, s.update_cosine_bound, color="#9ecae1", alpha=0.12)
    ax.axhline(0, color="#999999", lw=0.8)
    ax.set_xticks(xs, [str(r["round"]) for r in records])
    ax.set_xlabel(f"round i (N = {point.n})")
    ax.set_ylabel("pairwise cosine")
    ax.set_title(f"Per-round cosines, N = {point.n} (seed 001, Fig. 11)")
    ax.legend([b1["boxes"][0], b2["boxes"][0]], ["updates δ_t(i)", "task vectors τ_t(i)"], loc="upper left", fontsize=8, frameon=False)
    fig.savefig(path, dpi=130, format="png")
    plt.close(fig)
    return True


# ---------------------------------------------------------------- report body
def _accuracy_table(points: list[Point]) -> str:
    ours = {p.n: p for p in points}
    ns = sorted(set(ours) | set(PAPER_VIT_B32))
    head = "| N | source | UA ours | UA seed | TA ours | TA seed | TIES ours | TIES seed | individual ours | individual seed | TA λ ours | TA λ seed |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for n in ns:
        p, paper = ours.get(n), PAPER_VIT_B32.get(n, {})
        acc = p.accuracy if p else {}
        lam = p.lam.get("ta") if p else None
        cells = [str(n), p.source if p else "not run"]
        for role in ("ua", "ta", "ties"):
            cells += [_pct(acc.get(role)), _pct(paper.get(role))]
        cells += [_pct(p.individual_average if p else None), _pct(paper.get("individual")), "—" if lam is None else f"{lam:g}", "—" if "ta_lam" not in paper else f"{paper['ta_lam']:g}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cosine_table(points: list[Point], s: MimaSettings) -> str:
    a, b = s.related_pair
    lines = [f"| N | pairs | median | IQR | min | max | cos({a}, {b}) |", "|---|---|---|---|---|---|---|"]
    for p in points:
        pairs = p.pairs()
        if not pairs:
            continue
        q1, med, q3 = _quartiles(list(pairs.values()))
        rel = pairs.get((a, b), pairs.get((b, a)))
        lines.append(f"| {p.n} | {len(pairs)} | {med:.3f} | {q1:.3f} – {q3:.3f} | {min(pairs.values()):.3f} | {max(pairs.values()):.3f} | {'—' if rel is None else f'{rel:.3f}'} |")
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def _rounds_table(point: Point) -> str:
    lines = ["| round | median cos(δ) | median cos(τ) | mean ‖δ‖ | mean ‖τ‖ |", "|---|---|---|---|---|"]
    for r in point.rounds or []:
        u = list((r.get("update_cosines") or {}).values())
        t = list((r.get("task_vector_cosines") or {}).values())
        un = list((r.get("update_norms") or {}).values())
        tn = list((r.get("task_vector_norms") or {}).values())

        def m(v):
            return "—" if not v else f"{median(v):.3f}"

        def mean(v):
            return "—" if not v else f"{sum(v) / len(v):.4g}"

        lines.append(f"| {r.get('round')} | {m(u)} | {m(t)} | {mean(un)} | {mean(tn)} |")
    return "\n".join(lines) + "\n"


@register("mima", paper="Seed 001: MIMA, Iterative model averaging and fine-tuning for multi-task learning (under review)",
          title="MIMA: does iterated averaging align task vectors and close the merging gap?", settings=MimaSettings)
def mima_study(context: StudyContext) -> StudyResult:
    s: MimaSettings = context.settings
    points, notes = collect(context)
    n_tasks = len(context.params.suite.tasks)
    round_claim, round_point = claim_rounds(points, s)
    claims = [
        claim_cosines(points, s),
        claim_related(points, s),
        claim_ua_individual(points, s),
        claim_gap(points, s),
        claim_advantage(points, s, "ta", "001.4b"),
        claim_advantage(points, s, "ties", "001.4c"),
        claim_lambda(points, s, n_tasks),
        round_claim,
    ]
    out = Path(context.out_dir)
    figures = []
    if plot_cosines(points, s, out / "cosine_by_n.png"):
        figures.append("cosine_by_n.png")
    if plot_accuracy(points, out / "accuracy_by_n.png"):
        figures.append("accuracy_by_n.png")
    rounds_name = f"rounds_n{round_point.n}.png" if round_point else None
    if round_point and plot_rounds(round_point, s, out / rounds_name):
        figures.append(rounds_name)

    n1 = points[0]
    body = [
        f"N = 1 is {'the regime variant `mima_n1`' if n1.source != 'standard fine-tune' else 'the standard fine-tune (vectors/, metrics/finetune/, metrics/evaluate/)'}: "
        "the seed's \"N = 1 corresponds to the standard, independent fine-tuning baseline\". Every N has the same per-task budget "
        f"S = finetune.steps = {context.params.finetune.steps} steps, K = S/N a round. UA is the uniform average of the task models "
        "(weight_averaging); TA and TIES choose their hyperparameters on validation. Accuracies are test averages over "
        f"our {n_tasks} tasks; the seed's are ViT-B/32 on its {PAPER_T} tasks (Table 1; TA's λ from Table 2).",
        "",
        f"Rules: a sequence over N ascending (or over rounds) *rises* when no step goes down by more than the slack "
        f"(accuracy {100 * s.accuracy_slack:g} points, cosine {s.cosine_slack:g}) and the last value is above the first; *shrinks* is the mirror. "
        "A claim needs two round counts with its numbers (claim 5: two rounds of the largest N), else it is *not measured*.",
        "",
    ]
    if notes:
        body += ["Missing inputs:", ""] + [f"- {n}" for n in notes] + [""]
    body += ["## Accuracy against N (%): ours and the seed's", "", _accuracy_table(points)]
    if "accuracy_by_n.png" in figures:
        body += ["![accuracy against N](accuracy_by_n.png)", ""]
    body += ["## Pairwise cosines of the task vectors per N", ""]
    table = _cosine_table(points, s)
    body += [table] if table else ["No task-vector statistics were found.", ""]
    if "cosine_by_n.png" in figures:
        body += ["![pairwise cosines per N](cosine_by_n.png)", ""]
    if round_point is not None:
        body += [f"## Per-round updates and task vectors, N = {round_point.n}", "",
                 "δ_t(i) = θ_t(i) − θ̄(i−1), the round's update; τ_t(i) = θ_t(i) − θ0 (seed 001, eqs. 5 and 8; Appendix C.2).", "",
                 _rounds_table(round_point)]
        if rounds_name in figures:
            body += [f"![per-round cosines]({rounds_name})", ""]
    return StudyResult(claims=claims, body="\n".join(body), figures=figures)
