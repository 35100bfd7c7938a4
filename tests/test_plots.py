"""Plots from small hand-made inputs: each is a PNG with nothing drawn outside the figure, methods are in the order
worked out by hand, and a merge plot's chosen point is the one its metrics name."""

import struct

import pytest

from mergeflow.report import plots, search_plots
from mergeflow.report.summary import summary_rows

TASKS = ["a", "b"]
# test accuracy per task; averages: m1 0.7, m2 0.8, m3 0.5, Pretrained 0.4, Individual 0.95
PROBE = {"a": 0.4, "b": 0.4}
INDIVIDUAL = {"a": 1.0, "b": 0.9}
METHODS = {"m1": {"a": 0.6, "b": 0.8}, "m2": {"a": 0.9, "b": 0.7}, "m3": {"a": 0.5, "b": 0.5}}


def rows_by_hand() -> list[dict]:
    finetune = {t: {"probe": {"test": PROBE[t]}, "individual": {"test": INDIVIDUAL[t]}} for t in TASKS}
    return summary_rows(TASKS, finetune, {m: {"searched": {}, "accuracy": acc} for m, acc in METHODS.items()})


def png_size(path) -> tuple[int, int]:
    """(width, height) in pixels from the PNG header."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def layout_problems(fig) -> list[str]:
    """What reads badly in a drawn figure: text under 8 pt, anything outside the figure, and the figure's own
    title, axis labels and legends overlapping one another."""
    from matplotlib.text import Text

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    problems = []
    drawn = fig.get_tightbbox(renderer)  # inches
    width, height = fig.get_size_inches()
    if drawn.x0 < -0.02 or drawn.y0 < -0.02 or drawn.x1 > width + 0.02 or drawn.y1 > height + 0.02:
        problems.append(f"cut off: drawn over {drawn.bounds} in a {width} x {height} figure")
    texts = [
        t for t in fig.findobj(Text) if t.get_visible() and t.get_text() and (t.axes is None or t.axes.get_visible())
    ]
    problems += [f"{t.get_text()!r} at {t.get_fontsize()} pt" for t in texts if t.get_fontsize() < 8]
    own = [a for a in (fig._suptitle, fig._supxlabel, fig._supylabel, *fig.legends) if a is not None]
    boxes = [a.get_window_extent(renderer) for a in own]
    problems += [
        f"{own[i]} overlaps {own[j]}"
        for i in range(len(own))
        for j in range(i + 1, len(own))
        if boxes[i].overlaps(boxes[j])
    ]
    return problems


@pytest.fixture(autouse=True)
def layout_checked(monkeypatch):
    """Every figure a test draws is checked by ``layout_problems`` before it is saved."""
    save = plots.save

    def checked(fig, path):
        assert layout_problems(fig) == []
        save(fig, path)

    monkeypatch.setattr(plots, "save", checked)
    monkeypatch.setattr(search_plots, "save", checked)  # the search plots' own reference to it


# ---------------------------------------------------------------- summary
def test_reference_names_are_summary_rows_own():
    assert [r["method"] for r in rows_by_hand()[:2]] == [plots.PRETRAINED, plots.INDIVIDUAL]


@pytest.mark.parametrize(
    ("head", "name"), [("zeroshot", "Pretrained (zero-shot)"), ("verbalizer", "Pretrained (answer words)")]
)
def test_the_pretrained_row_names_the_head_that_reads_it_and_stays_a_reference(tmp_path, head, name):
    finetune = {t: {"probe": {"head": head, "test": PROBE[t]}, "individual": {"test": INDIVIDUAL[t]}} for t in TASKS}
    rows = summary_rows(TASKS, finetune, {m: {"searched": {}, "accuracy": acc} for m, acc in METHODS.items()})
    assert rows[0]["method"] == name and plots.is_pretrained(name)
    assert plots.plot_accuracy_heatmap(rows, TASKS, tmp_path / "accuracy.png") == [
        plots.INDIVIDUAL,
        "m2",
        "m1",
        "m3",
        name,
    ]
    assert plots.plot_averages(rows, tmp_path / "averages.png") == ["m2", "m1", "m3"]


def test_accuracy_heatmap_sorts_methods_between_the_references(tmp_path):
    path = tmp_path / "accuracy.png"
    order = plots.plot_accuracy_heatmap(rows_by_hand(), TASKS, path)
    assert order == [plots.INDIVIDUAL, "m2", "m1", "m3", plots.PRETRAINED]
    width, height = png_size(path)
    assert 600 < width < 3000 and 300 < height < 3000


def test_accuracy_heatmap_of_21_rows_and_9_columns(tmp_path):
    """The pipeline's size: 19 methods and the two references on 8 tasks and the average."""
    tasks = ["digits", "house_numbers", "signs", "rotation", "orientation", "texture", "count", "position"]
    rows = [
        {"method": plots.PRETRAINED, **{t: 0.5 for t in tasks}, "average": 0.5},
        {"method": plots.INDIVIDUAL, **{t: 0.9 for t in tasks}, "average": 0.9},
    ]
    rows += [
        {"method": f"method_with_a_long_name_{i}", **{t: 0.5 + 0.02 * i for t in tasks}, "average": 0.5 + 0.02 * i}
        for i in range(19)
    ]
    path = tmp_path / "accuracy.png"
    order = plots.plot_accuracy_heatmap(rows, tasks, path)
    assert order[1:-1] == [f"method_with_a_long_name_{i}" for i in reversed(range(19))]
    width, height = png_size(path)
    # at least 30 pixels per row: each cell's number stays legible
    assert height > 30 * 21 and width > 1000


def test_ties_keep_the_rows_order():
    rows = [{"method": "x", "average": 0.5}, {"method": "y", "average": 0.6}, {"method": "z", "average": 0.5}]
    assert plots.sorted_methods(rows) == ["y", "x", "z"]


def test_averages_are_sorted_bars_without_the_references(tmp_path):
    path = tmp_path / "averages.png"
    assert plots.plot_averages(rows_by_hand(), path) == ["m2", "m1", "m3"]
    width, height = png_size(path)
    assert width > 600 and height > 200


# ---------------------------------------------------------------- merge searches
def merge_metrics(grid, curve, searched, per_task_curves=None, kind="model") -> dict:
    """A metrics/merge/<method>.json: ``curve`` is [(hyperparameters, average)], the best being the chosen one."""
    val_curve = [{"hyperparameters": hp, "accuracy": {"a": avg, "b": avg}, "average": avg} for hp, avg in curve]
    best = max(val_curve, key=lambda r: r["average"])
    return {
        "method": "by_hand",
        "kind": kind,
        "grid": grid,
        "hyperparameters": {**best["hyperparameters"], **searched},
        "searched": searched,
        "val_accuracy": {"a": 0.6, "b": 0.8},
        "val_average": best["average"],
        "val_curve": val_curve,
        "per_task_curves": per_task_curves or {},
    }


ONE_D = merge_metrics(
    {"lam": [0.1, 0.3, 1.0, 3.0]},
    [({"lam": 0.1}, 0.5), ({"lam": 0.3}, 0.6), ({"lam": 1.0}, 0.7), ({"lam": 3.0}, 0.4)],
    {"lam": 1.0},
)


def test_one_searched_hyperparameter_is_a_curve_with_the_chosen_value(tmp_path):
    (panel,) = search_plots.search_panels(ONE_D)
    assert isinstance(panel, search_plots.GridCurve)
    assert panel.key == "lam" and panel.values == [0.1, 0.3, 1.0, 3.0]
    assert panel.averages == pytest.approx([50, 60, 70, 40])
    assert panel.chosen == 1.0 and panel.chosen_average == pytest.approx(70)
    assert search_plots.uses_log_scale(panel.values)  # 0.1 to 3: more than a decade
    search_plots.plot_merge_search(ONE_D, tmp_path / "one_d.png")
    assert png_size(tmp_path / "one_d.png")[0] > 500


def test_log_scale_only_past_a_decade():
    assert not search_plots.uses_log_scale([0.8, 1.0, 1.5, 2.5])
    assert search_plots.uses_log_scale([0.05, 0.1, 1.0])
    assert not search_plots.uses_log_scale([0.0, 0.5, 1.0]) and not search_plots.uses_log_scale(["row", "global"])


def test_a_categorical_hyperparameter_is_drawn_at_its_place(tmp_path):
    metrics = merge_metrics(
        {"scope": ["row", "global"]}, [({"scope": "row"}, 0.5), ({"scope": "global"}, 0.6)], {"scope": "global"}
    )
    (panel,) = search_plots.search_panels(metrics)
    assert (
        panel.values == ["row", "global"]
        and panel.chosen == "global"
        and search_plots._x(panel.values, panel.chosen) == 1
    )
    search_plots.plot_merge_search(metrics, tmp_path / "categorical.png")


def test_two_searched_hyperparameters_are_a_heatmap_with_the_chosen_cell(tmp_path):
    grid = {"rank_ratio": [0.1, 0.2], "lam": [0.5, 1.0, 1.5]}
    averages = {
        (0.1, 0.5): 0.50,
        (0.1, 1.0): 0.55,
        (0.1, 1.5): 0.52,
        (0.2, 0.5): 0.58,
        (0.2, 1.0): 0.61,
        (0.2, 1.5): 0.60,
    }
    metrics = merge_metrics(
        grid,
        [({"rank_ratio": r, "lam": lam}, avg) for (r, lam), avg in averages.items()],
        {"rank_ratio": 0.2, "lam": 1.0},
    )
    (panel,) = search_plots.search_panels(metrics)
    assert isinstance(panel, search_plots.GridHeatmap)
    # lam has more values: it spans x
    assert (panel.x_key, panel.y_key) == ("lam", "rank_ratio") and panel.best_over == []
    assert panel.averages == [pytest.approx([50, 55, 52]), pytest.approx([58, 61, 60])]
    assert panel.chosen == (1, 1) and panel.chosen_average == pytest.approx(61)
    search_plots.plot_merge_search(metrics, tmp_path / "two_d.png")
    assert png_size(tmp_path / "two_d.png")[0] > 500


def test_a_third_searched_hyperparameter_is_folded_into_each_cell_as_its_best():
    grid = {"k": [0.1, 0.2], "lam": [0.5, 1.0, 1.5], "seed": [0, 1]}
    curve = [
        ({"k": k, "lam": lam, "seed": s}, 0.5 + 0.1 * k + 0.01 * lam + 0.001 * s)
        for k in grid["k"]
        for lam in grid["lam"]
        for s in grid["seed"]
    ]
    (panel,) = search_plots.search_panels(merge_metrics(grid, curve, {"k": 0.2, "lam": 1.5, "seed": 1}))
    assert (panel.x_key, panel.y_key, panel.best_over) == ("lam", "k", ["seed"])
    assert panel.averages[0][0] == pytest.approx(100 * (0.5 + 0.01 + 0.005 + 0.001))
    assert panel.chosen == (1, 2)


PER_TASK_CURVES = {
    "tall_lambda": {"a": {"0.4": 0.7, "0.2": 0.5, "0.3": 0.6}, "b": {"0.4": 0.6, "0.2": 0.8, "0.3": 0.7}}
}


def test_a_choice_per_task_is_one_curve_per_task_with_each_chosen_value(tmp_path):
    metrics = merge_metrics(
        {}, [({"lam": 1.0}, 0.7)], {"tall_lambda": {"a": 0.4, "b": 0.2}}, PER_TASK_CURVES, kind="per_task"
    )
    (panel,) = search_plots.search_panels(metrics)
    assert isinstance(panel, search_plots.PerTaskCurves)
    assert panel.values == [0.2, 0.3, 0.4]  # sorted, whatever the file's order
    assert panel.accuracies == {"a": pytest.approx([50, 60, 70]), "b": pytest.approx([80, 70, 60])}
    assert panel.chosen == {"a": 0.4, "b": 0.2} and panel.chosen_accuracy == pytest.approx({"a": 70, "b": 80})
    search_plots.plot_merge_search(metrics, tmp_path / "per_task.png")
    assert png_size(tmp_path / "per_task.png")[0] > 500


def test_a_grid_and_a_choice_per_task_are_two_panels(tmp_path):
    metrics = merge_metrics(
        {"alpha": [0.5, 1.0]},
        [({"alpha": 0.5}, 0.6), ({"alpha": 1.0}, 0.65)],
        {"alpha": 1.0, "tall_lambda": {"a": 0.4, "b": 0.2}},
        PER_TASK_CURVES,
    )
    curve, per_task = search_plots.search_panels(metrics)
    assert isinstance(curve, search_plots.GridCurve) and curve.chosen == 1.0
    assert isinstance(per_task, search_plots.PerTaskCurves) and per_task.chosen == {"a": 0.4, "b": 0.2}
    search_plots.plot_merge_search(metrics, tmp_path / "both.png")


@pytest.mark.parametrize("grid", [{}, {"lam": [0.3]}], ids=["no grid", "a grid of one value"])
def test_no_search_is_the_one_setting_per_task(tmp_path, grid):
    metrics = merge_metrics(grid, [({"lam": 0.3}, 0.7)], {"lam": 0.3} if grid else {}, kind="per_task")
    (panel,) = search_plots.search_panels(metrics)
    assert panel == search_plots.OneSetting({"a": pytest.approx(60), "b": pytest.approx(80)}, pytest.approx(70))
    search_plots.plot_merge_search(metrics, tmp_path / "one.png")
    assert png_size(tmp_path / "one.png")[0] > 500


def negation_metrics() -> dict:
    """Three tasks; pretrained validation accuracy a 0.8, b 0.6, c 0.7; control floor 0.9."""

    def curve(rows):
        return [{"lam": lam, "target": t, "control": c} for lam, t, c in rows]

    per_task = {
        # control of a: mean(b, c) = 0.65, floor 0.585: lam 0.5 keeps it, lam 1 does not
        "a": {
            "curve": curve([(0.5, 0.5, 0.62), (1.0, 0.3, 0.55)]),
            "chosen": {"lam": 0.5, "target": 0.5, "control": 0.62},
        },
        "b": {
            "curve": curve([(0.5, 0.4, 0.74), (1.0, 0.2, 0.70)]),
            "chosen": {"lam": 1.0, "target": 0.2, "control": 0.70},
        },
        # no lam keeps c's control: lam = 0, the pretrained model, with its own accuracies
        "c": {
            "curve": curve([(0.5, 0.6, 0.5), (1.0, 0.5, 0.4)]),
            "chosen": {"lam": 0.0, "target": 0.7, "control": 0.7},
        },
    }
    return {
        "method": "task_negation",
        "kind": "negation",
        "grid": {"lam": [0.5, 1.0]},
        "hyperparameters": {"control_floor": 0.9},
        "searched": {},
        "pretrained_val_accuracy": {"a": 0.8, "b": 0.6, "c": 0.7},
        "per_task": per_task,
    }


def test_negation_is_one_panel_per_task_with_its_floor_and_chosen_lam(tmp_path):
    panels = search_plots.search_panels(negation_metrics())
    assert [p.task for p in panels] == ["a", "b", "c"]
    a, b, c = panels
    # lam = 0 is the pretrained model: target its accuracy, control the others' mean
    assert (
        a.lams == [0.0, 0.5, 1.0]
        and a.target == pytest.approx([80, 50, 30])
        and a.control == pytest.approx([65, 62, 55])
    )
    assert (
        a.control_floor == pytest.approx(90 * 0.65)
        and b.control_floor == pytest.approx(90 * 0.75)
        and c.control_floor == pytest.approx(90 * 0.7)
    )
    assert (a.chosen_lam, a.chosen_target, a.chosen_control) == (0.5, pytest.approx(50), pytest.approx(62))
    assert b.chosen_lam == 1.0
    # the chosen point lies on the drawn curve, also when it is the pretrained model
    for p in panels:
        i = p.lams.index(p.chosen_lam)
        assert (p.target[i], p.control[i]) == (pytest.approx(p.chosen_target), pytest.approx(p.chosen_control))
    assert c.chosen_lam == 0.0
    search_plots.plot_merge_search(negation_metrics(), tmp_path / "negation.png")
    width, height = png_size(tmp_path / "negation.png")
    assert width > 800 and height > 300


# ---------------------------------------------------------------- task vectors
def test_cosine_heatmap(tmp_path):
    stats = {"tasks": ["a", "b", "c"], "cosine": [[1.0, 0.05, -0.02], [0.05, 1.0, 0.01], [-0.02, 0.01, 1.0]]}
    plots.plot_cosine_heatmap(stats, tmp_path / "cosine.png")
    width, height = png_size(tmp_path / "cosine.png")
    assert width > 300 and height > 300


def test_masks_learned_add_the_components_kept_per_task_and_matrix(tmp_path):
    kept = {
        "a": {"blocks.0.attn.qkv.weight": 3, "blocks.0.mlp.fc1.weight": 0},
        "b": {"blocks.0.attn.qkv.weight": 1, "blocks.0.mlp.fc1.weight": 2},
        "common subspace": {"blocks.0.attn.qkv.weight": 40, "blocks.0.mlp.fc1.weight": 37},
    }
    learned = {
        "layer_wise": True,
        "split": "test",
        "entropy": [0.5, 0.4, 0.3],
        "coefficients": {t: {"blocks.0.attn.qkv.weight": 0.3, "blocks.0.mlp.fc1.weight": 0.4} for t in "ab"},
    }
    metrics = {"method": "adarank", "val_average": 0.7, "learned": learned}
    plain, masked = tmp_path / "plain.png", tmp_path / "masked.png"
    plots.plot_learned_coefficients(metrics, plain)
    plots.plot_learned_coefficients({**metrics, "learned": {**learned, "kept": kept}}, masked)
    assert png_size(masked)[0] > png_size(plain)[0] * 1.3  # a third panel
    plt = plots.pyplot()
    fig, ax = plt.subplots()
    plots._plot_kept(fig, ax, kept)
    assert ax.images[0].get_array().tolist() == [[3, 0], [1, 2], [40, 37]]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b", "common subspace"]
    assert ax.get_title() == "singular components kept per matrix (83 in all)"
    plt.close(fig)


def test_heatmap_colour_is_points_above_the_pretrained_model():
    # by hand: a merge 2 points below the probe and an individual model 1 point below it are red (negative), not the
    # probe's colour or a better one
    rows = [
        {"method": plots.PRETRAINED, "t": 0.60},
        {"method": plots.INDIVIDUAL, "t": 0.59},
        {"method": "m", "t": 0.58},
        {"method": "n", "t": 0.70},
    ]
    assert plots.points_above_pretrained(rows, "t") == pytest.approx([0.0, -1.0, -2.0, 10.0])
    # no pretrained row (a regime's own table): the column's median is the centre
    assert plots.points_above_pretrained(rows[1:], "t") == pytest.approx([0.0, -1.0, 11.0])
