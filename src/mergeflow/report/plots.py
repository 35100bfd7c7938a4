"""Every plot the pipeline draws: accuracy per method and task (heatmap and sorted averages), each merge method's
search on validation, and the task vectors' cosine similarities. matplotlib is imported inside the functions (Agg
backend) so that importing mergeflow stays light; what a merge plot shows is computed by ``search_panels``, a pure
function the tests check."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# the reference rows of summary.summary_rows (a test checks the names agree)
PRETRAINED = "Pretrained (linear probe)"
INDIVIDUAL = "Individual"
REFERENCES = (INDIVIDUAL, PRETRAINED)

DPI = 130
FONT_SIZE = 10  # matplotlib's default; annotations use 9, nothing is under 8
CHOSEN_COLOR = "#d62728"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path) -> None:
    # format given: the stages write to a temporary name without the .png suffix
    fig.savefig(path, dpi=DPI, format="png")
    import matplotlib.pyplot as plt

    plt.close(fig)


def _pct(fraction: float) -> float:
    return 100.0 * fraction


def _shown(value: Any) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def _chosen_text(searched: Mapping[str, Any]) -> str:
    return ", ".join(f"{k} per task" if isinstance(v, Mapping) else f"{k} = {_shown(v)}" for k, v in searched.items())


# ---------------------------------------------------------------- summary: accuracy per method and task
def sorted_methods(rows: list[dict]) -> list[str]:
    """The methods (reference rows aside) by average accuracy, best first; ties keep the rows' order."""
    methods = [r for r in rows if r["method"] not in REFERENCES]
    return [r["method"] for r in sorted(methods, key=lambda r: -r["average"])]


def _gap_closed(rows: list[dict], column: str) -> list[float]:
    """Each row's value in ``column`` as the share of the Pretrained-to-Individual gap it closes (0: Pretrained,
    1: Individual); min-to-max instead when a reference row is missing or there is no gap."""
    by_name = {r["method"]: r[column] for r in rows}
    low, high = by_name.get(PRETRAINED), by_name.get(INDIVIDUAL)
    if low is None or high is None or high <= low:
        values = [r[column] for r in rows]
        low, high = min(values), max(values)
    return [(r[column] - low) / (high - low) if high > low else 0.5 for r in rows]


def plot_accuracy_heatmap(rows: list[dict], tasks: list[str], path) -> list[str]:
    """Test accuracy (%) of every method on every task and on average, methods sorted by average (best on top)
    between the reference rows Individual (top) and Pretrained (bottom). Returns the rows' order, top to bottom."""
    plt = _pyplot()
    from matplotlib.colors import Normalize

    by_name = {r["method"]: r for r in rows}
    order = [n for n in (INDIVIDUAL,) if n in by_name] + sorted_methods(rows) + [n for n in (PRETRAINED,) if n in by_name]
    drawn = [by_name[n] for n in order]
    columns = [*tasks, "average"]
    # colour per column: tasks differ in difficulty (a 55% can be good on one task and poor on another), so each
    # column is scaled from Pretrained to Individual; the numbers are the absolute accuracies
    shades = [_gap_closed(drawn, c) for c in columns]
    colour = [[shades[j][i] for j in range(len(columns))] for i in range(len(drawn))]

    n_rows, n_cols = len(drawn), len(columns)
    # wide enough for the title and the x label however few the columns
    fig, ax = plt.subplots(figsize=(max(8.5, 3.2 + 0.95 * n_cols), max(3.5, 1.9 + 0.36 * n_rows)), layout="constrained")
    cmap, norm = plt.get_cmap("viridis"), Normalize(0.0, 1.0)
    image = ax.imshow(colour, cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
    for i, r in enumerate(drawn):
        for j, c in enumerate(columns):
            # dark text on the light end of viridis, white on the dark end
            text_colour = "black" if norm(colour[i][j]) > 0.6 else "white"
            weight = "bold" if c == "average" else "normal"
            ax.text(j, i, f"{_pct(r[c]):.1f}", ha="center", va="center", color=text_colour, fontsize=9, fontweight=weight)
    # task names above the columns, where the eye starts; slanted so long names do not collide
    ax.xaxis.tick_top()
    ax.set_xticks(range(n_cols), columns, rotation=30, ha="left", rotation_mode="anchor")
    ax.set_yticks(range(n_rows), order)
    for label in ax.get_yticklabels():
        if label.get_text() in REFERENCES:
            label.set_fontstyle("italic")
            label.set_fontweight("bold")
    ax.get_xticklabels()[-1].set_fontweight("bold")
    # white rules set the reference rows and the average column apart
    if order and order[0] == INDIVIDUAL:
        ax.axhline(0.5, color="white", lw=4)
    if order and order[-1] == PRETRAINED:
        ax.axhline(n_rows - 1.5, color="white", lw=4)
    ax.axvline(n_cols - 1.5, color="white", lw=4)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    bar = fig.colorbar(image, ax=ax, fraction=0.04, pad=0.02, ticks=[0, 0.5, 1])
    bar.ax.set_yticklabels(["Pretrained", "half-way", "Individual"])
    ax.set_xlabel("numbers: test accuracy (%), each task with its own head\ncolour: each column scaled from Pretrained to Individual")
    ax.set_title("Test accuracy (%) per method and task, sorted by average", loc="left")
    _save(fig, path)
    return order


def plot_averages(rows: list[dict], path) -> list[str]:
    """Average test accuracy (%) of every method as sorted horizontal bars (best on top), with Pretrained and
    Individual as labelled reference lines. Returns the methods' order, top to bottom."""
    plt = _pyplot()

    by_name = {r["method"]: r for r in rows}
    order = sorted_methods(rows)
    values = [_pct(by_name[m]["average"]) for m in order]
    references = {n: _pct(by_name[n]["average"]) for n in REFERENCES if n in by_name}

    fig, ax = plt.subplots(figsize=(8.5, 1.6 + 0.32 * max(len(order), 1)), layout="constrained")
    positions = list(range(len(order)))[::-1]  # best on top
    from mergeflow.ml.merging import DATA

    # test-time adaptation (reads the test inputs) in its own colour: not comparable with the others
    adapted = [by_name[m].get("data") == DATA["test_inputs"] for m in order]
    ax.barh(positions, values, height=0.7, color=["#dd8452" if a else "#4c72b0" for a in adapted])
    if any(adapted):
        from matplotlib.patches import Patch

        ax.legend(handles=[Patch(color="#dd8452", label=f"reads {DATA['test_inputs']}")], loc="lower center", frameon=False)
    # values inside the bars' ends, where no reference line crosses them
    for y, v in zip(positions, values):
        ax.text(v - 0.2, y, f"{v:.1f}", ha="right", va="center", color="white", fontsize=9, fontweight="bold")
    ax.set_yticks(positions, order)
    ax.set_ylim(-0.7, len(order) - 0.3)
    # start near the lowest value: a full 0-100 axis would hide the differences between methods
    everything = values + list(references.values())
    low = min(everything, default=0.0)
    high = max(everything, default=100.0)
    left = max(0.0, 5 * math.floor((low - 3) / 5))
    ax.set_xlim(left, high + 0.12 * (high - left) + 1)
    # each label on the outer side of its line (Pretrained to the left, Individual to the right): they never meet
    styles = {INDIVIDUAL: ("#2ca02c", "--", "left"), PRETRAINED: ("#7f7f7f", ":", "right")}
    for name, v in references.items():
        colour, style, side = styles[name]
        ax.axvline(v, color=colour, ls=style, lw=2)
        ax.text(v, 1.0, f" {name}: {v:.1f} ", transform=ax.get_xaxis_transform(), ha=side, va="bottom", color=colour, fontsize=9, fontweight="bold")
    ax.set_xlabel(f"average test accuracy (%) over tasks (axis starts at {left:g})")
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    ax.set_title("Average test accuracy per method", loc="left", pad=22)
    _save(fig, path)
    return order


# ---------------------------------------------------------------- merge: the search on validation
@dataclass(frozen=True)
class GridCurve:
    """Validation average (%) against the one searched hyperparameter."""

    key: str
    values: list
    averages: list[float]
    chosen: Any
    chosen_average: float


@dataclass(frozen=True)
class GridHeatmap:
    """Validation average (%) over two searched hyperparameters; with more, each cell is the best over the rest."""

    x_key: str
    x_values: list
    y_key: str
    y_values: list
    averages: list[list[float]]  # [y index][x index]; nan where the grid has no point
    chosen: tuple[int, int]  # (y index, x index)
    chosen_average: float
    best_over: list[str]  # searched hyperparameters folded into each cell (their best)


@dataclass(frozen=True)
class PerTaskCurves:
    """A hyperparameter chosen per task on that task's validation split (TALL masks' lambda_t): accuracy (%) of each
    task against it."""

    key: str
    values: list
    accuracies: dict[str, list[float]]
    chosen: dict[str, Any]
    chosen_accuracy: dict[str, float]


@dataclass(frozen=True)
class OneSetting:
    """No search: the validation accuracy (%) of the one setting, per task."""

    accuracies: dict[str, float]
    average: float


@dataclass(frozen=True)
class NegationCurves:
    """One negated task: target and control validation accuracy (%) against lam, lam = 0 being the pretrained model."""

    task: str
    lams: list[float]
    target: list[float]
    control: list[float]
    control_floor: float  # control_floor x the pretrained model's control accuracy, in %
    chosen_lam: float
    chosen_target: float
    chosen_control: float


def _numeric(values) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def _negation_panels(merge_metrics: Mapping) -> list[NegationCurves]:
    floor = merge_metrics["hyperparameters"].get("control_floor", 0.95)
    pretrained = merge_metrics["pretrained_val_accuracy"]
    panels = []
    for task, result in merge_metrics["per_task"].items():
        others = [t for t in pretrained if t != task]
        base_control = sum(pretrained[t] for t in others) / len(others)
        curve = [{"lam": 0.0, "target": pretrained[task], "control": base_control}, *result["curve"]]
        chosen = result["chosen"]
        panels.append(
            NegationCurves(
                task,
                [c["lam"] for c in curve],
                [_pct(c["target"]) for c in curve],
                [_pct(c["control"]) for c in curve],
                _pct(floor * base_control),
                chosen["lam"],
                _pct(chosen["target"]),
                _pct(chosen["control"]),
            )
        )
    return panels


def _grid_panel(merge_metrics: Mapping, searched_keys: list[str]) -> GridCurve | GridHeatmap:
    curve, searched = merge_metrics["val_curve"], merge_metrics["searched"]
    grid = merge_metrics["grid"]
    if len(searched_keys) == 1:
        key = searched_keys[0]
        return GridCurve(key, [r["hyperparameters"][key] for r in curve], [_pct(r["average"]) for r in curve], searched[key], _pct(merge_metrics["val_average"]))
    # the two with the most values span the heatmap (the first-listed on ties); the rest are folded in
    by_size = sorted(searched_keys, key=lambda k: -len(grid[k]))
    x_key, y_key = by_size[0], by_size[1]
    x_values, y_values = list(grid[x_key]), list(grid[y_key])
    cells = [[math.nan] * len(x_values) for _ in y_values]
    for r in curve:
        hp = r["hyperparameters"]
        i, j = y_values.index(hp[y_key]), x_values.index(hp[x_key])
        cells[i][j] = max(_pct(r["average"]), cells[i][j]) if not math.isnan(cells[i][j]) else _pct(r["average"])
    chosen = (y_values.index(searched[y_key]), x_values.index(searched[x_key]))
    return GridHeatmap(x_key, x_values, y_key, y_values, cells, chosen, _pct(merge_metrics["val_average"]), by_size[2:])


def _per_task_panel(key: str, curves: Mapping[str, Mapping[str, float]], chosen: Mapping[str, Any]) -> PerTaskCurves:
    labels = list(next(iter(curves.values())))  # the values as str() wrote them (JSON keys)
    try:
        labels = sorted(labels, key=float)
        values, as_value = [float(v) for v in labels], float
    except ValueError:
        values, as_value = labels, str
    accuracies = {t: [_pct(c[label]) for label in labels] for t, c in curves.items()}
    chosen_accuracy = {t: _pct(curves[t][str(chosen[t])]) for t in curves}
    return PerTaskCurves(key, values, accuracies, {t: as_value(chosen[t]) for t in curves}, chosen_accuracy)


def search_panels(merge_metrics: Mapping) -> list:
    """What ``plot_merge_search`` draws for one method's ``metrics/merge/<method>.json``: negation, one panel per
    task; otherwise a curve (one searched hyperparameter) or a heatmap (two or more), then one panel per
    hyperparameter chosen per task, and, with neither, the one setting's accuracy per task."""
    if merge_metrics["kind"] == "negation":
        return _negation_panels(merge_metrics)
    # a grid of one value fixes that hyperparameter: nothing was searched over it
    searched_keys = [k for k, v in merge_metrics["grid"].items() if len(v) > 1]
    panels: list = [_grid_panel(merge_metrics, searched_keys)] if searched_keys else []
    for key, curves in (merge_metrics.get("per_task_curves") or {}).items():
        if curves:
            panels.append(_per_task_panel(key, curves, merge_metrics["searched"][key]))
    if not panels:
        accuracies = {t: _pct(a) for t, a in merge_metrics["val_accuracy"].items()}
        panels.append(OneSetting(accuracies, _pct(merge_metrics["val_average"])))
    return panels


def uses_log_scale(values: list) -> bool:
    """Positive numbers spanning more than a decade: on a linear axis the small ones would crowd together."""
    return bool(values) and _numeric(values) and min(values) > 0 and max(values) / min(values) > 10


def _x(values: list, value) -> float:
    """Where ``value`` sits on a hyperparameter's axis: itself if the values are numbers, else its place."""
    return value if _numeric(values) else values.index(value)


def _set_hyperparameter_axis(ax, values: list, key: str) -> None:
    """The searched values as ticks, on a log scale when ``uses_log_scale``."""
    ax.set_xlabel(key)
    if uses_log_scale(values):
        ax.set_xscale("log")
        ax.minorticks_off()
    ax.set_xticks([_x(values, v) for v in values], [_shown(v) for v in values], rotation=45 if len(values) > 6 else 0)


def _draw_curve(ax, panel: GridCurve) -> None:
    xs = [_x(panel.values, v) for v in panel.values]
    chosen_x = _x(panel.values, panel.chosen)
    ax.plot(xs, panel.averages, marker="o", color="#4c72b0", lw=2)
    ax.plot([chosen_x], [panel.chosen_average], marker="*", ms=18, color=CHOSEN_COLOR, mec="black", ls="none", zorder=5, label="chosen")
    ax.annotate(f"{panel.key} = {_shown(panel.chosen)}\n{panel.chosen_average:.1f}%", (chosen_x, panel.chosen_average), xytext=(0, -18), textcoords="offset points", ha="center", va="top", fontsize=9, color=CHOSEN_COLOR, fontweight="bold", bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.85})
    _set_hyperparameter_axis(ax, panel.values, panel.key)
    # room under the chosen point for its label
    low, high = min(panel.averages), max(panel.averages)
    span = max(high - low, 1.0)
    ax.set_ylim(low - 0.45 * span, high + 0.15 * span)
    ax.set_ylabel("validation accuracy, average (%)")
    ax.grid(alpha=0.3)
    ax.set_title(f"average over tasks against {panel.key}")


def _draw_heatmap(fig, ax, panel: GridHeatmap) -> None:
    from matplotlib.patches import Rectangle

    image = ax.imshow(panel.averages, cmap="viridis", aspect="auto", origin="lower", interpolation="nearest")
    finite = [v for row in panel.averages for v in row if not math.isnan(v)]
    middle = (min(finite) + max(finite)) / 2
    for i, row in enumerate(panel.averages):
        for j, v in enumerate(row):
            if not math.isnan(v):
                ax.text(j, i, f"{v:.1f}", ha="center", va="center", fontsize=9, color="black" if v > middle else "white")
    i, j = panel.chosen
    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, ec=CHOSEN_COLOR, lw=3.5))
    ax.set_xticks(range(len(panel.x_values)), [_shown(v) for v in panel.x_values])
    ax.set_yticks(range(len(panel.y_values)), [_shown(v) for v in panel.y_values])
    ax.set_xlabel(panel.x_key)
    ax.set_ylabel(panel.y_key)
    folded = f" (best over {', '.join(panel.best_over)})" if panel.best_over else ""
    ax.set_title(f"average over tasks (%){folded}; chosen: red box")
    fig.colorbar(image, ax=ax, label="validation accuracy, average (%)")


def _task_colours(plt, tasks) -> dict[str, Any]:
    cmap = plt.get_cmap("tab10" if len(tasks) <= 10 else "tab20")
    return {t: cmap(i % cmap.N) for i, t in enumerate(tasks)}


def _draw_per_task(plt, ax, panel: PerTaskCurves) -> None:
    colours = _task_colours(plt, panel.accuracies)
    xs = [_x(panel.values, v) for v in panel.values]
    for task, accs in panel.accuracies.items():
        ax.plot(xs, accs, marker="o", ms=4, color=colours[task], lw=1.8, label=f"{task} ({panel.key} = {_shown(panel.chosen[task])})")
        ax.plot([_x(panel.values, panel.chosen[task])], [panel.chosen_accuracy[task]], marker="*", ms=15, color=colours[task], mec="black", ls="none", zorder=5)
    _set_hyperparameter_axis(ax, panel.values, panel.key)
    ax.set_ylabel("validation accuracy of the task (%)")
    ax.grid(alpha=0.3)
    ax.legend(title="task (chosen: star)", fontsize=8, title_fontsize=9, loc="center left", bbox_to_anchor=(1.02, 0.5))
    ax.set_title(f"{panel.key}, chosen per task")


def _draw_one_setting(ax, panel: OneSetting) -> None:
    tasks = list(panel.accuracies)
    ax.bar(range(len(tasks)), list(panel.accuracies.values()), color="#4c72b0", width=0.7)
    for x, v in enumerate(panel.accuracies.values()):
        ax.text(x, v + 1, f"{v:.1f}", ha="center", va="bottom", fontsize=9)
    ax.axhline(panel.average, color=CHOSEN_COLOR, ls="--", lw=2)
    ax.set_xticks(range(len(tasks)), tasks, rotation=30, ha="right", rotation_mode="anchor")
    ax.set_ylim(0, 108)
    ax.set_ylabel("validation accuracy (%)")
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    # the average is named in the title: a label on the line would cross the bars
    ax.set_title(f"no search: the one setting, per task (red dashes: average {panel.average:.1f}%)")


def _plot_negation(plt, method: str, floor_fraction: float, panels: list[NegationCurves], path) -> None:
    n = len(panels)
    cols = min(4, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols + 2.8, 2.7 * rows + 1.1), sharex=True, sharey=True, layout="constrained", squeeze=False)
    for ax, p in zip(axes.flat, panels):
        ax.plot(p.lams, p.target, marker="o", ms=4, color="#4c72b0", lw=2, label="target (negated task)")
        ax.plot(p.lams, p.control, marker="s", ms=4, color="#dd8452", lw=2, ls="--", label="control (other tasks)")
        ax.axhline(p.control_floor, color="#7f7f7f", ls=":", lw=2, label=f"control floor ({floor_fraction:g} x pretrained)")
        ax.axvline(p.chosen_lam, color=CHOSEN_COLOR, lw=1.5, alpha=0.6, label="chosen lam")
        ax.plot([p.chosen_lam, p.chosen_lam], [p.chosen_target, p.chosen_control], marker="*", ms=13, color=CHOSEN_COLOR, mec="black", ls="none", zorder=5)
        ax.set_title(f"{p.task}: lam = {_shown(p.chosen_lam)}", fontsize=FONT_SIZE)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    # at the right: a legend above or below collides with the figure's title or x label under constrained layout
    fig.legend(handles, labels, loc="outside right center", fontsize=9)
    fig.supxlabel("lam (how much of the task vector is subtracted; 0 = pretrained)", fontsize=FONT_SIZE)
    fig.supylabel("validation accuracy (%)", fontsize=FONT_SIZE)
    fig.suptitle(f"{method}: per task, the lam that lowers the target most while control stays above the floor")
    _save(fig, path)


def plot_merge_search(merge_metrics: dict, path) -> None:
    """One method's search on validation (``metrics/merge/<method>.json``), as ``search_panels`` describes it."""
    plt = _pyplot()
    method = merge_metrics["method"]
    panels = search_panels(merge_metrics)
    if merge_metrics["kind"] == "negation":
        _plot_negation(plt, method, merge_metrics["hyperparameters"].get("control_floor", 0.95), panels, path)
        return
    widths = [7.2 if isinstance(p, PerTaskCurves) else 6.2 for p in panels]
    fig, axes = plt.subplots(1, len(panels), figsize=(sum(widths), 4.6), layout="constrained", squeeze=False, width_ratios=widths)
    for ax, panel in zip(axes[0], panels):
        if isinstance(panel, GridCurve):
            _draw_curve(ax, panel)
        elif isinstance(panel, GridHeatmap):
            _draw_heatmap(fig, ax, panel)
        elif isinstance(panel, PerTaskCurves):
            _draw_per_task(plt, ax, panel)
        else:
            _draw_one_setting(ax, panel)
    chosen = _chosen_text(merge_metrics["searched"])
    chosen = f"chosen {chosen}" if chosen else "nothing searched"
    fig.suptitle(f"{method}: {chosen}; validation average {_pct(merge_metrics['val_average']):.1f}%")
    _save(fig, path)


# ---------------------------------------------------------------- task vectors
def plot_cosine_heatmap(stats: dict, path) -> None:
    """Cosine similarity of every pair of task vectors; the colour scale spans the off-diagonal values, and the
    diagonal (always 1) is drawn grey so that it does not saturate the scale."""
    plt = _pyplot()
    import numpy as np

    tasks, cos = stats["tasks"], stats["cosine"]
    n = len(tasks)
    off_diagonal = np.ma.masked_array(cos, mask=np.eye(n, dtype=bool))
    vmax = (float(abs(off_diagonal).max()) if n > 1 else 0.0) or 1.0
    cmap = plt.get_cmap("RdBu_r").with_extremes(bad="#d9d9d9")
    fig, ax = plt.subplots(figsize=(2.6 + 0.8 * n, 1.6 + 0.7 * n), layout="constrained")
    image = ax.imshow(off_diagonal, cmap=cmap, vmin=-vmax, vmax=vmax)
    for i in range(n):
        for j in range(n):
            strong = i != j and abs(cos[i][j]) > 0.6 * vmax
            ax.text(j, i, f"{cos[i][j]:.2f}", ha="center", va="center", fontsize=9, color="white" if strong else "black")
    ax.set_xticks(range(n), tasks, rotation=45, ha="right", rotation_mode="anchor")
    ax.set_yticks(range(n), tasks)
    ax.set_title("Task-vector cosine similarity (whole vectors)")
    fig.colorbar(image, ax=ax, fraction=0.046, label="cosine similarity (off-diagonal range)")
    _save(fig, path)


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
    plt = _pyplot()
    import numpy as np

    learned = merge_metrics["learned"]
    coefficients = learned["coefficients"]
    tasks = list(coefficients)
    names = list(coefficients[tasks[0]])
    values = np.array([[coefficients[t][n] for n in names] for t in tasks])
    if "kept" in learned:
        fig, (left, middle, right) = plt.subplots(1, 3, figsize=(19, 4.8), layout="constrained", width_ratios=[2.2, 1.6, 1])
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
    fig.suptitle(f"{merge_metrics['method']}: validation average {_pct(merge_metrics['val_average']):.1f}%")
    _save(fig, path)


def _by_tensor(fig, ax, values, rows: list[str], names: list[str], what: str, label: str, *, cmap: str, fraction: float, norm=None) -> None:
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
    _by_tensor(fig, ax, counts, rows, matrices, "matrix", "singular components kept", cmap="magma", fraction=0.05, norm=norm)
    ax.set_title(f"singular components kept per matrix ({int(counts.sum()):,} in all)")
