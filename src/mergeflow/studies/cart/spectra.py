"""Study ``cart``'s spectral measurements (claims 2 and 5): the task vectors' singular values, the interference I(k)
and the reconstruction error R(k) of the original and the centred vectors, per layer."""

from __future__ import annotations

from typing import TYPE_CHECKING

import math
from dataclasses import dataclass, field

if TYPE_CHECKING:
    import torch


def svd_stack(vectors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Singular values [T, r] and right singular vectors [T, r, n] (rows) of T matrices [T, m, n], in float64."""
    import torch

    _, s, vh = torch.linalg.svd(vectors.double(), full_matrices=False)
    return s, vh


def interference(s: torch.Tensor, vh: torch.Tensor, k: int, *, top_only: bool = False) -> float:
    """I(k) = sum_{i != j} ||S_i V_i^T V_j S_j||_F (seed eq. 5): the top-k singular values divided by the l2 norm of
    all of them (top_only: of the top k alone)."""
    import torch

    if k <= 0:
        return 0.0
    sk = s[:, :k] / (s[:, :k] if top_only else s).norm(dim=1, keepdim=True).clamp_min(1e-300)
    a = sk[:, :, None] * vh[:, :k]  # [T, k, n]: S_t V_t^T
    gram = torch.einsum("ikn,jln->ijkl", a, a)  # [T, T, k, k]
    norms = gram.flatten(2).norm(dim=2)
    return float(norms.sum() - norms.diagonal().sum())


def reconstruction(s: torch.Tensor, k: int) -> float:
    """R(k) = sum_t sum_{s > k} sigma_{t,s}^2 (seed eq. 7)."""
    return float((s[:, k:] ** 2).sum())


def energy_kept(s: torch.Tensor, k: int) -> float:
    """Mean over the T vectors of the fraction of ||.||_F^2 in the top k singular values."""
    e = s**2
    return float((e[:, :k].sum(1) / e.sum(1).clamp_min(1e-300)).mean())


def rank_of(shape, ratio: float) -> int:
    r = min(shape)
    return max(0, min(r, math.ceil(ratio * r - 1e-9)))


@dataclass
class LayerSpectra:
    key: str
    shape: tuple[int, int]
    ranks: list[int]
    i_centred: list[float]
    i_original: list[float]
    r_centred: list[float]  # R(k) / R(0)
    energy_centred: float  # at the CART rank ratio
    energy_original: float
    energy_gaussian: float
    cumulative_centred: list[float] = field(default_factory=list)  # energy kept at every rank 0..r
    cumulative_original: list[float] = field(default_factory=list)
    i_centred_top: list[float] = field(default_factory=list)  # I(k) with the top-k-only normalisation
    i_original_top: list[float] = field(default_factory=list)
    norm_ratio: float = float("nan")  # mean over tasks of ||theta_t - theta_avg||_F / ||tau_t||_F


def spectra(
    pretrained, task_vectors, tasks: list[str], ratios: list[float], rank_ratio: float, seed: int = 0
) -> list[LayerSpectra]:
    import torch

    from mergeflow.ml.merging import is_matrix

    gen = torch.Generator().manual_seed(seed)
    out = []
    for key, theta0 in pretrained.items():
        if not is_matrix(key, theta0):
            continue
        taus = torch.stack([task_vectors[t][key].double() for t in tasks])
        centred = taus - taus.mean(0, keepdim=True)
        sc, vc = svd_stack(centred)
        so, vo = svd_stack(taus)
        ranks = [rank_of(theta0.shape, r) for r in ratios]
        r0 = reconstruction(sc, 0)
        k8 = rank_of(theta0.shape, rank_ratio)
        g = torch.linalg.svdvals(torch.randn(tuple(theta0.shape), generator=gen, dtype=torch.float64))[None]
        ec, eo = sc**2, so**2
        out.append(
            LayerSpectra(
                key,
                tuple(theta0.shape),
                ranks,
                [interference(sc, vc, k) for k in ranks],
                [interference(so, vo, k) for k in ranks],
                [reconstruction(sc, k) / r0 if r0 > 0 else 0.0 for k in ranks],
                energy_kept(sc, k8),
                energy_kept(so, k8),
                energy_kept(g, k8),
                [0.0] + (ec.cumsum(1) / ec.sum(1, keepdim=True)).mean(0).tolist(),
                [0.0] + (eo.cumsum(1) / eo.sum(1, keepdim=True)).mean(0).tolist(),
                [interference(sc, vc, k, top_only=True) for k in ranks],
                [interference(so, vo, k, top_only=True) for k in ranks],
                float((centred.flatten(1).norm(dim=1) / taus.flatten(1).norm(dim=1).clamp_min(1e-300)).mean()),
            )
        )
    return out
