"""Study mima: its figures (cosines and accuracy against N, per-round cosines)."""

from __future__ import annotations

from pathlib import Path

from mergeflow.studies.mima.claims import series
from mergeflow.studies.mima.measure import PAPER_VIT_B32, ROLE_NAMES, MimaSettings, Point


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


COLOURS = {"ua": "#1f77b4", "ta": "#ff7f0e", "ties": "#2ca02c", "individual": "#444444"}


def plot_cosines(points: list[Point], s: MimaSettings, path: Path) -> bool:
    data = [(p, p.pairs()) for p in points if p.pairs()]
    if not data:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(min(max(4.8, 2.4 + 1.1 * len(data)), 12.0), 4.6), layout="constrained")
    values = [list(pairs.values()) for _, pairs in data]
    ax.boxplot(values, positions=range(len(data)), widths=0.55, showfliers=False, medianprops={"color": "black"})
    a, b = s.related_pair
    related_label = f"{a} / {b}"
    shown_related = False
    for x, (p, pairs) in enumerate(data):
        k = len(pairs)
        for j, (key, v) in enumerate(pairs.items()):
            related = set(key) == {a, b}
            dx = (j / max(k - 1, 1) - 0.5) * 0.3
            ax.scatter(
                x + dx,
                v,
                s=26 if related else 12,
                color="#d62728" if related else "#7f7f7f",
                zorder=3,
                alpha=1 if related else 0.6,
                label=related_label if related and not shown_related else None,
            )
            shown_related |= related
    lo, hi = s.n1_cosine_range
    ax.axhspan(lo, hi, color="#1f77b4", alpha=0.08, label=f"claim 1's N = 1 range [{lo:g}, {hi:g}]")
    ax.axhline(0, color="#999999", lw=0.8)
    ax.set_xticks(
        range(len(data)), [f"N = {p.n}" + ("\n(standard)" if p.source == "standard fine-tune" else "") for p, _ in data]
    )
    ax.set_xlabel("MIMA rounds N (same total steps)")
    ax.set_ylabel("pairwise cosine of task vectors τ_t")
    ax.set_title("Pairwise task-vector cosines per N\n(as the seed's Fig. 5; dots: the pairs)")
    fig.legend(loc="outside lower center", fontsize=8, frameon=False, ncol=2)
    fig.savefig(path, dpi=130, format="png")
    plt.close(fig)
    return True


def plot_accuracy(points: list[Point], path: Path) -> bool:
    """Accuracy against N, ours and the seed's Table 1 side by side, each on its own axis: the two sit tens of
    points apart, and one shared axis would flatten ours."""
    by_role = {
        role: series(points, (lambda p, r=role: p.individual_average if r == "individual" else p.accuracy.get(r)))
        for role in ("individual", "ua", "ta", "ties")
    }
    if not any(ns for ns, _ in by_role.values()):
        return False
    plt = _pyplot()
    fig, (ours, paper) = plt.subplots(1, 2, figsize=(11.0, 4.2), layout="constrained")
    for role, (ns, vs) in by_role.items():
        if ns:
            ours.plot(ns, [100 * v for v in vs], marker="o", color=COLOURS[role], label=ROLE_NAMES[role])
        pn = sorted(PAPER_VIT_B32)
        paper.plot(
            pn, [100 * PAPER_VIT_B32[n][role] for n in pn], marker="o", color=COLOURS[role], label=ROLE_NAMES[role]
        )
    for ax, ns, title in (
        (ours, {p.n for p in points}, "ours"),
        (paper, set(PAPER_VIT_B32), "the seed's Table 1 (ViT-B/32)"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(ns), [str(n) for n in sorted(ns)])
        ax.minorticks_off()
        ax.set_xlabel("MIMA rounds N (same total steps)")
        ax.set_ylabel("average test accuracy (%)")
        ax.set_title(f"Accuracy against N: {title}", loc="left")
        ax.grid(alpha=0.3)
    paper.legend(fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, dpi=130, format="png")
    plt.close(fig)
    return True


def plot_rounds(point: Point, s: MimaSettings, path: Path) -> bool:
    records = [r for r in point.rounds or [] if r.get("update_cosines") and r.get("task_vector_cosines")]
    if not records:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(min(2.0 + 0.9 * len(records), 12.0), 4.0), layout="constrained")
    xs = list(range(len(records)))
    upd = [list(r["update_cosines"].values()) for r in records]
    tv = [list(r["task_vector_cosines"].values()) for r in records]
    b1 = ax.boxplot(
        upd,
        positions=[x - 0.18 for x in xs],
        widths=0.3,
        showfliers=False,
        patch_artist=True,
        medianprops={"color": "black"},
    )
    b2 = ax.boxplot(
        tv,
        positions=[x + 0.18 for x in xs],
        widths=0.3,
        showfliers=False,
        patch_artist=True,
        medianprops={"color": "black"},
    )
    for box in b1["boxes"]:
        box.set_facecolor("#9ecae1")
    for box in b2["boxes"]:
        box.set_facecolor("#fdae6b")
    ax.axhspan(-s.update_cosine_bound, s.update_cosine_bound, color="#9ecae1", alpha=0.12)
    ax.axhline(0, color="#999999", lw=0.8)
    ax.set_xticks(xs, [str(r["round"]) for r in records])
    ax.set_xlabel(f"round i (N = {point.n})")
    ax.set_ylabel("pairwise cosine")
    ax.set_title(f"Per-round cosines, N = {point.n} (seed 001, Fig. 11)")
    ax.legend(
        [b1["boxes"][0], b2["boxes"][0]],
        ["updates δ_t(i)", "task vectors τ_t(i)"],
        loc="upper left",
        fontsize=8,
        frameon=False,
    )
    fig.savefig(path, dpi=130, format="png")
    plt.close(fig)
    return True
