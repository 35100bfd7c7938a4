"""DOP, dual projections: each linear weight is optimised to stay close to the merged model and to the new one, each
measured in its own task vector's singular subspaces; every other tensor is their average.

"Continual Model Merging without Data: Dual Projections for Balancing Stability and Plasticity", NeurIPS 2025;
FusionBench's fusion_bench/method/dop/dop.py (ContinualDOPForCLIP; defaults from config/method/dop/dop.yaml). With
theta(1) = theta_1, at arrival t >= 2 the two models are i = 0, the merged theta(t-1), and i = 1, the new theta_t:

    a 2-D tensor (a linear layer's weight) W: tau_i = W_i - W_0 = U_i S_i V_i^T (full SVD), kept to its first
        k_i singular triplets, k_i = searchsorted(cumsum(s) / sum(s), svd_epsilon);
        L_i(W) = ||diag(s_i) U_i^T (W - W_i)||_F^2 + ||(W - W_i) V_i diag(s_i)||_F^2  (svd_proj_space "uv"; "u" or
        "v": one term); W starts at (W_merged + W_new) / 2 and takes num_steps Adam steps (lr) on
        c_0 L_0 + c_1 L_1, where with mgda the weights c are the min-norm point of the two gradients, each divided
        by its loss (Sener and Koltun 2018, MGDA), smoothed with ema: c <- ema_beta c + (1 - ema_beta) c_mgda from
        c = (alpha, 1 - alpha); without mgda, c = (alpha, 1 - alpha).
    any other tensor: (theta(t-1) + theta_t) / 2.

No state besides the merged model. FusionBench averages leaf modules only, so a tensor held by a module with children
(a ViT's cls_token, pos_embed) stays theta0's there; here every tensor follows its rule above. A loss of exactly 0
(the two weights equal in that subspace) is not divided by: FusionBench's division would give NaN.
"""

from mergeflow.ml.continual import Interval, OneOf, register


def subspace(tau, epsilon: float):
    """(s, U, V) of ``tau`` kept to its first k triplets, k = searchsorted(cumsum(s) / sum(s), epsilon)."""
    import torch

    u, s, vh = torch.linalg.svd(tau, full_matrices=True)
    rank = int(torch.searchsorted(s.cumsum(0) / s.sum(), torch.tensor(epsilon, dtype=s.dtype)))
    return s[:rank], u[:, :rank], vh.T[:, :rank]


def projected_loss(delta, s, u, v, space: str):
    """||diag(s) U^T delta||_F^2 + ||delta V diag(s)||_F^2 (``space`` "uv"), or one of the two terms ("u", "v")."""
    left = (s[:, None] * (u.T @ delta)).pow(2).sum() if space in ("uv", "u") else 0
    right = ((delta @ v) * s[None, :]).pow(2).sum() if space in ("uv", "v") else 0
    return left + right


def min_norm_pair(g0g0: float, g0g1: float, g1g1: float) -> float:
    """gamma of the min-norm point gamma g0 + (1 - gamma) g1 (MGDA's two-gradient case, FusionBench's
    min_norm_solvers._min_norm_element_from2, with its 0.999 and 0.001 at the ends)."""
    if g0g1 >= g0g0:
        return 0.999
    if g0g1 >= g1g1:
        return 0.001
    return -(g0g1 - g1g1) / (g0g0 + g1g1 - 2 * g0g1)


def optimise(w0, weights, hp):
    """The merged 2-D weight: ``weights`` = (merged W, new W), theta0's ``w0``; ``hp`` the method's settings."""
    import torch

    with torch.enable_grad():
        w = torch.nn.Parameter((weights[0] + weights[1]) / 2)
        spaces = [subspace(wi - w0, hp["svd_epsilon"]) for wi in weights]
        optimizer = torch.optim.Adam([w], lr=hp["lr"])
        c = [hp["alpha"], 1 - hp["alpha"]]

        def losses():
            return [projected_loss(w - wi, *sp, hp["svd_proj_space"]) for wi, sp in zip(weights, spaces)]

        for _ in range(hp["num_steps"]):
            if hp["mgda"]:
                grads = []
                for loss in losses():
                    g = torch.autograd.grad(loss, w, allow_unused=True)[0] if torch.is_tensor(loss) else None
                    g = torch.zeros_like(w) if g is None else g
                    value = float(loss.detach()) if torch.is_tensor(loss) else 0.0
                    grads.append(g / value if value != 0 else g)
                dots = [float((grads[0] * grads[0]).sum()), float((grads[0] * grads[1]).sum())]
                gamma = min_norm_pair(dots[0], dots[1], float((grads[1] * grads[1]).sum()))
                sol = [gamma, 1 - gamma]
                c = [hp["ema_beta"] * ci + (1 - hp["ema_beta"]) * si for ci, si in zip(c, sol)] if hp["ema"] else sol
            total = sum(ci * li for ci, li in zip(c, losses()))
            optimizer.zero_grad()
            if torch.is_tensor(total) and total.requires_grad:
                total.backward()
                optimizer.step()
    return w.detach()


@register(
    "dop",
    paper="Continual model merging without data: dual projections for balancing stability and plasticity (DOP, "
    "NeurIPS 2025)",
    reference="fusion_bench/method/dop/dop.py",
    defaults={
        "lr": 1e-4,
        "num_steps": 200,
        "mgda": True,
        "ema": True,
        "ema_beta": 0.999,
        "alpha": 0.8,
        "svd_epsilon": 0.99999,
        "svd_proj_space": "uv",
    },
    ranges={
        "lr": Interval(0.0),
        "num_steps": Interval(0, integer=True),
        "mgda": OneOf((True, False)),
        "ema": OneOf((True, False)),
        "ema_beta": Interval(0.0, 1.0),
        "alpha": Interval(0.0, 1.0),
        "svd_epsilon": Interval(0.0, 1.0),
        "svd_proj_space": OneOf(("uv", "u", "v")),
    },
)
def dop(pretrained, merged, state, tau, **hp):
    if merged is None:
        return {k: pretrained[k] + tau[k] for k in pretrained}, None
    out = {}
    for k, theta0 in pretrained.items():
        new = theta0 + tau[k]
        out[k] = optimise(theta0, (merged[k], new), hp) if theta0.dim() == 2 else (merged[k] + new) / 2
    return out, None
