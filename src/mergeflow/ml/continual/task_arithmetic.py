"""Sequential task arithmetic: theta(t) = theta(t-1) + lam * tau_t, theta(0) = theta0.

After T arrivals it is task arithmetic, theta0 + lam * sum_t tau_t. Ilharco et al., "Editing models with task
arithmetic", ICLR 2023 (arXiv:2212.04089); FusionBench's continual baseline
(fusion_bench/method/opcm/task_arithmetic.py, ``scaling_factor`` 0.3 in config/method/opcm/task_arithmetic.yaml).
No state.
"""

from mergeflow.ml.continual import Interval, register


@register(
    "task_arithmetic",
    paper="Ilharco et al. 2023, Editing models with task arithmetic (arXiv:2212.04089), one vector at a time",
    reference="fusion_bench/method/opcm/task_arithmetic.py",
    defaults={"lam": 0.3},
    ranges={"lam": Interval()},
)
def task_arithmetic(pretrained, merged, state, tau, *, lam):
    base = pretrained if merged is None else merged
    return {k: base[k] + lam * tau[k] for k in pretrained}, None
