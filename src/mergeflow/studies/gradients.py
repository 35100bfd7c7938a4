"""Seed 000: Zhou, Solombrino, Crisostomi, Bucarelli, Silvestri and Rodolà, "On Task Vectors and Gradients".

Proposition 1 / Remark 1: after one epoch of full-batch gradient descent (GD) at step size eta, a task vector is
tau_t(1) = -eta * grad Lbar_t(theta0), so theta0 + alpha * sum_t tau_t(1) is one multi-task GD step at step size
alpha * eta; Theorem 1: after k >= 2 epochs, theta_TA(k) - theta_MT(k) = O(eta^2). Section 2.1: the first epoch's
update dominates the fine-tuning trajectory in norm and direction (Fig. 3), and merging one-epoch task vectors is
about as good as merging converged ones (Fig. 2). Section 3.1, reading ATM (Zhou et al., arXiv:2411.03055): at a
fixed budget, more rounds of shorter fine-tunes merge better than one-shot task arithmetic, TIES or Breadcrumbs.

Claims 1-5 are measured here, on the suite's own tasks, backbone and heads: the identities through the pipeline's
own trainer (mergeflow.regimes._finetune.finetune_trainer, under the registered regimes one_epoch and atm) against
gradients computed by plain autograd, both on the CPU in float32 (on CUDA the trainer autocasts to bfloat16); the
eta^2 scaling by an exact float64 GD loop on the CPU; the AdamW and per-epoch measurements through the trainer and
training.finetune on ``context.device``. Claims 6-7 read the pipeline's regime outputs
(metrics/regime/<regime>.json and the regimes' merges), and are "not measured" when those regimes did not run.

The measurements are small pure functions (``loss_gradient``, ``gd_steps``, ``one_epoch_identity``,
``atm_identity``, ``ta_mt_gaps``, ``log_slope``, ``minibatch_cosines``, ``epoch_updates``) and the verdicts of
claims 6-7 are pure functions of the metrics dictionaries (``claim_one_epoch_merge``, ``claim_atm_budget``).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import Field, PositiveInt, field_validator
from torch import nn

from mergeflow.config import task_seed
from mergeflow.errors import MergeflowError
from mergeflow.studies import Claim, StudyContext, StudyResult, StudySettings, register

PAPER = "Zhou, Solombrino, Crisostomi, Bucarelli, Silvestri, Rodolà: On Task Vectors and Gradients (seed 000)"
State = dict[str, torch.Tensor]
GradFn = Callable[[Mapping[str, torch.Tensor]], State]  # state -> grad of the task's mean loss at that state


class GradientsSettings(StudySettings):
    """Every cost is bounded here: the defaults take about a minute on 2 CPU cores with the default suite."""

    examples: int = Field(512, ge=1)  # training examples per task (the split's first n) for claims 1-4
    gd_lr: float = Field(1e-4, gt=0)  # eta of the full-batch GD runs of claims 1-2 (alpha * eta * sharpness well under 2: GD stays stable)
    alpha: float | None = Field(None, gt=0)  # task-arithmetic / ATM scaling in claims 1-3; empty (null): 1/T
    tasks: list[str] | None = Field(None, min_length=1)  # tasks of claims 2-5 (the costly parts); empty (null): the first four of suite.tasks
    atm_rounds: int = Field(3, ge=1)  # R of claim 2: ATM rounds of one full-batch GD step per task
    identity_ulps: float = Field(4.0, gt=0)  # claims 1-2 hold when each error norm is at most this many float32 floors ‖ulp(theta)/2‖ (claim 2: per round)
    gap_examples: int = Field(256, ge=1)  # examples per task in claim 3 (float64 GD: each step size costs (k - 1) x 2T gradients)
    gap_epochs: int = Field(2, ge=2)  # k of claim 3: full-batch GD epochs per task before comparing TA with MT
    gap_lrs: list[float] = Field(default_factory=lambda: [1e-4, 1e-5, 1e-6], min_length=2)  # eta values of claim 3 (the log-slope is fitted over them)
    slope_range: tuple[float, float] = (1.7, 2.3)  # claim 3 holds when the fitted log-slope of the gap in eta is inside
    batch_sizes: list[PositiveInt] = Field(default_factory=lambda: [512, 128, 32, 8], min_length=2)  # claim 4: AdamW batch sizes, one epoch each
    trajectory_examples: int = Field(1024, ge=1)  # claim 5: examples per task of the multi-epoch fine-tune
    trajectory_epochs: int = Field(6, ge=2)  # claim 5: epochs of the pipeline's fine-tune settings
    cosine_threshold: float = Field(0.8, ge=-1, le=1)  # claim 5: cos(g1, g_k) must exceed this for k <= cosine_epochs
    cosine_epochs: int = Field(5, ge=2)  # claim 5: the epochs k the cosine bound is checked for
    merge_tolerance: float = Field(0.03, ge=0)  # claim 6: one-epoch TA may be at most this far (accuracy fraction) below converged TA
    chunk: int = Field(256, ge=1)  # examples per autograd chunk of the independent gradients

    @field_validator("slope_range")
    @classmethod
    def _ordered(cls, v: tuple[float, float]) -> tuple[float, float]:
        if v[0] >= v[1]:
            raise ValueError(f"{list(v)}: expected [low, high] with low < high")
        return v

    @field_validator("gap_lrs")
    @classmethod
    def _two_sizes(cls, v: list[float]) -> list[float]:
        if len(set(v)) < 2 or min(v) <= 0:
            raise ValueError(f"{v}: expected at least two different positive step sizes")
        return v


# ------------------------------------------------------------------------------------------------ vectors
def _flat(state: Mapping[str, torch.Tensor], keys: Sequence[str] | None = None) -> torch.Tensor:
    keys = [k for k in state if state[k].is_floating_point()] if keys is None else keys
    return torch.cat([state[k].detach().reshape(-1).to(torch.float64) for k in keys])


def sub(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> State:
    return {k: a[k] - b[k] for k in b if b[k].is_floating_point()}


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = float(a.norm() * b.norm())
    return float(a @ b) / denom if denom > 0 else math.nan


def float32_floor(state: Mapping[str, torch.Tensor], keys: Sequence[str]) -> float:
    """‖ ulp(theta) / 2 ‖: the l2 error of merely storing ``state`` (exact) in float32, over ``keys``."""
    x = _flat(state, keys).to(torch.float32).abs()
    return float(((torch.nextafter(x, torch.full_like(x, math.inf)) - x).to(torch.float64) / 2).norm())


def errors(measured: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], theta0: Mapping[str, torch.Tensor] | None = None) -> dict[str, float]:
    """max |measured - expected|, ‖measured - expected‖ / ‖expected‖ over the keys of ``expected`` (updates
    from ``theta0``); with ``theta0``, also ``ulps``: ‖measured - expected‖ over the float32 floor of theta0 + expected."""
    keys = list(expected)
    m, e = _flat(measured, keys), _flat(expected, keys)
    diff = m - e
    out = {"max_abs": float(diff.abs().max()), "relative": float(diff.norm() / e.norm()) if e.norm() > 0 else math.nan}
    if theta0 is not None:
        floor = float32_floor({k: theta0[k].to(torch.float64) + expected[k].to(torch.float64) for k in keys}, keys)
        out["floor_relative"] = floor / float(e.norm()) if e.norm() > 0 else math.nan
        out["ulps"] = float(diff.norm()) / floor if floor > 0 else math.nan
    return out


# ------------------------------------------------------------------------------------------------ gradients
def loss_gradient(backbone, head: nn.Linear, images: torch.Tensor, labels: torch.Tensor, state: Mapping[str, torch.Tensor], *, chunk: int = 256, dtype: torch.dtype = torch.float32) -> State:
    """grad Lbar_t(state) by plain autograd, independently of the training loop: the mean cross-entropy of
    ``head`` (frozen) on ``backbone.net`` holding ``state`` (cast to ``dtype``), summed over chunks of examples and
    divided by their number. ``backbone`` is a mergeflow Backbone (its input normalisation is used, then cast)."""
    net = backbone.net.eval()
    # the trainable tensors: CLIP's projection bias is frozen, so it has no gradient (and no task-vector share)
    trainable = {k for k, p in net.named_parameters() if p.requires_grad}
    params = {k: v.detach().to(dtype).requires_grad_(k in trainable) for k, v in state.items() if v.is_floating_point()}
    weight, bias = head.weight.detach().to(dtype), head.bias.detach().to(dtype)
    total = {k: torch.zeros_like(v) for k, v in params.items()}
    n = len(images)
    for i in range(0, n, chunk):
        x = backbone.normalise(images[i : i + chunk]).to(dtype)
        logits = backbone.embed(torch.func.functional_call(net, params, (x,))) @ weight.T + bias
        loss = nn.functional.cross_entropy(logits, labels[i : i + chunk], reduction="sum")
        for k, g in zip(trainable & set(params), torch.autograd.grad(loss, [params[k] for k in trainable & set(params)])):
            total[k] += g
    return {k: g / n for k, g in total.items()}


def gd_steps(state0: Mapping[str, torch.Tensor], grad_fns: Sequence[GradFn], lr: float, steps: int, *, first: Sequence[State] | None = None) -> list[State]:
    """``steps`` full-batch GD steps theta <- theta - lr * sum_f f(theta) (constant step size); returns the
    states after each step (the first is after one step). ``first``: the gradients at ``state0``, if known."""
    state = {k: v.detach().clone() for k, v in state0.items() if v.is_floating_point()}
    out = []
    for i in range(steps):
        grads = list(first) if i == 0 and first is not None else [f(state) for f in grad_fns]
        state = {k: v - lr * sum(g[k] for g in grads) for k, v in state.items()}
        out.append(state)
    return out


# ------------------------------------------------------------------------------------------------ claims 1-2
def one_epoch_identity(theta0: State, tasks: Sequence[str], trainer, grads: Mapping[str, State], *, eta: float, alpha: float) -> dict[str, Any]:
    """Claim 1: the one_epoch regime through ``trainer`` (full-batch GD, lr ``eta``) against -eta * ``grads[t]``
    (grad Lbar_t(theta0)), per task; and theta0 + alpha * sum_t tau_t(1) against theta0 - alpha * eta * sum_t grads[t]."""
    from mergeflow.regimes import REGISTRY

    result = REGISTRY["one_epoch"](theta0, tasks, trainer)
    taus = {t: sub(result.task_states[t], theta0) for t in tasks}
    per_task = {t: errors(taus[t], {k: -eta * g for k, g in grads[t].items()}, theta0) for t in tasks}
    ta = {k: v + alpha * sum(taus[t][k] for t in tasks) for k, v in theta0.items() if v.is_floating_point()}
    mt = {k: v - alpha * eta * sum(grads[t][k] for t in tasks) for k, v in theta0.items() if v.is_floating_point()}
    return {"tasks": per_task, "multitask": errors(sub(ta, theta0), sub(mt, theta0), theta0), "tau_norms": {t: float(_flat(taus[t]).norm()) for t in tasks}}


def atm_identity(theta0: State, tasks: Sequence[str], trainer, grad_fns: Mapping[str, GradFn], *, eta: float, alpha: float, rounds: int) -> list[dict[str, float]]:
    """Claim 2: ATM (the registered regime, ``trainer`` = one full-batch GD step at ``eta`` per task per round)
    against ``rounds`` multi-task GD steps at alpha * eta; per round, the errors of theta_ATM(r) - theta0."""
    from mergeflow.regimes import REGISTRY

    result = REGISTRY["atm"](theta0, tasks, trainer, rounds=rounds, steps=1, alpha=alpha, keep_updates=False)
    mt = gd_steps(theta0, [grad_fns[t] for t in tasks], alpha * eta, rounds)
    return [{"round": r + 1, **errors(sub(rec.combined, theta0), sub(mt[r], theta0), theta0)} for r, rec in enumerate(result.rounds)]


# ------------------------------------------------------------------------------------------------ claim 3
def ta_mt_gaps(theta0: State, grad_fns: Mapping[str, GradFn], *, eta: float, alpha: float, epochs: int, grads0: Mapping[str, State] | None = None) -> list[dict[str, float]]:
    """Theorem 1: per task ``epochs`` full-batch GD steps at ``eta``, merged by task arithmetic (alpha), against
    ``epochs`` multi-task GD steps at alpha * eta; per epoch k, ‖theta_TA(k) - theta_MT(k)‖ and ‖theta_MT(k) - theta0‖.
    ``grads0``: each task's gradient at theta0, if known (shared by every step size)."""
    g0 = grads0 or {t: f(theta0) for t, f in grad_fns.items()}
    per_task = {t: gd_steps(theta0, [f], eta, epochs, first=[g0[t]]) for t, f in grad_fns.items()}
    mt = gd_steps(theta0, list(grad_fns.values()), alpha * eta, epochs, first=[g0[t] for t in grad_fns])
    out = []
    for k in range(epochs):
        ta = {key: v + alpha * sum(per_task[t][k][key] - v for t in grad_fns) for key, v in theta0.items() if v.is_floating_point()}
        out.append({"epoch": k + 1, "gap": float((_flat(ta) - _flat(mt[k])).norm()), "mt_step": float((_flat(mt[k]) - _flat(theta0)).norm())})
    return out


def directional_curvature(grad_fn: GradFn, state: Mapping[str, torch.Tensor], grad: Mapping[str, torch.Tensor], *, eps: float = 1e-5) -> float:
    """u' H u along u = grad / ‖grad‖ (the loss's sharpness in the gradient's direction), by a central-free
    finite difference of the gradient: (grad(state - eps u) - grad(state)) . (-u) / eps."""
    keys = list(grad)
    norm = float(_flat(grad, keys).norm())
    moved = {k: state[k] - eps * grad[k] / norm for k in keys}
    return float((_flat(grad_fn(moved), keys) - _flat(grad, keys)) @ (-_flat(grad, keys) / norm)) / eps


def log_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of log y against log x."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


# ------------------------------------------------------------------------------------------------ claims 4-5
def minibatch_cosines(theta0: State, tasks: Sequence[str], trainers: Mapping[int, Any], grads: Mapping[str, State]) -> dict[int, dict[str, float]]:
    """Claim 4: per key of ``trainers`` (steps per epoch -> a trainer), one epoch of the one_epoch regime, and
    cos(tau_t(1), -grads[t]) per task."""
    from mergeflow.regimes import REGISTRY

    out = {}
    for steps, trainer in trainers.items():
        result = REGISTRY["one_epoch"](theta0, tasks, trainer)
        out[steps] = {t: cosine(_flat(sub(result.task_states[t], theta0), list(grads[t])), -_flat(grads[t])) for t in tasks}
    return out


def epoch_updates(states: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, list[float]]:
    """Claim 5 from theta(0), theta(1), ..., theta(K): ‖g_k‖ with g_k = theta(k) - theta(k-1), cos(g_1, g_k),
    and ‖tau(k)‖ = ‖theta(k) - theta(0)‖, for k = 1..K."""
    flats = [_flat(s) for s in states]
    g = [flats[k] - flats[k - 1] for k in range(1, len(flats))]
    return {
        "update_norms": [float(v.norm()) for v in g],
        "cos_first": [cosine(g[0], v) for v in g],
        "tau_norms": [float((f - flats[0]).norm()) for f in flats[1:]],
    }


def trajectory_claim(per_task: Mapping[str, Mapping[str, list[float]]], *, threshold: float, cosine_epochs: int) -> tuple[bool, dict[str, dict[str, bool]]]:
    """Claim 5's verdict per task: g_1 has the largest norm; cos(g_1, g_k) > threshold for 2 <= k <= cosine_epochs;
    ‖tau(k)‖ increases with k. Holds when all three hold for every task."""
    checks = {}
    for t, u in per_task.items():
        n = u["update_norms"]
        checks[t] = {
            "first_largest": n[0] >= max(n),
            "aligned": all(c > threshold for c in u["cos_first"][1:cosine_epochs]),
            "tau_grows": all(b > a for a, b in zip(u["tau_norms"], u["tau_norms"][1:])),
        }
    return all(all(c.values()) for c in checks.values()), checks


# ------------------------------------------------------------------------------------------------ claims 6-7 (pipeline outputs)
def _test_average(evaluation: Mapping[str, Any]) -> float:
    """The test average of a metrics/evaluate-format dictionary (``average`` a number, or {val, test})."""
    avg = evaluation["average"]
    return float(avg["test"] if isinstance(avg, Mapping) else avg)


def claim_one_epoch_merge(regime_metrics: Mapping[str, Any] | None, one_epoch_ta: Mapping[str, Any] | None, standard_ta: Mapping[str, Any] | None, finetune: Mapping[str, Mapping[str, Any]] | None, *, tolerance: float, missing: Sequence[str] = ()) -> Claim:
    """Claim 6 from metrics/regime/one_epoch.json, the one-epoch vectors' task_arithmetic evaluation, the standard
    task_arithmetic evaluation and metrics/finetune/<t>.json; ``missing`` lists what was not run (-> not measured)."""
    text = "Task arithmetic on one-epoch task vectors is within a few points of (or above) task arithmetic on converged ones, while the one-epoch models alone are weaker"
    if missing or regime_metrics is None or one_epoch_ta is None or standard_ta is None or not finetune:
        return Claim("000.6", text, None, {}, "; ".join(missing) or "inputs missing")
    one, full = _test_average(one_epoch_ta), _test_average(standard_ta)
    individual_one = float(regime_metrics["variants"]["one_epoch"]["individual_average"]["test"])
    individual_full = sum(float(m["individual"]["test"]) for m in finetune.values()) / len(finetune)
    merges_close = one >= full - tolerance
    weaker = individual_one < individual_full
    numbers = {"ta_one_epoch": one, "ta_converged": full, "individual_one_epoch": individual_one, "individual_converged": individual_full, "tolerance": tolerance}
    detail = (f"TA test avg {100 * one:.1f}% (1 epoch) vs {100 * full:.1f}% (converged), needs >= {100 * (full - tolerance):.1f}%: {'yes' if merges_close else 'no'}; "
              f"individual avg {100 * individual_one:.1f}% vs {100 * individual_full:.1f}%: {'weaker' if weaker else 'not weaker'}")
    return Claim("000.6", text, merges_close and weaker, numbers, detail)


BASELINES = ("task_arithmetic", "ties", "breadcrumbs")


def claim_atm_budget(atm: Mapping[int, Mapping[str, Any]], baselines: Mapping[str, Mapping[str, Any] | None], *, missing: Sequence[str] = ()) -> Claim:
    """Claim 7 from ATM's own model's evaluation per round count R (at the standard budget: R * K = finetune.steps)
    and the standard regime's one-shot evaluations of ``BASELINES``: holds when ATM at the largest R beats each
    baseline on the test average and, with two or more R, the average does not fall as R grows."""
    text = "At a fixed fine-tuning budget, ATM with more rounds of shorter fine-tunes beats one-shot task arithmetic, TIES and Breadcrumbs"
    absent = [m for m in BASELINES if baselines.get(m) is None]
    if missing or not atm or absent:
        reasons = list(missing) + ([f"no evaluation of {', '.join(absent)} (add to merge.methods)"] if absent else []) + ([] if atm else ["no ATM evaluation"])
        return Claim("000.7", text, None, {}, "; ".join(reasons))
    rounds = sorted(atm)
    atm_avg = {r: _test_average(atm[r]) for r in rounds}
    base = {m: _test_average(baselines[m]) for m in BASELINES}
    best_r = rounds[-1]
    beats = all(atm_avg[best_r] > v for v in base.values())
    trend = all(b >= a for a, b in zip([atm_avg[r] for r in rounds], [atm_avg[r] for r in rounds[1:]])) if len(rounds) > 1 else None
    numbers = {"atm": {str(r): v for r, v in atm_avg.items()}, "baselines": base}
    parts = [f"ATM R={r}: {100 * atm_avg[r]:.1f}%" for r in rounds] + [f"{m}: {100 * v:.1f}%" for m, v in base.items()]
    trend_text = "trend in R not measured (one round count: add more to regimes.atm.rounds)" if trend is None else f"non-decreasing in R: {'yes' if trend else 'no'}"
    detail = f"test avg {', '.join(parts)}; R={best_r} beats all three: {'yes' if beats else 'no'}; {trend_text}"
    return Claim("000.7", text, beats and (trend is not False), numbers, detail)


def _read(path: Path):
    from mergeflow.io import read_json

    return read_json(path) if Path(path).is_file() else None


def _pipeline_claim_6(params, layout, tolerance: float) -> Claim:
    missing = []
    if "one_epoch" not in params.regimes.run:
        missing.append("regime one_epoch did not run (add one_epoch to regimes.run)")
    elif "task_arithmetic" not in params.regimes.methods_of("one_epoch"):
        missing.append("the one-epoch vectors are not merged by task_arithmetic (add it to regimes.methods.one_epoch)")
    if "task_arithmetic" not in params.merge.methods:
        missing.append("task_arithmetic not in merge.methods")
    if missing:
        return claim_one_epoch_merge(None, None, None, None, tolerance=tolerance, missing=missing)
    paths = {
        "regime": layout.metrics("regime", "one_epoch"),
        "one_epoch_ta": layout.merge_run("task_arithmetic", "one_epoch", "one_epoch").evaluation,
        "standard_ta": layout.merge_run("task_arithmetic").evaluation,
        **{f"finetune {t}": layout.metrics("finetune", t) for t in params.suite.tasks},
    }
    found = {k: _read(p) for k, p in paths.items()}
    missing = [f"{paths[k]} missing (run dvc repro)" for k, v in found.items() if v is None]
    finetune = {t: found[f"finetune {t}"] for t in params.suite.tasks}
    return claim_one_epoch_merge(found["regime"], found["one_epoch_ta"], found["standard_ta"], finetune, tolerance=tolerance, missing=missing)


def one_epoch_rows(params, layout) -> list[tuple[str, float | None, float | None]]:
    """(method, test average on one-epoch vectors, on the converged ones) for each method the one-epoch vectors
    went to; None where that evaluation is absent."""
    if "one_epoch" not in params.regimes.run:
        return []
    rows = []
    for m in params.regimes.methods_of("one_epoch"):
        one = _read(layout.merge_run(m, "one_epoch", "one_epoch").evaluation)
        full = _read(layout.merge_run(m).evaluation) if m in params.merge.methods else None
        rows.append((m, _test_average(one) if one else None, _test_average(full) if full else None))
    return rows


def _pipeline_claim_7(params, layout) -> Claim:
    missing, atm_evals = [], {}
    if "atm" not in params.regimes.run:
        missing.append("regime atm did not run (add atm to regimes.run)")
    elif "atm" not in params.regimes.methods_of("atm"):
        missing.append("ATM's own model is not evaluated (add atm to regimes.methods.atm)")
    else:
        at_budget = {v: kw for v, kw in params.regimes.config("atm").variants("atm", params.finetune.steps).items()
                     if kw["steps"] is not None and kw["rounds"] * kw["steps"] == params.finetune.steps}
        if not at_budget:
            missing.append(f"no ATM variant at the standard budget of finetune.steps = {params.finetune.steps} steps (leave regimes.atm.steps empty)")
        for variant, kw in at_budget.items():
            path = layout.merge_run("atm", "atm", variant).evaluation
            atm_evals[kw["rounds"]] = _read(path)
            if atm_evals[kw["rounds"]] is None:
                missing.append(f"{path} missing (run dvc repro)")
    baselines = {}
    for m in BASELINES:
        path = layout.merge_run(m).evaluation
        baselines[m] = _read(path) if m in params.merge.methods else None
        if m in params.merge.methods and baselines[m] is None:
            missing.append(f"{path} missing (run dvc repro)")
    return claim_atm_budget(atm_evals, baselines, missing=missing)


# ------------------------------------------------------------------------------------------------ figures
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_minibatch(cosines: Mapping[int, Mapping[str, float]], sign_cos: Mapping[str, float], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.6, 3.8))
    steps = sorted(cosines)
    tasks = list(cosines[steps[0]])
    for t in tasks:
        ax.plot(steps, [cosines[s][t] for s in steps], marker="o", lw=1, alpha=0.7, label=t)
    ax.plot(steps, [sum(cosines[s].values()) / len(tasks) for s in steps], color="black", lw=2.2, marker="s", label="mean")
    ax.axhline(sum(sign_cos.values()) / len(sign_cos), color="grey", ls="--", lw=1, label="mean cos(sign g, g)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(steps, [str(s) for s in steps])
    ax.set_xlabel("AdamW steps in the one epoch")
    ax.set_ylabel("cos(tau_t(1), -grad L_t(theta0))")
    ax.set_title("One-epoch task vector vs. full-batch gradient (claim 4)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=130, format="png")
    plt.close(fig)


def plot_trajectory(per_task: Mapping[str, Mapping[str, list[float]]], threshold: float, path: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    for t, u in per_task.items():
        k = list(range(1, len(u["update_norms"]) + 1))
        total = sum(u["update_norms"])
        axes[0].plot(k, [n / total for n in u["update_norms"]], marker="o", label=t)
        axes[1].plot(k, u["cos_first"], marker="o", label=t)
        axes[2].plot(k, u["tau_norms"], marker="o", label=t)
    axes[1].axhline(threshold, color="grey", ls="--", lw=1)
    titles = ("‖g_k‖ / sum_j ‖g_j‖", "cos(g_1, g_k)", "‖tau(k)‖ = ‖theta(k) - theta0‖")
    for ax, title in zip(axes, titles):
        ax.set_xlabel("epoch k")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Per-epoch updates g_k = theta(k) - theta(k-1) under the pipeline's fine-tune (claim 5)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130, format="png")
    plt.close(fig)


def plot_gaps(gaps: Mapping[float, list[dict[str, float]]], slope: float, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.2, 3.8))
    etas = sorted(gaps)
    k = len(gaps[etas[0]])
    for j in range(1, k):
        ys = [gaps[e][j]["gap"] for e in etas]
        ax.plot(etas, ys, marker="o", label=f"‖theta_TA - theta_MT‖, epoch {j + 1}")
    ref = [gaps[etas[0]][-1]["gap"] * (e / etas[0]) ** 2 for e in etas]  # through the smallest eta's gap
    ax.plot(etas, ref, color="grey", ls="--", label="slope 2")
    ax.plot(etas, [gaps[e][-1]["mt_step"] for e in etas], color="black", ls=":", label="‖theta_MT - theta0‖ (slope 1)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("step size eta")
    ax.set_title(f"TA vs multi-task GD after k epochs (claim 3): slope {slope:.2f}", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130, format="png")
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ the study
def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _sci(x: float) -> str:
    return f"{x:.1e}"


@register("gradients", paper=PAPER, title="On Task Vectors and Gradients: task vectors as (approximate) gradients", settings=GradientsSettings)
def gradients(context: StudyContext) -> StudyResult:
    from mergeflow import data as data_mod
    from mergeflow.io import LazyStateDict, load_state_dict
    from mergeflow.models import backbone_state, build_backbone, load_head
    from mergeflow.regimes._finetune import finetune_trainer
    from mergeflow.training import FeatureAnchor, finetune as finetune_loop

    params, layout, s, device = context.params, context.layout, context.settings, context.device
    started = time.perf_counter()
    timings: dict[str, float] = {}
    all_tasks = list(params.suite.tasks)
    subset = list(s.tasks) if s.tasks is not None else all_tasks[:4]
    unknown = [t for t in subset if t not in all_tasks]
    if unknown:
        raise MergeflowError(f"studies.gradients.tasks: unknown task '{unknown[0]}' (suite.tasks: {', '.join(all_tasks)})")
    theta0 = load_state_dict(layout.pretrained)
    backbone = build_backbone(params.backbone, theta0, source=str(layout.pretrained))
    tasks = {t: data_mod.load_task(layout.task_data(t), params.suite.image_size) for t in all_tasks}
    heads = {t: load_head(layout.head(t), backbone.num_features, num_classes=len(tasks[t].classes), classes_source=str(layout.task_data(t))) for t in all_tasks}
    seeds = {t: task_seed(params.seed, t) for t in all_tasks}

    def train_set(t: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tasks[t].train.images[:n], tasks[t].train.labels[:n]

    gd_cfg = params.finetune.model_copy(update={"optimizer": "gd", "lr": s.gd_lr, "weight_decay": 0.0, "warmup_steps": 0, "epochs": 1, "momentum": 0.0,
                                                "preserve_features": params.finetune.preserve_features.model_copy(update={"weight": 0.0})})
    sets = {t: train_set(t, s.examples) for t in all_tasks}
    # on the CPU whatever runtime.device is: on CUDA the trainer autocasts to bfloat16, and the identities are float32 ones
    gd_trainer = finetune_trainer(params.backbone, heads, sets, gd_cfg, seeds=seeds, device=torch.device("cpu"))

    def grad_fn(t: str, n: int, dtype=torch.float32) -> GradFn:
        x, y = train_set(t, n)
        return lambda state: loss_gradient(backbone, heads[t], x, y, state, chunk=s.chunk, dtype=dtype)

    # claim 1: one epoch of full-batch GD through the pipeline's trainer vs the autograd gradient
    t0 = time.perf_counter()
    grads = {t: grad_fn(t, s.examples)(theta0) for t in all_tasks}
    alpha_all = s.alpha if s.alpha is not None else 1 / len(all_tasks)
    ident = one_epoch_identity(theta0, all_tasks, gd_trainer, grads, eta=s.gd_lr, alpha=alpha_all)
    worst = max(e["ulps"] for e in ident["tasks"].values())
    worst_rel = max(e["relative"] for e in ident["tasks"].values())
    c1_holds = worst <= s.identity_ulps and ident["multitask"]["ulps"] <= s.identity_ulps
    claim1 = Claim(
        "000.1", "One epoch of full-batch GD gives tau_t(1) = -eta grad Lbar_t(theta0), and theta0 + alpha sum_t tau_t(1) is one multi-task GD step at alpha eta",
        c1_holds, {"eta": s.gd_lr, "alpha": alpha_all, "examples": s.examples, "tasks": ident["tasks"], "multitask": ident["multitask"], "identity_ulps": s.identity_ulps},
        f"{len(all_tasks)} tasks, {s.examples} examples each, float32: worst error {worst:.2f} float32 floors (relative {_sci(worst_rel)}), "
        f"multi-task step {ident['multitask']['ulps']:.2f} floors (relative {_sci(ident['multitask']['relative'])}); holds at <= {s.identity_ulps:g} floors",
    )
    timings["claim 1"] = time.perf_counter() - t0

    # claim 2: ATM with one GD step per task per round vs multi-task GD
    t0 = time.perf_counter()
    alpha_sub = s.alpha if s.alpha is not None else 1 / len(subset)
    atm_rounds = atm_identity(theta0, subset, gd_trainer, {t: grad_fn(t, s.examples) for t in subset}, eta=s.gd_lr, alpha=alpha_sub, rounds=s.atm_rounds)
    c2_holds = all(r["ulps"] <= s.identity_ulps * r["round"] for r in atm_rounds)
    claim2 = Claim(
        "000.2", f"ATM with one full-batch GD step per task per round equals R multi-task GD steps at alpha eta (R = {s.atm_rounds})",
        c2_holds, {"eta": s.gd_lr, "alpha": alpha_sub, "tasks": subset, "rounds": atm_rounds, "identity_ulps": s.identity_ulps},
        f"{len(subset)} tasks, float32: error of theta_ATM(r) per round {', '.join(format(r['ulps'], '.2f') for r in atm_rounds)} float32 floors "
        f"(relative {', '.join(_sci(r['relative']) for r in atm_rounds)}); holds at <= {s.identity_ulps:g} x r floors",
    )
    timings["claim 2"] = time.perf_counter() - t0

    # claim 3: the TA - MT gap after k >= 2 epochs scales as eta^2 (float64, constant step size)
    t0 = time.perf_counter()
    theta0_64 = {k: v.to(torch.float64) for k, v in theta0.items() if v.is_floating_point()}
    fns64 = {t: grad_fn(t, s.gap_examples, torch.float64) for t in subset}
    grads64 = {t: f(theta0_64) for t, f in fns64.items()}
    sharpness = {t: directional_curvature(fns64[t], theta0_64, grads64[t]) for t in subset}
    gaps = {eta: ta_mt_gaps(theta0_64, fns64, eta=eta, alpha=alpha_sub, epochs=s.gap_epochs, grads0=grads64) for eta in sorted(s.gap_lrs)}
    etas = sorted(gaps)
    slope = log_slope(etas, [gaps[e][-1]["gap"] for e in etas])
    # the gap's shrink factor from each step size to the next smaller one (eta^2: the square of the eta ratio)
    ratios = [{"eta": [hi, lo], "eta_ratio": hi / lo, "gap_ratio": gaps[hi][-1]["gap"] / gaps[lo][-1]["gap"]} for lo, hi in zip(etas, etas[1:])]
    low, high = s.slope_range
    claim3 = Claim(
        "000.3", f"After k = {s.gap_epochs} GD epochs, ‖theta_TA(k) - theta_MT(k)‖ scales as eta^2",
        low <= slope <= high, {"etas": etas, "gaps": {str(e): g for e, g in gaps.items()}, "slope": slope, "ratios": ratios, "sharpness": sharpness, "slope_range": [low, high]},
        f"{len(subset)} tasks, {s.gap_examples} examples each, float64: the gap shrinks " + ", ".join(f"{r['gap_ratio']:.0f}x for eta {r['eta'][0]:g} -> {r['eta'][1]:g}" for r in ratios)
        + f"; log-slope {slope:.2f} (holds in [{low}, {high}])",
    )
    timings["claim 3"] = time.perf_counter() - t0

    # claim 4: minibatch AdamW, one epoch per batch size: cos(tau_t(1), -grad Lbar_t(theta0))
    t0 = time.perf_counter()
    trainers = {}
    for b in sorted(s.batch_sizes, reverse=True):
        cfg = params.finetune.model_copy(update={"optimizer": "adamw", "batch_size": b, "epochs": 1, "warmup_steps": 0})
        trainers[max(1, s.examples // min(b, s.examples))] = finetune_trainer(params.backbone, heads, {t: sets[t] for t in subset}, cfg, seeds=seeds, device=device)
    cos4 = minibatch_cosines(theta0, subset, trainers, grads)
    sign_cos = {t: cosine(torch.sign(_flat(grads[t])), _flat(grads[t])) for t in subset}
    steps4 = sorted(cos4)
    means4 = [sum(cos4[k].values()) / len(subset) for k in steps4]
    below_one = all(c < 1 - 1e-6 for v in cos4.values() for c in v.values())
    falling = all(b < a for a, b in zip(means4, means4[1:]))
    claim4 = Claim(
        "000.4", "Under minibatch AdamW, cos(tau_t(1), -grad Lbar_t(theta0)) < 1 and it falls as the steps per epoch grow",
        below_one and falling, {"steps_per_epoch": steps4, "cosines": {str(k): v for k, v in cos4.items()}, "mean": means4, "sign_cosine": sign_cos},
        f"mean cosine over {len(subset)} tasks at {', '.join(map(str, steps4))} steps/epoch: {', '.join(f'{m:.3f}' for m in means4)}; all < 1: {'yes' if below_one else 'no'}; strictly falling: {'yes' if falling else 'no'}",
    )
    timings["claim 4"] = time.perf_counter() - t0

    # claim 5: per-epoch updates of the pipeline's fine-tune (its optimiser, lr, weight decay, batch, feature anchor)
    t0 = time.perf_counter()
    n5 = min(s.trajectory_examples, len(tasks[subset[0]].train.images))
    per_epoch = max(1, n5 // min(params.finetune.batch_size, n5))
    full_per_epoch = max(1, len(tasks[subset[0]].train.images) // min(params.finetune.batch_size, len(tasks[subset[0]].train.images)))
    # the warm-up keeps the share of the first epoch it has in the pipeline's fine-tune on the whole training split
    warmup = round(params.finetune.warmup_steps * per_epoch / full_per_epoch)
    cfg5 = params.finetune.model_copy(update={"epochs": s.trajectory_epochs, "warmup_steps": warmup})
    trajectories = {}
    preserve = params.finetune.preserve_features
    # the feature anchor as the finetune stage builds it (stages._feature_anchor), the corpus read once
    corpus = LazyStateDict(layout.pretrain_corpus)["images"] if preserve.weight > 0 else None
    for t in subset:
        model = copy.deepcopy(backbone)
        anchor = FeatureAnchor.build(backbone, corpus, preserve, seed=seeds[t], device=device, eval_batch_size=params.runtime.eval_batch_size) if corpus is not None else None
        states = [backbone_state(model)]
        x, y = train_set(t, n5)
        finetune_loop(model, copy.deepcopy(heads[t]), x, y, cfg5, seed=seeds[t], device=device, desc=f"study gradients {t}",
                      on_epoch_end=lambda k, m=model: states.append(backbone_state(m)), anchor=anchor)
        trajectories[t] = epoch_updates([{k: v.cpu() for k, v in st.items()} for st in states])
    holds5, checks5 = trajectory_claim(trajectories, threshold=s.cosine_threshold, cosine_epochs=s.cosine_epochs)
    failing = {t: [k for k, ok in c.items() if not ok] for t, c in checks5.items() if not all(c.values())}
    claim5 = Claim(
        "000.5", f"The first epoch's update has the largest norm, cos(g_1, g_k) > {s.cosine_threshold} for k <= {s.cosine_epochs}, and ‖tau_t(k)‖ grows with k",
        holds5, {"epochs": s.trajectory_epochs, "examples": n5, "warmup_steps": warmup, "steps_per_epoch": per_epoch, "tasks": trajectories, "checks": checks5},
        f"{len(subset)} tasks, {s.trajectory_epochs} epochs of {per_epoch} steps: epoch 1's share of sum ‖g_k‖ "
        f"{min(u['update_norms'][0] / sum(u['update_norms']) for u in trajectories.values()):.2f}-{max(u['update_norms'][0] / sum(u['update_norms']) for u in trajectories.values()):.2f}, "
        f"lowest cos(g_1, g_k<={s.cosine_epochs}) {min(min(u['cos_first'][1:s.cosine_epochs]) for u in trajectories.values()):.2f}; "
        + ("all three hold for every task" if holds5 else "fails: " + "; ".join(f"{t} ({', '.join(v)})" for t, v in failing.items())),
    )
    timings["claim 5"] = time.perf_counter() - t0

    # claims 6-7: the pipeline's regime outputs
    claim6 = _pipeline_claim_6(params, layout, s.merge_tolerance)
    claim7 = _pipeline_claim_7(params, layout)

    # figures and body
    out = Path(context.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures = ["minibatch_cosine.png", "epoch_updates.png", "eta_scaling.png"]
    plot_minibatch(cos4, sign_cos, out / figures[0])
    plot_trajectory(trajectories, s.cosine_threshold, out / figures[1])
    plot_gaps(gaps, slope, out / figures[2])
    timings["total"] = time.perf_counter() - started
    # to the stage's log, not the report: the report's bytes must not change with the machine's load
    print("study gradients: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()), flush=True)
    body = _body(s, subset, ident, atm_rounds, gaps, slope, sharpness, cos4, sign_cos, trajectories, checks5, claim6, claim7, figures, warmup, per_epoch, one_epoch_rows(params, layout))
    return StudyResult([claim1, claim2, claim3, claim4, claim5, claim6, claim7], body, figures)


def _body(s, subset, ident, atm_rounds, gaps, slope, sharpness, cos4, sign_cos, trajectories, checks5, claim6, claim7, figures, warmup, per_epoch, rows6) -> str:
    lines = [
        "## Task vectors as gradients under full-batch GD (claims 1-2)",
        "",
        f"Each task's backbone is trained through the pipeline's trainer (`regimes._finetune.finetune_trainer`, regime `one_epoch`) with "
        f"`optimizer: gd`, lr eta = {s.gd_lr}, no weight decay or warm-up, on the first {s.examples} training examples; the gradient is "
        f"computed apart, by autograd of the mean cross-entropy under the task's frozen head in chunks of {s.chunk}. Float32 throughout, so "
        "the errors are set against the float32 floor ‖ulp(theta)/2‖, the error of merely storing the exact result: tau_t(1) is a small "
        "difference of two float32 models (relative floor below).",
        "",
        "| task | max abs error | relative error | relative floor | error / floor | norm of tau_t(1) |",
        "|---|---|---|---|---|---|",
    ]
    for t, e in ident["tasks"].items():
        lines.append(f"| {t} | {_sci(e['max_abs'])} | {_sci(e['relative'])} | {_sci(e['floor_relative'])} | {e['ulps']:.2f} | {ident['tau_norms'][t]:.4g} |")
    mt = ident["multitask"]
    lines += [f"| theta0 + alpha sum tau_t vs one multi-task step | {_sci(mt['max_abs'])} | {_sci(mt['relative'])} | {_sci(mt['floor_relative'])} | {mt['ulps']:.2f} | |", ""]
    lines += [f"ATM (regime `atm`, steps=1, alpha = 1/{len(subset)}) against {s.atm_rounds} multi-task GD steps (own loop, same gradients' route) on {', '.join(subset)}:", "",
              "| round | max abs error | relative error of theta(r) - theta0 | relative floor | error / floor |", "|---|---|---|---|---|"]
    lines += [f"| {r['round']} | {_sci(r['max_abs'])} | {_sci(r['relative'])} | {_sci(r['floor_relative'])} | {r['ulps']:.2f} |" for r in atm_rounds]
    etas = sorted(gaps)
    lines += ["", "## The TA - multi-task gap is second order in eta (claim 3)", "",
              f"Float64 full-batch GD at a constant step size (the theorem's setting), {s.gap_examples} examples per task on {', '.join(subset)}; "
              f"TA = theta0 + alpha sum_t tau_t(k), MT = k GD steps at alpha eta on sum_t Lbar_t. At k = 1 the gap is the identity of claim 1 in float64. "
              "The step sizes are small because the loss is sharp: its curvature along the gradient, u'Hu, is "
              + ", ".join(f"{sharpness[t]:.3g} ({t})" for t in subset)
              + "; the expansion in eta needs eta u'Hu well below 1.", "",
              "| eta | " + " | ".join(f"gap, k={g['epoch']}" for g in gaps[etas[0]]) + f" | norm of theta_MT({s.gap_epochs}) - theta0 |",
              "|---|" + "---|" * (len(gaps[etas[0]]) + 1)]
    for e in etas:
        lines.append(f"| {e:g} | " + " | ".join(_sci(g["gap"]) for g in gaps[e]) + f" | {gaps[e][-1]['mt_step']:.3g} |")
    lines += ["", f"Fitted log-slope of the gap at k = {s.gap_epochs}: **{slope:.2f}** (2 is eta^2).", "", f"![eta scaling]({figures[2]})", "",
              "## Minibatch AdamW: one epoch is no longer the gradient (claim 4)", "",
              f"One epoch of AdamW (the pipeline's lr and weight decay, no warm-up, no feature anchor) on the same {s.examples} examples, "
              f"at batch sizes {', '.join(map(str, sorted(s.batch_sizes, reverse=True)))}; cosine of tau_t(1) with the full-batch negative gradient. "
              "Adam's first step is about -lr sign(g), so one step already has the cosine of sign(g) with g (last row).", "",
              "| steps / epoch | " + " | ".join(subset) + " | mean |", "|---|" + "---|" * (len(subset) + 1)]
    for k in sorted(cos4):
        v = cos4[k]
        lines.append(f"| {k} | " + " | ".join(f"{v[t]:.3f}" for t in subset) + f" | {sum(v.values()) / len(v):.3f} |")
    lines.append("| cos(sign g, g) | " + " | ".join(f"{sign_cos[t]:.3f}" for t in subset) + f" | {sum(sign_cos.values()) / len(sign_cos):.3f} |")
    lines += ["", f"![cosine vs steps per epoch]({figures[0]})", "", "## The first epoch dominates the trajectory (claim 5)", "",
              f"The pipeline's fine-tune settings (optimizer, lr, weight decay, batch size, feature anchor) for {s.trajectory_epochs} epochs on the first "
              f"{s.trajectory_examples} training examples ({per_epoch} steps an epoch; warm-up {warmup} steps, the share of the first epoch it has in the "
              "pipeline's run on the whole split; cosine decay over all epochs, so later epochs' learning rates are smaller by construction). "
              "g_k = theta(k) - theta(k-1).", "",
              "| task | share of sum ‖g_k‖, k = 1.. | cos(g_1, g_k), k = 2.. | ‖tau(k)‖, k = 1.. | first largest | aligned | grows |", "|---|---|---|---|---|---|---|"]
    for t, u in trajectories.items():
        total = sum(u["update_norms"])
        c = checks5[t]
        lines.append(f"| {t} | {', '.join(f'{n / total:.2f}' for n in u['update_norms'])} | {', '.join(f'{x:.2f}' for x in u['cos_first'][1:])} | "
                     f"{', '.join(f'{x:.3g}' for x in u['tau_norms'])} | {'yes' if c['first_largest'] else 'no'} | {'yes' if c['aligned'] else 'no'} | {'yes' if c['tau_grows'] else 'no'} |")
    lines += ["", f"![per-epoch updates]({figures[1]})", "", "## From the pipeline's regimes (claims 6-7)", "", "| claim | verdict | measured |", "|---|---|---|"]
    for c in (claim6, claim7):
        lines.append(f"| {c.id} | {c.verdict} | {c.detail} |")
    if rows6:
        lines += ["", "Each merge of the one-epoch task vectors (regime `one_epoch`: one epoch of the pipeline's fine-tune per task) against the same "
                  "method on the converged ones (test average, %, hyperparameters chosen on validation for each):", "",
                  "| method | one epoch | converged | difference |", "|---|---|---|---|"]
        for m, one, full in rows6:
            diff = f"{100 * (one - full):+.1f}" if one is not None and full is not None else "-"
            lines.append(f"| {m} | {_pct(one) if one is not None else '-'} | {_pct(full) if full is not None else '-'} | {diff} |")
    return "\n".join(lines) + "\n"
