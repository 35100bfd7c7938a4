"""The synthetic setting's measurements: the fine-tunes, the addition and negation maps over (alpha, lambda), the
out-of-domain grids."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TYPE_CHECKING


from mergeflow.studies.provable.model import (
    Params,
    alignment,
    closed_form_lambdas,
    delta,
    evaluate,
    finetune,
    forward,
    grid,
    hinge,
    impossible,
    init_model,
    irrelevant_directions,
    make_data,
    merge,
    ood_condition,
    patterns,
    residual,
    second_alignment,
    target_pattern,
    top_energy,
    truncate_params,
)
from mergeflow.studies.provable.settings import ProvableSettings

if TYPE_CHECKING:
    import torch


@dataclass
class FineTune:
    name: str  # "T1" or "T2(alpha=...)"
    mu: torch.Tensor
    delta: Params
    loss: float  # test hinge loss of the fine-tuned model
    accuracy: float
    pretrained_loss: float  # test hinge loss of Psi0 on the task
    low_rank_loss: float  # test hinge loss of Psi0 + rank-r truncation of delta
    low_rank_accuracy: float

    def spectrum(self) -> dict[str, Any]:
        W, V = self.delta["W"], self.delta["V"]
        wl, wr = alignment(W, self.mu)
        _, vr = alignment(V, self.mu)
        vbar = irrelevant_directions(self.mu.shape[0]).sum(0)
        return {
            "energy_W": top_energy(W),
            "energy_V": top_energy(V),
            "align_W_left": wl,
            "align_W_right": wr,
            "align_V_right": vr,
            "residual1_W": residual(W, 1),
            "residual1_V": residual(V, 1),
            "residual2_V": residual(V, 2),
            "second_V_irrelevant_mean": second_alignment(V, vbar),
        }


@dataclass
class OodTarget:
    gammas: tuple[float, float]
    lambdas: list[float]  # the grid, both axes
    loss: list[list[float]]  # [i][j]: lambda1 = lambdas[i], lambda2 = lambdas[j]
    predicted: list[list[bool]]  # (7) holds
    closed_form: list[float] | None
    closed_form_loss: float | None
    closed_form_accuracy: float | None

    @property
    def impossible(self) -> bool:
        return impossible(list(self.gammas))


@dataclass
class Measurements:
    alphas: list[float]
    lambdas: list[float]
    finetunes: list[FineTune]  # T1 first, then T2 per alpha
    loss1: list[list[float]]  # addition map [alpha][lambda]: task 1's test loss of Psi0 + dPsi1 + lambda dPsi2
    loss2: list[list[float]]  # task 2's
    low_rank_loss1: list[list[float]]  # the same with rank-r truncated task vectors
    low_rank_loss2: list[list[float]]
    ood: list[OodTarget]
    seconds: dict[str, float]


def _test_set(mu: torch.Tensor, irrelevant: torch.Tensor, s: ProvableSettings, gen: torch.Generator):
    return make_data(
        mu, irrelevant, s.test_examples, tokens=s.tokens, relevant=s.relevant, confusion=s.confusion, gen=gen
    )


def addition_map(
    theta0: Params, a: torch.Tensor, d1: Params, d2: Params, lambdas: Sequence[float], test1, test2
) -> tuple[list[float], list[float]]:
    """Test losses on tasks 1 and 2 of theta0 + d1 + lambda d2 for each lambda."""
    import torch

    X, y, n1 = torch.cat([test1[0], test2[0]]), torch.cat([test1[1], test2[1]]), len(test1[1])
    l1, l2 = [], []
    with torch.no_grad():
        for lam in lambdas:
            loss = hinge(forward(merge(theta0, [d1, d2], [1.0, lam]), a, X), y)  # both test sets in one pass
            l1.append(float(loss[:n1].mean()))
            l2.append(float(loss[n1:].mean()))
    return l1, l2


def measure(s: ProvableSettings, seed: int) -> Measurements:
    """Every measurement, on one CPU thread (the tensors are tiny: more threads only contend), restored after."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(s, seed)
    finally:
        torch.set_num_threads(threads)


def _measure(s: ProvableSettings, seed: int) -> Measurements:
    import torch

    torch_threads = torch.get_num_threads()
    times: dict[str, float] = {}
    gen = torch.Generator().manual_seed(seed)
    test_gen = torch.Generator().manual_seed(seed + 1)
    irr = irrelevant_directions(s.d)
    theta0, a = init_model(s.d, s.m, s.init_std, gen)
    alphas = [float(x) for x in s.alphas]
    lambdas = grid(s.lambda_min, s.lambda_max, s.lambda_step)

    def tune(name: str, mu: torch.Tensor) -> tuple[FineTune, Any]:
        test = _test_set(mu, irr, s, test_gen)
        ft = finetune(theta0, a, mu, irr, s, gen)
        dv = delta(ft, theta0)
        loss, acc = evaluate(ft, a, *test)
        lr_loss, lr_acc = evaluate(merge(theta0, [truncate_params(dv, s.low_rank)], [1.0]), a, *test)
        return FineTune(name, mu, dv, loss, acc, evaluate(theta0, a, *test)[0], lr_loss, lr_acc), test

    t = time.perf_counter()
    mu1, _ = patterns(0.0, s.d)
    first, test1 = tune("T1", mu1)
    seconds = [(first, test1)]
    for alpha in alphas:
        seconds.append(tune(f"T2(α={alpha:g})", patterns(alpha, s.d)[1]))
    times["finetune"] = time.perf_counter() - t

    t = time.perf_counter()
    loss1, loss2, lr1, lr2 = [], [], [], []
    d1_lr = truncate_params(first.delta, s.low_rank)
    for ft, test2 in seconds[1:]:
        l1, l2 = addition_map(theta0, a, first.delta, ft.delta, lambdas, test1, test2)
        loss1.append(l1), loss2.append(l2)
        l1, l2 = addition_map(theta0, a, d1_lr, truncate_params(ft.delta, s.low_rank), lambdas, test1, test2)
        lr1.append(l1), lr2.append(l2)
    times["addition_maps"] = time.perf_counter() - t

    t = time.perf_counter()
    orthogonal = seconds[1 + alphas.index(0.0)][0]  # mu2 = e1 _|_ mu1 = e0
    deltas = [first.delta, orthogonal.delta]
    ood_lams = grid(s.ood_lambda_min, s.ood_lambda_max, s.ood_lambda_step)
    ood = []
    for g1, g2 in s.ood_targets:
        test = _test_set(target_pattern(g1, g2, s.d), irr, s, test_gen)
        loss = [[evaluate(merge(theta0, deltas, [l1, l2]), a, *test)[0] for l2 in ood_lams] for l1 in ood_lams]
        pred = [[ood_condition([l1, l2], [g1, g2], s.ood_c, s.ood_beta) for l2 in ood_lams] for l1 in ood_lams]
        cf = closed_form_lambdas([g1, g2], s.ood_c)
        cf_eval = evaluate(merge(theta0, deltas, cf), a, *test) if cf is not None else (None, None)
        ood.append(OodTarget((g1, g2), ood_lams, loss, pred, cf, *cf_eval))
    times["out_of_domain"] = time.perf_counter() - t
    times["threads"] = torch_threads
    return Measurements(alphas, lambdas, [ft for ft, _ in seconds], loss1, loss2, lr1, lr2, ood, times)
