"""Every plot the pipeline draws: accuracy per method and task (heatmap and sorted averages), each merge method's
search on validation, and the task vectors' cosine similarities. matplotlib is imported inside the functions (Agg
backend) so that importing mergeflow stays light; what a merge plot shows is computed by ``search_panels``, a pure
function the tests check."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

# the reference rows of summary.summary_rows (a test checks the names agree): the pretrained one says which head
# reads it, "Pretrained (linear probe)", "(zero-shot)" or "(answer words)"
PRETRAINED = "Pretrained (linear probe)"
INDIVIDUAL = "Individual"
COSINE_SCALE_FLOOR = 0.25  # the cosine heatmap's smallest half-range


def is_reference(name: str) -> bool:
    return name == INDIVIDUAL or is_pretrained(name)


def is_pretrained(name: str) -> bool:
    return name.startswith("Pretrained (")


def is_not_merged(name: str) -> bool:
    """A registered method's row that is no merge (an ensemble keeps and runs every task's model: ``merged=False``);
    a regime's row carries its variant after a space ("simple_ensemble (mima_n4)")."""
    from mergeflow.ml.merging import REGISTRY

    spec = REGISTRY.get(name.split(" ")[0])
    return spec is not None and not spec.merged


def is_baseline(name: str) -> bool:
    """A row shown beside the merges and not ranked among them: the pretrained and individual models, the ensembles."""
    return is_reference(name) or is_not_merged(name)


DPI = 130
FONT_SIZE = 10  # matplotlib's default; annotations use 9, nothing is under 8
CHOSEN_COLOR = "#d62728"


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path) -> None:
    # format given: the stages write to a temporary name without the .png suffix
    fig.savefig(path, dpi=DPI, format="png")
    import matplotlib.pyplot as plt

    plt.close(fig)


def pct(fraction: float) -> float:
    return 100.0 * fraction


def shown(value: Any) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def chosen_text(searched: Mapping[str, Any]) -> str:
    return ", ".join(f"{k} per task" if isinstance(v, Mapping) else f"{k} = {shown(v)}" for k, v in searched.items())


# ---------------------------------------------------------------- summary: accuracy per method and task
def sorted_methods(rows: list[dict]) -> list[str]:
    """The merges (baseline rows aside) by average accuracy, best first; ties keep the rows' order."""
    methods = [r for r in rows if not is_baseline(r["method"])]
    return [r["method"] for r in sorted(methods, key=lambda r: -r["average"])]


def sorted_not_merged(rows: list[dict]) -> list[str]:
    """The ensembles' rows (is_not_merged) by average accuracy, best first."""
    return [r["method"] for r in sorted(rows, key=lambda r: -r["average"]) if is_not_merged(r["method"])]


def points_above_pretrained(rows: list[dict], column: str) -> list[float]:
    """Each row's value in ``column`` minus the Pretrained row's, in points (the column's median when there is no
    Pretrained row): the accuracy heatmap's colour, diverging at 0."""
    values = [r[column] for r in rows]
    reference = next((r[column] for r in rows if is_pretrained(r["method"])), sorted(values)[len(values) // 2])
    return [100 * (v - reference) for v in values]


def _unit(measure: str) -> str:
    return "(%)" if measure == "accuracy" else "(×100: each task's own metric)"


def plot_accuracy_heatmap(rows: list[dict], tasks: list[str], path, measure: str = "accuracy") -> list[str]:
    """Test accuracy (%) of every method on every task and on average, methods sorted by average (best on top)
    between the reference rows Individual and the ensembles (top) and Pretrained (bottom); ``measure``: "score"
    when the tasks have other metrics (text: GLUE's). Returns the rows' order, top to bottom."""
    plt = pyplot()
    from matplotlib.colors import Normalize

    by_name = {r["method"]: r for r in rows}
    top = [n for n in (INDIVIDUAL,) if n in by_name] + sorted_not_merged(rows)
    order = top + sorted_methods(rows) + [n for n in by_name if is_pretrained(n)]
    drawn = [by_name[n] for n in order]
    columns = [*tasks, "average"]
    # colour: points above (blue) or below (red) the pretrained model on that task, white at it, the scale
    # symmetric over the table's range; a merge or an individual model below the pretrained model shows red
    shades = [points_above_pretrained(drawn, c) for c in columns]
    colour = [[shades[j][i] for j in range(len(columns))] for i in range(len(drawn))]
    span = max((abs(v) for row in colour for v in row), default=0.0) or 1.0

    n_rows, n_cols = len(drawn), len(columns)
    # wide enough for the title and the x label however few the columns
    fig, ax = plt.subplots(figsize=(max(8.5, 3.2 + 0.95 * n_cols), max(3.5, 1.9 + 0.36 * n_rows)), layout="constrained")
    cmap, norm = plt.get_cmap("RdBu"), Normalize(-span, span)
    image = ax.imshow(colour, cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
    for i, r in enumerate(drawn):
        for j, c in enumerate(columns):
            # white text on the saturated ends, black near the centre
            text_colour = "white" if abs(colour[i][j]) > 0.6 * span else "black"
            weight = "bold" if c == "average" else "normal"
            ax.text(
                j, i, f"{pct(r[c]):.1f}", ha="center", va="center", color=text_colour, fontsize=9, fontweight=weight
            )
    # task names above the columns, where the eye starts; slanted so long names do not collide
    ax.xaxis.tick_top()
    ax.set_xticks(range(n_cols), columns, rotation=30, ha="left", rotation_mode="anchor")
    ax.set_yticks(range(n_rows), order)
    for label in ax.get_yticklabels():
        if is_baseline(label.get_text()):
            label.set_fontstyle("italic")
            label.set_fontweight("bold")
    ax.get_xticklabels()[-1].set_fontweight("bold")
    # grey rules set the reference rows and the average column apart (white would vanish into the scale's centre)
    if top:
        ax.axhline(len(top) - 0.5, color="0.35", lw=2)
    if order and is_pretrained(order[-1]):
        ax.axhline(n_rows - 1.5, color="0.35", lw=2)
    ax.axvline(n_cols - 1.5, color="0.35", lw=2)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    bar = fig.colorbar(image, ax=ax, fraction=0.04, pad=0.02)
    bar.set_label("points above the pretrained model (0: at it)")
    ax.set_xlabel(
        f"numbers: test {measure} {_unit(measure)}, each task with its own head\ncolour: points above (blue) or below "
        "(red) the pretrained model on that task"
    )
    ax.set_title(f"Test {measure} {_unit(measure)} per method and task, sorted by average", loc="left")
    save(fig, path)
    return order


def plot_averages(rows: list[dict], path, measure: str = "accuracy") -> list[str]:
    """Average test accuracy (%) of every method as sorted horizontal bars (best on top), the ensembles' grey bars
    above the merges', with Pretrained and Individual as labelled reference lines. Returns the methods' order, top to
    bottom."""
    plt = pyplot()

    by_name = {r["method"]: r for r in rows}
    order = sorted_not_merged(rows) + sorted_methods(rows)
    values = [pct(by_name[m]["average"]) for m in order]
    references = {n: pct(by_name[n]["average"]) for n in by_name if is_reference(n)}

    fig, ax = plt.subplots(figsize=(8.5, 1.6 + 0.32 * max(len(order), 1)), layout="constrained")
    positions = list(range(len(order)))[::-1]  # best on top
    from mergeflow.ml.merging import DATA

    # test-time adaptation (reads the test inputs) in its own colour: not comparable with the others; the
    # ensembles (no merge: every task's model run) in grey
    kinds = [
        "ensemble" if is_not_merged(m) else "adapted" if by_name[m].get("data") == DATA["test_inputs"] else "merge"
        for m in order
    ]
    colours = {"ensemble": "#8c8c8c", "adapted": "#dd8452", "merge": "#4c72b0"}
    ax.barh(positions, values, height=0.7, color=[colours[k] for k in kinds])
    labels = {"ensemble": "not merged: every task's model run", "adapted": f"reads {DATA['test_inputs']}"}
    if shown_kinds := [k for k in labels if k in kinds]:
        from matplotlib.patches import Patch

        ax.legend(
            handles=[Patch(color=colours[k], label=labels[k]) for k in shown_kinds], loc="lower right", frameon=False
        )
    # values inside the bars' ends, where no reference line crosses them
    for y, v in zip(positions, values):
        ax.text(v - 0.2, y, f"{v:.1f}", ha="right", va="center", color="white", fontsize=9, fontweight="bold")
    ax.set_yticks(positions, order)
    for label in ax.get_yticklabels():
        if is_not_merged(label.get_text()):
            label.set_fontstyle("italic")
    ax.set_ylim(-0.7, len(order) - 0.3)
    # start near the lowest value: a full 0-100 axis would hide the differences between methods
    everything = values + list(references.values())
    low = min(everything, default=0.0)
    high = max(everything, default=100.0)
    left = max(0.0, 5 * math.floor((low - 3) / 5))
    ax.set_xlim(left, high + 0.12 * (high - left) + 1)
    # each label on the outer side of its line (Pretrained to the left, Individual to the right): they never meet
    for name, v in references.items():
        colour, style, side = ("#2ca02c", "--", "left") if name == INDIVIDUAL else ("#7f7f7f", ":", "right")
        ax.axvline(v, color=colour, ls=style, lw=2)
        ax.text(
            v,
            1.0,
            f" {name}: {v:.1f} ",
            transform=ax.get_xaxis_transform(),
            ha=side,
            va="bottom",
            color=colour,
            fontsize=9,
            fontweight="bold",
        )
    ax.set_xlabel(f"average test {measure} {_unit(measure)} over tasks (axis starts at {left:g})")
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    ax.set_title(f"Average test {measure} per method", loc="left", pad=22)
    save(fig, path)
    return order


# ---------------------------------------------------------------- task vectors
def plot_cosine_heatmap(stats: dict, path) -> None:
    """Cosine similarity of every pair of task vectors; the colour scale is centred at 0 and spans the off-diagonal
    values (at least +-COSINE_SCALE_FLOOR), and the diagonal (always 1) is drawn grey so that it does not saturate
    the scale."""
    plt = pyplot()
    import numpy as np

    tasks, cos = stats["tasks"], stats["cosine"]
    n = len(tasks)
    off_diagonal = np.ma.masked_array(cos, mask=np.eye(n, dtype=bool))
    # centred at 0 (orthogonal), the scale at least +-COSINE_SCALE_FLOOR: near-orthogonal vectors (cosines of a
    # few hundredths, as task vectors usually are) stay pale instead of taking the whole colour range
    vmax = max(float(abs(off_diagonal).max()) if n > 1 else 0.0, COSINE_SCALE_FLOOR)
    cmap = plt.get_cmap("RdBu_r").with_extremes(bad="#d9d9d9")
    fig, ax = plt.subplots(figsize=(2.6 + 0.8 * n, 1.6 + 0.7 * n), layout="constrained")
    image = ax.imshow(off_diagonal, cmap=cmap, vmin=-vmax, vmax=vmax)
    for i in range(n):
        for j in range(n):
            strong = i != j and abs(cos[i][j]) > 0.6 * vmax
            ax.text(
                j, i, f"{cos[i][j]:.2f}", ha="center", va="center", fontsize=9, color="white" if strong else "black"
            )
    ax.set_xticks(range(n), tasks, rotation=45, ha="right", rotation_mode="anchor")
    ax.set_yticks(range(n), tasks)
    ax.set_title("Task-vector cosine similarity (whole vectors)")
    fig.colorbar(image, ax=ax, fraction=0.046, label=f"cosine similarity (scale ±{vmax:.2g})")
    save(fig, path)


# ---------------------------------------------------------------- learned coefficients (AdaMerging)
def _block_ticks(names: list[str]) -> tuple[list[float], list[str]]:
    """One tick per group of tensors sharing their first two name parts (blocks.3, patch_embed.proj, ...)."""
    groups: list[tuple[str, list[int]]] = []
    for i, name in enumerate(names):
        parts = name.split(".")
        group = ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]
        if not groups or groups[-1][0] != group:
            groups.append((group, []))
        groups[-1][1].append(i)
    return [(idx[0] + idx[-1]) / 2 for _, idx in groups], [g for g, _ in groups]


def plot_learned_coefficients(merge_metrics: dict, path) -> None:
    """A learned merge (``merge_metrics["learned"]``): its coefficients lambda per task (and tensor, layer-wise),
    the singular components each task kept per matrix where it learned masks (AdaRank: ``learned["kept"]``) and the
    mean prediction entropy per task over the adaptation steps."""
    plt = pyplot()
    import numpy as np

    learned = merge_metrics["learned"]
    coefficients = learned["coefficients"]
    tasks = list(coefficients)
    names = list(coefficients[tasks[0]])
    values = np.array([[coefficients[t][n] for n in names] for t in tasks])
    if "kept" in learned:
        fig, (left, middle, right) = plt.subplots(
            1, 3, figsize=(19, 4.8), layout="constrained", width_ratios=[2.2, 1.6, 1]
        )
        _plot_kept(fig, middle, learned["kept"])
    else:
        fig, (left, right) = plt.subplots(1, 2, figsize=(13.5, 4.8), layout="constrained", width_ratios=[2.2, 1])
    base = f"its base ({learned['base']}): " if "base" in learned else ""  # Surgery: the λ are its base merge's
    if learned["layer_wise"]:
        _by_tensor(fig, left, values, tasks, names, "tensor", "λ (task, tensor)", cmap="viridis", fraction=0.04)
        left.set_title(f"{base}learned λ per task and tensor")
    else:
        left.barh(range(len(tasks)), values[:, 0], color="#4c72b0")
        left.set_yticks(range(len(tasks)), tasks)
        left.invert_yaxis()
        left.set_xlabel(learned.get("coefficient", "λ") + " (task)")
        left.set_title(f"{base}learned {learned.get('coefficient', 'λ')} per task")
    entropy = learned["entropy"]
    right.plot(range(1, len(entropy) + 1), entropy, color="#999999", lw=0.8, label="per step")
    window = max(1, len(entropy) // 20)
    if window > 1:
        smooth = np.convolve(entropy, np.ones(window) / window, mode="valid")
        right.plot(range(window, len(entropy) + 1), smooth, color="#c44e52", lw=2, label=f"mean of {window} steps")
    right.set_xlabel("adaptation step")
    what = learned.get("objective", "entropy")  # FW-Merging records its cross-entropy, Surgery its L1 distance
    right.set_ylabel(f"mean {what} per task ({learned['split']} inputs, {learned.get('unit', 'nats')})")
    right.set_title(f"{what} minimised")
    right.legend(frameon=False)
    fig.suptitle(f"{merge_metrics['method']}: validation average {pct(merge_metrics['val_average']):.1f}%")
    save(fig, path)


def _by_tensor(
    fig, ax, values, rows: list[str], names: list[str], what: str, label: str, *, cmap: str, fraction: float, norm=None
) -> None:
    """A heatmap of ``values`` [rows, names], the names ticked by block (``_block_ticks``), with its colour bar."""
    image = ax.imshow(values, aspect="auto", cmap=cmap, interpolation="nearest", norm=norm)
    ticks, labels = _block_ticks(names)
    ax.set_xticks(ticks, labels, rotation=45, ha="right", rotation_mode="anchor", fontsize=8)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel(f"{what} ({len(names)}, by name)")
    fig.colorbar(image, ax=ax, fraction=fraction, label=label)


def _plot_kept(fig, ax, kept: dict) -> None:
    """Components kept per task (rows; AdaRank on Iso-CTS adds its common subspace) and matrix (columns)."""
    import numpy as np
    from matplotlib.colors import SymLogNorm

    rows = list(kept)
    matrices = list(kept[rows[0]])
    counts = np.array([[kept[r][m] for m in matrices] for r in rows])
    # log-like: a common subspace keeps ~30x a task's columns; 0 (a matrix a task dropped whole) stays readable
    norm = SymLogNorm(linthresh=1, vmin=0, vmax=max(1, int(counts.max())), base=10)
    _by_tensor(
        fig, ax, counts, rows, matrices, "matrix", "singular components kept", cmap="magma", fraction=0.05, norm=norm
    )
    ax.set_title(f"singular components kept per matrix ({int(counts.sum()):,} in all)")
