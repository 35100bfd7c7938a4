"""LoRA: theta_t = theta0 + s B_t A_t on the adapted linear layers, everything else frozen; tau_t = s B_t A_t.

Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", ICLR 2022 (arXiv:2106.09685): each task trains a
rank-r adapter (A_t r x in, B_t out x r, scale s = alpha / r) on each target layer for the fine-tune's schedule,
from theta0, under the task's frozen head; the task vector is the adapters' update, stored as its factors
(mergeflow.lora). One round, as ``standard``; ``steps`` None is the fine-tune's own schedule.
"""

from dataclasses import replace

from mergeflow.lora import DEFAULT_TARGETS, AdapterSpec
from mergeflow.regimes import Budget, register, run_rounds


def adapter_spec(*, rank, alpha, dropout, targets, lr, **_) -> AdapterSpec:
    """The adapter of a variant's hyperparameters; alpha None is r (a scale of 1)."""
    return AdapterSpec(rank, float(rank if alpha is None else alpha), dropout, tuple(targets), lr)


@register(
    "lora",
    paper="Hu et al. 2022, LoRA: Low-Rank Adaptation of Large Language Models (arXiv:2106.09685)",
    defaults={"rank": 16, "alpha": None, "dropout": 0.0, "targets": DEFAULT_TARGETS, "lr": None, "steps": None},
)
def lora(theta0, tasks, train, *, rank, alpha, dropout, targets, lr, steps, on_round_end=None, resume=None):
    adapter = adapter_spec(rank=rank, alpha=alpha, dropout=dropout, targets=targets, lr=lr)
    budget = replace(Budget() if steps is None else Budget.of_steps(steps), adapter=adapter)
    return run_rounds(theta0, tasks, train, n_rounds=1, budget=lambda r: budget, combine=None, on_round_end=on_round_end, resume=resume)
