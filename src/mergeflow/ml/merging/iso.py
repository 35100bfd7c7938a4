"""Iso-C and Iso-CTS: flatten the spectrum of the merged task matrix (isotropic merging).

Marczak et al., "No task left behind: isotropic model merging with common and task-specific subspaces", ICML 2025
(arXiv:2502.04959). Per matrix (r = min(m, n)), with M = sum_t tau_t = U S V^T:
    Iso-C    merged = U (mean(S) I) V^T;
    Iso-CTS  common subspace: the top c singular vectors of M; for each task the top s singular vectors of tau_t
             projected off the common left subspace, (I - U_c U_c^T) tau_t; concatenate [U_c, U_1 ... U_T] and
             [V_c, V_1 ... V_T], orthogonalise both by their polar factors, and give every direction the same
             singular value sigma. (U_1 ... U_T are orthogonal to U_c, so the left polar factor is
             [U_c, polar([U_1 ... U_T])]: computed so, ``_left_polar``.)
Non-matrix tensors: the mean of tau_t. theta = theta0 + alpha merged, alpha in linspace(0, 3, 21)[1:].

Two choices of Iso-CTS are left open by "c = common_space_fraction r, s = (r - c) / T"; both follow the authors' code
(danielm1405/iso-merging, src/utils/iso.py):
- the sizes, when T does not divide r - c: c0 = floor(fraction r), s = round((r - c0) / T) (Python's round, half to
  even), and the common subspace takes the rest, c = r - T s. So c + T s = r and the merged matrix has full rank
  (r = 768, T = 8, fraction 0.8: c = 616, s = 19). Where T s would exceed r (c0 < T / 2, tiny matrices; the
  authors' code would make c negative), s = floor(r / T).
- the scale: sigma is the mean of the r singular values kept, the top c of M with each task's top s of its
  projected residual (not the mean of all of M's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mergeflow.ml.merging import ANY_NUMBER, POSITIVE_FRACTION, register
from mergeflow.ml.merging.tsv_m import ALPHA_GRID

if TYPE_CHECKING:
    import torch

# |U_c^T W| in units of the dtype's eps above which the tasks' left vectors are not taken as orthogonal to the common
# ones (on the benchmark's ViT-B/16 block: 3e-6 - 8e-6 in float32, 1e-14 - 3e-14 in float64)
ORTHOGONAL_EPS = 1000
PAPER = "Marczak et al. 2025, Isotropic merging (arXiv:2502.04959)"


def iso_c_matrix(taus: torch.Tensor) -> torch.Tensor:
    from mergeflow.ml.merging._tensors import svd

    u, s, vh = svd(taus.sum(0))
    return (s.mean() * (u @ vh)).to(taus.device)


def subspace_sizes(r: int, n_tasks: int, common_space_fraction: float) -> tuple[int, int]:
    """(c, s): the common subspace's size and each task's, with c + n_tasks s = r (see the module's docstring)."""
    per_task = round((r - int(r * common_space_fraction)) / n_tasks)
    if n_tasks * per_task > r:
        per_task = r // n_tasks
    return r - n_tasks * per_task, per_task


def iso_cts_factors(
    taus: torch.Tensor, common_space_fraction: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Iso-CTS's parts: (U [m, r], V [n, r], sigma, owner [r]), the merged matrix sigma U V^T. Column j of U and V
    comes from the common subspace (owner -1) or from task owner[j]'s block (tasks in the order of ``taus``)."""
    import torch

    from mergeflow.ml.merging._tensors import polar, top_singular

    n_tasks, r = taus.shape[0], min(taus.shape[1:])
    c, per_task = subspace_sizes(r, n_tasks, common_space_fraction)
    u_common, s_common, vh_common = top_singular(taus.sum(0), c)
    us, vs, kept = [u_common], [vh_common.T], [s_common]
    if per_task > 0:
        for tau in taus.to(u_common.device):
            residual = tau - u_common @ (u_common.T @ tau)  # off the common left subspace
            ut, st, vht = top_singular(residual, per_task)
            us.append(ut), vs.append(vht.T), kept.append(st)
    owner = torch.cat([torch.full((len(s),), i - 1, dtype=torch.long) for i, s in enumerate(kept)])
    return _left_polar(u_common, us[1:]), polar(torch.cat(vs, 1)), torch.cat(kept).mean(), owner


def _left_polar(u_common: torch.Tensor, task_blocks: list[torch.Tensor]) -> torch.Tensor:
    """polar([U_c, W]) for W = [U_1 ... U_T]. Each U_t spans part of its residual's range, orthogonal to U_c, so
    [U_c, W]^T [U_c, W] = diag(I, W^T W) and the factor is [U_c, polar(W)]: the thin W's (m x T s) instead of the
    whole m x r basis'. Checked: where a residual has fewer than s nonzero singular values (a low-rank tau_t) its
    extra vectors need not be orthogonal to U_c, and the whole basis' factor is taken."""
    import torch

    from mergeflow.ml.merging._tensors import polar

    if not task_blocks:
        return polar(u_common)
    w = torch.cat(task_blocks, 1)
    overlap = u_common.T @ w
    if overlap.numel() and float(overlap.abs().max()) > ORTHOGONAL_EPS * torch.finfo(w.dtype).eps:
        return polar(torch.cat([u_common, w], 1))
    # the rounding left in U_c's span removed (in float32 it put the merge 6x further from float64's on a square
    # matrix), then the thin factor
    return torch.cat([u_common, polar(w - u_common @ overlap)], 1)


def iso_cts_matrix(taus: torch.Tensor, common_space_fraction: float) -> torch.Tensor:
    u_hat, v_hat, sigma, _ = iso_cts_factors(taus, common_space_fraction)
    return (sigma * (u_hat @ v_hat.T)).to(taus.device)


@register(
    "iso_c",
    paper=PAPER,
    defaults={"alpha": 1.0},
    grid={"alpha": ALPHA_GRID},
    coefficient="alpha",
    ranges={"alpha": ANY_NUMBER},
)
def iso_c(pretrained, task_vectors, *, alpha):
    from mergeflow.ml.merging._tensors import is_matrix, map_tensors

    def merge(key, theta0, taus):
        return theta0 + alpha * (iso_c_matrix(taus) if is_matrix(key, theta0) else taus.mean(0))

    return map_tensors(pretrained, task_vectors, merge)


@register(
    "iso_cts",
    paper=PAPER,
    defaults={"common_space_fraction": 0.8, "alpha": 1.0},
    grid={"alpha": ALPHA_GRID},
    coefficient="alpha",
    ranges={"common_space_fraction": POSITIVE_FRACTION, "alpha": ANY_NUMBER},
)
def iso_cts(pretrained, task_vectors, *, common_space_fraction, alpha):
    from mergeflow.ml.merging._tensors import is_matrix, map_tensors

    def merge(key, theta0, taus):
        return theta0 + alpha * (
            iso_cts_matrix(taus, common_space_fraction) if is_matrix(key, theta0) else taus.mean(0)
        )

    return map_tensors(pretrained, task_vectors, merge)
