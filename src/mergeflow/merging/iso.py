"""Iso-C and Iso-CTS: flatten the spectrum of the merged task matrix (isotropic merging).

Marczak et al., "No task left behind: isotropic model merging with common and task-specific subspaces", ICML 2025
(arXiv:2502.04959). Per matrix, with M = sum_t tau_t = U S V^T:
    Iso-C    merged = U (mean(S) I) V^T;
    Iso-CTS  common subspace: the top c = round(common_space_fraction r) singular vectors of M; for each task the top
             s = (r - c) / T singular vectors of tau_t projected off the common left subspace; concatenate
             [U_common, U_1 ... U_T] and [V_common, V_1 ... V_T], orthogonalise both by their polar factors, and set
             every singular value to mean(S) of M.
Non-matrix tensors: the mean of tau_t. theta = theta0 + alpha merged, alpha in linspace(0, 3, 21)[1:].
"""

import torch

from mergeflow.merging import register
from mergeflow.merging._tensors import is_matrix, map_tensors, polar, svd
from mergeflow.merging.tsv_m import ALPHA_GRID

PAPER = "Marczak et al. 2025, Isotropic merging (arXiv:2502.04959)"


def iso_c_matrix(taus: torch.Tensor) -> torch.Tensor:
    u, s, vh = svd(taus.sum(0))
    return (s.mean() * (u @ vh)).to(taus.device)


def iso_cts_matrix(taus: torch.Tensor, common_space_fraction: float) -> torch.Tensor:
    n_tasks, r = taus.shape[0], min(taus.shape[1:])
    u, s, vh = svd(taus.sum(0))
    c = int(round(common_space_fraction * r))
    per_task = (r - c) // n_tasks
    us, vs = [u[:, :c]], [vh[:c].T]
    if per_task > 0:
        u_common = u[:, :c]
        for tau in taus.to(u.device):
            residual = tau - u_common @ (u_common.T @ tau)  # off the common left subspace
            ut, _, vht = svd(residual)
            us.append(ut[:, :per_task]), vs.append(vht[:per_task].T)
    u_hat, v_hat = polar(torch.cat(us, 1)), polar(torch.cat(vs, 1))
    return (s.mean() * (u_hat @ v_hat.T)).to(taus.device)


@register("iso_c", paper=PAPER, defaults={"alpha": 1.0}, grid={"alpha": ALPHA_GRID}, coefficient="alpha")
def iso_c(pretrained, task_vectors, *, alpha):
    def merge(key, theta0, taus):
        return theta0 + alpha * (iso_c_matrix(taus) if is_matrix(key, theta0) else taus.mean(0))

    return map_tensors(pretrained, task_vectors, merge)


@register("iso_cts", paper=PAPER, defaults={"common_space_fraction": 0.8, "alpha": 1.0}, grid={"alpha": ALPHA_GRID}, coefficient="alpha")
def iso_cts(pretrained, task_vectors, *, common_space_fraction, alpha):
    if not 0 < common_space_fraction <= 1:
        raise ValueError(f"merge.iso_cts.common_space_fraction: expected a fraction in (0, 1], got {common_space_fraction}")

    def merge(key, theta0, taus):
        return theta0 + alpha * (iso_cts_matrix(taus, common_space_fraction) if is_matrix(key, theta0) else taus.mean(0))

    return map_tensors(pretrained, task_vectors, merge)
