"""Weight averaging (model soup): theta = (1/T) sum_t theta_t = theta0 + (1/T) sum_t tau_t.

Wortsman et al., "Model soups", ICML 2022; the 'weight averaging' baseline of Ilharco et al., ICLR 2023.
"""

from mergeflow.merging import register
from mergeflow.merging._tensors import add_scaled, stack


@register("weight_averaging", paper="Wortsman et al. 2022, Model soups (arXiv:2203.05482)")
def weight_averaging(pretrained, task_vectors):
    return add_scaled(pretrained, {k: stack(task_vectors, k).mean(0) for k in pretrained}, 1.0)
