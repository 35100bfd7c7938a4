"""NuSLERP: SLERP of two task vectors, per tensor or per row or column of each matrix.

mergekit's ``nuslerp`` with a base model (no paper of its own; SLERP is Shoemake 1985). For two task vectors
a, b and t: on each vector pair (u, v) (the whole tensor flattened, or each matrix row, or each column),
cos Omega = <u/|u|, v/|v|> (norms at least 1e-7), and slerp = (sin((1 - t) Omega) u + sin(t Omega) v) / sin Omega,
linear interpolation (1 - t) u + t v where the pair is nearly parallel or opposite (1 - cos^2 Omega within the
dtype's rounding: merging._sphere; mergekit: |cos| > 0.9995); theta = theta0 + slerp. ``vectors``: ``'tensor'``
(mergekit's default, nuslerp_flatten: true; the same merge as ``slerp`` away from parallel vectors), ``'rows'``
(nuslerp_flatten: false: each W[i, :]) or ``'columns'`` (nuslerp_row_wise: true as well: each W[:, j]); 1-D
tensors are one vector. mergekit's t = weight_b / (weight_a + weight_b); two tasks only. ``space``:
``'task_vectors'`` (mergekit's nuslerp with a base model, the default) or ``'weights'`` (mergekit's without one:
the fine-tuned weights theta_a, theta_b interpolated themselves, theta = nuslerp(theta_a, theta_b), theta0 unused).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mergeflow.ml.merging import FRACTION, Choice, register
from mergeflow.ml.merging.slerp import SPACES

if TYPE_CHECKING:
    import torch


def nuslerp_pair(t: float, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SLERP of the rows of u and v [..., n] (each row a vector), mergekit's clamps; linear where a pair is nearly
    parallel or opposite (merging._sphere: 1 - cos^2 within the dtype's rounding)."""
    import torch

    from mergeflow.ml.merging._sphere import degenerate

    def unit(x):
        return x / x.norm(dim=-1, keepdim=True).clamp(min=1e-7)

    cos = (unit(u) * unit(v)).sum(-1, keepdim=True).clamp(-1, 1)
    omega = torch.acos(cos)
    sin = torch.sin(omega)
    parallel = degenerate(cos)
    spherical = (torch.sin((1 - t) * omega) * u + torch.sin(t * omega) * v) / torch.where(
        parallel, torch.ones_like(sin), sin
    )
    return torch.where(parallel, (1 - t) * u + t * v, spherical)


def along(tau: torch.Tensor, vectors: str) -> torch.Tensor:
    """The tensor as rows of the vectors it is interpolated by (a view for 'tensor' and 'rows')."""
    if tau.dim() < 2 or vectors == "tensor":
        return tau.reshape(1, -1)
    return tau if vectors == "rows" else tau.transpose(0, -1)


@register(
    "nuslerp",
    paper="mergekit's nuslerp (SLERP: Shoemake 1985)",
    defaults={"t": 0.5, "vectors": "tensor", "space": "task_vectors"},
    grid={"t": [0.25, 0.5, 0.75]},
    ranges={"t": FRACTION, "vectors": Choice(("tensor", "rows", "columns")), "space": SPACES},
    tasks=2,
)
def nuslerp(pretrained, task_vectors, *, t, vectors, space):
    from mergeflow.ml.merging._tensors import map_tensors

    if len(task_vectors) != 2:
        raise ValueError(f"merge.nuslerp: NuSLERP merges exactly two models, got {len(task_vectors)} tasks")

    def merge(key, theta0, taus):
        ends = (theta0 + taus[0], theta0 + taus[1]) if space == "weights" else (taus[0], taus[1])
        merged = nuslerp_pair(t, along(ends[0], vectors), along(ends[1], vectors))
        if taus[0].dim() >= 2 and vectors == "columns":
            merged = merged.transpose(0, -1)
        return merged.reshape(theta0.shape) + (0 if space == "weights" else theta0)

    return map_tensors(pretrained, task_vectors, merge)
