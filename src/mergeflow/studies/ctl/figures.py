"""Study ``ctl``'s figures (matplotlib, imported when drawing)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


ALPHA_COLOURS = {0.25: "#9ecae1", 0.5: "#3182bd", 0.75: "#08519c"}


def _ticks(ax, n_layers: int, names: Sequence[str] | None) -> None:
    ax.set_xticks(range(n_layers), list(names) if names else [f"block {L}" for L in range(n_layers)])


def _bars(
    ax,
    groups: Sequence[tuple[str, Sequence[Mapping[str, Any]], str, str]],
    title: str,
    names: Sequence[str] | None = None,
) -> None:
    """Per layer, one bar per group (label, layer summaries, key 'd' or 'baseline', colour), error bars the
    quartiles."""
    n_layers = len(groups[0][1])
    w = 0.8 / len(groups)
    for g, (label, layers, key, colour) in enumerate(groups):
        xs = [L + (g - (len(groups) - 1) / 2) * w for L in range(n_layers)]
        mid = [layers[L][key] for L in range(n_layers)]
        q = [layers[L][f"{key}_q"] for L in range(n_layers)]
        err = [[max(0.0, m - lo) for m, (lo, _, _) in zip(mid, q)], [max(0.0, hi - m) for m, (_, _, hi) in zip(mid, q)]]
        ax.bar(xs, mid, w, color=colour, label=label, yerr=err, capsize=2, error_kw={"lw": 0.8})
    positive = [v for _, layers, key, _ in groups for L in layers for v in (L[key], *L[f"{key}_q"]) if v > 0]
    if positive:
        ax.set_ylim(min(positive) / 3, max(positive) * 3)
    _ticks(ax, n_layers, names)
    # log scale: d is often orders of magnitude below its baseline, and both must stay readable
    ax.set_yscale("log")
    ax.set_ylabel("E[1 − cos], log scale (bars: mean; whiskers: quartiles)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, frameon=False)


def _boxes(
    ax, series: Sequence[tuple[str, Sequence[torch.Tensor], str]], title: str, names: Sequence[str] | None = None
) -> None:
    """Per layer, one box per series (label, per-layer coef tensors, colour)."""
    n_layers = len(series[0][1])
    w = 0.8 / len(series)
    for g, (label, per_layer, colour) in enumerate(series):
        pos = [L + (g - (len(series) - 1) / 2) * w for L in range(n_layers)]
        bp = ax.boxplot(
            [v.numpy() for v in per_layer], positions=pos, widths=w * 0.85, showfliers=False, patch_artist=True
        )
        for box in bp["boxes"]:
            box.set_facecolor(colour)
        ax.plot([], [], color=colour, lw=6, label=label)
    ax.axhline(1.0, color="#999999", ls=":", lw=1)
    _ticks(ax, n_layers, names)
    ax.set_ylabel("coef (box: quartiles; whiskers: 1.5 IQR)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, frameon=False)


def plot_ctl(per_alpha, coefs, n_pairs: int, path: Path, names: Sequence[str] | None = None) -> None:
    plt = _pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained")
    groups = [
        (f"α = {a:g}: 1 − cos(f(θα), αf(θi) + (1−α)f(θj))", L, "d", ALPHA_COLOURS.get(a, "#3182bd"))
        for a, L in per_alpha.items()
    ]
    groups.append(("baseline 1 − cos(f(θi), f(θj))", per_alpha[0.5], "baseline", "#bbbbbb"))
    _bars(a1, groups, f"Cross-task linearity (seed Fig. 2), {n_pairs} pairs, x in Di ∪ Dj", names)
    _boxes(
        a2,
        [(f"α = {a:g}", c, ALPHA_COLOURS.get(a, "#3182bd")) for a, c in coefs.items()],
        "coef = ‖f(θα)‖ cos / ‖αf(θi) + (1−α)f(θj)‖ (seed Fig. 3)",
        names,
    )
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_arithmetic(
    per_k, addition, negation, coefs, lam: float, path: Path, names: Sequence[str] | None = None
) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.6), layout="constrained")
    k_colours = ["#fdae6b", "#e6550d", "#a63603", "#7f2704"]
    groups = [(f"k = {k}: f(mean θ) vs mean f(θt)", L, "d", k_colours[n % 4]) for n, (k, L) in enumerate(per_k.items())]
    groups += [
        (f"k = {k}: baseline", L, "baseline", c)
        for (k, L), c in zip(per_k.items(), ["#d9d9d9", "#bdbdbd", "#969696", "#737373"])
    ]
    if per_k:
        _bars(axes[0, 0], groups, "Averaging k models (seed eq. 1, Fig. 5)", names)
        _boxes(
            axes[1, 0],
            [(f"k = {k}", c, k_colours[n % 4]) for n, (k, c) in enumerate(coefs["average"].items())],
            "coef, averaging (seed Fig. 6)",
            names,
        )
    _bars(
        axes[0, 1],
        [
            ("f(θ0 + λ(τi+τj)) vs ½f(θ0+2λτi) + ½f(θ0+2λτj)", addition, "d", "#31a354"),
            ("baseline 1 − cos(f(θ0+2λτi), f(θ0+2λτj))", addition, "baseline", "#bbbbbb"),
        ],
        f"Addition (seed eq. 2, Fig. 7), λ = {lam:g}",
        names,
    )
    _bars(
        axes[0, 2],
        [
            ("f(θ0) vs ½f(θ0+λτi) + ½f(θ0−λτi)", negation, "d", "#756bb1"),
            ("baseline 1 − cos(f(θ0+λτi), f(θ0−λτi))", negation, "baseline", "#bbbbbb"),
        ],
        f"Negation (seed eq. 3, Fig. 7), λ = {lam:g}",
        names,
    )
    _boxes(axes[1, 1], [("addition", coefs["addition"], "#31a354")], "coef, addition (seed Fig. 8)", names)
    _boxes(axes[1, 2], [("negation", coefs["negation"], "#756bb1")], "coef, negation (seed Fig. 8)", names)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_barrier(paths: Mapping[str, Mapping[float, float]], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), layout="constrained")
    for name, losses in paths.items():
        xs = sorted(losses)
        ax.plot(xs, [losses[a] for a in xs], marker="o", ms=3, lw=1, alpha=0.7, label=name)
    ax.set_xlabel("α  (θα = αθi + (1−α)θj; 0 is θj, 1 is θi)")
    ax.set_ylabel("loss on Di ∪ Dj (each example: its task's head)")
    ax.set_title("Loss along the linear path between fine-tuned models", fontsize=9)
    ax.grid(alpha=0.3)
    if len(paths) <= 10:
        ax.legend(fontsize=6, frameon=False)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_stitching(rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.6, 5.2), layout="constrained")
    kinds = [
        ("stitched ½f(θ0+λτi) + ½f(θ0+λτj)", "avg_i", "avg_j", "#d62728", "o"),
        ("stitched f(θ0+λτi)", "own_i", "other_j", "#1f77b4", "^"),
        ("stitched f(θ0+λτj)", "other_i", "own_j", "#2ca02c", "v"),
        ("θ0 + λ(τi + τj)", "ta_i", "ta_j", "#7f7f7f", "s"),
    ]
    for label, kx, ky, colour, marker in kinds:
        ax.scatter(
            [100 * r[kx] for r in rows],
            [100 * r[ky] for r in rows],
            color=colour,
            marker=marker,
            s=22,
            alpha=0.8,
            label=label,
        )
    ax.plot([0, 100], [0, 100], color="#cccccc", ls="--", lw=1)
    ax.set_xlabel("accuracy on Di (%)")
    ax.set_ylabel("accuracy on Dj (%)")
    ax.set_title(f"Stitching at block {rows[0]['layer']} into θ0 (seed Fig. 9), one point per pair", fontsize=9)
    ax.legend(fontsize=7, frameon=False, loc="lower left")
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_scratch(scratch, control, pipeline, coefs, pair, path: Path, names: Sequence[str] | None = None) -> None:
    plt = _pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained")
    groups = [
        ("from a random init", scratch, "d", "#e6550d"),
        ("fine-tuned from θ0, same schedule", control, "d", "#3182bd"),
        ("pipeline's fine-tuned models", pipeline, "d", "#9ecae1"),
        ("baseline, random init", scratch, "baseline", "#fdd0a2"),
        ("baseline, fine-tuned from θ0", control, "baseline", "#c6dbef"),
    ]
    _bars(a1, groups, f"{pair[0]} / {pair[1]} at α = 0.5: without pretraining (seed Fig. 11)", names)
    _boxes(
        a2,
        [(name, c, colour) for (name, c), colour in zip(coefs.items(), ["#e6550d", "#3182bd", "#9ecae1"])],
        "coef at α = 0.5",
        names,
    )
    fig.savefig(path, dpi=130)
    plt.close(fig)
