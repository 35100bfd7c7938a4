"""Weight averaging (model soup): theta = (1/T) sum_t theta_t = theta0 + (1/T) sum_t tau_t.

Wortsman et al., "Model soups", ICML 2022; the 'weight averaging' baseline of Ilharco et al., ICLR 2023.
"""

from mergeflow.merging import register
from mergeflow.merging._tensors import map_tensors


@register("weight_averaging", paper="Wortsman et al. 2022, Model soups (arXiv:2203.05482)")
def weight_averaging(pretrained, task_vectors):
    return map_tensors(pretrained, task_vectors, lambda key, theta0, taus: theta0 + taus.mean(0))
