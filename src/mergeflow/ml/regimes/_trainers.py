"""Trainers for the regimes that need no pipeline: exact, tiny, for tests and seed 000's identities."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from mergeflow.core.io import StateDict
from mergeflow.ml.regimes._types import Budget

Loss = Callable[[Mapping[str, torch.Tensor]], torch.Tensor]


def full_batch_gd_trainer(losses: Mapping[str, Loss], lr: float, *, full_schedule_steps: int = 1):
    """``train(task, state, budget, carry)`` taking full-batch gradient-descent steps theta <- theta - lr * grad
    L_t(theta), where ``losses[task](state)`` is task t's mean loss over all its examples.

    One epoch is one step (the whole data set is one batch); ``Budget()`` takes ``full_schedule_steps``. No
    momentum, weight decay or schedule: the learning rate is ``lr`` at every step, as seed 000's Proposition 1
    assumes, so one call of one step gives tau_t = -lr * grad L_t(theta0) exactly. Every floating tensor of the
    state is trained; the carry is unused (GD has no optimiser state)."""

    def train(task: str, state: StateDict, budget: Budget, carry: Any) -> tuple[StateDict, Any]:
        steps = (
            budget.steps
            if budget.steps is not None
            else budget.epochs
            if budget.epochs is not None
            else full_schedule_steps
        )
        for _ in range(steps):
            params = {k: v.detach().requires_grad_(v.is_floating_point()) for k, v in state.items()}
            trained = [k for k, v in params.items() if v.requires_grad]
            grads = torch.autograd.grad(losses[task](params), [params[k] for k in trained])
            state = {k: v.detach() for k, v in params.items()}
            for k, g in zip(trained, grads):
                state[k] = state[k] - lr * g
        return state, None

    return train
