"""ATM: theta(0) = theta0; for r = 1..R: tau_t(r) = FineTune(theta(r-1), D_t, K) - theta(r-1); theta(r) = theta(r-1) + \
alpha * sum_t tau_t(r).

Alternating tuning and merging: Zhou et al., "ATM: Improving model merging by alternating tuning and merging"
(arXiv:2411.03055), read through seed 000 ("On Task Vectors and Gradients"): with one full-batch GD step per task
per round, R rounds are exactly R multi-task GD steps at step size alpha * eta on sum_t L_t, and with longer
rounds the gap is O(eta^2) per round.

Each round is a fresh, short fine-tune from the current model: K = ``steps`` steps, or one epoch when ``steps``
is None (seed 000's one-epoch task vectors), with its own learning-rate schedule and a fresh optimiser. ``alpha``
None is 1/T, so that each round moves to the average of the round's task models (no scaling to tune without
validation data). ATM's own result is ``RegimeResult.model`` (theta(R)); the per-round task vectors tau_t(r) are
kept in ``rounds[r - 1].updates``; ``task_states`` are the last round's models theta(R-1) + tau_t(R).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from mergeflow.config.fields import MAX_GRID, MAX_STEPS, at_most
from mergeflow.ml.regimes import Budget, RegimeSettings, register


class Settings(RegimeSettings):
    # R; one run per R
    rounds: list[Annotated[int, at_most(MAX_STEPS, "rounds"), Field(ge=1)]] = Field(
        default_factory=lambda: [4], min_length=1, max_length=MAX_GRID
    )
    steps: int | Literal["epoch"] | None = (
        None  # K per round; empty (null): finetune.steps / R (the standard budget); "epoch": one epoch
    )
    alpha: float | None = Field(None, gt=0)  # theta += alpha * sum of the round's task vectors; empty (null): 1/T

    _steps_bound = field_validator("steps", mode="before")(at_most(MAX_STEPS, "steps").func)

    @field_validator("steps")
    @classmethod
    def _at_least_one(cls, steps: int | str | None) -> int | str | None:
        if isinstance(steps, int) and steps < 1:
            raise ValueError("expected at least 1 step a round, 'epoch' or empty (null)")
        return steps

    def variants(self, regime: str, finetune_steps: int) -> dict[str, dict[str, Any]]:
        def steps(r: int) -> int | None:
            return None if self.steps == "epoch" else self.steps if self.steps is not None else finetune_steps // r

        return {f"{regime}_r{r}": {"rounds": r, "steps": steps(r), "alpha": self.alpha} for r in self.rounds}

    def training_steps(self, variant_kwargs, finetune_steps: int, epoch_steps: int) -> int:
        k = variant_kwargs["steps"] if variant_kwargs["steps"] is not None else epoch_steps
        return variant_kwargs["rounds"] * k

    def check_budget(self, regime: str, finetune_steps: int) -> None:
        for r in self.rounds:
            if r < 1 or (self.steps is None and finetune_steps < r):
                raise ValueError(
                    f"regimes.{regime}.rounds: {r} rounds of finetune.steps / R "
                    f"steps: needs 1 <= R <= finetune.steps = {finetune_steps}"
                )


def _step(alpha: float):
    def combine(theta, task_states):
        out = {}
        for k, v in theta.items():
            if not v.is_floating_point():
                out[k] = v
                continue
            total = task_states[next(iter(task_states))][k] - v
            for s in list(task_states.values())[1:]:
                total += s[k] - v
            out[k] = v + alpha * total
        return out

    return combine


@register(
    "atm",
    paper="Zhou et al. 2024, ATM: Improving model merging by "
    "alternating tuning and merging (arXiv:2411.03055); seed 000",
    defaults={"rounds": 4, "steps": None, "alpha": None, "keep_updates": True},
    settings=Settings,
    methods=("atm", "task_arithmetic", "ties"),
    own_model=True,
)
def atm(theta0, tasks, train, *, rounds, steps, alpha, keep_updates, on_round_end=None, resume=None):
    from mergeflow.ml.regimes import run_rounds

    alpha = 1 / len(tasks) if alpha is None else alpha

    def budget(r):
        return Budget(epochs=1, round=r) if steps is None else Budget.of_steps(steps, round=r)

    return run_rounds(
        theta0,
        tasks,
        train,
        n_rounds=rounds,
        budget=budget,
        combine=_step(alpha),
        keep_updates=keep_updates,
        on_round_end=on_round_end,
        resume=resume,
    )
