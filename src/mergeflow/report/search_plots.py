"""The plot of each merge method's search on validation: what it shows is computed by ``search_panels``, a pure
function the tests check (a grid curve, a grid heatmap, per-task curves, one setting, task negation's curves),
then drawn. matplotlib is imported inside the functions (Agg backend)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mergeflow.report.plots import CHOSEN_COLOR, FONT_SIZE, chosen_text, pct, pyplot, save, shown


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
                [pct(c["target"]) for c in curve],
                [pct(c["control"]) for c in curve],
                pct(floor * base_control),
                chosen["lam"],
                pct(chosen["target"]),
                pct(chosen["control"]),
            )
        )
    return panels


def _grid_panel(merge_metrics: Mapping, searched_keys: list[str]) -> GridCurve | GridHeatmap:
    curve, searched = merge_metrics["val_curve"], merge_metrics["searched"]
    grid = merge_metrics["grid"]
    if len(searched_keys) == 1:
        key = searched_keys[0]
        return GridCurve(
            key,
            [r["hyperparameters"][key] for r in curve],
            [pct(r["average"]) for r in curve],
            searched[key],
            pct(merge_metrics["val_average"]),
        )
    # the two with the most values span the heatmap (the first-listed on ties); the rest are folded in
    by_size = sorted(searched_keys, key=lambda k: -len(grid[k]))
    x_key, y_key = by_size[0], by_size[1]
    x_values, y_values = list(grid[x_key]), list(grid[y_key])
    cells = [[math.nan] * len(x_values) for _ in y_values]
    for r in curve:
        hp = r["hyperparameters"]
        i, j = y_values.index(hp[y_key]), x_values.index(hp[x_key])
        cells[i][j] = max(pct(r["average"]), cells[i][j]) if not math.isnan(cells[i][j]) else pct(r["average"])
    chosen = (y_values.index(searched[y_key]), x_values.index(searched[x_key]))
    return GridHeatmap(x_key, x_values, y_key, y_values, cells, chosen, pct(merge_metrics["val_average"]), by_size[2:])


def _per_task_panel(key: str, curves: Mapping[str, Mapping[str, float]], chosen: Mapping[str, Any]) -> PerTaskCurves:
    labels = list(next(iter(curves.values())))  # the values as str() wrote them (JSON keys)
    try:
        labels = sorted(labels, key=float)
        values, as_value = [float(v) for v in labels], float
    except ValueError:
        values, as_value = labels, str
    accuracies = {t: [pct(c[label]) for label in labels] for t, c in curves.items()}
    chosen_accuracy = {t: pct(curves[t][str(chosen[t])]) for t in curves}
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
        accuracies = {t: pct(a) for t, a in merge_metrics["val_accuracy"].items()}
        panels.append(OneSetting(accuracies, pct(merge_metrics["val_average"])))
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
    ax.set_xticks([_x(values, v) for v in values], [shown(v) for v in values], rotation=45 if len(values) > 6 else 0)


def _draw_curve(ax, panel: GridCurve) -> None:
    xs = [_x(panel.values, v) for v in panel.values]
    chosen_x = _x(panel.values, panel.chosen)
    ax.plot(xs, panel.averages, marker="o", color="#4c72b0", lw=2)
    ax.plot(
        [chosen_x],
        [panel.chosen_average],
        marker="*",
        ms=18,
        color=CHOSEN_COLOR,
        mec="black",
        ls="none",
        zorder=5,
        label="chosen",
    )
    ax.annotate(
        f"{panel.key} = {shown(panel.chosen)}\n{panel.chosen_average:.1f}%",
        (chosen_x, panel.chosen_average),
        xytext=(0, -18),
        textcoords="offset points",
        ha="center",
        va="top",
        fontsize=9,
        color=CHOSEN_COLOR,
        fontweight="bold",
        bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.85},
    )
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
                ax.text(
                    j, i, f"{v:.1f}", ha="center", va="center", fontsize=9, color="black" if v > middle else "white"
                )
    i, j = panel.chosen
    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, ec=CHOSEN_COLOR, lw=3.5))
    ax.set_xticks(range(len(panel.x_values)), [shown(v) for v in panel.x_values])
    ax.set_yticks(range(len(panel.y_values)), [shown(v) for v in panel.y_values])
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
        ax.plot(
            xs,
            accs,
            marker="o",
            ms=4,
            color=colours[task],
            lw=1.8,
            label=f"{task} ({panel.key} = {shown(panel.chosen[task])})",
        )
        ax.plot(
            [_x(panel.values, panel.chosen[task])],
            [panel.chosen_accuracy[task]],
            marker="*",
            ms=15,
            color=colours[task],
            mec="black",
            ls="none",
            zorder=5,
        )
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
    fig, axes = plt.subplots(
        rows,
        cols,
        figsize=(3.2 * cols + 2.8, 2.7 * rows + 1.1),
        sharex=True,
        sharey=True,
        layout="constrained",
        squeeze=False,
    )
    for ax, p in zip(axes.flat, panels):
        ax.plot(p.lams, p.target, marker="o", ms=4, color="#4c72b0", lw=2, label="target (negated task)")
        ax.plot(p.lams, p.control, marker="s", ms=4, color="#dd8452", lw=2, ls="--", label="control (other tasks)")
        ax.axhline(
            p.control_floor, color="#7f7f7f", ls=":", lw=2, label=f"control floor ({floor_fraction:g} x pretrained)"
        )
        ax.axvline(p.chosen_lam, color=CHOSEN_COLOR, lw=1.5, alpha=0.6, label="chosen lam")
        ax.plot(
            [p.chosen_lam, p.chosen_lam],
            [p.chosen_target, p.chosen_control],
            marker="*",
            ms=13,
            color=CHOSEN_COLOR,
            mec="black",
            ls="none",
            zorder=5,
        )
        ax.set_title(f"{p.task}: lam = {shown(p.chosen_lam)}", fontsize=FONT_SIZE)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    # at the right: a legend above or below collides with the figure's title or x label under constrained layout
    fig.legend(handles, labels, loc="outside right center", fontsize=9)
    fig.supxlabel("lam (how much of the task vector is subtracted; 0 = pretrained)", fontsize=FONT_SIZE)
    fig.supylabel("validation accuracy (%)", fontsize=FONT_SIZE)
    fig.suptitle(f"{method}: per task, the lam that lowers the target most while control stays above the floor")
    save(fig, path)


def plot_merge_search(merge_metrics: dict, path) -> None:
    """One method's search on validation (``metrics/merge/<method>.json``), as ``search_panels`` describes it."""
    plt = pyplot()
    method = merge_metrics["method"]
    panels = search_panels(merge_metrics)
    if merge_metrics["kind"] == "negation":
        _plot_negation(plt, method, merge_metrics["hyperparameters"].get("control_floor", 0.95), panels, path)
        return
    widths = [7.2 if isinstance(p, PerTaskCurves) else 6.2 for p in panels]
    fig, axes = plt.subplots(
        1, len(panels), figsize=(sum(widths), 4.6), layout="constrained", squeeze=False, width_ratios=widths
    )
    for ax, panel in zip(axes[0], panels):
        if isinstance(panel, GridCurve):
            _draw_curve(ax, panel)
        elif isinstance(panel, GridHeatmap):
            _draw_heatmap(fig, ax, panel)
        elif isinstance(panel, PerTaskCurves):
            _draw_per_task(plt, ax, panel)
        else:
            _draw_one_setting(ax, panel)
    chosen = chosen_text(merge_metrics["searched"])
    chosen = f"chosen {chosen}" if chosen else "nothing searched"
    fig.suptitle(f"{method}: {chosen}; validation average {pct(merge_metrics['val_average']):.1f}%")
    save(fig, path)
