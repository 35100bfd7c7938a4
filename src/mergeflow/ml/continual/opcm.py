"""OPCM, orthogonal projection for continual merging: each new task vector, projected off the dominant singular
directions of the merged task vector, is added to it, and the sum rescaled to the mean task-vector norm.

Tang et al., "Merging Models on the Fly Without Retraining: A Sequential Approach to Scalable Continual Model Merging"
(arXiv:2501.09522); FusionBench's fusion_bench/method/opcm/opcm_general.py (alpha 0.5, config/method/opcm/opcm.yaml).
With theta(1) = theta_1, lambda_1 = 1, and at arrival t >= 2, tau_bar = theta(t-1) - theta0, tau_t = theta_t - theta0:

    a 2-D tensor (a linear layer's weight): tau_bar = U S V^T (full SVD), r = the first k with
        sum_{i<=k} s_i / sum_i s_i > alpha (0-based), P = U^T tau_t V with P_ii = 0 and P[:r, :r] = 0,
        delta = lambda_(t-1) tau_bar + U P V^T
    any other tensor: delta = lambda_(t-1) tau_bar + tau_t
    n = ||delta|| (over every tensor), nbar = mean_(i<=t) ||tau_i||, lambda_t = n / nbar,
    theta(t) = theta0 + delta * nbar / n.

State: lambda_(t-1) and the running sum of the task-vector norms (FusionBench keeps their list; it takes the mean).
FusionBench walks leaf modules, so a tensor held by a module with children (a ViT's cls_token, pos_embed) keeps
theta(t-1)'s value there before the rescale; here every tensor follows its rule above, as the paper writes it.
"""

from mergeflow.ml.continual import Interval, register


def norm(state) -> float:
    """The Euclidean norm of every tensor of ``state`` together, in float64."""
    return sum(float(v.double().pow(2).sum()) for v in state.values()) ** 0.5


def project(merged_tau, tau, alpha: float):
    """U P V^T, ``tau`` with its components on the singular pairs u_i v_i^T of ``merged_tau`` and on the block of its
    first r left and right singular vectors removed (r: the energy rule above)."""
    import torch

    u, s, vh = torch.linalg.svd(merged_tau, full_matrices=True)
    v = vh.T
    split_rank = int((s.cumsum(0) / s.sum() > alpha).float().argmax())
    p = u.T @ tau @ v
    p.diagonal().fill_(0)
    p[:split_rank, :split_rank] = 0
    return u @ p @ v.T


@register(
    "opcm",
    paper="Tang et al. 2025, Merging models on the fly without retraining (OPCM, arXiv:2501.09522)",
    reference="fusion_bench/method/opcm/opcm_general.py",
    defaults={"alpha": 0.5},
    ranges={"alpha": Interval(0.0, 1.0)},
)
def opcm(pretrained, merged, state, tau, *, alpha):
    tau_norm = norm(tau)
    if merged is None:
        return {k: pretrained[k] + tau[k] for k in pretrained}, {"lambda": 1.0, "norm_sum": tau_norm, "arrivals": 1}
    arrivals = state["arrivals"] + 1
    mean_norm = (state["norm_sum"] + tau_norm) / arrivals
    delta = {}
    for k, theta0 in pretrained.items():
        merged_tau = merged[k] - theta0
        added = project(merged_tau, tau[k], alpha) if theta0.dim() == 2 else tau[k]
        delta[k] = state["lambda"] * merged_tau + added
    n = norm(delta)
    scale = mean_norm / n if n > 0 else 0.0  # every tensor of every vector zero: theta0 again
    new_state = {"lambda": n / mean_norm if mean_norm > 0 else 1.0, "norm_sum": state["norm_sum"] + tau_norm}
    return {k: pretrained[k] + delta[k] * scale for k in pretrained}, {**new_state, "arrivals": arrivals}
