"""Weight averaging (model soup): theta = (1/T) sum_t theta_t = theta0 + (1/T) sum_t tau_t.

Wortsman et al., "Model soups", ICML 2022; the 'weight averaging' baseline of Ilharco et al., ICLR 2023.
"""

from mergeflow.ml.merging import register


@register("weight_averaging", paper="Wortsman et al. 2022, Model soups (arXiv:2203.05482)")
def weight_averaging(pretrained, task_vectors):
    from mergeflow.ml.merging._kernels import task_sum
    from mergeflow.ml.merging._tensors import kernel_vector, map_stacked, plus_scaled

    return map_stacked(
        pretrained,
        task_vectors,
        lambda theta0, taus, _: plus_scaled(theta0, 1 / len(taus), kernel_vector(task_sum, taus)),
    )
