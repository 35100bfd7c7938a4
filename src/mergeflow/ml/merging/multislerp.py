"""Multi-SLERP: per tensor, the task vectors' mean direction on the unit sphere, scaled by their mean norm.

mergekit's ``multislerp`` (Goddard 2025, "barycentric interpolation on a hypersphere"), with its base model: per
tensor, u_t = tau_t / (|tau_t| + eps), m = mean_t u_t / |mean_t u_t|, the u_t projected onto the tangent plane at m
and averaged there, then mapped back by the exponential map, times mean_t |tau_t|; theta = theta0 + that. With
equal weights the tangent average is zero (mean_t (u_t - (u_t . m) m) = |mean u| m - |mean u| m), so the result is
m itself: the normalised mean direction, which for two task vectors of equal norm is SLERP at 1/2. A weighted sum of
directions that cancels (two opposite task vectors) falls back, as in mergekit, to the mean for two tasks and is
refused for more.
"""

from __future__ import annotations

from mergeflow.ml.merging import register

EPS = 1e-8  # mergekit's


@register("multislerp", paper="mergekit's multislerp (Goddard 2025, barycentric interpolation on a hypersphere)")
def multislerp(pretrained, task_vectors):
    import torch

    from mergeflow.ml.merging._sphere import sin2_floor
    from mergeflow.ml.merging._tensors import map_tensors

    def merge(key, theta0, taus):
        flat = taus.reshape(len(taus), -1)
        norms = flat.norm(dim=1, keepdim=True)
        units = flat / (norms + EPS)
        mean = units.mean(0)
        if mean.norm() ** 2 <= sin2_floor(mean.dtype):  # cancelled to the dtype's rounding (float32: 6e-8, not 0)
            if len(taus) == 2:  # mergekit's fallback: the linear mean
                return theta0 + taus.mean(0)
            raise ValueError(
                f"merge.multislerp: tensor '{key}': the task vectors' directions cancel out (their mean is zero)"
            )
        mean = mean / mean.norm()
        tangent = (units - (units @ mean)[:, None] * mean).mean(0)
        length = tangent.norm() + EPS
        direction = mean * torch.cos(length) + tangent * (torch.sin(length) / length)
        return theta0 + (norms.mean() * direction).reshape(theta0.shape)

    return map_tensors(pretrained, task_vectors, merge)
