"""Study ``ctl`` (seed 003, Zhou, Chen, Chen, Zhang, Yan 2024, "Cross-Task Linearity Emerges in the
Pretraining-Finetuning Paradigm", arXiv:2402.03660): do the seed's measurements hold on our suite? It reads the
standard fine-tune's outputs (models/pretrained, models/finetuned, models/heads, data/tasks and, for lambda,
metrics/merge/task_arithmetic.json) and measures features itself; the only training is claim 8's four short runs.

f_l(theta; x) is block l's output (every token: [tokens x width] flattened), hooked on the backbone's
``net.blocks`` (timm ViT). For a model feature F and a target feature G built from other models' features, per x:

    d = 1 - cos(F, G),    coef = ||F|| cos(F, G) / ||G||    (the seed's 1 - cosine and coef; both per example)

Claims (the seed's sections; every "d_l small" reads: mean d_l <= ``ctl_ratio`` x mean baseline_l at every layer):

1. CTL (Sec. 4.1, Fig. 2): F = f_l(alpha theta_i + (1 - alpha) theta_j), G = alpha f_l(theta_i) + (1 - alpha)
   f_l(theta_j), x in D_i u D_j, alpha in {0.25, 0.5, 0.75}; baseline 1 - cos(f_l(theta_i), f_l(theta_j)).
2. The coefficient is about 1 (Fig. 3): median coef within 1 +- ``coef_tolerance`` at every layer and alpha.
3. Averaging k = 3..5 models (Sec. 4.2, eq. 1, Figs. 5-6): F = f_l(mean theta), G = mean f_l(theta_t), x in the
   union of their tasks; baseline mean_t (1 - cos(F, f_l(theta_t))). The seed averages models fine-tuned on one
   task with different hyperparameters; ours are fine-tuned on different tasks (Lemma 2's setting).
4. Addition (Sec. 4.3, eq. 2, Figs. 7-8): F = f_l(theta0 + lam (tau_i + tau_j)), G = (f_l(theta0 + 2 lam tau_i) +
   f_l(theta0 + 2 lam tau_j)) / 2 on D_i u D_j; baseline 1 - cos(f_l(theta0 + 2 lam tau_i), f_l(theta0 + 2 lam tau_j)).
5. Negation (eq. 3): F = f_l(theta0), G = (f_l(theta0 + lam tau_i) + f_l(theta0 - lam tau_i)) / 2 on D_i; baseline
   1 - cos(f_l(theta0 + lam tau_i), f_l(theta0 - lam tau_i)). The report adds eq. 4, f_l(theta0 - lam tau_i) against
   f_l(theta0) - Delta_l with Delta_l = f_l(theta0 + lam tau_i) - f_l(theta0), and the first-order reading
   f_l(theta0) - lam (f_l(theta_i) - f_l(theta0)) (shown, not judged).
6. CTL holds without linear mode connectivity (Sec. 4.1): the loss barrier on D_i u D_j at alpha = 0.5,
   L(theta_0.5) - (L(theta_i) + L(theta_j)) / 2, each example scored by its own task's head (the pipeline's frozen
   heads), exceeds ``barrier_tolerance`` (mean over pairs), and claim 1 holds.
7. Stitching (Sec. 4.3, Fig. 9): theta0's blocks after layer l fed (f_l(theta0 + lam tau_i) + f_l(theta0 + lam
   tau_j)) / 2 do both tasks: over the pairs and both tasks, the stitched average recovers at least
   ``stitch_recovery`` of the gap between the other task's single stitched model and the task's own,
   sum(avg - other) / sum(own - other).
8. Without pretraining CTL is much weaker (Sec. 5, App. B.3, Fig. 11): one pair trained from a common random init
   with the pipeline's fine-tune schedule (no feature anchor: there are no pretrained features to keep), against
   the same pair fine-tuned from theta0 with the same schedule; d_l at alpha = 0.5, mean over layers, must be at
   least ``weaker_factor`` times larger from scratch. Both runs keep each task's head from models/heads frozen,
   the pipeline's protocol, so the init is the only difference.

lam is metrics/merge/task_arithmetic.json's chosen ``hyperparameters.lam`` when that file exists, else ``lam``
(setting). Wall times go to stdout (the stage's log), never into the report or the claims' numbers.
"""

from __future__ import annotations

import copy
import itertools
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any

import torch
from pydantic import Field, model_validator
from torch import nn

from mergeflow.config import task_seed
from mergeflow.errors import MergeflowError
from mergeflow.studies import Claim, StudyContext, StudyResult, StudySettings, register

PAPER = "Seed 003: Zhou, Chen, Chen, Zhang, Yan 2024, Cross-Task Linearity Emerges in the Pretraining-Finetuning Paradigm (arXiv:2402.03660)"
State = dict[str, torch.Tensor]


class CtlSettings(StudySettings):
    """Every threshold is fixed here, before any number is seen; the defaults run in well under 2 minutes on the
    default suite and 2 CPU cores."""

    examples: int = Field(128, ge=2)  # per task: the first n of its test split (D_i u D_j holds 2n) for claims 1-6
    pairs: int | None = Field(8, ge=1)  # task pairs measured: n of all pairs, drawn with the pipeline's seed (suite order kept); empty (null): all
    alphas: list[float] = Field(default_factory=lambda: [0.25, 0.5, 0.75], min_length=1)  # claim 1's alpha (0.5 must be one: claims 6 and 8)
    lam: float = Field(0.3, gt=0)  # claims 4, 5, 7: lambda when metrics/merge/task_arithmetic.json is absent
    average_sizes: list[int] = Field(default_factory=lambda: [3, 4, 5], min_length=1)  # claim 3: k models averaged (one subset each; k above the task count dropped)
    average_seed: int = 0  # claim 3: seed of the subsets' draw
    stitch_layer: int | None = Field(None, ge=0)  # claim 7: block index; empty: the middle block, depth // 2 - 1
    stitch_examples: int = Field(200, ge=1)  # claim 7: test examples per task, the first n (capped at the split)
    scratch_pair: tuple[str, str] | None = None  # claim 8's pair; empty: the first measured pair
    scratch_steps: int | None = Field(None, ge=1)  # claim 8: steps of both runs; empty: finetune.steps
    # claims 1, 3, 4, 5: "d close to 0 compared with the baseline": the mean d at every layer (and alpha, and k) is at
    # most this fraction of the mean baseline there (the seed's figures show d an order of magnitude below it)
    ctl_ratio: float = Field(0.25, gt=0)
    # claims 2-5: "coef close to 1": the median coef (pooled over pairs and examples) within 1 +- this at every layer
    coef_tolerance: float = Field(0.1, ge=0)
    # claim 6: LMC fails when the barrier at alpha = 0.5 (mean over pairs, nats) exceeds this
    barrier_tolerance: float = Field(0.05, ge=0)
    # claim 7: the stitched average must recover at least this share of the own-task over other-task accuracy gap
    stitch_recovery: float = Field(0.5, ge=0, le=1)
    # claim 8: "much weaker": scratch d (alpha = 0.5, mean over layers) at least this many times the fine-tuned pair's
    weaker_factor: float = Field(2.0, ge=1)

    @model_validator(mode="after")
    def _check(self) -> CtlSettings:
        if any(not 0 < a < 1 for a in self.alphas) or 0.5 not in self.alphas or sorted(set(self.alphas)) != list(self.alphas):
            raise ValueError("alphas: ascending, distinct, within (0, 1), and 0.5 among them")
        if sorted(set(self.average_sizes)) != list(self.average_sizes) or min(self.average_sizes) < 2:
            raise ValueError("average_sizes: ascending, distinct, each at least 2")
        if self.scratch_pair is not None and self.scratch_pair[0] == self.scratch_pair[1]:
            raise ValueError("scratch_pair: two different tasks")
        return self


# ---------------------------------------------------------------- the metric (pure functions on features)
def combine(parts: Sequence[tuple[float, torch.Tensor]]) -> torch.Tensor:
    """sum_k w_k F_k, in float64."""
    out = None
    for w, f in parts:
        term = w * f.to(torch.float64)
        out = term if out is None else out + term
    return out


def cosine_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row cosine of [N, ...] features (flattened per row), float64; two zero rows have cosine 1."""
    a, b = a.reshape(len(a), -1).to(torch.float64), b.reshape(len(b), -1).to(torch.float64)
    na, nb = a.norm(dim=1), b.norm(dim=1)
    cos = (a * b).sum(1) / (na * nb).clamp_min(1e-300)
    both_zero = (na == 0) & (nb == 0)
    return torch.where(both_zero, torch.ones_like(cos), cos.clamp(-1.0, 1.0))


def linearity(model: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d, coef) per example: d = 1 - cos(F, G), coef = ||F|| cos(F, G) / ||G||."""
    f, g = model.reshape(len(model), -1).to(torch.float64), target.reshape(len(target), -1).to(torch.float64)
    cos = cosine_rows(f, g)
    gn = g.norm(dim=1)
    coef = torch.where(gn > 0, f.norm(dim=1) * cos / gn.clamp_min(1e-300), torch.ones_like(cos))
    return 1.0 - cos, coef


def ctl_terms(f_mix: torch.Tensor, f_i: torch.Tensor, f_j: torch.Tensor, alpha: float) -> dict[str, torch.Tensor]:
    """Claim 1 at one layer: d = 1 - cos(f(theta_alpha), alpha f_i + (1 - alpha) f_j), its coef, and the baseline
    1 - cos(f_i, f_j), per example."""
    d, coef = linearity(f_mix, combine([(alpha, f_i), (1 - alpha, f_j)]))
    return {"d": d, "coef": coef, "baseline": 1.0 - cosine_rows(f_i, f_j)}


def average_terms(f_avg: torch.Tensor, fs: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Claim 3 (seed eq. 1): f(mean theta) against mean f(theta_t); baseline mean_t (1 - cos(f(mean theta), f(theta_t)))."""
    k = len(fs)
    d, coef = linearity(f_avg, combine([(1 / k, f) for f in fs]))
    return {"d": d, "coef": coef, "baseline": torch.stack([1.0 - cosine_rows(f_avg, f) for f in fs]).mean(0)}


def addition_terms(f_sum: torch.Tensor, f_2i: torch.Tensor, f_2j: torch.Tensor) -> dict[str, torch.Tensor]:
    """Claim 4 (seed eq. 2): f(theta0 + lam (tau_i + tau_j)) against (f(theta0 + 2 lam tau_i) + f(theta0 + 2 lam tau_j)) / 2."""
    d, coef = linearity(f_sum, combine([(0.5, f_2i), (0.5, f_2j)]))
    return {"d": d, "coef": coef, "baseline": 1.0 - cosine_rows(f_2i, f_2j)}


def negation_terms(f_0: torch.Tensor, f_plus: torch.Tensor, f_minus: torch.Tensor) -> dict[str, torch.Tensor]:
    """Claim 5 (seed eq. 3): f(theta0) against (f(theta0 + lam tau) + f(theta0 - lam tau)) / 2."""
    d, coef = linearity(f_0, combine([(0.5, f_plus), (0.5, f_minus)]))
    return {"d": d, "coef": coef, "baseline": 1.0 - cosine_rows(f_plus, f_minus)}


def loss_barrier(loss_i: float, loss_mid: float, loss_j: float) -> float:
    """L(theta_0.5) - (L(theta_i) + L(theta_j)) / 2."""
    return loss_mid - (loss_i + loss_j) / 2


def recovery(avg: Sequence[float], own: Sequence[float], other: Sequence[float]) -> float:
    """sum(avg - other) / sum(own - other): 1 when the stitched average matches each task's own stitched model, 0
    when it is no better than the other task's."""
    den = sum(o - x for o, x in zip(own, other))
    return sum(a - x for a, x in zip(avg, other)) / den if den > 0 else math.nan


def mix(states: Sequence[tuple[float, Mapping[str, torch.Tensor]]]) -> State:
    """sum_k w_k theta_k over floating tensors (the first state's other tensors kept), in the first state's dtype."""
    first = states[0][1]
    out = {}
    for k, v in first.items():
        if v.is_floating_point():
            acc = sum(w * s[k].to(torch.float64) for w, s in states)
            out[k] = acc.to(v.dtype)
        else:
            out[k] = v.clone()
    return out


# ---------------------------------------------------------------- features by forward hooks
def _wide(t: torch.Tensor) -> torch.Tensor:
    """Detached, in float32 or wider (a float64 model keeps float64: the exactness tests need it)."""
    return t.detach().to(torch.promote_types(t.dtype, torch.float32))


@dataclass
class Probe:
    """A model whose layers' outputs are read by forward hooks: ``model(x)`` runs it, ``target`` receives the
    states (a state dict), ``layers`` are the modules whose outputs are f_l."""

    model: nn.Module
    target: nn.Module
    layers: list[nn.Module]
    batch_size: int = 512
    device: torch.device = torch.device("cpu")

    def load(self, state: Mapping[str, torch.Tensor]) -> None:
        self.target.load_state_dict(dict(state))

    @torch.no_grad()
    def run(self, state: Mapping[str, torch.Tensor] | None, x: torch.Tensor, *, replace: tuple[int, torch.Tensor] | None = None,
            keep: Sequence[int] | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(f_l for l in ``keep`` (default all), each [N, tokens x width] in the model's dtype (at least float32), and
        the model's output) on ``x``;
        ``replace`` = (l, F): layer l's output is replaced by F (stitching)."""
        if state is not None:
            self.load(state)
        self.model.eval()
        keep = list(range(len(self.layers))) if keep is None else list(keep)
        feats: dict[int, list[torch.Tensor]] = {i: [] for i in keep}
        outs, handles, batch = [], [], {}

        def hook(i):
            def fn(_module, _inputs, output):
                if replace is not None and replace[0] == i:
                    output = replace[1][batch["lo"] : batch["hi"]].reshape(output.shape).to(device=output.device, dtype=output.dtype)
                if i in feats:
                    feats[i].append(_wide(output).reshape(len(output), -1).cpu())
                return output

            return fn

        for i, layer in enumerate(self.layers):
            handles.append(layer.register_forward_hook(hook(i)))
        try:
            for lo in range(0, len(x), self.batch_size):
                batch["lo"], batch["hi"] = lo, min(lo + self.batch_size, len(x))
                outs.append(_wide(self.model(x[lo : batch["hi"]].to(self.device))).cpu())
        finally:
            for h in handles:
                h.remove()
        return [torch.cat(feats[i]) for i in keep], torch.cat(outs)


# ---------------------------------------------------------------- summaries
def _r(v: float) -> float:
    return round(float(v), 6)


def quartiles(v: torch.Tensor) -> tuple[float, float, float]:
    q = torch.quantile(v.to(torch.float64), torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64))
    return float(q[0]), float(q[1]), float(q[2])


def summarise(terms: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, Any]:
    """Pooled over pairs (their examples concatenated): mean and quartiles of d and baseline, median and quartiles of coef."""
    d = torch.cat([t["d"] for t in terms])
    b = torch.cat([t["baseline"] for t in terms])
    c = torch.cat([t["coef"] for t in terms])
    return {"d": _r(d.mean()), "d_q": [_r(v) for v in quartiles(d)], "baseline": _r(b.mean()), "baseline_q": [_r(v) for v in quartiles(b)],
            "coef_median": _r(quartiles(c)[1]), "coef_q": [_r(v) for v in quartiles(c)]}


def small_against_baseline(layers: Sequence[Mapping[str, Any]], ratio: float, coef_tolerance: float) -> tuple[bool, bool]:
    """(mean d <= ratio x mean baseline at every layer, median coef within 1 +- tolerance at every layer)."""
    return (all(L["d"] <= ratio * L["baseline"] + 1e-12 for L in layers), all(abs(L["coef_median"] - 1) <= coef_tolerance + 1e-12 for L in layers))


# ---------------------------------------------------------------- claims (pure functions of the summaries)
def _join(values, fmt: str = ".3g") -> str:
    return ", ".join(format(v, fmt) for v in values)


def _worst(layers: Sequence[Mapping[str, Any]]) -> tuple[int, float]:
    ratios = [L["d"] / L["baseline"] if L["baseline"] > 0 else math.inf for L in layers]
    i = max(range(len(ratios)), key=ratios.__getitem__)
    return i, ratios[i]


def claim_ctl(per_alpha: Mapping[float, list[Mapping[str, Any]]], s: CtlSettings) -> Claim:
    text = "Cross-task linearity: f_l(αθi + (1−α)θj) ≈ αf_l(θi) + (1−α)f_l(θj) at every layer, d_l near 0 against the baseline 1 − cos(f_l(θi), f_l(θj))"
    oks = {a: small_against_baseline(L, s.ctl_ratio, s.coef_tolerance)[0] for a, L in per_alpha.items()}
    worst = {a: _worst(L) for a, L in per_alpha.items()}
    a_w = max(worst, key=lambda a: worst[a][1])
    numbers = {"alphas": list(per_alpha), "d": {str(a): [L["d"] for L in Ls] for a, Ls in per_alpha.items()},
               "baseline": [L["baseline"] for L in next(iter(per_alpha.values()))], "ctl_ratio": s.ctl_ratio, "worst_d_over_baseline": _r(worst[a_w][1])}
    detail = (f"mean d_l at α = 0.5: {_join(L['d'] for L in per_alpha[0.5])} against baseline {_join(L['baseline'] for L in per_alpha[0.5])} "
              f"(blocks 0–{len(per_alpha[0.5]) - 1}); worst d/baseline {worst[a_w][1]:.3f} (block {worst[a_w][0]}, α = {a_w:g}) "
              f"{'≤' if all(oks.values()) else '>'} {s.ctl_ratio:g}")
    return Claim("003.1", text, all(oks.values()), numbers, detail)


def claim_coef(per_alpha: Mapping[float, list[Mapping[str, Any]]], s: CtlSettings) -> Claim:
    text = "The features' lengths agree too: coef = ‖f_l(θα)‖ cos / ‖αf_l(θi) + (1−α)f_l(θj)‖ ≈ 1"
    meds = {a: [L["coef_median"] for L in Ls] for a, Ls in per_alpha.items()}
    flat = [m for ms in meds.values() for m in ms]
    far = max(flat, key=lambda m: abs(m - 1))
    holds = all(small_against_baseline(L, s.ctl_ratio, s.coef_tolerance)[1] for L in per_alpha.values())
    numbers = {"coef_median": {str(a): v for a, v in meds.items()}, "coef_tolerance": s.coef_tolerance}
    detail = (f"median coef at α = 0.5: {', '.join(f'{m:.3f}' for m in meds[0.5])}; farthest from 1 over layers and α: {far:.3f} "
              f"({'within' if holds else 'outside'} 1 ± {s.coef_tolerance:g})")
    return Claim("003.2", text, holds, numbers, detail)


def claim_average(per_k: Mapping[int, list[Mapping[str, Any]]], s: CtlSettings) -> Claim:
    text = "Averaging k models averages their features: f_l(mean θ) ≈ mean f_l(θt) (k = 3–5), d near 0 against the baseline, coef ≈ 1"
    if not per_k:
        return Claim("003.3", text, None, {}, "needs at least 3 tasks")
    checks = {k: small_against_baseline(L, s.ctl_ratio, s.coef_tolerance) for k, L in per_k.items()}
    holds = all(a and b for a, b in checks.values())
    numbers = {"k": list(per_k), "d": {str(k): [L["d"] for L in Ls] for k, Ls in per_k.items()}, "baseline": {str(k): [L["baseline"] for L in Ls] for k, Ls in per_k.items()},
               "coef_median": {str(k): [L["coef_median"] for L in Ls] for k, Ls in per_k.items()}}
    detail = "; ".join(f"k = {k}: worst d/baseline {_worst(Ls)[1]:.3f} ({'≤' if checks[k][0] else '>'} {s.ctl_ratio:g}), median coef "
                       f"{min(L['coef_median'] for L in Ls):.3f}–{max(L['coef_median'] for L in Ls):.3f}" for k, Ls in per_k.items())
    return Claim("003.3", text, holds, numbers, detail)


def _arith_claim(cid: str, text: str, layers: list[Mapping[str, Any]], s: CtlSettings, lam: float) -> Claim:
    small, coef = small_against_baseline(layers, s.ctl_ratio, s.coef_tolerance)
    i, w = _worst(layers)
    numbers = {"lam": lam, "d": [L["d"] for L in layers], "baseline": [L["baseline"] for L in layers], "coef_median": [L["coef_median"] for L in layers]}
    detail = (f"λ = {lam:g}: mean d_l {_join(L['d'] for L in layers)} against baseline {_join(L['baseline'] for L in layers)}; "
              f"worst d/baseline {w:.3f} (block {i}, {'≤' if small else '>'} {s.ctl_ratio:g}); median coef {min(L['coef_median'] for L in layers):.3f}–"
              f"{max(L['coef_median'] for L in layers):.3f} ({'within' if coef else 'outside'} 1 ± {s.coef_tolerance:g})")
    return Claim(cid, text, small and coef, numbers, detail)


def claim_addition(layers, s: CtlSettings, lam: float) -> Claim:
    return _arith_claim("003.4", "Addition in weights is addition in features: f_l(θ0 + λ(τi + τj)) ≈ ½f_l(θ0 + 2λτi) + ½f_l(θ0 + 2λτj)", layers, s, lam)


def claim_negation(layers, s: CtlSettings, lam: float) -> Claim:
    return _arith_claim("003.5", "Negation in weights is negation in features: f_l(θ0) ≈ ½f_l(θ0 + λτi) + ½f_l(θ0 − λτi)", layers, s, lam)


def claim_barrier(barriers: Sequence[float], ctl_holds: bool | None, s: CtlSettings) -> Claim:
    text = "Cross-task linearity holds without linear mode connectivity: at α = 0.5 the loss on Di ∪ Dj rises above the endpoints' mean"
    b = mean(barriers)
    high = b > s.barrier_tolerance
    numbers = {"barriers": [_r(v) for v in barriers], "mean_barrier": _r(b), "barrier_tolerance": s.barrier_tolerance, "ctl_holds": ctl_holds,
               "pairs_above": sum(v > s.barrier_tolerance for v in barriers)}
    detail = (f"barrier L(θ0.5) − ½(L(θi) + L(θj)), mean over {len(barriers)} pairs {b:+.4f} nats ({'>' if high else '≤'} {s.barrier_tolerance:g}; "
              f"{numbers['pairs_above']} of {len(barriers)} pairs above, range {min(barriers):+.3f} to {max(barriers):+.3f}); CTL (003.1) {'holds' if ctl_holds else 'fails'}")
    return Claim("003.6", text, bool(high and ctl_holds), numbers, detail)


def claim_stitching(rows: Sequence[Mapping[str, Any]], s: CtlSettings) -> Claim:
    text = "Stitching the averaged features ½f_l(θ0 + λτi) + ½f_l(θ0 + λτj) into θ0 at a middle layer gives a model that does both tasks"
    avg = [r["avg_i"] for r in rows] + [r["avg_j"] for r in rows]
    own = [r["own_i"] for r in rows] + [r["own_j"] for r in rows]
    other = [r["other_i"] for r in rows] + [r["other_j"] for r in rows]
    rec = recovery(avg, own, other)
    holds = math.isfinite(rec) and rec >= s.stitch_recovery
    numbers = {"recovery": _r(rec) if math.isfinite(rec) else None, "stitch_recovery": s.stitch_recovery, "layer": rows[0]["layer"] if rows else None,
               "mean_accuracy": {"stitched_average": _r(mean(avg)), "own_task_stitched": _r(mean(own)), "other_task_stitched": _r(mean(other))}}
    detail = (f"block {numbers['layer']}, {len(rows)} pairs × 2 tasks: mean accuracy stitched average {100 * mean(avg):.1f}, own task's stitched model "
              f"{100 * mean(own):.1f}, other task's {100 * mean(other):.1f}; recovery {rec:.2f} ({'≥' if holds else '<'} {s.stitch_recovery:g})")
    return Claim("003.7", text, holds, numbers, detail)


def claim_scratch(pair: tuple[str, str], scratch: list[Mapping[str, Any]], control: list[Mapping[str, Any]], acc: Mapping[str, Mapping[str, float]], s: CtlSettings,
                  distance: Mapping[str, float] | None = None) -> Claim:
    text = "Without pretraining, cross-task linearity is much weaker: the same pair trained from a common random init has a far larger d_l"
    ds, dc = mean(L["d"] for L in scratch), mean(L["d"] for L in control)
    factor = ds / dc if dc > 0 else math.inf
    holds = factor >= s.weaker_factor
    numbers = {"pair": list(pair), "d_scratch": [L["d"] for L in scratch], "d_finetuned": [L["d"] for L in control], "baseline_scratch": [L["baseline"] for L in scratch],
               "baseline_finetuned": [L["baseline"] for L in control], "coef_scratch": [L["coef_median"] for L in scratch], "coef_finetuned": [L["coef_median"] for L in control],
               "factor": _r(factor) if math.isfinite(factor) else "inf", "weaker_factor": s.weaker_factor, "accuracy": {k: {t: _r(v) for t, v in a.items()} for k, a in acc.items()},
               "relative_distance": dict(distance or {})}
    detail = (f"{pair[0]} / {pair[1]}, same schedule and heads: mean d_l (α = 0.5) from scratch {ds:.3g}, fine-tuned from θ0 {dc:.3g}: "
              f"{factor:.2f}× ({'≥' if holds else '<'} {s.weaker_factor:g}); test accuracy from scratch "
              f"{', '.join(f'{100 * v:.0f}' for v in acc['scratch'].values())}, fine-tuned {', '.join(f'{100 * v:.0f}' for v in acc['finetuned'].values())}")
    return Claim("003.8", text, holds, numbers, detail)


# ---------------------------------------------------------------- measurements on the pipeline's models
def choose_pairs(tasks: Sequence[str], n: int | None, seed: int) -> list[tuple[str, str]]:
    """All pairs in suite order, or n of them drawn with ``seed`` (kept in suite order)."""
    every = list(itertools.combinations(tasks, 2))
    if n is None or n >= len(every):
        return every
    drawn = set(random.Random(f"{seed}/pairs").sample(range(len(every)), n))
    return [p for i, p in enumerate(every) if i in drawn]


def choose_subset(tasks: Sequence[str], k: int, seed: int) -> list[str]:
    return sorted(random.Random(f"{seed}/average/{k}").sample(list(tasks), k), key=list(tasks).index)


def pipeline_lam(layout, default: float) -> tuple[float, str]:
    """(lam, where it came from): metrics/merge/task_arithmetic.json's chosen lam, else the setting."""
    from mergeflow.io import read_json

    path = Path(layout.metrics("merge", "task_arithmetic"))
    if path.is_file():
        lam = (read_json(path).get("hyperparameters") or {}).get("lam")
        if isinstance(lam, (int, float)) and lam > 0:
            return float(lam), "metrics/merge/task_arithmetic.json"
    return default, "the setting studies.ctl.lam (metrics/merge/task_arithmetic.json absent)"


def _head_loss(out: torch.Tensor, head: nn.Linear, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float(nn.functional.cross_entropy(head(out), y))


def _head_acc(out: torch.Tensor, head: nn.Linear, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((head(out).argmax(1) == y).float().mean())


@dataclass
class Suite:
    """The inputs the study reads once: theta0, the fine-tuned theta_t, the heads and each task's test examples."""

    theta0: State
    thetas: dict[str, State]
    heads: dict[str, nn.Linear]
    test: dict[str, tuple[torch.Tensor, torch.Tensor]]

    def x(self, tasks: Sequence[str], n: int) -> tuple[torch.Tensor, list[tuple[str, slice]]]:
        """The first n test images of each task, concatenated, and each task's rows."""
        xs, rows, at = [], [], 0
        for t in tasks:
            x = self.test[t][0][:n]
            xs.append(x)
            rows.append((t, slice(at, at + len(x))))
            at += len(x)
        return torch.cat(xs), rows

    def loss(self, out: torch.Tensor, rows, n: int) -> float:
        """Mean cross-entropy over the rows, each scored by its own task's head."""
        total = sum(_head_loss(out[sl], self.heads[t], self.test[t][1][:n]) * (sl.stop - sl.start) for t, sl in rows)
        return total / sum(sl.stop - sl.start for _, sl in rows)

    def tau(self, t: str) -> State:
        return {k: self.thetas[t][k].to(torch.float64) - self.theta0[k].to(torch.float64) for k in self.theta0 if self.theta0[k].is_floating_point()}

    def edit(self, parts: Sequence[tuple[float, str]]) -> State:
        """theta0 + sum_k w_k tau_k."""
        out = {}
        for k, v in self.theta0.items():
            if v.is_floating_point():
                acc = v.to(torch.float64) + sum(w * (self.thetas[t][k].to(torch.float64) - v.to(torch.float64)) for w, t in parts)
                out[k] = acc.to(v.dtype)
            else:
                out[k] = v.clone()
        return out


def measure_pair(probe: Probe, suite: Suite, i: str, j: str, alphas: Sequence[float], lam: float, n: int) -> dict[str, Any]:
    """Claims 1, 2, 4 and 6 on one pair, on D_i u D_j: per layer the terms of CTL at each alpha and of addition, and
    the losses along the path (alpha = 0 is theta_j, 1 is theta_i)."""
    x, rows = suite.x([i, j], n)
    fi, out_i = probe.run(suite.thetas[i], x)
    fj, out_j = probe.run(suite.thetas[j], x)
    ctl, losses = {}, {0.0: suite.loss(out_j, rows, n), 1.0: suite.loss(out_i, rows, n)}
    for a in alphas:
        fa, out_a = probe.run(mix([(a, suite.thetas[i]), (1 - a, suite.thetas[j])]), x)
        ctl[a] = [ctl_terms(fa[L], fi[L], fj[L], a) for L in range(len(fi))]
        losses[a] = suite.loss(out_a, rows, n)
    f_sum, _ = probe.run(suite.edit([(lam, i), (lam, j)]), x)
    f_2i, _ = probe.run(suite.edit([(2 * lam, i)]), x)
    f_2j, _ = probe.run(suite.edit([(2 * lam, j)]), x)
    addition = [addition_terms(f_sum[L], f_2i[L], f_2j[L]) for L in range(len(fi))]
    per_task = {t: {"theta_i": suite.loss(out_i[sl], [(t, slice(0, sl.stop - sl.start))], n), "theta_j": suite.loss(out_j[sl], [(t, slice(0, sl.stop - sl.start))], n)} for t, sl in rows}
    return {"ctl": ctl, "addition": addition, "losses": dict(sorted(losses.items())), "per_task": per_task}


def measure_negation(probe: Probe, suite: Suite, t: str, lam: float, n: int) -> dict[str, Any]:
    """Claim 5 on D_t, with eq. 4 and the first-order reading beside it."""
    x, _ = suite.x([t], n)
    f0, _ = probe.run(suite.theta0, x)
    fp, _ = probe.run(suite.edit([(lam, t)]), x)
    fm, _ = probe.run(suite.edit([(-lam, t)]), x)
    ft, _ = probe.run(suite.thetas[t], x)
    eq3 = [negation_terms(f0[L], fp[L], fm[L]) for L in range(len(f0))]
    eq4 = [linearity(fm[L], combine([(2.0, f0[L]), (-1.0, fp[L])]))[0] for L in range(len(f0))]  # f(theta0) - Delta = 2 f(theta0) - f(theta0 + lam tau)
    first = [linearity(fm[L], combine([(1.0 + lam, f0[L]), (-lam, ft[L])]))[0] for L in range(len(f0))]  # f(theta0) - lam (f(theta_t) - f(theta0))
    return {"eq3": eq3, "eq4": eq4, "first_order": first}


def measure_average(probe: Probe, suite: Suite, subset: Sequence[str], n: int) -> list[dict[str, torch.Tensor]]:
    x, _ = suite.x(subset, n)
    f_avg, _ = probe.run(mix([(1 / len(subset), suite.thetas[t]) for t in subset]), x)
    fs = [probe.run(suite.thetas[t], x)[0] for t in subset]
    return [average_terms(f_avg[L], [f[L] for f in fs]) for L in range(len(f_avg))]


def measure_stitching(probe: Probe, suite: Suite, i: str, j: str, lam: float, layer: int, n: int) -> dict[str, Any]:
    """Claim 7 on one pair: accuracies on D_i and D_j of theta0 continued after ``layer`` from the averaged, the
    i-edited and the j-edited features, of the pair's task-arithmetic model and of theta0."""
    x, rows = suite.x([i, j], n)
    (fa,), _ = probe.run(suite.edit([(lam, i)]), x, keep=[layer])
    (fb,), _ = probe.run(suite.edit([(lam, j)]), x, keep=[layer])
    outs = {
        "avg": probe.run(suite.theta0, x, replace=(layer, combine([(0.5, fa), (0.5, fb)]).float()), keep=[])[1],
        "stitch_i": probe.run(suite.theta0, x, replace=(layer, fa), keep=[])[1],
        "stitch_j": probe.run(suite.theta0, x, replace=(layer, fb), keep=[])[1],
        "ta": probe.run(suite.edit([(lam, i), (lam, j)]), x, keep=[])[1],
        "theta0": probe.run(suite.theta0, x, keep=[])[1],
    }
    (ti, si), (tj, sj) = rows
    acc = {name: (_head_acc(o[si], suite.heads[ti], suite.test[ti][1][:n]), _head_acc(o[sj], suite.heads[tj], suite.test[tj][1][:n])) for name, o in outs.items()}
    return {"pair": [i, j], "layer": layer, "avg_i": acc["avg"][0], "avg_j": acc["avg"][1], "own_i": acc["stitch_i"][0], "own_j": acc["stitch_j"][1],
            "other_i": acc["stitch_j"][0], "other_j": acc["stitch_i"][1], "ta_i": acc["ta"][0], "ta_j": acc["ta"][1], "theta0_i": acc["theta0"][0], "theta0_j": acc["theta0"][1]}


def train_pair(params, suite: Suite, train: Mapping[str, tuple[torch.Tensor, torch.Tensor]], init: State, pair: Sequence[str], steps: int | None, device, label: str) -> dict[str, State]:
    """Each task of ``pair`` trained from ``init`` with the pipeline's fine-tune schedule (finetune.*, its steps or
    ``steps``), no feature anchor, the task's head frozen, the task's seed: the same data order for both inits."""
    from mergeflow.models import backbone_state, build_backbone
    from mergeflow.training import finetune as finetune_loop

    update: dict[str, Any] = {"preserve_features": params.finetune.preserve_features.model_copy(update={"weight": 0.0})}
    if steps is not None:
        update |= {"steps": steps, "epochs": None}
    cfg = params.finetune.model_copy(update=update)
    out = {}
    for t in pair:
        model = build_backbone(params.backbone, {k: v.clone() for k, v in init.items()}, source=label)
        x, y = train[t]
        finetune_loop(model, copy.deepcopy(suite.heads[t]), x, y, cfg, seed=task_seed(params.seed, t), device=device, desc=f"study ctl {label} {t}")
        out[t] = {k: v.cpu() for k, v in backbone_state(model.cpu()).items()}
    return out


# ---------------------------------------------------------------- figures
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


ALPHA_COLOURS = {0.25: "#9ecae1", 0.5: "#3182bd", 0.75: "#08519c"}


def _bars(ax, groups: Sequence[tuple[str, Sequence[Mapping[str, Any]], str, str]], title: str) -> None:
    """Per layer, one bar per group (label, layer summaries, key 'd' or 'baseline', colour), error bars the quartiles."""
    n_layers = len(groups[0][1])
    w = 0.8 / len(groups)
    for g, (label, layers, key, colour) in enumerate(groups):
        xs = [L + (g - (len(groups) - 1) / 2) * w for L in range(n_layers)]
        mid = [layers[L][key] for L in range(n_layers)]
        q = [layers[L][f"{key}_q"] for L in range(n_layers)]
        err = [[max(0.0, m - lo) for m, (lo, _, _) in zip(mid, q)], [max(0.0, hi - m) for m, (_, _, hi) in zip(mid, q)]]
        ax.bar(xs, mid, w, color=colour, label=label, yerr=err, capsize=2, error_kw={"lw": 0.8})
    positive = [v for _, layers, key, _ in groups for L in layers for v in (L[key], *L[f"{key}_q"]) if v > 0]
    if positive:
        ax.set_ylim(min(positive) / 3, max(positive) * 3)
    ax.set_xticks(range(n_layers), [f"block {L}" for L in range(n_layers)])
    # log scale: d is often orders of magnitude below its baseline, and both must stay readable
    ax.set_yscale("log")
    ax.set_ylabel("E[1 − cos], log scale (bars: mean; whiskers: quartiles)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, frameon=False)


def _boxes(ax, series: Sequence[tuple[str, Sequence[torch.Tensor], str]], title: str) -> None:
    """Per layer, one box per series (label, per-layer coef tensors, colour)."""
    n_layers = len(series[0][1])
    w = 0.8 / len(series)
    for g, (label, per_layer, colour) in enumerate(series):
        pos = [L + (g - (len(series) - 1) / 2) * w for L in range(n_layers)]
        bp = ax.boxplot([v.numpy() for v in per_layer], positions=pos, widths=w * 0.85, showfliers=False, patch_artist=True)
        for box in bp["boxes"]:
            box.set_facecolor(colour)
        ax.plot([], [], color=colour, lw=6, label=label)
    ax.axhline(1.0, color="#999999", ls=":", lw=1)
    ax.set_xticks(range(n_layers), [f"block {L}" for L in range(n_layers)])
    ax.set_ylabel("coef (box: quartiles; whiskers: 1.5 IQR)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, frameon=False)


def plot_ctl(per_alpha, coefs, n_pairs: int, path: Path) -> None:
    plt = _pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained")
    groups = [(f"α = {a:g}: 1 − cos(f(θα), αf(θi) + (1−α)f(θj))", L, "d", ALPHA_COLOURS.get(a, "#3182bd")) for a, L in per_alpha.items()]
    groups.append(("baseline 1 − cos(f(θi), f(θj))", per_alpha[0.5], "baseline", "#bbbbbb"))
    _bars(a1, groups, f"Cross-task linearity (seed Fig. 2), {n_pairs} pairs, x in Di ∪ Dj")
    _boxes(a2, [(f"α = {a:g}", c, ALPHA_COLOURS.get(a, "#3182bd")) for a, c in coefs.items()], "coef = ‖f(θα)‖ cos / ‖αf(θi) + (1−α)f(θj)‖ (seed Fig. 3)")
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_arithmetic(per_k, addition, negation, coefs, lam: float, path: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.6), layout="constrained")
    k_colours = ["#fdae6b", "#e6550d", "#a63603", "#7f2704"]
    groups = [(f"k = {k}: f(mean θ) vs mean f(θt)", L, "d", k_colours[n % 4]) for n, (k, L) in enumerate(per_k.items())]
    groups += [(f"k = {k}: baseline", L, "baseline", c) for (k, L), c in zip(per_k.items(), ["#d9d9d9", "#bdbdbd", "#969696", "#737373"])]
    if per_k:
        _bars(axes[0, 0], groups, "Averaging k models (seed eq. 1, Fig. 5)")
        _boxes(axes[1, 0], [(f"k = {k}", c, k_colours[n % 4]) for n, (k, c) in enumerate(coefs["average"].items())], "coef, averaging (seed Fig. 6)")
    _bars(axes[0, 1], [("f(θ0 + λ(τi+τj)) vs ½f(θ0+2λτi) + ½f(θ0+2λτj)", addition, "d", "#31a354"), ("baseline 1 − cos(f(θ0+2λτi), f(θ0+2λτj))", addition, "baseline", "#bbbbbb")],
          f"Addition (seed eq. 2, Fig. 7), λ = {lam:g}")
    _bars(axes[0, 2], [("f(θ0) vs ½f(θ0+λτi) + ½f(θ0−λτi)", negation, "d", "#756bb1"), ("baseline 1 − cos(f(θ0+λτi), f(θ0−λτi))", negation, "baseline", "#bbbbbb")],
          f"Negation (seed eq. 3, Fig. 7), λ = {lam:g}")
    _boxes(axes[1, 1], [("addition", coefs["addition"], "#31a354")], "coef, addition (seed Fig. 8)")
    _boxes(axes[1, 2], [("negation", coefs["negation"], "#756bb1")], "coef, negation (seed Fig. 8)")
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_barrier(paths: Mapping[str, Mapping[float, float]], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), layout="constrained")
    for name, losses in paths.items():
        xs = sorted(losses)
        ax.plot(xs, [losses[a] for a in xs], marker="o", ms=3, lw=1, alpha=0.7, label=name)
    ax.set_xlabel("α  (θα = αθi + (1−α)θj; 0 is θj, 1 is θi)")
    ax.set_ylabel("loss on Di ∪ Dj (each example: its task's head)")
    ax.set_title("Loss along the linear path between fine-tuned models", fontsize=9)
    ax.grid(alpha=0.3)
    if len(paths) <= 10:
        ax.legend(fontsize=6, frameon=False)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_stitching(rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.6, 5.2), layout="constrained")
    kinds = [("stitched ½f(θ0+λτi) + ½f(θ0+λτj)", "avg_i", "avg_j", "#d62728", "o"), ("stitched f(θ0+λτi)", "own_i", "other_j", "#1f77b4", "^"),
             ("stitched f(θ0+λτj)", "other_i", "own_j", "#2ca02c", "v"), ("θ0 + λ(τi + τj)", "ta_i", "ta_j", "#7f7f7f", "s")]
    for label, kx, ky, colour, marker in kinds:
        ax.scatter([100 * r[kx] for r in rows], [100 * r[ky] for r in rows], color=colour, marker=marker, s=22, alpha=0.8, label=label)
    ax.plot([0, 100], [0, 100], color="#cccccc", ls="--", lw=1)
    ax.set_xlabel("accuracy on Di (%)")
    ax.set_ylabel("accuracy on Dj (%)")
    ax.set_title(f"Stitching at block {rows[0]['layer']} into θ0 (seed Fig. 9), one point per pair", fontsize=9)
    ax.legend(fontsize=7, frameon=False, loc="lower left")
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_scratch(scratch, control, pipeline, coefs, pair, path: Path) -> None:
    plt = _pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained")
    groups = [("from a random init", scratch, "d", "#e6550d"), ("fine-tuned from θ0, same schedule", control, "d", "#3182bd"), ("pipeline's fine-tuned models", pipeline, "d", "#9ecae1"),
              ("baseline, random init", scratch, "baseline", "#fdd0a2"), ("baseline, fine-tuned from θ0", control, "baseline", "#c6dbef")]
    _bars(a1, groups, f"{pair[0]} / {pair[1]} at α = 0.5: without pretraining (seed Fig. 11)")
    _boxes(a2, [(name, c, colour) for (name, c), colour in zip(coefs.items(), ["#e6550d", "#3182bd", "#9ecae1"])], "coef at α = 0.5")
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ---------------------------------------------------------------- the study
def ctl_at(probe: Probe, theta_i: State, theta_j: State, x: torch.Tensor, alpha: float) -> list[dict[str, torch.Tensor]]:
    fi, _ = probe.run(theta_i, x)
    fj, _ = probe.run(theta_j, x)
    fa, _ = probe.run(mix([(alpha, theta_i), (1 - alpha, theta_j)]), x)
    return [ctl_terms(fa[L], fi[L], fj[L], alpha) for L in range(len(fi))]


def _by_layer(items: Sequence[Sequence[Mapping[str, torch.Tensor]]]) -> list[dict[str, Any]]:
    """[pair][layer] terms -> per layer, pooled over pairs."""
    return [summarise([p[L] for p in items]) for L in range(len(items[0]))]


def _coefs(items: Sequence[Sequence[Mapping[str, torch.Tensor]]]) -> list[torch.Tensor]:
    return [torch.cat([p[L]["coef"] for p in items]) for L in range(len(items[0]))]


@register("ctl", paper=PAPER, title="Cross-task linearity: interpolated weights give interpolated features, layer by layer", settings=CtlSettings)
def ctl_study(context: StudyContext) -> StudyResult:
    from mergeflow import data as data_mod
    from mergeflow.io import load_state_dict
    from mergeflow.models import build_backbone, load_head

    params, layout, s, device = context.params, context.layout, context.settings, context.device
    started = time.perf_counter()
    timings: dict[str, float] = {}
    tasks = list(params.suite.tasks)
    if len(tasks) < 2:
        raise MergeflowError("studies.ctl: needs at least two tasks in suite.tasks")
    theta0 = load_state_dict(layout.pretrained)
    backbone = build_backbone(params.backbone, theta0, source=str(layout.pretrained)).to(device)
    data = {t: data_mod.load_task(layout.task_data(t), params.suite.image_size) for t in tasks}
    heads = {t: load_head(layout.head(t), backbone.num_features, num_classes=len(data[t].classes), classes_source=str(layout.task_data(t))) for t in tasks}
    suite = Suite(theta0, {t: load_state_dict(layout.finetuned(t)) for t in tasks}, heads, {t: (data[t].test.images, data[t].test.labels) for t in tasks})
    blocks = list(getattr(backbone.net, "blocks", []))
    if not blocks:
        raise MergeflowError(f"studies.ctl: backbone '{params.backbone.model}' has no 'blocks' (the study hooks a timm ViT's blocks)")
    probe = Probe(backbone, backbone.net, blocks, params.runtime.eval_batch_size, device)
    depth = len(blocks)
    layer = s.stitch_layer if s.stitch_layer is not None else max(0, depth // 2 - 1)
    if layer >= depth:
        raise MergeflowError(f"studies.ctl.stitch_layer: block {layer} does not exist (the backbone has {depth})")
    lam, lam_source = pipeline_lam(layout, s.lam)
    pairs = choose_pairs(tasks, s.pairs, params.seed)
    n = min(s.examples, *(len(suite.test[t][1]) for t in tasks))

    # claims 1, 2, 4, 6
    t0 = time.perf_counter()
    measured = {p: measure_pair(probe, suite, *p, s.alphas, lam, n) for p in pairs}
    per_alpha = {a: _by_layer([m["ctl"][a] for m in measured.values()]) for a in s.alphas}
    addition = _by_layer([m["addition"] for m in measured.values()])
    barriers = [loss_barrier(m["losses"][1.0], m["losses"][0.5], m["losses"][0.0]) for m in measured.values()]
    timings["pairs"] = time.perf_counter() - t0

    # claim 5, per task
    t0 = time.perf_counter()
    neg = {t: measure_negation(probe, suite, t, lam, n) for t in tasks}
    negation = _by_layer([v["eq3"] for v in neg.values()])
    eq4 = [float(torch.cat([v["eq4"][L] for v in neg.values()]).mean()) for L in range(depth)]
    first_order = [float(torch.cat([v["first_order"][L] for v in neg.values()]).mean()) for L in range(depth)]
    timings["negation"] = time.perf_counter() - t0

    # claim 3
    t0 = time.perf_counter()
    subsets = {k: choose_subset(tasks, k, s.average_seed) for k in s.average_sizes if k <= len(tasks)}
    avg_terms = {k: measure_average(probe, suite, sub, n) for k, sub in subsets.items()}
    per_k = {k: _by_layer([v]) for k, v in avg_terms.items()}
    timings["averaging"] = time.perf_counter() - t0

    # claim 7
    t0 = time.perf_counter()
    m_st = min(s.stitch_examples, *(len(suite.test[t][1]) for t in tasks))
    stitch = [measure_stitching(probe, suite, i, j, lam, layer, m_st) for i, j in pairs]
    timings["stitching"] = time.perf_counter() - t0

    # claim 8
    t0 = time.perf_counter()
    pair8 = tuple(s.scratch_pair) if s.scratch_pair is not None else pairs[0]
    for t in pair8:
        params.check_task(t)
    train = {t: (data[t].train.images, data[t].train.labels) for t in pair8}
    torch.manual_seed(params.seed)
    random_init = {k: v.detach().clone() for k, v in build_backbone(params.backbone).net.state_dict().items()}
    from_scratch = train_pair(params, suite, train, random_init, pair8, s.scratch_steps, device, "scratch")
    from_theta0 = train_pair(params, suite, train, theta0, pair8, s.scratch_steps, device, "from-theta0")
    x8, _ = suite.x(list(pair8), n)
    t_scratch = ctl_at(probe, from_scratch[pair8[0]], from_scratch[pair8[1]], x8, 0.5)
    t_control = ctl_at(probe, from_theta0[pair8[0]], from_theta0[pair8[1]], x8, 0.5)
    t_pipeline = ctl_at(probe, suite.thetas[pair8[0]], suite.thetas[pair8[1]], x8, 0.5)
    acc8 = {}
    for name, states in (("scratch", from_scratch), ("finetuned", from_theta0)):
        acc8[name] = {}
        for t in pair8:
            _, out = probe.run(states[t], data[t].test.images)
            acc8[name][t] = _head_acc(out, heads[t], data[t].test.labels)
    rel8 = {name: _r(_distance(states[pair8[0]], states[pair8[1]]) / _norm(init)) for name, states, init in (("scratch", from_scratch, random_init), ("finetuned", from_theta0, theta0))}
    scratch, control, pipeline8 = _by_layer([t_scratch]), _by_layer([t_control]), _by_layer([t_pipeline])
    timings["scratch"] = time.perf_counter() - t0

    c1 = claim_ctl(per_alpha, s)
    claims = [c1, claim_coef(per_alpha, s), claim_average(per_k, s), claim_addition(addition, s, lam), claim_negation(negation, s, lam),
              claim_barrier(barriers, c1.holds, s), claim_stitching(stitch, s), claim_scratch(pair8, scratch, control, acc8, s, rel8)]

    out = Path(context.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures = ["ctl.png", "arithmetic.png", "barrier.png", "stitching.png", "scratch.png"]
    plot_ctl(per_alpha, {a: _coefs([m["ctl"][a] for m in measured.values()]) for a in s.alphas}, len(pairs), out / figures[0])
    plot_arithmetic(per_k, addition, negation, {"average": {k: _coefs([v]) for k, v in avg_terms.items()}, "addition": _coefs([m["addition"] for m in measured.values()]),
                                                "negation": _coefs([v["eq3"] for v in neg.values()])}, lam, out / figures[1])
    plot_barrier({f"{i} / {j}": m["losses"] for (i, j), m in measured.items()}, out / figures[2])
    plot_stitching(stitch, out / figures[3])
    plot_scratch(scratch, control, pipeline8, {"random init": _coefs([t_scratch]), "from θ0, same schedule": _coefs([t_control]), "pipeline": _coefs([t_pipeline])}, pair8, out / figures[4])
    timings["total"] = time.perf_counter() - started
    # to the stage's log, not the report: the report's bytes must not change with the machine's load
    print("study ctl: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()), flush=True)
    body = _body(params, s, depth, layer, lam, lam_source, pairs, n, m_st, measured, per_alpha, per_k, subsets, addition, negation, eq4, first_order, barriers,
                 stitch, pair8, scratch, control, pipeline8, acc8, rel8, claims)
    return StudyResult(claims, body, figures)


def _norm(state: Mapping[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(v.to(torch.float64).pow(2).sum()) for v in state.values() if v.is_floating_point()))


def _distance(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float((a[k].to(torch.float64) - b[k].to(torch.float64)).pow(2).sum()) for k in a if a[k].is_floating_point()))


def _row(label: str, values: Sequence[float], fmt: str = ".3g") -> str:
    return f"| {label} | " + " | ".join(format(v, fmt) for v in values) + " |"


def _body(params, s: CtlSettings, depth, layer, lam, lam_source, pairs, n, m_st, measured, per_alpha, per_k, subsets, addition, negation, eq4, first_order, barriers,
          stitch, pair8, scratch, control, pipeline8, acc8, rel8, claims) -> str:
    head = "| | " + " | ".join(f"block {L}" for L in range(depth)) + " |"
    sep = "|---|" + "---|" * depth
    steps8 = s.scratch_steps if s.scratch_steps is not None else params.finetune.steps
    b = [
        f"Our suite: {len(params.suite.tasks)} tasks, backbone `{params.backbone.model}` {params.backbone.kwargs} ({depth} blocks); f_l is block l's output, "
        f"every token, flattened. {len(pairs)} task pairs ({'all' if s.pairs is None or len(pairs) == len(params.suite.tasks) * (len(params.suite.tasks) - 1) // 2 else f'drawn with seed {params.seed}'}): "
        + ", ".join(f"{i}/{j}" for i, j in pairs) + f". D_t: the first {n} test images of task t (D_i ∪ D_j: {2 * n}). λ = {lam:g}, from {lam_source}.",
        "",
        "Thresholds (settings, fixed before the numbers): a d_l is \"near 0\" when its mean is at most "
        f"{s.ctl_ratio:g} × the mean baseline at every layer (and every α or k); coef is \"≈ 1\" when its median is within 1 ± {s.coef_tolerance:g} at every layer; "
        f"LMC fails when the mean barrier at α = 0.5 exceeds {s.barrier_tolerance:g} nats; stitching holds when the averaged features recover ≥ {s.stitch_recovery:g} "
        f"of the own-task over other-task accuracy gap; without pretraining CTL is \"much weaker\" when its mean d_l at α = 0.5 is ≥ {s.weaker_factor:g}× the fine-tuned pair's. "
        "The seed gives figures, not thresholds: these are ours. The times are in the stage's log.",
        "",
        "## 1–2. Cross-task linearity and its coefficient (seed Sec. 4.1, Figs. 2–3)",
        "",
        "Mean over all pairs' examples of d_l = 1 − cos(f_l(αθi + (1−α)θj), αf_l(θi) + (1−α)f_l(θj)), against the baseline 1 − cos(f_l(θi), f_l(θj)), and the median coef:",
        "",
        head, sep,
    ]
    for a, Ls in per_alpha.items():
        b.append(_row(f"d, α = {a:g}", [L["d"] for L in Ls]))
    b.append(_row("baseline", [L["baseline"] for L in per_alpha[0.5]]))
    for a, Ls in per_alpha.items():
        b.append(_row(f"median coef, α = {a:g}", [L["coef_median"] for L in Ls], ".3f"))
    b += ["", "![cross-task linearity](ctl.png)", "",
          "## 3. Averaging several models (seed Sec. 4.2, eq. 1, Figs. 5–6)", "",
          "f_l(mean θ) against mean f_l(θt) on the union of the k tasks' D_t; baseline mean_t (1 − cos(f_l(mean θ), f_l(θt))). The seed averages models fine-tuned "
          "on one task with different hyperparameters; ours are fine-tuned on different tasks (its Lemma 2, CTL for several models). Subsets (seed "
          f"{s.average_seed}): " + "; ".join(f"k = {k}: {', '.join(sub)}" for k, sub in subsets.items()) + ".", "", head, sep]
    for k, Ls in per_k.items():
        b += [_row(f"d, k = {k}", [L["d"] for L in Ls]), _row(f"baseline, k = {k}", [L["baseline"] for L in Ls]), _row(f"median coef, k = {k}", [L["coef_median"] for L in Ls], ".3f")]
    b += ["", "## 4–5. Task arithmetic in feature space (seed Sec. 4.3, eqs. 2–4, Figs. 7–8)", "",
          f"Addition on D_i ∪ D_j of every pair; negation on D_t of every task; λ = {lam:g}.", "", head, sep,
          _row("addition d: f(θ0 + λ(τi+τj)) vs ½f(θ0+2λτi) + ½f(θ0+2λτj)", [L["d"] for L in addition]),
          _row("addition baseline: 1 − cos(f(θ0+2λτi), f(θ0+2λτj))", [L["baseline"] for L in addition]),
          _row("addition median coef", [L["coef_median"] for L in addition], ".3f"),
          _row("negation d (eq. 3): f(θ0) vs ½f(θ0+λτi) + ½f(θ0−λτi)", [L["d"] for L in negation]),
          _row("negation baseline: 1 − cos(f(θ0+λτi), f(θ0−λτi))", [L["baseline"] for L in negation]),
          _row("negation median coef", [L["coef_median"] for L in negation], ".3f"),
          _row("eq. 4 (shown): 1 − cos(f(θ0−λτi), f(θ0) − Δ), Δ = f(θ0+λτi) − f(θ0)", eq4),
          _row("first order (shown): 1 − cos(f(θ0−λτi), f(θ0) − λ(f(θi) − f(θ0)))", first_order),
          "", "![task arithmetic in feature space](arithmetic.png)", "",
          "## 6. The loss barrier: linearity without linear mode connectivity (seed Sec. 4.1)", "",
          "Loss on D_i ∪ D_j, each example scored by its own task's head (the pipeline's frozen heads), along θα = αθi + (1−α)θj; the barrier is "
          "L(θ0.5) − ½(L(θi) + L(θj)). Per task, the loss of each end model on that task's images shows why the endpoints differ.", "",
          "| pair | L(θj) | " + " | ".join(f"L(θ{a:g})" for a in s.alphas) + " | L(θi) | barrier | L_i(θi) | L_i(θj) | L_j(θi) | L_j(θj) |",
          "|---|---|" + "---|" * len(s.alphas) + "---|---|---|---|---|---|"]
    for ((i, j), m), bar in zip(measured.items(), barriers):
        L = m["losses"]
        pt = m["per_task"]
        b.append(f"| {i} / {j} | {L[0.0]:.4f} | " + " | ".join(f"{L[a]:.4f}" for a in s.alphas) + f" | {L[1.0]:.4f} | {bar:+.4f} | "
                 f"{pt[i]['theta_i']:.3f} | {pt[i]['theta_j']:.3f} | {pt[j]['theta_i']:.3f} | {pt[j]['theta_j']:.3f} |")
    b += ["", f"Mean barrier {mean(barriers):+.4f} nats. With an exact CTL and equal coefficient, the logits along the path are the interpolated logits and "
          "cross-entropy is convex in them, so the loss on any dataset lies below the chord (the seed's Lemma 1): a barrier needs CTL to be inexact.", "",
          "![loss along the path](barrier.png)", "",
          f"## 7. Stitching averaged features at block {layer} (seed Sec. 4.3, Fig. 9)", "",
          f"θ0's blocks after block {layer} (then its norm and pooling, then task t's head) fed the features of θ0 + λτ; the first {m_st} test images of each task. "
          "Accuracies (%):", "",
          "| pair | stitched avg on D_i | on D_j | stitched f(θ0+λτi) on D_i | on D_j | stitched f(θ0+λτj) on D_i | on D_j | θ0+λ(τi+τj) on D_i | on D_j | θ0 on D_i | on D_j |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in stitch:
        b.append(f"| {r['pair'][0]} / {r['pair'][1]} | " + " | ".join(f"{100 * r[k]:.1f}" for k in ("avg_i", "avg_j", "own_i", "other_j", "other_i", "own_j", "ta_i", "ta_j", "theta0_i", "theta0_j")) + " |")
    b += ["", "![stitching](stitching.png)", "",
          "## 8. Without pretraining (seed Sec. 5, App. B.3, Fig. 11)", "",
          f"The pair {pair8[0]} / {pair8[1]} trained twice with the pipeline's fine-tune schedule ({params.finetune.optimizer}, lr {params.finetune.lr:g}, {steps8} steps of "
          f"{params.finetune.batch_size}), with no feature anchor, each task's head from models/heads frozen: once from a common random init (seed {params.seed}), once "
          "from θ0. The seed trains its scratch models independently (and then aligns them by permutation); ours share their init, which favours linearity: "
          "the seed's setting is the harder test, ours isolates pretraining from the shared init. d_l at α = 0.5 on D_i ∪ D_j:", "", head, sep,
          _row("d, random init", [L["d"] for L in scratch]), _row("d, from θ0 (same schedule)", [L["d"] for L in control]), _row("d, the pipeline's models", [L["d"] for L in pipeline8]),
          _row("baseline, random init", [L["baseline"] for L in scratch]), _row("baseline, from θ0", [L["baseline"] for L in control]),
          _row("median coef, random init", [L["coef_median"] for L in scratch], ".3f"), _row("median coef, from θ0", [L["coef_median"] for L in control], ".3f"), "",
          "Test accuracy (%): " + "; ".join(f"{name}: " + ", ".join(f"{t} {100 * v:.1f}" for t, v in a.items()) for name, a in acc8.items())
          + f". ‖θi − θj‖ / ‖init‖: random init {rel8['scratch']:.4f}, from θ0 {rel8['finetuned']:.4f}.", "",
          "![without pretraining](scratch.png)", ""]
    return "\n".join(b)
