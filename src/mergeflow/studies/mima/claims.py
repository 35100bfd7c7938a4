"""Study mima: the rules (rises, shrinks) and each claim's verdict from the measurements."""

from __future__ import annotations

import math
from statistics import median
from typing import Any

from mergeflow.studies import Claim
from mergeflow.studies.mima.measure import REGIME, ROLE_NAMES, ROLES, MimaSettings, Point


def rises(values: list[float], slack: float = 0.0) -> bool:
    """No step down by more than ``slack``, and the last value above the first."""
    return len(values) >= 2 and all(b >= a - slack for a, b in zip(values, values[1:])) and values[-1] > values[0]


def shrinks(values: list[float], slack: float = 0.0) -> bool:
    return rises([-v for v in values], slack)


def series(points: list[Point], value) -> tuple[list[int], list[float]]:
    ns, vs = [], []
    for p in points:
        v = value(p)
        if v is not None and math.isfinite(v):
            ns.append(p.n)
            vs.append(float(v))
    return ns, vs


def pct(v: float | None, digits: int = 1) -> str:
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


NOT_ENOUGH_N = (
    "needs two round counts N with these numbers: run e.g. `dvc exp run -S 'regimes.run=[mima]' -S "
    "'regimes.mima.rounds=[2,4,8]'`"
)


def quartiles(values: list[float]) -> tuple[float, float, float]:
    s = sorted(values)

    def q(p):
        k = (len(s) - 1) * p
        lo, hi = math.floor(k), math.ceil(k)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return q(0.25), q(0.5), q(0.75)


# ---------------------------------------------------------------- claims
def claim_cosines(points: list[Point], s: MimaSettings) -> Claim:
    text = "At N = 1 the pairwise cosines of the task vectors are near 0–0.1, and their median rises with N"
    ns, medians = series(points, lambda p: median(p.pairs().values()) if p.pairs() else None)
    numbers = {"n": ns, "median_cosine": [_r(v) for v in medians], "n1_range": list(s.n1_cosine_range)}
    if not ns or ns[0] != 1:
        return Claim(
            "001.1", text, None, numbers, "no N = 1 task-vector cosines (vectors/stats.json): run `dvc repro vectors`"
        )
    lo, hi = s.n1_cosine_range
    near = lo <= medians[0] <= hi
    head = f"N=1 median {medians[0]:.3f} {'in' if near else 'outside'} [{lo:g}, {hi:g}]"
    if len(ns) < 2:
        return Claim("001.1", text, None, numbers, f"{head}; the rise with N {NOT_ENOUGH_N}")
    up = rises(medians, s.cosine_slack)
    numbers |= {"n1_near_zero": near, "median_rises": up}
    detail = (
        f"{head}; median by N ({', '.join(f'N={n}: {m:.3f}' for n, m in zip(ns, medians))}) "
        f"{'rises' if up else 'does not rise'} ({_rule(s.cosine_slack, '')}, last > first)"
    )
    return Claim("001.1", text, near and up, numbers, detail)


def claim_related(points: list[Point], s: MimaSettings) -> Claim:
    a, b = s.related_pair
    text = f"Related tasks ({a} / {b}) have a higher N = 1 task-vector cosine than the median of the other pairs"
    pairs = points[0].pairs() if points and points[0].n == 1 else {}
    numbers: dict[str, Any] = {"pair": [a, b]}
    if not pairs:
        return Claim(
            "001.2", text, None, numbers, "no N = 1 task-vector cosines (vectors/stats.json): run `dvc repro vectors`"
        )
    key = (a, b) if (a, b) in pairs else (b, a) if (b, a) in pairs else None
    if key is None:
        return Claim(
            "001.2",
            text,
            None,
            numbers,
            f"task {a!r} or {b!r} not in the N = 1 task vectors (suite.tasks: {', '.join(points[0].tasks or [])})",
        )
    others = [v for k, v in pairs.items() if k != key]
    if not others:
        return Claim("001.2", text, None, numbers, "needs a third task for other pairs to compare with")
    pair, med = pairs[key], median(others)
    numbers |= {
        "pair_cosine": _r(pair),
        "others_median": _r(med),
        "others_max": _r(max(others)),
        "rank": 1 + sum(v > pair for v in others),
        "pairs": len(pairs),
    }
    rank = numbers["rank"]
    detail = (
        f"cos({a}, {b}) = {pair:.3f} {'>' if pair > med else '≤'} median of the other {len(others)} pairs {med:.3f} "
        f"(rank {rank} of {len(pairs)}; their max {max(others):.3f})"
    )
    return Claim("001.2", text, pair > med, numbers, detail)


def claim_ua_individual(points: list[Point], s: MimaSettings) -> Claim:
    text = (
        "UA accuracy rises with N while the individual models' accuracy changes little (within "
        f"{100 * s.individual_tolerance:.1f} points)"
    )
    both = [p for p in points if p.accuracy.get("ua") is not None and p.individual_average is not None]
    ns, ua = series(both, lambda p: p.accuracy["ua"])
    _, ind = series(both, lambda p: p.individual_average)
    numbers: dict[str, Any] = {
        "n": ns,
        "ua": [_r(v) for v in ua],
        "individual": [_r(v) for v in ind],
        "individual_tolerance": s.individual_tolerance,
    }
    if len(ns) < 2:
        return Claim("001.3", text, None, numbers, f"UA and individual accuracy at N = {_ns(ns)}; {NOT_ENOUGH_N}")
    up = rises(ua, s.accuracy_slack)
    span = max(ind) - min(ind)
    little = span <= s.individual_tolerance + 1e-12
    numbers |= {"ua_rises": up, "individual_span": _r(span), "individual_little_change": little}
    detail = (
        f"UA {_by_n(ns, ua)} {'rises' if up else 'does not rise'} "
        f"({_rule(100 * s.accuracy_slack, ' points')}, last > first); "
        f"individual {_by_n(ns, ind)}: span {100 * span:.1f} {'≤' if little else '>'} "
        f"{100 * s.individual_tolerance:.1f} points"
    )
    return Claim("001.3", text, up and little, numbers, detail, margin=ua[-1] - ua[0])


def claim_gap(points: list[Point], s: MimaSettings) -> Claim:
    text = "The gap between the individual models and UA shrinks with N"
    both = [p for p in points if p.accuracy.get("ua") is not None and p.individual_average is not None]
    ns, gap = series(both, lambda p: p.individual_average - p.accuracy["ua"])
    numbers: dict[str, Any] = {"n": ns, "gap": [_r(v) for v in gap]}
    if len(ns) < 2:
        return Claim("001.4a", text, None, numbers, f"individual − UA at N = {_ns(ns)}; {NOT_ENOUGH_N}")
    down = shrinks(gap, s.accuracy_slack)
    return Claim(
        "001.4a",
        text,
        down,
        numbers,
        f"individual − UA {_by_n(ns, gap)} points {'shrinks' if down else 'does not shrink'} "
        f"({_rule(100 * s.accuracy_slack, ' points')}, last < first)",
        margin=gap[0] - gap[-1],
    )


def claim_advantage(points: list[Point], s: MimaSettings, role: str, cid: str) -> Claim:
    name = ROLE_NAMES[role]
    method = ROLES[role]
    text = f"{'Task arithmetic’s' if role == 'ta' else 'TIES’'} advantage over UA shrinks with N"
    both = [p for p in points if p.accuracy.get("ua") is not None and p.accuracy.get(role) is not None]
    ns, adv = series(both, lambda p: p.accuracy[role] - p.accuracy["ua"])
    numbers: dict[str, Any] = {"n": ns, "advantage": [_r(v) for v in adv]}
    if len(ns) < 2:
        return Claim(
            cid,
            text,
            None,
            numbers,
            f"{name} − UA at N = {_ns(ns)}; {NOT_ENOUGH_N} (and {method} in merge.methods / regimes.mima.methods)",
        )
    down = shrinks(adv, s.accuracy_slack)
    return Claim(
        cid,
        text,
        down,
        numbers,
        f"{name} − UA {_by_n(ns, adv)} points {'shrinks' if down else 'does not shrink'} "
        f"({_rule(100 * s.accuracy_slack, ' points')}, last < first)",
        margin=adv[0] - adv[-1],
    )


def claim_lambda(points: list[Point], s: MimaSettings, n_tasks: int) -> Claim:
    text = "Task arithmetic’s chosen λ falls toward 1/T with N"
    target = 1.0 / n_tasks
    ns, lams = series(points, lambda p: p.lam.get("ta"))
    numbers: dict[str, Any] = {"n": ns, "lam": lams, "one_over_t": _r(target)}
    if len(ns) < 2:
        return Claim(
            "001.4d",
            text,
            None,
            numbers,
            f"task arithmetic's λ at N = {_ns(ns)}; {NOT_ENOUGH_N} (and "
            "task_arithmetic in merge.methods / regimes.mima.methods)",
        )
    falls = all(b <= a for a, b in zip(lams, lams[1:]))
    closer = abs(lams[-1] - target) < abs(lams[0] - target)
    numbers |= {"never_rises": falls, "closer_to_one_over_t": closer}
    detail = (
        f"λ {', '.join(f'N={n}: {v:g}' for n, v in zip(ns, lams))}; 1/T = {target:.3f}: "
        f"{'never rises' if falls else 'rises at some step'}, distance to 1/T {abs(lams[0] - target):.3f} → "
        f"{abs(lams[-1] - target):.3f} ({'closer' if closer else 'not closer'})"
    )
    return Claim("001.4d", text, falls and closer, numbers, detail)


def round_medians(point: Point) -> tuple[list[int], list[float], list[float]]:
    rounds, upd, tv = [], [], []
    for r in point.rounds or []:
        u = [v for v in (r.get("update_cosines") or {}).values() if isinstance(v, (int, float)) and math.isfinite(v)]
        t = [
            v for v in (r.get("task_vector_cosines") or {}).values() if isinstance(v, (int, float)) and math.isfinite(v)
        ]
        if u and t:
            rounds.append(int(r["round"]))
            upd.append(median(u))
            tv.append(median(t))
    return rounds, upd, tv


def claim_rounds(points: list[Point], s: MimaSettings) -> tuple[Claim, Point | None]:
    text = "The per-round updates δ_t(i) of different tasks stay near-orthogonal while cos(τ_t(i)) rises with round i"
    with_rounds = [p for p in points if p.n >= 2 and len(round_medians(p)[0]) >= 2]
    if not with_rounds:
        return Claim(
            "001.5",
            text,
            None,
            {},
            f"no per-round records of a MIMA variant with N ≥ 2 (metrics/regime/{REGIME}.json): run e.g. `dvc exp run "
            "-S 'regimes.run=[mima]' -S 'regimes.mima.rounds=[2,4,8]'`",
        ), None
    point = max(with_rounds, key=lambda p: p.n)
    rounds, upd, tv = round_medians(point)
    bound = s.update_cosine_bound
    orth = all(abs(u) <= bound for u in upd)
    up = rises(tv, s.cosine_slack)
    numbers = {
        "n": point.n,
        "round": rounds,
        "update_median_cosine": [_r(v) for v in upd],
        "task_vector_median_cosine": [_r(v) for v in tv],
        "update_bound": bound,
        "updates_orthogonal": orth,
        "task_vectors_rise": up,
    }
    detail = (
        f"N = {point.n}: median cos(δ) by round {_fmt(upd)} {'all within' if orth else 'not all within'} ±{bound:g}; "
        f"median cos(τ) by round {_fmt(tv)} {'rises' if up else 'does not rise'} "
        f"({_rule(s.cosine_slack, '')}, last > first)"
    )
    return Claim("001.5", text, orth and up, numbers, detail), point
