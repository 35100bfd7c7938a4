"""Study ``gradients``' measurements of claims 1-5, small pure functions: vectors, gradients by autograd, exact GD,
the one-epoch and ATM identities, the eta^2 scaling of TA - MT, the mini-batch cosines and the per-epoch updates."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, TYPE_CHECKING


from mergeflow.studies.gradients.settings import GradFn, State

if TYPE_CHECKING:
    import torch
    from torch import nn


def _flat(state: Mapping[str, torch.Tensor], keys: Sequence[str] | None = None) -> torch.Tensor:
    import torch

    keys = [k for k in state if state[k].is_floating_point()] if keys is None else keys
    return torch.cat([state[k].detach().reshape(-1).to(torch.float64) for k in keys])


def sub(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> State:
    return {k: a[k] - b[k] for k in b if b[k].is_floating_point()}


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = float(a.norm() * b.norm())
    return float(a @ b) / denom if denom > 0 else math.nan


def float32_floor(state: Mapping[str, torch.Tensor], keys: Sequence[str]) -> float:
    """‖ ulp(theta) / 2 ‖: the l2 error of merely storing ``state`` (exact) in float32, over ``keys``."""
    import torch

    x = _flat(state, keys).to(torch.float32).abs()
    return float(((torch.nextafter(x, torch.full_like(x, math.inf)) - x).to(torch.float64) / 2).norm())


def errors(
    measured: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    theta0: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, float]:
    """max |measured - expected|, ‖measured - expected‖ / ‖expected‖ over the keys of ``expected`` (updates
    from ``theta0``); with ``theta0``, also ``ulps``: ‖measured - expected‖ over the float32 floor of theta0 +
    expected."""
    import torch

    keys = list(expected)
    m, e = _flat(measured, keys), _flat(expected, keys)
    diff = m - e
    out = {"max_abs": float(diff.abs().max()), "relative": float(diff.norm() / e.norm()) if e.norm() > 0 else math.nan}
    if theta0 is not None:
        floor = float32_floor({k: theta0[k].to(torch.float64) + expected[k].to(torch.float64) for k in keys}, keys)
        out["floor_relative"] = floor / float(e.norm()) if e.norm() > 0 else math.nan
        out["ulps"] = float(diff.norm()) / floor if floor > 0 else math.nan
    return out


def loss_gradient(
    backbone,
    head: nn.Linear,
    images: torch.Tensor,
    labels: torch.Tensor,
    state: Mapping[str, torch.Tensor],
    *,
    chunk: int = 256,
    dtype: torch.dtype | None = None,
) -> State:
    """grad Lbar_t(state) by plain autograd, independently of the training loop: the mean cross-entropy of
    ``head`` (frozen) on ``backbone.net`` holding ``state`` (cast to ``dtype``, float32 by default), summed over chunks
    of examples and
    divided by their number. ``backbone`` is a mergeflow Backbone (its input normalisation is used, then cast)."""
    import torch
    from torch import nn

    dtype = torch.float32 if dtype is None else dtype
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
        for k, g in zip(
            trainable & set(params), torch.autograd.grad(loss, [params[k] for k in trainable & set(params)])
        ):
            total[k] += g
    return {k: g / n for k, g in total.items()}


def gd_steps(
    state0: Mapping[str, torch.Tensor],
    grad_fns: Sequence[GradFn],
    lr: float,
    steps: int,
    *,
    first: Sequence[State] | None = None,
) -> list[State]:
    """``steps`` full-batch GD steps theta <- theta - lr * sum_f f(theta) (constant step size); returns the
    states after each step (the first is after one step). ``first``: the gradients at ``state0``, if known."""
    state = {k: v.detach().clone() for k, v in state0.items() if v.is_floating_point()}
    out = []
    for i in range(steps):
        grads = list(first) if i == 0 and first is not None else [f(state) for f in grad_fns]
        state = {k: v - lr * sum(g[k] for g in grads) for k, v in state.items()}
        out.append(state)
    return out


def one_epoch_identity(
    theta0: State, tasks: Sequence[str], trainer, grads: Mapping[str, State], *, eta: float, alpha: float
) -> dict[str, Any]:
    """Claim 1: the one_epoch regime through ``trainer`` (full-batch GD, lr ``eta``) against -eta * ``grads[t]``
    (grad Lbar_t(theta0)), per task; and theta0 + alpha * sum_t tau_t(1) against theta0 - alpha * eta * sum_t
    grads[t]."""
    from mergeflow.ml.regimes import REGISTRY

    result = REGISTRY["one_epoch"](theta0, tasks, trainer)
    taus = {t: sub(result.task_states[t], theta0) for t in tasks}
    per_task = {t: errors(taus[t], {k: -eta * g for k, g in grads[t].items()}, theta0) for t in tasks}
    ta = {k: v + alpha * sum(taus[t][k] for t in tasks) for k, v in theta0.items() if v.is_floating_point()}
    mt = {k: v - alpha * eta * sum(grads[t][k] for t in tasks) for k, v in theta0.items() if v.is_floating_point()}
    return {
        "tasks": per_task,
        "multitask": errors(sub(ta, theta0), sub(mt, theta0), theta0),
        "tau_norms": {t: float(_flat(taus[t]).norm()) for t in tasks},
    }


def atm_identity(
    theta0: State,
    tasks: Sequence[str],
    trainer,
    grad_fns: Mapping[str, GradFn],
    *,
    eta: float,
    alpha: float,
    rounds: int,
) -> list[dict[str, float]]:
    """Claim 2: ATM (the registered regime, ``trainer`` = one full-batch GD step at ``eta`` per task per round)
    against ``rounds`` multi-task GD steps at alpha * eta; per round, the errors of theta_ATM(r) - theta0."""
    from mergeflow.ml.regimes import REGISTRY

    result = REGISTRY["atm"](theta0, tasks, trainer, rounds=rounds, steps=1, alpha=alpha, keep_updates=False)
    mt = gd_steps(theta0, [grad_fns[t] for t in tasks], alpha * eta, rounds)
    return [
        {"round": r + 1, **errors(sub(rec.combined, theta0), sub(mt[r], theta0), theta0)}
        for r, rec in enumerate(result.rounds)
    ]


def ta_mt_gaps(
    theta0: State,
    grad_fns: Mapping[str, GradFn],
    *,
    eta: float,
    alpha: float,
    epochs: int,
    grads0: Mapping[str, State] | None = None,
) -> list[dict[str, float]]:
    """Theorem 1: per task ``epochs`` full-batch GD steps at ``eta``, merged by task arithmetic (alpha), against
    ``epochs`` multi-task GD steps at alpha * eta; per epoch k, ‖theta_TA(k) - theta_MT(k)‖ and ‖theta_MT(k) - theta0‖.
    ``grads0``: each task's gradient at theta0, if known (shared by every step size)."""
    g0 = grads0 or {t: f(theta0) for t, f in grad_fns.items()}
    per_task = {t: gd_steps(theta0, [f], eta, epochs, first=[g0[t]]) for t, f in grad_fns.items()}
    mt = gd_steps(theta0, list(grad_fns.values()), alpha * eta, epochs, first=[g0[t] for t in grad_fns])
    out = []
    for k in range(epochs):
        ta = {
            key: v + alpha * sum(per_task[t][k][key] - v for t in grad_fns)
            for key, v in theta0.items()
            if v.is_floating_point()
        }
        out.append(
            {
                "epoch": k + 1,
                "gap": float((_flat(ta) - _flat(mt[k])).norm()),
                "mt_step": float((_flat(mt[k]) - _flat(theta0)).norm()),
            }
        )
    return out


def directional_curvature(
    grad_fn: GradFn, state: Mapping[str, torch.Tensor], grad: Mapping[str, torch.Tensor], *, eps: float = 1e-5
) -> float:
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


def minibatch_cosines(
    theta0: State, tasks: Sequence[str], trainers: Mapping[int, Any], grads: Mapping[str, State]
) -> dict[int, dict[str, float]]:
    """Claim 4: per key of ``trainers`` (steps per epoch -> a trainer), one epoch of the one_epoch regime, and
    cos(tau_t(1), -grads[t]) per task."""
    from mergeflow.ml.regimes import REGISTRY

    out = {}
    for steps, trainer in trainers.items():
        result = REGISTRY["one_epoch"](theta0, tasks, trainer)
        out[steps] = {
            t: cosine(_flat(sub(result.task_states[t], theta0), list(grads[t])), -_flat(grads[t])) for t in tasks
        }
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


def trajectory_claim(
    per_task: Mapping[str, Mapping[str, list[float]]], *, threshold: float, cosine_epochs: int
) -> tuple[bool, dict[str, dict[str, bool]]]:
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
