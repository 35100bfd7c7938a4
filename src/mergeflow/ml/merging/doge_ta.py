"""DOGE-TA: task arithmetic after a learned correction delta of each matrix, kept out of the tasks' shared subspace,
and a magnitude mask of each task vector.

Wei et al., "Modeling multi-task model merging as adaptive projective gradient descent", ICML 2025
(arXiv:2501.01230), as FusionBench runs it (DOGE_TA_Algorithm). Per 2-D weight, with lambda_i = lam / |tau_i|_F:
1. shared subspace: the top floor(r / T) left singular vectors of each tau_i side by side, and of that [m, r]
   matrix the top floor(r / subspace) left singular vectors U_s; P = U_s U_s^T;
2. delta (from 0) minimises sum_j sum_rows (|tau_j[row]|^2 - tau_j[row] . M[row])^2 with
   M = sum_i lambda_i (tau_i + delta), by Adam (lr 1e-4, 400 steps) on gradients projected off the shared subspace,
   g <- g - P g (the gradient is written in closed form; tested against autograd of FusionBench's loss);
3. mask: each task's top k fraction of |tau_i| over all its 2-D weights together (int(k d) + 1 entries, as its
   kthvalue keeps; entries tied with the cut kept);
4. theta = theta0 + sum_i lambda_i (tau_i + delta) * mask_i.
Tensors that are not the blocks' 2-D weights keep theta0's values, as FusionBench's (it merges only the
encoder's weights: not CLIP's projection, timm's ``head.weight``).
Defaults: FusionBench's config (lam 0.07, k 0.3, subspace 6). lambda_i gives every task's layer the same norm lam,
so lam depends on the backbone's weight scale: searched on validation over LAM_GRID (each value re-optimises delta).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mergeflow.ml.merging import POSITIVE_FRACTION, Range, register

if TYPE_CHECKING:
    import torch

LAM_GRID = [0.02, 0.05, 0.07, 0.1, 0.2, 0.5]


def shared_basis(taus: torch.Tensor, subspace: int) -> torch.Tensor:
    """U_s [m, floor(r / subspace)]: the shared subspace of the tasks' top left singular vectors."""
    import torch

    from mergeflow.ml.merging._tensors import top_singular

    r = min(taus.shape[1:])
    per_task = r // len(taus)
    stacked = torch.zeros(taus.shape[1], r, dtype=taus.dtype)
    for i, tau in enumerate(taus):
        if per_task:
            stacked[:, i * per_task : (i + 1) * per_task] = top_singular(tau, per_task)[0].to(taus.device, taus.dtype)
    return top_singular(stacked, r // subspace)[0].to(taus.device, taus.dtype)


def conflict(delta: torch.Tensor, taus: torch.Tensor, lambdas: torch.Tensor) -> torch.Tensor:
    """FusionBench's loss: sum_j sum_rows (|tau_j[row]|^2 - tau_j[row] . M[row])^2, M = sum_i lambda_i (tau_i +
    delta)."""
    merged = (lambdas[:, None, None] * taus).sum(0) + lambdas.sum() * delta
    return ((taus * taus).sum(-1) - (taus * merged).sum(-1)).pow(2).sum()


def correction(taus: torch.Tensor, lambdas: torch.Tensor, basis: torch.Tensor, steps: int, lr: float) -> torch.Tensor:
    """delta after ``steps`` Adam steps on the projected gradient of ``conflict``:
    dL/d delta[row] = -2 sum(lambda) sum_j residual_j[row] tau_j[row]."""
    import torch

    fixed = (lambdas[:, None, None] * taus).sum(0)
    own = (taus * taus).sum(-1)  # [T, m]
    scale = -2 * lambdas.sum()
    delta = torch.zeros_like(fixed, requires_grad=True)
    optimizer = torch.optim.Adam([delta], lr=lr)
    for _ in range(steps):
        merged = fixed + lambdas.sum() * delta.detach()
        residual = own - (taus * merged).sum(-1)  # [T, m]
        grad = scale * (residual[:, :, None] * taus).sum(0)
        delta.grad = grad - basis @ (basis.T @ grad)
        optimizer.step()
    return delta.detach()


@register(
    "doge_ta",
    paper="Wei et al. 2025, DOGE: adaptive projective gradient descent (ICML 2025, arXiv:2501.01230)",
    defaults={"lam": 0.07, "k": 0.3, "subspace": 6, "steps": 400, "lr": 1e-4},
    grid={"lam": LAM_GRID},
    ranges={
        "lam": Range("a layer norm", 0, low_open=True),
        "k": POSITIVE_FRACTION,
        "subspace": Range("a divisor of the rank", 1),
        "steps": Range("a number of steps", 0),
        "lr": Range("a learning rate", 0),
    },
)
def doge_ta(pretrained, task_vectors, *, lam, k, subspace, steps, lr):
    import torch

    from mergeflow.ml.merging._tensors import as_compute, divide_or_zero, is_matrix, map_tensors
    from mergeflow.ml.merging.ties import cut_in_place

    def merged(key, tensor) -> bool:  # the encoder's weights: not timm's head (CLIP's projection)
        return is_matrix(key, tensor) and not key.startswith("head.")

    matrices = [key for key, p in pretrained.items() if merged(key, p)]
    cuts = []
    for tv in task_vectors.values():  # each task's magnitude cut over all its matrices, one task at a time
        mags = torch.cat([as_compute(tv[key]).reshape(-1).abs() for key in matrices]) if matrices else torch.zeros(0)
        cuts.append(float(cut_in_place(mags.numpy(), k, "ties_original")) if mags.numel() else 0.0)

    def merge(key, theta0, taus):
        if not merged(key, theta0):
            return theta0.clone()
        norms = taus.reshape(len(taus), -1).norm(dim=1)
        lambdas = divide_or_zero(torch.full_like(norms, lam), norms)
        delta = correction(taus, lambdas, shared_basis(taus, int(subspace)), int(steps), lr)
        masks = taus.abs() >= torch.tensor(cuts, dtype=taus.dtype)[:, None, None]
        return theta0 + (lambdas[:, None, None] * (taus + delta) * masks).sum(0)

    return map_tensors(pretrained, task_vectors, merge)
