"""One epoch: theta_t = FineTune(theta0, D_t, one epoch); with full-batch GD, tau_t = -eta * grad L_t(theta0).

Zhou et al., "On Task Vectors and Gradients" (seed 000), Proposition 1 / Remark 1: after one epoch of full-batch
gradient descent
with step size eta a task vector is exactly the scaled negative gradient of the task's mean loss at theta0, and
theta0 + alpha * sum_t tau_t is one multi-task GD step at step size alpha * eta. Under minibatch training one
epoch is n_t / batch steps and the identity holds only approximately. The learning-rate schedule spans that one
epoch.
"""

from mergeflow.ml.regimes import Budget, RegimeSettings, register

PAPER = "Zhou, Solombrino, Crisostomi et al., On Task Vectors and Gradients (seed 000), Proposition 1"
SEED_001_METHODS = ("weight_averaging", "task_arithmetic", "ties")  # seed 001's Table 1: UA, TA, TIES


class Settings(RegimeSettings):
    """No settings: one epoch of the fine-tune's data."""

    def training_steps(self, variant_kwargs, finetune_steps: int, epoch_steps: int) -> int:
        return epoch_steps


@register("one_epoch", paper=PAPER, defaults={}, settings=Settings, methods=SEED_001_METHODS)
def one_epoch(theta0, tasks, train, *, on_round_end=None, resume=None):
    from mergeflow.ml.regimes import run_rounds

    return run_rounds(
        theta0,
        tasks,
        train,
        n_rounds=1,
        budget=lambda r: Budget(epochs=1),
        combine=None,
        on_round_end=on_round_end,
        resume=resume,
    )
