"""Study ``gradients``' figures (matplotlib, imported when drawing)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_minibatch(cosines: Mapping[int, Mapping[str, float]], sign_cos: Mapping[str, float], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.6, 3.8))
    steps = sorted(cosines)
    tasks = list(cosines[steps[0]])
    for t in tasks:
        ax.plot(steps, [cosines[s][t] for s in steps], marker="o", lw=1, alpha=0.7, label=t)
    ax.plot(
        steps, [sum(cosines[s].values()) / len(tasks) for s in steps], color="black", lw=2.2, marker="s", label="mean"
    )
    ax.axhline(sum(sign_cos.values()) / len(sign_cos), color="grey", ls="--", lw=1, label="mean cos(sign g, g)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(steps, [str(s) for s in steps])
    ax.set_xlabel("AdamW steps in the one epoch")
    ax.set_ylabel("cos(tau_t(1), -grad L_t(theta0))")
    ax.set_title("One-epoch task vector vs. full-batch gradient (claim 4)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=130, format="png")
    plt.close(fig)


def plot_trajectory(per_task: Mapping[str, Mapping[str, list[float]]], threshold: float, path: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    for t, u in per_task.items():
        k = list(range(1, len(u["update_norms"]) + 1))
        total = sum(u["update_norms"])
        axes[0].plot(k, [n / total for n in u["update_norms"]], marker="o", label=t)
        axes[1].plot(k, u["cos_first"], marker="o", label=t)
        axes[2].plot(k, u["tau_norms"], marker="o", label=t)
    axes[1].axhline(threshold, color="grey", ls="--", lw=1)
    titles = ("‖g_k‖ / sum_j ‖g_j‖", "cos(g_1, g_k)", "‖tau(k)‖ = ‖theta(k) - theta0‖")
    for ax, title in zip(axes, titles):
        ax.set_xlabel("epoch k")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Per-epoch updates g_k = theta(k) - theta(k-1) under the pipeline's fine-tune (claim 5)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130, format="png")
    plt.close(fig)


def plot_gaps(gaps: Mapping[float, list[dict[str, float]]], slope: float, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.2, 3.8))
    etas = sorted(gaps)
    k = len(gaps[etas[0]])
    for j in range(1, k):
        ys = [gaps[e][j]["gap"] for e in etas]
        ax.plot(etas, ys, marker="o", label=f"‖theta_TA - theta_MT‖, epoch {j + 1}")
    ref = [gaps[etas[0]][-1]["gap"] * (e / etas[0]) ** 2 for e in etas]  # through the smallest eta's gap
    ax.plot(etas, ref, color="grey", ls="--", label="slope 2")
    ax.plot(etas, [gaps[e][-1]["mt_step"] for e in etas], color="black", ls=":", label="‖theta_MT - theta0‖ (slope 1)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("step size eta")
    ax.set_title(f"TA vs multi-task GD after k epochs (claim 3): slope {slope:.2f}", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130, format="png")
    plt.close(fig)
