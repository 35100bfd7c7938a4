"""MagMax: for each entry keep the task-vector value of largest magnitude across tasks; theta0 + lam * that.

Marczak et al., "MagMax: leveraging model merging for seamless continual learning", ECCV 2024 (arXiv:2407.06322).
The paper uses lam = 1.
"""

import torch

from mergeflow.merging import register
from mergeflow.merging._tensors import map_tensors


def max_magnitude(taus: torch.Tensor) -> torch.Tensor:
    index = taus.abs().argmax(dim=0, keepdim=True)
    return taus.gather(0, index).squeeze(0)


@register("magmax", paper="Marczak et al. 2024, MagMax (arXiv:2407.06322)", defaults={"lam": 1.0}, grid={"lam": [0.5, 0.75, 1.0, 1.25, 1.5]}, coefficient="lam")
def magmax(pretrained, task_vectors, *, lam):
    return map_tensors(pretrained, task_vectors, lambda key, theta0, taus: theta0 + lam * max_magnitude(taus))
