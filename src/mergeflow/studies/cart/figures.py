"""Study ``cart``'s figures (matplotlib, imported when drawing)."""

from __future__ import annotations

import math
from pathlib import Path
from statistics import mean, stdev

from mergeflow.studies.cart.claims import layer_medians
from mergeflow.studies.cart.settings import NAMES, SCALING_METHODS
from mergeflow.studies.cart.spectra import LayerSpectra


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_rank_curve(ratios, sweep: dict, ta_full: float | None, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), layout="constrained")
    xs = [100 * r for r in ratios]
    ax.plot(xs, [100 * v for v in sweep["cart"]], marker="o", color="#ff7f0e", label="CART (centred, rank k)")
    ax.plot(xs, [100 * v for v in sweep["low_rank_ta"]], marker="s", color="#1f77b4", label="low-rank TA (rank k)")
    ax.axhline(100 * sweep["weight_averaging"], color="#444444", ls="--", lw=1, label="weight averaging")
    if ta_full is not None:
        ax.axhline(100 * ta_full, color="#1f77b4", ls=":", lw=1, label="task arithmetic (merge@task_arithmetic)")
    ax.set_xscale("symlog", linthresh=2)
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.minorticks_off()
    ax.set_xlabel("rank ratio k / min(m, n) (%)")
    ax.set_ylabel("average test accuracy (%)")
    ax.set_title("Accuracy against rank (seed 002, Fig. 1); λ chosen on validation")
    ax.legend(fontsize=8, frameon=False)
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_interference(layers: list[LayerSpectra], ratios, example: LayerSpectra, path: Path) -> None:
    plt = _pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
    xs = [100 * r for r in ratios]
    a1.plot(xs, example.i_original, marker="o", color="#1f77b4", label="original τ_t")
    a1.plot(xs, example.i_centred, marker="o", color="#ff7f0e", label="centred θ_t − θ_avg")
    a1.set_title(f"I(k), one layer: {example.key} (Fig. 2)")
    _, i_c, i_o = layer_medians(layers)
    for L in layers:
        a2.scatter(xs, L.i_original, s=10, color="#1f77b4", alpha=0.35)
        a2.scatter(xs, L.i_centred, s=10, color="#ff7f0e", alpha=0.35)
    a2.plot(xs, i_o, color="#1f77b4", label="original: median over layers")
    a2.plot(xs, i_c, color="#ff7f0e", label="centred: median over layers")
    a2.set_title(f"I(k), all {len(layers)} matrices (Fig. 8)")
    for ax in (a1, a2):
        ax.set_xscale("symlog", linthresh=2)
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        ax.minorticks_off()
        ax.set_xlabel("rank ratio (%)")
        ax.set_ylabel("row-space interference I(k)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, frameon=False)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_tradeoff(layers: list[LayerSpectra], ratios, example: LayerSpectra, knee: float, path: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
    xs = [100 * r for r in ratios]
    r_med, i_med, _ = layer_medians(layers)
    for ax, (title, r, i) in zip(
        axes,
        [(f"one layer: {example.key}", example.r_centred, example.i_centred), ("median over layers", r_med, i_med)],
    ):
        ax.plot(xs, r, marker="o", color="#2ca02c", label="R(k) / R(0)")
        ax.set_ylabel("R(k) / R(0) (centred)", color="#2ca02c")
        ax.set_ylim(0, 1.05)
        ax2 = ax.twinx()
        ax2.plot(xs, i, marker="s", color="#ff7f0e", label="I(k)")
        ax2.set_ylabel("I(k) (centred)", color="#ff7f0e")
        ax.axvline(100 * knee, color="#999999", ls=":", lw=1)
        ax.set_xlabel("rank ratio (%)")
        ax.set_title(f"R(k) and I(k), centred vectors (Fig. 3): {title}", fontsize=9)
        ax.grid(alpha=0.3)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_scaling(sizes, rows, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), layout="constrained")
    colours = {"weight_averaging": "#444444", "task_arithmetic": "#1f77b4", "ties": "#2ca02c", "cart": "#ff7f0e"}
    for j, m in enumerate(SCALING_METHODS):
        mu, se = [], []
        for size in sizes:
            v = [r[m] for r in rows if r["size"] == size]
            mu.append(100 * mean(v))
            se.append(100 * stdev(v) / math.sqrt(len(v)) if len(v) > 1 else 0.0)
        ax.errorbar(
            [x + 0.06 * (j - 1.5) for x in sizes], mu, yerr=se, marker="o", capsize=3, color=colours[m], label=NAMES[m]
        )
    ax.set_xticks(sizes)
    ax.set_xlabel("number of tasks T (random subsets)")
    ax.set_ylabel("normalized accuracy (%): merged / individual")
    ax.set_title("Scaling with T (seed 002, Fig. 7): mean ± s.e. over subsets")
    ax.legend(fontsize=8, frameon=False)
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_spectra(layers: list[LayerSpectra], rank_ratio: float, path: Path) -> None:
    plt = _pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
    for L in layers:
        r = min(L.shape)
        xs = [100 * i / r for i in range(r + 1)]
        a1.plot(xs, L.cumulative_centred, color="#ff7f0e", alpha=0.5, lw=1)
        a1.plot(xs, L.cumulative_original, color="#1f77b4", alpha=0.5, lw=1)
    a1.plot([], [], color="#ff7f0e", label="centred")
    a1.plot([], [], color="#1f77b4", label="original")
    a1.axvline(100 * rank_ratio, color="#999999", ls=":", lw=1)
    a1.set_xlabel("rank ratio (%)")
    a1.set_ylabel("fraction of ||·||_F² in the top k")
    a1.set_title("Cumulative energy of the task vectors, every matrix", fontsize=9)
    a1.legend(fontsize=8, frameon=False)
    a1.grid(alpha=0.3)
    idx = range(len(layers))
    w = 0.28
    a2.bar([i - w for i in idx], [100 * L.energy_original for L in layers], w, color="#1f77b4", label="original")
    a2.bar(list(idx), [100 * L.energy_centred for L in layers], w, color="#ff7f0e", label="centred")
    a2.bar(
        [i + w for i in idx],
        [100 * L.energy_gaussian for L in layers],
        w,
        color="#bbbbbb",
        label="Gaussian matrix, same shape",
    )
    a2.set_xticks(
        list(idx), [L.key.replace("blocks.", "b").replace(".weight", "") for L in layers], rotation=70, fontsize=7
    )
    a2.set_ylabel(f"energy in the top {100 * rank_ratio:g}% of the rank (%)")
    a2.set_title(f"Energy kept at CART's rank ({100 * rank_ratio:g}%), per layer", fontsize=9)
    a2.legend(fontsize=8, frameon=False)
    a2.grid(alpha=0.3, axis="y")
    fig.savefig(path, dpi=130)
    plt.close(fig)
