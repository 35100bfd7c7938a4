"""MIMA: theta_bar(0) = theta0; for i = 1..N: theta_t(i) = FineTune(theta_bar(i-1), D_t, K = S/N); theta_bar(i) = \
(1/T) sum_t theta_t(i).

Seed 001, "MIMA: Iterative model averaging and fine-tuning for multi-task learning", Section 4 (eqs. 4-5). After
round N the task models theta_t(N) are the regime's task models (their vectors theta_t(N) - theta0 go to the
merge methods) and theta_bar(N) is its uniform average ("UA"). N = 1 is standard fine-tuning (the seed: "the case
N = 1 corresponds to the standard, independent fine-tuning baseline"). The records keep, per round, the
incremental updates' norms and pairwise cosines (delta_t(i) = theta_t(i) - theta_bar(i-1), eq. 5) and the task
vectors' (tau_t(i) = theta_t(i) - theta0), the seed's Appendix C.2 quantities.

The seed leaves two choices unstated; both are options here.
- ``schedule``: ``one_schedule`` (default) runs one learning-rate schedule over the whole budget S, round i taking
  its steps (i-1)K .. iK-1; ``restart`` starts a fresh schedule of K steps each round. Default one_schedule: the
  seed fine-tunes "for a total of S = 2000 iterations on each task" with "a cosine annealing learning rate
  schedule with 200 warm-up steps", one schedule described over the budget; restarting it would put N warm-ups
  in the budget, and with N = 20 (K = 100 < 200 warm-up steps) training would never leave warm-up.
- ``optimizer_state``: ``reset`` (default) gives every round's fine-tune a fresh optimiser; ``carry`` hands each
  task the optimiser state it ended the previous round with. Default reset: the seed writes each round as
  FineTune(theta_bar(i-1), D_t, K), a function of the start point, data and steps only, and the parameters jump
  to the average between rounds, so moments gathered on the task's own trajectory no longer describe where
  training resumes (FedAvg, the seed's nearest relative, also starts each round's local training afresh).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from mergeflow.config.fields import MAX_GRID, MAX_STEPS, at_most
from mergeflow.ml.regimes import Budget, RegimeSettings, register

SCHEDULES = ("one_schedule", "restart")
OPTIMIZER_STATES = ("reset", "carry")


class Settings(RegimeSettings):
    # N, each dividing finetune.steps; one set of task vectors per N
    rounds: list[Annotated[int, at_most(MAX_STEPS, "rounds"), Field(ge=1)]] = Field(
        default_factory=lambda: [4], min_length=1, max_length=MAX_GRID
    )
    schedule: Literal[SCHEDULES] = "one_schedule"  # one lr schedule over S, or a fresh one per round
    optimizer_state: Literal[OPTIMIZER_STATES] = "reset"  # a fresh optimiser per round, or each task's carried over

    def variants(self, regime: str, finetune_steps: int) -> dict[str, dict[str, Any]]:
        return {
            f"{regime}_n{n}": {
                "rounds": n,
                "total_steps": finetune_steps,
                "schedule": self.schedule,
                "optimizer_state": self.optimizer_state,
            }
            for n in self.rounds
        }

    def check_budget(self, regime: str, finetune_steps: int) -> None:
        for n in self.rounds:
            if n < 1 or finetune_steps % n:
                raise ValueError(
                    f"regimes.{regime}.rounds: {n} rounds must divide "
                    f"finetune.steps = {finetune_steps} (K = S/N steps a round)"
                )


@register(
    "mima",
    paper="Seed 001: MIMA, Iterative model averaging and fine-tuning for multi-task learning (under review)",
    defaults={
        "rounds": 4,
        "total_steps": None,
        "schedule": "one_schedule",
        "optimizer_state": "reset",
        "keep_updates": False,
    },
    settings=Settings,
    methods=("weight_averaging", "task_arithmetic", "ties"),
    own_model=True,  # seed 001's Table 1: UA, TA, TIES
)
def mima(
    theta0,
    tasks,
    train,
    *,
    rounds,
    total_steps,
    schedule,
    optimizer_state,
    keep_updates,
    on_round_end=None,
    resume=None,
):
    from mergeflow.ml.regimes import run_rounds, uniform_average

    if total_steps is None:
        raise ValueError("mima: total_steps (S, the per-task budget that the rounds split) is required")
    if schedule not in SCHEDULES or optimizer_state not in OPTIMIZER_STATES:
        raise ValueError(
            f"mima: schedule in {SCHEDULES} and optimizer_state in "
            f"{OPTIMIZER_STATES}, got {schedule!r}, {optimizer_state!r}"
        )
    if rounds < 1 or total_steps % rounds:
        raise ValueError(f"mima: {rounds} rounds must divide total_steps = {total_steps} (K = S/N steps each)")
    k = total_steps // rounds

    def budget(i):
        if schedule == "restart":
            return Budget.of_steps(k, round=i)
        return Budget.of_steps(k, round=i, schedule_start=(i - 1) * k, schedule_length=total_steps)

    return run_rounds(
        theta0,
        tasks,
        train,
        n_rounds=rounds,
        budget=budget,
        combine=lambda start, task_states: uniform_average(list(task_states.values())),
        carry_optimizer=optimizer_state == "carry",
        keep_updates=keep_updates,
        on_round_end=on_round_end,
        resume=resume,
    )
