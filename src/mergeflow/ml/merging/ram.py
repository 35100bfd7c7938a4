"""RAM and RAM+ (Reinforced Agent Merging): average the entries that several tasks update, keep whole the entries
that only one task updates (RAM+: scaled up by how much of that task's update is shared).

Yuan et al., "Behavior knowledge merge in reinforced agentic models", 2026 (arXiv:2601.13572), as mergekit
implements it (mergekit/merge_methods/ram.py: ``ram``, ``ramplus_tl``) and as the authors' code does
(github.com/xiangchi-yuan/mrl, ram-main.py). Task t updates an entry when |tau_t| > epsilon (1e-5 in both); with
c the number of tasks that update it, the merged update is
- c = 0 (unchanged): 0, so theta0;
- c = 1 (unique): that task's tau_t, times lambda_t in RAM+ (1 in RAM);
- c >= 2 (shared): the mean of the c updates (the updates at or under epsilon left out).
theta = theta0 + lam * that. Neither reference has lam (lam = 1, the default); it is searched here as TIES' is.
RAM+: lambda_t = 1 + r clip(rho_t, 0, alpha), rho_t = (entries task t updates that are shared) / (those that are
unique to it), counted per tensor (``scope: tensor``, mergekit's ``ramplus_tl``, "tensor-local") or over the whole
model (``scope: global``, the paper's and the authors' code's). Where a task has no unique entry, lambda_t scales
nothing (mergekit divides by the unique count clamped at epsilon; the authors' code divides by zero). The defaults
are mergekit's (r 0.1, alpha 0.2, per tensor); the authors' default (``arm-r-v2`` with rescale_factor 1.05:
lambda_t = 1 + 0.05 min(1, rho_t)) is ``scope: global, r: 0.05, alpha: 1.0``.
RAM is made for RL-trained task vectors, which are sparse. Fine-tuned ones are dense: every entry is shared by all T
tasks, and RAM and RAM+ are the mean of the task vectors (weight averaging at lam = 1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mergeflow.ml.merging import ANY_NUMBER, Choice, Range, register

if TYPE_CHECKING:
    import torch

LAMBDA_GRID = [round(0.8 + 0.1 * i, 2) for i in range(18)]  # 0.8, 0.9, ..., 2.5: TIES' grid (RAM is a mean too)
EPSILON = Range("an update threshold", 0)
SCOPE = Choice(("tensor", "global"))


def updated(taus: torch.Tensor, epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """([T, *shape] bool: task t updates the entry, |tau_t| > epsilon; [*shape]: how many tasks do)."""
    active = taus.abs() > epsilon
    return active, active.sum(0)


def shared_and_unique(active: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([T] int64: the entries task t updates that other tasks update too; [T]: those only it updates)."""
    flat = active.reshape(len(active), -1)
    return (flat & (count > 1).reshape(-1)).sum(1), (flat & (count == 1).reshape(-1)).sum(1)


def rescales(shared: torch.Tensor, unique: torch.Tensor, r: float, alpha: float) -> torch.Tensor:
    """[T] float64: lambda_t = 1 + r clip(shared_t / unique_t, 0, alpha); 1 where task t has no unique entry."""
    import torch

    rho = shared.double() / unique.clamp(min=1).double()
    return torch.where(unique > 0, 1 + r * rho.clamp(0, alpha), torch.ones_like(rho))


def ram_update(
    taus: torch.Tensor, active: torch.Tensor, count: torch.Tensor, lambdas: torch.Tensor | None = None
) -> torch.Tensor:
    """The merged update, (sum of the active updates) / max(c, 1): their mean where c >= 2, the one update where
    c = 1 (times that task's lambda_t when ``lambdas`` is given: RAM+), 0 where c = 0."""
    import torch

    kept = torch.where(active, taus, 0.0)
    if lambdas is not None:
        scaled = kept * lambdas.to(taus.dtype).reshape(-1, *[1] * (taus.ndim - 1))
        kept = torch.where(count == 1, scaled, kept)
    return kept.sum(0) / count.clamp(min=1)


def global_rescales(pretrained, task_vectors, epsilon: float, r: float, alpha: float) -> torch.Tensor:
    """Pass 1 of ``scope: global``: lambda_t from the shared and unique counts over every tensor."""
    import torch

    from mergeflow.ml.merging._tensors import stack

    shared = unique = torch.zeros(len(task_vectors), dtype=torch.int64)
    for key in pretrained:
        s, u = shared_and_unique(*updated(stack(task_vectors, key), epsilon))
        shared, unique = shared + s, unique + u
    return rescales(shared, unique, r, alpha)


@register(
    "ram",
    paper="Yuan et al. 2026, Reinforced Agent Merging (arXiv:2601.13572), as in mergekit",
    defaults={"epsilon": 1e-5, "lam": 1.0},
    grid={"lam": LAMBDA_GRID},
    coefficient="lam",
    ranges={"epsilon": EPSILON, "lam": ANY_NUMBER},
)
def ram(pretrained, task_vectors, *, epsilon, lam):
    from mergeflow.ml.merging._tensors import map_tensors

    def merge(key, theta0, taus):
        active, count = updated(taus, epsilon)
        return theta0 + lam * ram_update(taus, active, count)

    return map_tensors(pretrained, task_vectors, merge)


@register(
    "ram_plus",
    paper="Yuan et al. 2026, Reinforced Agent Merging's RAM+ (arXiv:2601.13572), as in mergekit (ramplus_tl)",
    defaults={"epsilon": 1e-5, "r": 0.1, "alpha": 0.2, "scope": "tensor", "lam": 1.0},
    grid={"lam": LAMBDA_GRID},
    coefficient="lam",
    ranges={
        "epsilon": EPSILON,
        "r": Range("a rescaling strength", 0),
        "alpha": Range("a bound on the shared-to-unique ratio", 0),
        "scope": SCOPE,
        "lam": ANY_NUMBER,
    },
)
def ram_plus(pretrained, task_vectors, *, epsilon, r, alpha, scope, lam):
    from mergeflow.ml.merging._tensors import map_tensors

    lambdas = global_rescales(pretrained, task_vectors, epsilon, r, alpha) if scope == "global" else None

    def merge(key, theta0, taus):
        active, count = updated(taus, epsilon)
        rescale = lambdas if lambdas is not None else rescales(*shared_and_unique(active, count), r, alpha)
        return theta0 + lam * ram_update(taus, active, count, rescale)

    return map_tensors(pretrained, task_vectors, merge)
