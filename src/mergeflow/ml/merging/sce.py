"""SCE: select the entries where the task vectors vary most, weight each task per tensor by its energy, erase the
entries whose sign disagrees with the elected one, and fuse.

Wan et al., "FuseChat: knowledge fusion of chat models" (arXiv:2408.07990), as mergekit implements it (``sce``).
Per tensor, with task vectors tau_t:
1. select: keep the top ``select_topk`` fraction of positions by the variance across tasks, var_t(tau_t)
   (population variance; of the positions where it is nonzero, floor(select_topk * count); ties with the cut are
   kept), zeroing the rest in every tau_t (1.0: keep all, mergekit's default);
2. calculate: w_t = mean(tau_t^2) / sum_s mean(tau_s^2) over the selected tensor (uniform when the sum is at most
   ``energy_floor``: 0, all zero, by default; mergekit's guard is 1e-6, under which its SCE is TIES' disjoint mean);
3. erase: gamma = sgn(sum_t tau_t); keep tau_t where its sign is gamma;
4. fuse: sum_t w_t tau_t / sum_t w_t over the kept entries (0 where none).
theta = theta0 + lam * that; mergekit has no lambda (lam = 1, the default); searched here like TIES' lambda.
"""

from __future__ import annotations

from mergeflow.ml.merging import ANY_NUMBER, POSITIVE_FRACTION, Range, register
from mergeflow.ml.merging.ties import LAMBDA_GRID


def variance_mask(taus, select_topk: float):
    """[*shape] bool: the positions whose variance across tasks is among the top ``select_topk`` of the nonzero ones."""
    import torch

    var = taus.var(0, unbiased=False)
    if select_topk >= 1:
        return torch.ones_like(var, dtype=torch.bool)
    count = int(torch.count_nonzero(var) * select_topk)
    if count == 0:
        return torch.zeros_like(var, dtype=torch.bool)
    cut = torch.topk(var.reshape(-1), count).values[-1]
    return var >= cut


def energy_weights(taus, floor: float = 0.0):
    """w_t = mean(tau_t^2) / sum_s mean(tau_s^2), [T]; uniform when that sum is at most ``floor``."""
    import torch

    energy = taus.reshape(len(taus), -1).pow(2).mean(1)
    total = energy.sum()
    return torch.full_like(energy, 1 / len(taus)) if total <= floor else energy / total


@register(
    "sce",
    paper="Wan et al. 2024, FuseChat's SCE (arXiv:2408.07990), as in mergekit",
    defaults={"select_topk": 1.0, "energy_floor": 0.0, "lam": 1.0},
    grid={"lam": LAMBDA_GRID},
    coefficient="lam",
    ranges={"select_topk": POSITIVE_FRACTION, "energy_floor": Range("an energy", 0), "lam": ANY_NUMBER},
)
def sce(pretrained, task_vectors, *, select_topk, energy_floor, lam):
    from mergeflow.ml.merging._sign import elect_and_fuse
    from mergeflow.ml.merging._tensors import map_tensors

    def merge(key, theta0, taus):
        selected = taus * variance_mask(taus, select_topk)
        return theta0 + lam * elect_and_fuse(selected, "mean", energy_weights(selected, energy_floor))

    return map_tensors(pretrained, task_vectors, merge)
