"""TSV-M (task singular vectors, merge): decorrelate the tasks' singular vectors before summing.

Gargiulo et al., "Task singular vectors: reducing task interference in model merging", CVPR 2025
(arXiv:2412.00081). Per matrix: SVD each tau_t = U_t S_t V_t^T and keep k = floor(r / T) triplets per task; stack
U^ = [U_1k ... U_Tk], S^ = diag(S_1k ... S_Tk), V^ = [V_1k ... V_Tk]; replace U^ and V^ by their orthogonal polar
factors (U^ = P Sigma Q^T -> P Q^T); merged = U^_perp S^ V^_perp^T. Non-matrix tensors: the mean of tau_t.
theta = theta0 + alpha merged, alpha in linspace(0, 3, 21)[1:], 1.0 by default.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mergeflow.ml.merging import ANY_NUMBER, register

if TYPE_CHECKING:
    import torch

ALPHA_GRID = [round(0.15 * i, 2) for i in range(1, 21)]  # linspace(0, 3, 21)[1:]


def task_singular_vectors(taus: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Concatenated top-k triplets of each task, on the SVD device: U^ [m, T k], S^ [T k], Vh^ [T k, n]."""
    import torch

    from mergeflow.ml.merging._tensors import top_singular

    us, ss, vhs = [], [], []
    for tau in taus:
        u, s, vh = top_singular(tau, k)
        us.append(u), ss.append(s), vhs.append(vh)
    return torch.cat(us, 1), torch.cat(ss), torch.cat(vhs, 0)


def tsv_merge_matrix(taus: torch.Tensor) -> torch.Tensor:
    from mergeflow.ml.merging._tensors import polar

    k = max(1, min(taus.shape[1:]) // taus.shape[0])
    u, s, vh = task_singular_vectors(taus, k)
    return ((polar(u) * s) @ polar(vh.T).T).to(taus.device)


@register(
    "tsv_m",
    paper="Gargiulo et al. 2025, Task Singular Vectors (arXiv:2412.00081)",
    defaults={"alpha": 1.0},
    grid={"alpha": ALPHA_GRID},
    coefficient="alpha",
    ranges={"alpha": ANY_NUMBER},
)
def tsv_m(pretrained, task_vectors, *, alpha):
    from mergeflow.ml.merging._tensors import is_matrix, map_tensors

    def merge(key, theta0, taus):
        return theta0 + alpha * (tsv_merge_matrix(taus) if is_matrix(key, theta0) else taus.mean(0))

    return map_tensors(pretrained, task_vectors, merge)
