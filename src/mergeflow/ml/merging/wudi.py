"""WUDI: per linear layer, the merged task vector whose interference with each task's own inputs is least, the task
vectors standing in for those inputs; other tensors averaged.

Cheng et al., "Whoever started the interference should end it: guiding data-free model merging via task vectors"
(arXiv:2503.08099), as FusionBench runs it (wudi_merging). Per matrix W [out, in], from tau_m = sum_t tau_t:

    min over tau_m of  L = sum_t |(tau_m - tau_t) tau_t^T|_F^2 / |tau_t|_F^2

by Adam (lr 1e-5, 300 steps: FusionBench's function; its config runs 400); theta = theta0 + tau_m. The gradient
is 2 (tau_m S - B) with S = sum_t G_t / |tau_t|^2, B = sum_t tau_t G_t / |tau_t|^2, G_t = tau_t^T tau_t, so a step
is one [out, in] x [in, in] product instead of FusionBench's autograd through T [out, out] products (the same
gradient; tested against autograd). ``solver: exact`` solves the quadratic instead: tau_m S = B on S's range,
keeping the start's component in S's null space (where gradient descent from the start converges). Tensors that are
not 2-D weights (biases, norms, embeddings, the patch conv) are averaged, as FusionBench does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mergeflow.ml.merging import Choice, Range, register

if TYPE_CHECKING:
    import torch


def normal_equations(taus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, B) of WUDI's quadratic for task vectors taus [T, out, in] (a zero task vector contributes nothing)."""
    norms = taus.reshape(len(taus), -1).pow(2).sum(1)
    weights = inverse_or_zero(norms)
    grams = taus.transpose(1, 2) @ taus  # [T, in, in]
    s = (grams * weights[:, None, None]).sum(0)
    b = (taus @ grams * weights[:, None, None]).sum(0)
    return s, b


def inverse_or_zero(norms: torch.Tensor) -> torch.Tensor:
    """1 / norms, 0 where a norm is 0."""
    import torch

    from mergeflow.ml.merging._tensors import divide_or_zero

    return divide_or_zero(torch.ones_like(norms), norms)


def interference(merged: torch.Tensor, taus: torch.Tensor) -> torch.Tensor:
    """L(tau_m) as FusionBench computes it: sum_t |(tau_m - tau_t) tau_t^T|^2 / |tau_t|^2."""
    products = (merged[None] - taus) @ taus.transpose(1, 2)
    return (products.pow(2).sum((1, 2)) * inverse_or_zero(taus.reshape(len(taus), -1).pow(2).sum(1))).sum()


def solve_exact(taus: torch.Tensor) -> torch.Tensor:
    """The minimiser nearest the start sum_t tau_t: B S^+ + start (I - S S^+), in float64."""
    import torch

    s, b = (m.double() for m in normal_equations(taus.double()))
    pinv = torch.linalg.pinv(s, hermitian=True)
    start = taus.double().sum(0)
    return (b @ pinv + start - start @ s @ pinv).to(taus.dtype)


def solve_adam(taus: torch.Tensor, steps: int, lr: float) -> torch.Tensor:
    import torch

    s, b = normal_equations(taus)
    merged = taus.sum(0).clone().requires_grad_(True)
    optimizer = torch.optim.Adam([merged], lr=lr)
    for _ in range(steps):
        merged.grad = 2 * (merged.detach() @ s - b)
        optimizer.step()
    return merged.detach()


@register(
    "wudi",
    paper="Cheng et al. 2025, WUDI: whoever started the interference should end it (arXiv:2503.08099)",
    defaults={"solver": "adam", "steps": 300, "lr": 1e-5},
    ranges={
        "solver": Choice(("adam", "exact")),
        "steps": Range("a number of steps", 0),
        "lr": Range("a learning rate", 0),
    },
)
def wudi(pretrained, task_vectors, *, solver, steps, lr):
    from mergeflow.ml.merging._tensors import is_matrix, map_tensors

    def merge(key, theta0, taus):
        if not is_matrix(key, theta0):
            return theta0 + taus.mean(0)
        return theta0 + (solve_exact(taus) if solver == "exact" else solve_adam(taus, int(steps), lr))

    return map_tensors(pretrained, task_vectors, merge)
