"""Task arithmetic: theta = theta0 + lam * sum_t tau_t.

Ilharco et al., "Editing models with task arithmetic", ICLR 2023. lam = 1/T gives weight averaging;
0.4 is the paper's value without validation data.
"""

from mergeflow.ml.merging import ANY_NUMBER, register

LAMBDA_GRID = [round(0.05 * i, 2) for i in range(1, 21)]  # 0.05, 0.10, ..., 1.0


@register(
    "task_arithmetic",
    paper="Ilharco et al. 2023, Editing models with task arithmetic (arXiv:2212.04089)",
    defaults={"lam": 0.4},
    grid={"lam": LAMBDA_GRID},
    coefficient="lam",
    ranges={"lam": ANY_NUMBER},
)
def task_arithmetic(pretrained, task_vectors, *, lam):
    from mergeflow.ml.merging._kernels import task_sum
    from mergeflow.ml.merging._tensors import kernel_vector, map_stacked, plus_scaled

    return map_stacked(
        pretrained, task_vectors, lambda theta0, taus, _: plus_scaled(theta0, lam, kernel_vector(task_sum, taus))
    )
