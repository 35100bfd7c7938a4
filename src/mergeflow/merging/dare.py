"""DARE (drop and rescale): drop each entry of tau_t with probability p, rescale survivors by 1/(1 - p), then
merge with task arithmetic (``dare_linear``: theta0 + lam sum_t tau~_t) or TIES' sign election and disjoint mean
(``dare_ties``: theta0 + lam disjoint_mean(tau~)).

Yu et al., "Language models are super Mario: absorbing abilities from homologous models as a free lunch",
ICML 2024 (arXiv:2311.03099). p = 0.9 follows seed 000's code (FusionBench uses 0.5). The drop mask of each
(task, tensor) comes from a generator seeded by (seed, task, tensor), so it does not depend on streaming order.
"""

import torch

from mergeflow.merging import register
from mergeflow.merging._tensors import map_tensors, seeded_generator
from mergeflow.merging.task_arithmetic import LAMBDA_GRID as TA_GRID
from mergeflow.merging.ties import LAMBDA_GRID as TIES_GRID, disjoint_mean

PAPER = "Yu et al. 2024, DARE: Language models are super Mario (arXiv:2311.03099)"


def drop_and_rescale(key: str, taus: torch.Tensor, tasks: list[str], p: float, seed: int) -> torch.Tensor:
    if not 0 <= p < 1:
        raise ValueError(f"merge.dare.p: expected a drop probability in [0, 1), got {p}")
    if p == 0:
        return taus
    keep = torch.stack([torch.rand(taus.shape[1:], generator=seeded_generator(seed, task, key)) >= p for task in tasks])
    return taus * keep / (1 - p)


@register("dare_linear", paper=PAPER, defaults={"p": 0.9, "seed": 0, "lam": 0.4}, grid={"lam": TA_GRID}, coefficient="lam")
def dare_linear(pretrained, task_vectors, *, p, seed, lam):
    tasks = list(task_vectors)
    return map_tensors(pretrained, task_vectors, lambda key, theta0, taus: theta0 + lam * drop_and_rescale(key, taus, tasks, p, seed).sum(0))


@register("dare_ties", paper=PAPER, defaults={"p": 0.9, "seed": 0, "lam": 1.0}, grid={"lam": TIES_GRID}, coefficient="lam")
def dare_ties(pretrained, task_vectors, *, p, seed, lam):
    tasks = list(task_vectors)
    return map_tensors(pretrained, task_vectors, lambda key, theta0, taus: theta0 + lam * disjoint_mean(drop_and_rescale(key, taus, tasks, p, seed)))
