"""SLERP: spherical linear interpolation between two task vectors, per tensor.

Shoemake 1985; as used for model merging by mergekit. For tau_1, tau_2 with angle Omega (per tensor):
    slerp = sin((1 - t) Omega) / sin(Omega) tau_1 + sin(t Omega) / sin(Omega) tau_2  (linear when nearly parallel or
    opposite: 1 - cos^2 Omega within the dtype's rounding, merging._sphere);
theta = theta0 + slerp. Defined for exactly two models; t = 0.5 by default. ``space``: ``'task_vectors'`` (the
default, as above) or ``'weights'``: the two fine-tuned models' weights theta_1, theta_2 interpolated themselves,
theta = slerp(theta_1, theta_2), theta0 unused (mergekit's slerp, whose base model is only one end).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mergeflow.ml.merging import FRACTION, Choice, register

if TYPE_CHECKING:
    import torch


def slerp_pair(a: torch.Tensor, b: torch.Tensor, t: float, eps: float = 1e-6) -> torch.Tensor:
    import torch

    from mergeflow.ml.merging._sphere import degenerate

    na, nb = a.norm(), b.norm()
    if na < eps or nb < eps:
        return (1 - t) * a + t * b
    cos = torch.clamp((a.flatten() @ b.flatten()) / (na * nb), -1.0, 1.0)
    if degenerate(cos):  # nearly parallel or opposite: sin(Omega) ~ 0, and slerp's limit is lerp
        return (1 - t) * a + t * b
    omega = torch.arccos(cos)
    return (torch.sin((1 - t) * omega) * a + torch.sin(t * omega) * b) / torch.sin(omega)


SPACES = Choice(("task_vectors", "weights"))  # what is interpolated: the task vectors around theta0, or the weights


@register(
    "slerp",
    paper="Shoemake 1985, Animating rotation with quaternion curves; mergekit's slerp",
    defaults={"t": 0.5, "space": "task_vectors"},
    grid={"t": [0.25, 0.5, 0.75]},
    ranges={"t": FRACTION, "space": SPACES},
    tasks=2,
)
def slerp(pretrained, task_vectors, *, t, space):
    from mergeflow.ml.merging._tensors import map_tensors

    if len(task_vectors) != 2:
        raise ValueError(f"merge.slerp: SLERP merges exactly two models, got {len(task_vectors)} tasks")
    if space == "weights":
        return map_tensors(
            pretrained, task_vectors, lambda key, theta0, taus: slerp_pair(theta0 + taus[0], theta0 + taus[1], t)
        )
    return map_tensors(pretrained, task_vectors, lambda key, theta0, taus: theta0 + slerp_pair(taus[0], taus[1], t))
