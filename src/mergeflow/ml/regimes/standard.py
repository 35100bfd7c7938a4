"""Standard: theta_t = FineTune(theta0, D_t, S) for each task t, independently; tau_t = theta_t - theta0.

Ilharco et al., "Editing models with task arithmetic", ICLR 2023: each task is fine-tuned once from the
pre-trained model, to the end of its schedule. ``steps=None`` is the trainer's own full schedule (the pipeline's
default fine-tune); a number of steps makes it budget-comparable with MIMA (N = 1 is this regime).
"""

from mergeflow.ml.regimes import Budget, register


@register(
    "standard",
    paper="Ilharco et al. 2023, Editing models with task arithmetic (arXiv:2212.04089)",
    defaults={"steps": None},
)
def standard(theta0, tasks, train, *, steps, on_round_end=None, resume=None):
    from mergeflow.ml.regimes import run_rounds

    budget = Budget() if steps is None else Budget.of_steps(steps)
    return run_rounds(
        theta0,
        tasks,
        train,
        n_rounds=1,
        budget=lambda r: budget,
        combine=None,
        on_round_end=on_round_end,
        resume=resume,
    )
