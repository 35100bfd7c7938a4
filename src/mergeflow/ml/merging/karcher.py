"""Karcher mean: per tensor, the Riemannian mean of the task vectors' directions on the unit sphere, scaled by
their mean norm.

Karcher, "Riemannian center of mass and mollifier smoothing", Comm. Pure Appl. Math. 1977; as a merge, mergekit's
``karcher``. Per tensor, with u_t = tau_t / |tau_t| (zero vectors left out), start from the normalised mean of the
u_t and iterate the gradient step on the sphere,

    v = mean_t theta_t / sin(theta_t) (u_t - cos(theta_t) m),  theta_t = angle(m, u_t);  m <- cos|v| m + sin|v| v/|v|,

until |v| < tol or max_iter steps; theta = theta0 + (mean_t |tau_t|) m. Of two task vectors of equal norm it is
SLERP at 1/2. ``space``: "task_vectors" (as mergeflow's slerp, around theta0) or "weights" (mergekit's: the mean
of the fine-tuned weights theta_t themselves, theta0 unused).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mergeflow.ml.merging import Choice, Range, register

if TYPE_CHECKING:
    import torch


def karcher_mean(vectors: torch.Tensor, max_iter: int, tol: float) -> torch.Tensor:
    """vectors [T, n] -> [n]: the Karcher mean of their directions times their mean norm (mergekit's arithmetic)."""
    import torch

    from mergeflow.ml.merging._sphere import degenerate

    norms = vectors.norm(dim=1)
    valid = norms > tol
    if not valid.any():
        return torch.zeros_like(vectors[0])
    units = vectors[valid] / norms[valid, None]
    mean = units.mean(0)
    mean = units[0].clone() if mean.norm() < tol else mean / mean.norm()
    for _ in range(max_iter):
        cos = (units @ mean).clamp(-1.0, 1.0)
        theta = torch.arccos(cos)
        # a direction at the mean already pulls nothing (theta / sin(theta) -> 1 there); one opposite to it pulls in
        # no defined direction (u - cos m ~ 0 over sin ~ 0): both left out (merging._sphere)
        moving = (theta >= tol) & ~degenerate(cos)
        scale = torch.where(moving, theta / torch.sin(theta).clamp(min=1e-12), torch.zeros_like(theta))
        tangent = (scale[:, None] * (units - cos[:, None] * mean)).mean(0)
        step = tangent.norm()
        if step < tol:
            break
        mean = torch.cos(step) * mean + torch.sin(step) * tangent / step
        mean = mean / mean.norm()
    return norms.mean() * mean


@register(
    "karcher",
    paper="Karcher 1977, Riemannian center of mass; mergekit's karcher",
    defaults={"space": "task_vectors", "max_iter": 10, "tol": 1e-5},
    ranges={
        "space": Choice(("task_vectors", "weights")),
        "max_iter": Range("a number of steps", 1),
        "tol": Range("a tolerance", 0, low_open=True),
    },
)
def karcher(pretrained, task_vectors, *, space, max_iter, tol):
    from mergeflow.ml.merging._tensors import map_tensors

    def merge(key, theta0, taus):
        flat = taus.reshape(len(taus), -1)
        if space == "weights":
            return karcher_mean(flat + theta0.reshape(1, -1), max_iter, tol).reshape(theta0.shape)
        return theta0 + karcher_mean(flat, max_iter, tol).reshape(theta0.shape)

    return map_tensors(pretrained, task_vectors, merge)
