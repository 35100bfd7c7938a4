"""Study ``provable``'s figures (matplotlib, imported when drawing)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from collections.abc import Sequence
from pathlib import Path


from mergeflow.studies.provable.claims import SEED_ALPHA
from mergeflow.studies.provable.measure import Measurements
from mergeflow.studies.provable.real import RealMeasurements, RealOod
from mergeflow.studies.provable.settings import ProvableSettings

if TYPE_CHECKING:
    pass


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _edges(values: Sequence[float]) -> list[float]:
    """Cell edges for pcolormesh around (possibly uneven) centres."""
    v = list(values)
    if len(v) == 1:
        return [v[0] - 0.5, v[0] + 0.5]
    mids = [(a + b) / 2 for a, b in zip(v, v[1:])]
    return [v[0] - (mids[0] - v[0])] + mids + [v[-1] + (v[-1] - mids[-1])]


def plot_addition(m: Measurements, s: ProvableSettings, path: Path, *, low_rank: bool = False) -> None:
    """Test losses of Psi0 + dPsi1 + lambda dPsi2 over (lambda, alpha): task 1, task 2, and where both are small."""
    plt = _pyplot()
    l1 = m.low_rank_loss1 if low_rank else m.loss1
    l2 = m.low_rank_loss2 if low_rank else m.loss2
    vmax = max(2.0, max(max(map(max, l1)), max(map(max, l2))))
    fig, axes = plt.subplots(1, 3, figsize=(14.5, 4.2), layout="constrained", sharey=True)
    xe, ye = _edges(m.lambdas), _edges(m.alphas)
    both = [[float(max(a, b)) for a, b in zip(r1, r2)] for r1, r2 in zip(l1, l2)]
    panels = [(l1, "task 1 loss"), (l2, "task 2 loss"), (both, f"max of the two (white line: ≤ {s.small_loss:g})")]
    for ax, (z, title) in zip(axes, panels):
        mesh = ax.pcolormesh(xe, ye, z, cmap="viridis", vmin=0, vmax=vmax, shading="flat")
        ax.contour(
            m.lambdas,
            m.alphas,
            [[float(max(a, b) <= s.small_loss) for a, b in zip(r1, r2)] for r1, r2 in zip(l1, l2)],
            levels=[0.5],
            colors="white",
            linewidths=1.5,
        )
        ax.plot([1 - a for a in m.alphas], m.alphas, color="#ff4040", ls="--", lw=1.2, label="λ = 1 − α (Theorem 1)")
        ax.axvline(0, color="#bbbbbb", lw=0.8, ls=":")
        ax.set_xlim(xe[0], xe[-1])
        ax.set_xlabel("λ (Ψ = Ψ0 + ΔΨ1 + λ ΔΨ2)")
        ax.set_title(title, fontsize=10)
    axes[0].set_ylabel("α = μ1ᵀμ2\n(< 0 contradictory, > 0 aligned)")
    axes[0].legend(loc="lower left", fontsize=8, framealpha=0.8)
    fig.colorbar(mesh, ax=axes, label="mean hinge test loss", shrink=0.9)
    kind = f"rank-{s.low_rank} task vectors" if low_rank else "full task vectors"
    fig.suptitle(
        f"Task addition and negation over (α, λ), {kind} (seed 004, Theorems 1-2; its Fig. 1 as a map)", fontsize=11
    )
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)


def plot_ood(m: Measurements, s: ProvableSettings, path: Path) -> None:
    """Per target: the loss over (lambda1, lambda2), the region where (7) holds and the closed-form lambdas."""
    plt = _pyplot()
    n = len(m.ood)
    fig, axes = plt.subplots(1, n, figsize=(3.4 * n + 1.2, 3.9), layout="constrained", squeeze=False)
    axes = axes[0]
    vmax = 2.0
    mesh = None
    for ax, t in zip(axes, m.ood):
        lams = t.lambdas
        e = _edges(lams)
        z = [[min(v, vmax) for v in row] for row in t.loss]  # z[i][j]: lambda1 = lams[i] (y), lambda2 = lams[j] (x)
        mesh = ax.pcolormesh(e, e, z, cmap="viridis", vmin=0, vmax=vmax, shading="flat")
        pred = [[float(p) for p in row] for row in t.predicted]
        if any(map(any, t.predicted)):
            ax.contourf(lams, lams, pred, levels=[0.5, 1.5], hatches=["///"], colors="none")
            ax.contour(lams, lams, pred, levels=[0.5], colors="#ff4040", linewidths=1.4)
        small = [[float(v <= s.small_loss) for v in row] for row in t.loss]
        if any(map(any, small)):
            ax.contour(lams, lams, small, levels=[0.5], colors="white", linewidths=1.2)
        if t.closed_form is not None:
            ax.plot([t.closed_form[1]], [t.closed_form[0]], marker="x", color="#ff9f1c", ms=10, mew=2.5)
        ax.plot([0], [0], marker="o", color="black", ms=4)
        ax.set_xlim(e[0], e[-1]), ax.set_ylim(e[0], e[-1])
        g1, g2 = t.gammas
        ax.set_title(f"γ = ({g1:g}, {g2:g})" + (" — impossible" if t.impossible else ""), fontsize=10)
        ax.set_xlabel("λ2")
    axes[0].set_ylabel("λ1")
    fig.colorbar(mesh, ax=list(axes), label=f"target hinge loss (clipped at {vmax:g})", shrink=0.9)
    fig.suptitle(
        f"Out of domain: Ψ0 + λ1 ΔΨ1 + λ2 ΔΨ2 on μ' = γ1 μ1 + γ2 μ2 + κ μ⊥ (seed 004, Theorem 3, its Fig. 2)\n"
        f"Red hatched: (7) holds; white: loss ≤ {s.small_loss:g}; ×: closed form (75); ●: Ψ0",
        fontsize=10,
    )
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)


def plot_spectra(m: Measurements, s: ProvableSettings, path: Path, k: int = 6) -> None:
    """sigma_i^2 / sum sigma^2 of the first k singular values of every update, Delta W and Delta V."""
    import torch

    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), layout="constrained", sharey=True)
    for ax, key in zip(axes, ("W", "V")):
        for ft in m.finetunes:
            S = torch.linalg.svdvals(ft.delta[key].double())
            share = (S * S / (S * S).sum())[:k].tolist()
            ax.plot(range(1, len(share) + 1), share, marker="o", ms=3, alpha=0.75, label=ft.name)
        ax.axhline(s.energy_min, color="#ff4040", ls="--", lw=1, label=f"claim 5's bound {s.energy_min:g}")
        ax.set_yscale("log")
        ax.set_xlabel("singular value index i")
        ax.set_title(f"Δ{key} ({'d × d' if key == 'W' else 'm × d'})", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("σ_i² / Σσ²")
    axes[1].legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle("Spectra of the fine-tuning updates (Corollary 1: rank one per pattern)", fontsize=11)
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)


def plot_real(m: RealMeasurements, s: ProvableSettings, path: Path) -> None:
    """Test accuracy of Psi0 + dPsi1 + lambda dPsi2 on T1 and T2 over lambda, per pair (the seed's Fig. 1)."""
    plt = _pyplot()
    fig, axes = plt.subplots(
        1, len(m.pairs), figsize=(4.3 * len(m.pairs), 3.7), layout="constrained", sharey=True, squeeze=False
    )
    for ax, p in zip(axes[0], m.pairs):
        for acc, ft, colour_, name in (
            (p.acc1, p.finetuned1, "#1f77b4", f"T1 (r_o = {s.real_r_t1:g})"),
            (p.acc2, p.finetuned2, "#d62728", f"T2 (r_o = {p.r_o:g})"),
        ):
            ax.plot(m.lambdas, [100 * v for v in acc], marker="o", ms=3, color=colour_, label=name)
            ax.axhline(100 * ft, color=colour_, ls="--", lw=0.9)
            ax.axhspan(100 * ft - s.real_keep, 100 * ft, color=colour_, alpha=0.08, lw=0)
        ax.axhline(50, color="#999999", lw=0.8, ls=":")
        ax.axvline(0, color="#bbbbbb", lw=0.8, ls=":")
        ax.set_title(f"{p.relation}: α̂ = {p.alpha_hat:.3f} (seed {SEED_ALPHA[p.relation]:g})", fontsize=10)
        ax.set_xlabel("λ (Ψ = Ψ0 + ΔΨ1 + λ ΔΨ2)")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower left")
    axes[0][0].set_ylabel("test accuracy %")
    fig.suptitle(
        "Real digits coloured red / green (seed 004, Table 1 and Fig. 1): dashed, each fine-tuned model; band, within "
        f"{s.real_keep:g} points of it",
        fontsize=10,
    )
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)


def plot_real_ood(o: RealOod, path: Path) -> None:
    """T' test accuracy of Psi0 + lambda1 dPsi1 + lambda2 dPsi2 over the grid (the seed's Fig. 2 (A))."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.6, 4.6), layout="constrained")
    e = _edges(o.lambdas)
    mesh = ax.pcolormesh(
        e, e, [[100 * v for v in row] for row in o.acc], cmap="viridis", vmin=0, vmax=100, shading="flat"
    )
    (l1, l2), (b1, b2, _) = o.chosen(), o.test_best()
    ax.plot([0], [0], marker="o", color="black", ms=5, label="Ψ0")
    ax.plot([0, 1], [1, 0], ls="none", marker="s", mfc="none", mec="white", ms=8, label="Ψ*_T1 (1, 0), Ψ*_T2 (0, 1)")
    ax.plot([l2], [l1], marker="x", color="#ff9f1c", ms=10, mew=2.5, label="chosen on validation")
    ax.plot([b2], [b1], marker="+", color="#ff4040", ms=12, mew=2, label="best on test (the seed's choice)")
    ax.set_xlim(e[0], e[-1]), ax.set_ylim(e[0], e[-1])
    ax.set_xlabel("λ2"), ax.set_ylabel("λ1")
    ax.legend(fontsize=7, loc="lower left", framealpha=0.8)
    fig.colorbar(mesh, ax=ax, label="T' test accuracy %")
    ax.set_title(
        f"Out of domain on the real digits: r_o = {o.r_o[0]:g}, "
        f"{o.r_o[1]:g} → T' {o.r_o[2]:g}\n(seed 004, Table 2 and Fig. 2 (A))",
        fontsize=10,
    )
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)
