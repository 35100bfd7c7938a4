"""The types a regime, its trainer and its checkpoints share (mergeflow.ml.regimes re-exports them): a trainer's
``Budget``, the ``Trainer`` itself, a finished round's ``RoundRecord`` and the ``Checkpoint`` a run resumes from."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # types only: the registry loads no torch (mergeflow check)
    from mergeflow.core.io import StateDict
    from mergeflow.ml.lora import AdapterSpec


@dataclass(frozen=True)
class Budget:
    """How long one call of the trainer trains, and the learning-rate schedule it follows.

    ``steps`` and ``epochs`` both None is the trainer's own full schedule (today's fine-tune). Otherwise the call
    takes ``steps`` optimisation steps (or ``epochs`` whole epochs), its first step at position ``schedule_start``
    of a schedule ``schedule_length`` steps long (warm-up and cosine are evaluated there)."""

    steps: int | None = None
    epochs: int | None = None
    schedule_start: int = 0
    schedule_length: int | None = None  # None: this call's own length (steps, or epochs in steps)
    round: int = 1  # 1-based; lets the trainer draw a fresh data order each round
    # train a LoRA adapter instead of every weight: the trainer then returns W0 + s B A in the state, and the factors
    # beside it under their peft keys (mergeflow.ml.lora.split_factors separates them)
    adapter: AdapterSpec | None = None

    @classmethod
    def of_steps(
        cls, steps: int, *, round: int = 1, schedule_start: int = 0, schedule_length: int | None = None
    ) -> Budget:
        """``steps`` steps; the schedule spelled out (its own length when not given), so that equal budgets
        compare equal however they were made."""
        if steps < 1:
            raise ValueError(f"a budget of {steps} steps: expected at least 1")
        return cls(
            steps=steps,
            schedule_start=schedule_start,
            schedule_length=steps if schedule_length is None else schedule_length,
            round=round,
        )


Trainer = Callable[[str, "StateDict", Budget, Any], tuple["StateDict", Any]]


@dataclass
class RoundRecord:
    """What one finished round leaves for the studies."""

    round: int  # 1-based
    start: StateDict  # the state every task trained from in this round
    combined: (
        StateDict | None
    )  # the round's combination (MIMA's uniform average, ATM's model); None for one-shot regimes
    update_norms: dict[str, float]  # ||delta_t||, delta_t = theta_t(r) - start: this round's own change
    update_cosines: dict[tuple[str, str], float]  # cos(delta_a, delta_b) for each pair a < b in task order
    task_vector_norms: dict[str, float]  # ||tau_t||, tau_t = theta_t(r) - theta0: the change since theta0
    task_vector_cosines: dict[tuple[str, str], float]  # cos(tau_a, tau_b)
    updates: dict[str, StateDict] | None = None  # delta_t itself (ATM's per-round task vectors), when kept


@dataclass
class Checkpoint:
    """Everything needed to run the rounds after ``round``: what ``on_round_end`` receives and ``resume`` takes."""

    round: int  # the last finished round
    task_states: dict[str, StateDict]  # theta_t(round)
    next_start: StateDict  # the state round + 1 starts from
    carries: dict[str, Any]  # the trainer's carry per task (None where it is reset)
    records: list[RoundRecord]  # rounds 1..round


@dataclass
class RegimeResult:
    task_states: dict[str, StateDict]  # the final task models, theta_t; their vectors theta_t - theta0 go to the merges
    model: (
        StateDict | None
    )  # the regime's own model (ATM after round R, MIMA's last average); None for one-shot regimes
    rounds: list[RoundRecord]
