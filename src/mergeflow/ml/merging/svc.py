"""Singular value calibration (SVC): scale down the directions of a merged update that several tasks over-count.

"When Shared Knowledge Hurts: Spectral Over-Accumulation in Model Merging", 2026 (arXiv:2602.05536), as
FusionBench implements it (Algorithm 1). A base merge (``base``, at its registered defaults, with ``lam`` where the
base has one: FusionBench's task arithmetic at 0.3) gives per matrix Delta = W_merge - W0 = U S V^T. For each
left singular vector u_r and task t, with a_r = u_r^T Delta and a_r,t = u_r^T tau_t,
    s_r,t = <a_r, a_r,t> / ||a_r,t||^2,   gamma_r = T / sum_t max(alpha, s_r,t),   W = W0 + U diag(gamma S) V^T.
A direction that T tasks share with equal weight is counted T times by the sum: s = T there and gamma = 1/T. A
direction only one task has gets s = 1 for it and alpha for the others, so gamma = T / (1 + (T - 1) alpha): it
is raised. Non-matrix tensors keep the base merge's values. ``alpha`` 0.1, FusionBench's default; nothing is
searched (FusionBench searches nothing either). ||a_r,t||^2 is floored at 1e-12, as FusionBench does.
"""

from mergeflow.ml.merging import ANY_NUMBER, Choice, Range, register

BASES = ("task_arithmetic", "weight_averaging", "ties", "tsv_m", "iso_c", "iso_cts", "wudi")


def calibrate(delta, taus, alpha):
    """U diag(gamma S) V^T for the merged update ``delta`` [m, n] and the task vectors ``taus`` [T, m, n]."""
    import torch

    from mergeflow.ml.merging._tensors import svd

    u, s, vh = svd(delta)
    taus = taus.to(u.device, u.dtype)
    merged = s[:, None] * vh  # u_r^T delta for every r: [R, n]
    responses = torch.einsum("mr,tmn->rtn", u, taus)  # [R, T, n]
    norms = (responses * responses).sum(-1).clamp_min(1e-12)
    coefficients = torch.einsum("rn,rtn->rt", merged, responses) / norms
    gamma = taus.shape[0] / torch.clamp(coefficients, min=alpha).sum(1)
    return (u * (gamma * s)) @ vh


@register(
    "svc",
    paper="Spectral over-accumulation in model merging, singular value "
    "calibration, 2026 (arXiv:2602.05536), as in FusionBench",
    defaults={"base": "task_arithmetic", "lam": 0.3, "alpha": 0.1},
    ranges={"base": Choice(BASES), "lam": ANY_NUMBER, "alpha": Range("a calibration floor", 0)},
)
def svc(pretrained, task_vectors, *, base, lam, alpha):
    from mergeflow.ml.merging import REGISTRY
    from mergeflow.ml.merging._tensors import as_compute, is_matrix, stack

    method = REGISTRY[base]
    merged = method(pretrained, task_vectors, **({"lam": lam} if "lam" in method.defaults else {}))
    out = {}
    for key, theta0 in pretrained.items():
        if not is_matrix(key, theta0):
            out[key] = merged[key]
            continue
        w0 = as_compute(theta0)
        delta = as_compute(merged[key]) - w0
        out[key] = (w0 + calibrate(delta, stack(task_vectors, key), alpha).to(w0.device, w0.dtype)).to(theta0.dtype)
    return out
