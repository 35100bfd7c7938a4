"""Study ``ctl``'s summaries of the per-example measurements and its claims, pure functions of them."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from statistics import mean
from typing import Any, TYPE_CHECKING


from mergeflow.studies import Claim
from mergeflow.studies.ctl.metric import recovery
from mergeflow.studies.ctl.settings import CtlSettings

if TYPE_CHECKING:
    import torch


def _r(v: float) -> float:
    return round(float(v), 6)


def quartiles(v: torch.Tensor) -> tuple[float, float, float]:
    import torch

    q = torch.quantile(v.to(torch.float64), torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64))
    return float(q[0]), float(q[1]), float(q[2])


def summarise(terms: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, Any]:
    """Pooled over pairs (their examples concatenated): mean and quartiles of d and baseline, median and quartiles of
    coef."""
    import torch

    d = torch.cat([t["d"] for t in terms])
    b = torch.cat([t["baseline"] for t in terms])
    c = torch.cat([t["coef"] for t in terms])
    return {
        "d": _r(d.mean()),
        "d_q": [_r(v) for v in quartiles(d)],
        "baseline": _r(b.mean()),
        "baseline_q": [_r(v) for v in quartiles(b)],
        "coef_median": _r(quartiles(c)[1]),
        "coef_q": [_r(v) for v in quartiles(c)],
    }


def small_against_baseline(
    layers: Sequence[Mapping[str, Any]], ratio: float, coef_tolerance: float
) -> tuple[bool, bool]:
    """(mean d <= ratio x mean baseline at every layer, median coef within 1 +- tolerance at every layer)."""
    return (
        all(L["d"] <= ratio * L["baseline"] + 1e-12 for L in layers),
        all(abs(L["coef_median"] - 1) <= coef_tolerance + 1e-12 for L in layers),
    )


def _join(values, fmt: str = ".3g") -> str:
    return ", ".join(format(v, fmt) for v in values)


def _worst(layers: Sequence[Mapping[str, Any]]) -> tuple[int, float]:
    ratios = [L["d"] / L["baseline"] if L["baseline"] > 0 else math.inf for L in layers]
    i = max(range(len(ratios)), key=ratios.__getitem__)
    return i, ratios[i]


def claim_ctl(per_alpha: Mapping[float, list[Mapping[str, Any]]], s: CtlSettings) -> Claim:
    text = (
        "Cross-task linearity: f_l(αθi + (1−α)θj) ≈ αf_l(θi) + (1−α)f_l(θj) at every layer, d_l near 0 against the "
        "baseline 1 − cos(f_l(θi), f_l(θj))"
    )
    oks = {a: small_against_baseline(L, s.ctl_ratio, s.coef_tolerance)[0] for a, L in per_alpha.items()}
    worst = {a: _worst(L) for a, L in per_alpha.items()}
    a_w = max(worst, key=lambda a: worst[a][1])
    numbers = {
        "alphas": list(per_alpha),
        "d": {str(a): [L["d"] for L in Ls] for a, Ls in per_alpha.items()},
        "baseline": [L["baseline"] for L in next(iter(per_alpha.values()))],
        "ctl_ratio": s.ctl_ratio,
        "worst_d_over_baseline": _r(worst[a_w][1]),
    }
    detail = (
        f"mean d_l at α = 0.5: {_join(L['d'] for L in per_alpha[0.5])} against baseline "
        f"{_join(L['baseline'] for L in per_alpha[0.5])} "
        f"(blocks 0–{len(per_alpha[0.5]) - 1}); worst d/baseline "
        f"{worst[a_w][1]:.3f} (block {worst[a_w][0]}, α = {a_w:g}) "
        f"{'≤' if all(oks.values()) else '>'} {s.ctl_ratio:g}"
    )
    return Claim("003.1", text, all(oks.values()), numbers, detail)


def claim_coef(per_alpha: Mapping[float, list[Mapping[str, Any]]], s: CtlSettings) -> Claim:
    text = "The features' lengths agree too: coef = ‖f_l(θα)‖ cos / ‖αf_l(θi) + (1−α)f_l(θj)‖ ≈ 1"
    meds = {a: [L["coef_median"] for L in Ls] for a, Ls in per_alpha.items()}
    flat = [m for ms in meds.values() for m in ms]
    far = max(flat, key=lambda m: abs(m - 1))
    holds = all(small_against_baseline(L, s.ctl_ratio, s.coef_tolerance)[1] for L in per_alpha.values())
    numbers = {"coef_median": {str(a): v for a, v in meds.items()}, "coef_tolerance": s.coef_tolerance}
    detail = (
        f"median coef at α = 0.5: {', '.join(f'{m:.3f}' for m in meds[0.5])}; "
        f"farthest from 1 over layers and α: {far:.3f} "
        f"({'within' if holds else 'outside'} 1 ± {s.coef_tolerance:g})"
    )
    return Claim("003.2", text, holds, numbers, detail)


def claim_average(per_k: Mapping[int, list[Mapping[str, Any]]], s: CtlSettings) -> Claim:
    text = (
        "Averaging k models averages their features: f_l(mean θ) ≈ mean "
        "f_l(θt) (k = 3–5), d near 0 against the baseline, coef ≈ 1"
    )
    if not per_k:
        return Claim("003.3", text, None, {}, "needs at least 3 tasks")
    checks = {k: small_against_baseline(L, s.ctl_ratio, s.coef_tolerance) for k, L in per_k.items()}
    holds = all(a and b for a, b in checks.values())
    numbers = {
        "k": list(per_k),
        "d": {str(k): [L["d"] for L in Ls] for k, Ls in per_k.items()},
        "baseline": {str(k): [L["baseline"] for L in Ls] for k, Ls in per_k.items()},
        "coef_median": {str(k): [L["coef_median"] for L in Ls] for k, Ls in per_k.items()},
    }
    detail = "; ".join(
        f"k = {k}: worst d/baseline {_worst(Ls)[1]:.3f} ({'≤' if checks[k][0] else '>'} {s.ctl_ratio:g}), median coef "
        f"{min(L['coef_median'] for L in Ls):.3f}–{max(L['coef_median'] for L in Ls):.3f}"
        for k, Ls in per_k.items()
    )
    return Claim("003.3", text, holds, numbers, detail)


def _arith_claim(cid: str, text: str, layers: list[Mapping[str, Any]], s: CtlSettings, lam: float) -> Claim:
    small, coef = small_against_baseline(layers, s.ctl_ratio, s.coef_tolerance)
    i, w = _worst(layers)
    numbers = {
        "lam": lam,
        "d": [L["d"] for L in layers],
        "baseline": [L["baseline"] for L in layers],
        "coef_median": [L["coef_median"] for L in layers],
    }
    detail = (
        f"λ = {lam:g}: mean d_l {_join(L['d'] for L in layers)} against baseline "
        f"{_join(L['baseline'] for L in layers)}; "
        f"worst d/baseline {w:.3f} (block {i}, {'≤' if small else '>'} {s.ctl_ratio:g}); median coef "
        f"{min(L['coef_median'] for L in layers):.3f}–"
        f"{max(L['coef_median'] for L in layers):.3f} ({'within' if coef else 'outside'} 1 ± {s.coef_tolerance:g})"
    )
    return Claim(cid, text, small and coef, numbers, detail)


def claim_addition(layers, s: CtlSettings, lam: float) -> Claim:
    return _arith_claim(
        "003.4",
        "Addition in weights is addition in features: f_l(θ0 + λ(τi + τj)) ≈ ½f_l(θ0 + 2λτi) + ½f_l(θ0 + 2λτj)",
        layers,
        s,
        lam,
    )


def claim_negation(layers, s: CtlSettings, lam: float) -> Claim:
    return _arith_claim(
        "003.5",
        "Negation in weights is negation in features: f_l(θ0) ≈ ½f_l(θ0 + λτi) + ½f_l(θ0 − λτi)",
        layers,
        s,
        lam,
    )


def claim_barrier(barriers: Sequence[float], ctl_holds: bool | None, s: CtlSettings) -> Claim:
    text = (
        "Cross-task linearity holds without linear mode connectivity: "
        "at α = 0.5 the loss on Di ∪ Dj rises above the endpoints' mean"
    )
    b = mean(barriers)
    high = b > s.barrier_tolerance
    numbers = {
        "barriers": [_r(v) for v in barriers],
        "mean_barrier": _r(b),
        "barrier_tolerance": s.barrier_tolerance,
        "ctl_holds": ctl_holds,
        "pairs_above": sum(v > s.barrier_tolerance for v in barriers),
    }
    detail = (
        f"barrier L(θ0.5) − ½(L(θi) + L(θj)), mean over {len(barriers)} pairs "
        f"{b:+.4f} nats ({'>' if high else '≤'} {s.barrier_tolerance:g}; "
        f"{numbers['pairs_above']} of {len(barriers)} pairs above, range {min(barriers):+.3f} to "
        f"{max(barriers):+.3f}); CTL (003.1) {'holds' if ctl_holds else 'fails'}"
    )
    return Claim("003.6", text, bool(high and ctl_holds), numbers, detail)


def claim_stitching(rows: Sequence[Mapping[str, Any]], s: CtlSettings) -> Claim:
    text = (
        "Stitching the averaged features ½f_l(θ0 + λτi) + ½f_l(θ0 + λτj) "
        "into θ0 at a middle layer gives a model that does both tasks"
    )
    avg = [r["avg_i"] for r in rows] + [r["avg_j"] for r in rows]
    own = [r["own_i"] for r in rows] + [r["own_j"] for r in rows]
    other = [r["other_i"] for r in rows] + [r["other_j"] for r in rows]
    rec = recovery(avg, own, other)
    holds = math.isfinite(rec) and rec >= s.stitch_recovery
    numbers = {
        "recovery": _r(rec) if math.isfinite(rec) else None,
        "stitch_recovery": s.stitch_recovery,
        "layer": rows[0]["layer"] if rows else None,
        "mean_accuracy": {
            "stitched_average": _r(mean(avg)),
            "own_task_stitched": _r(mean(own)),
            "other_task_stitched": _r(mean(other)),
        },
    }
    detail = (
        f"block {numbers['layer']}, {len(rows)} pairs × 2 tasks: mean accuracy "
        f"stitched average {100 * mean(avg):.1f}, own task's stitched model "
        f"{100 * mean(own):.1f}, other task's {100 * mean(other):.1f}; "
        f"recovery {rec:.2f} ({'≥' if holds else '<'} {s.stitch_recovery:g})"
    )
    return Claim("003.7", text, holds, numbers, detail)


def claim_scratch(
    pair: tuple[str, str],
    scratch: list[Mapping[str, Any]],
    control: list[Mapping[str, Any]],
    acc: Mapping[str, Mapping[str, float]],
    s: CtlSettings,
    distance: Mapping[str, float] | None = None,
) -> Claim:
    text = (
        "Without pretraining, cross-task linearity is much weaker: the "
        "same pair trained from a common random init has a far larger d_l"
    )
    ds, dc = mean(L["d"] for L in scratch), mean(L["d"] for L in control)
    factor = ds / dc if dc > 0 else math.inf
    holds = factor >= s.weaker_factor
    numbers = {
        "pair": list(pair),
        "d_scratch": [L["d"] for L in scratch],
        "d_finetuned": [L["d"] for L in control],
        "baseline_scratch": [L["baseline"] for L in scratch],
        "baseline_finetuned": [L["baseline"] for L in control],
        "coef_scratch": [L["coef_median"] for L in scratch],
        "coef_finetuned": [L["coef_median"] for L in control],
        "factor": _r(factor) if math.isfinite(factor) else "inf",
        "weaker_factor": s.weaker_factor,
        "accuracy": {k: {t: _r(v) for t, v in a.items()} for k, a in acc.items()},
        "relative_distance": dict(distance or {}),
    }
    detail = (
        f"{pair[0]} / {pair[1]}, same schedule and heads: mean d_l (α "
        f"= 0.5) from scratch {ds:.3g}, fine-tuned from θ0 {dc:.3g}: "
        f"{factor:.2f}× ({'≥' if holds else '<'} {s.weaker_factor:g}); test accuracy from scratch "
        f"{', '.join(f'{100 * v:.0f}' for v in acc['scratch'].values())}, fine-tuned "
        f"{', '.join(f'{100 * v:.0f}' for v in acc['finetuned'].values())}"
    )
    return Claim("003.8", text, holds, numbers, detail)
