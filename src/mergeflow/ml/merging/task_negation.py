"""Task negation: theta = theta0 - lam tau_t, to forget task t while keeping the others.

Ilharco et al., "Editing models with task arithmetic", ICLR 2023; seed 004 (Li et al. 2025) proves it unlearns
irrelevant or contradictory tasks. Judged as forgetting (accuracy on task t falls) against control (accuracy on
the other tasks holds): lam is the value, chosen on validation, that lowers task t's accuracy most while the
control accuracy stays at least 95% of the pretrained model's (Ilharco et al.'s rule).
"""

from mergeflow.ml.merging import ANY_NUMBER, FRACTION, register
from mergeflow.ml.merging.task_arithmetic import LAMBDA_GRID


@register(
    "task_negation",
    paper="Ilharco et al. 2023, Editing models with task arithmetic (arXiv:2212.04089)",
    defaults={"lam": 0.4, "control_floor": 0.95},
    grid={"lam": LAMBDA_GRID},
    kind="negation",
    ranges={"lam": ANY_NUMBER, "control_floor": FRACTION},
)
def task_negation(pretrained, task_vectors, *, lam, control_floor=0.95):
    from mergeflow.ml.merging._tensors import map_tensors

    if len(task_vectors) != 1:
        raise ValueError(f"merge.task_negation: negates one task vector at a time, got {len(task_vectors)}")
    return map_tensors(pretrained, task_vectors, lambda key, theta0, taus: theta0 - lam * taus[0])
