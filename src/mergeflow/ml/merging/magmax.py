"""MagMax: for each entry keep the task-vector value of largest magnitude across tasks; theta0 + lam * that.

Marczak et al., "MagMax: leveraging model merging for seamless continual learning", ECCV 2024 (arXiv:2407.06322).
The paper uses lam = 1. Per entry, the first task wins a tie of magnitudes (argmax's rule).
"""

from mergeflow.ml.merging import ANY_NUMBER, register


@register(
    "magmax",
    paper="Marczak et al. 2024, MagMax (arXiv:2407.06322)",
    defaults={"lam": 1.0},
    grid={"lam": [0.5, 0.75, 1.0, 1.25, 1.5]},
    coefficient="lam",
    ranges={"lam": ANY_NUMBER},
)
def magmax(pretrained, task_vectors, *, lam):
    from mergeflow.ml.merging._kernels import max_magnitude
    from mergeflow.ml.merging._tensors import kernel_vector, map_stacked, plus_scaled

    return map_stacked(
        pretrained, task_vectors, lambda theta0, taus, _: plus_scaled(theta0, lam, kernel_vector(max_magnitude, taus))
    )
