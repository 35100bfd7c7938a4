"""The headline metrics and the validation records, on small hand-made inputs."""

import pytest

from mergeflow.report.summary import (
    headline_metrics,
    regime_headline,
    summary_markdown,
    summary_rows,
    validation_records,
)

TASKS = ["a", "b"]
# probe 0.5 and 0.7 (average 0.6), individual 0.9 and 0.9 (average 0.9): the gap is 0.3
FINETUNE = {
    "a": {"probe": {"test": 0.5}, "individual": {"test": 0.9}},
    "b": {"probe": {"test": 0.7}, "individual": {"test": 0.9}},
}


def test_headline_metrics_by_hand():
    evaluations = {
        "task_arithmetic": {"kind": "single", "accuracy": {"a": 0.8, "b": 0.7}, "searched": {"lam": 0.3}},
        "tall": {
            "kind": "per_task",
            "accuracy": {"a": 0.9, "b": 0.8},
            "searched": {"tall_lambda": {"a": 0.2, "b": 0.6}},
            "storage_models": 1.5,
        },
        "task_negation": {
            "kind": "negation",
            "searched": {},
            "average": {"target": 0.3, "control": 0.55, "pretrained_target": 0.6, "pretrained_control": 0.6},
        },
    }
    rows = summary_rows(TASKS, FINETUNE, {m: e for m, e in evaluations.items() if e["kind"] != "negation"})
    headline = headline_metrics(rows, evaluations, {"task_arithmetic": 0.8125})
    assert headline["probe"] == {"test_avg": 60.0} and headline["individual"] == {"test_avg": 90.0}
    # (0.75 - 0.6) / 0.3 = 50%; the choice is one string, whatever the hyperparameters are called
    assert headline["task_arithmetic"] == {"test_avg": 75.0, "val_avg": 81.25, "gap": 50.0, "choice": "lam=0.3"}
    # a per-task choice is not a headline scalar
    assert headline["tall"] == {"test_avg": 85.0, "gap": pytest.approx(83.33)}
    # negation by the same formula: (0.3 - 0.6) / 0.3 = -100%
    assert headline["task_negation"] == {"test_avg": 30.0, "gap": -100.0, "control_avg": 55.0}


def test_a_regime_variants_headline_is_named_by_its_variant():
    evaluations = {"ties": {"kind": "single", "accuracy": {"a": 0.6, "b": 0.9}, "searched": {"k": 0.2, "lam": 1.5}}}
    rows = summary_rows(TASKS, FINETUNE, evaluations, regime="mima_n2", individual_models={"a": 0.8, "b": 1.0})
    headline = regime_headline("mima_n2", rows, evaluations, {"ties": 0.7})
    assert [r["data"] for r in rows] == ["", "none"]  # a method the data labels do not name reads none
    assert summary_rows(TASKS, FINETUNE, evaluations, data={"ties": "train stats"})[-1]["data"] == "train stats"
    # the gap on the standard fine-tune's scale: (0.75 - 0.6) / 0.3
    assert headline == {
        "mima_n2/individual": {"test_avg": 90.0},
        "mima_n2/ties": {"test_avg": 75.0, "val_avg": 70.0, "gap": 50.0, "choice": "k=0.2 lam=1.5"},
    }


def test_gap_recovered_is_not_a_number_when_the_fine_tunes_do_not_beat_the_probe():
    # the probe (average 0.9) beats the individual models (0.88): no gap to recover, so "n/a", never a ratio of noise
    finetune = {
        "a": {"probe": {"test": 0.9}, "individual": {"test": 0.86}},
        "b": {"probe": {"test": 0.9}, "individual": {"test": 0.9}},
    }
    evaluations = {"task_arithmetic": {"kind": "single", "accuracy": {"a": 0.8, "b": 0.9}, "searched": {"lam": 0.3}}}
    rows = summary_rows(TASKS, finetune, evaluations)
    assert [r["gap_recovered"] for r in rows] == [None, None, None]
    assert headline_metrics(rows, evaluations)["task_arithmetic"] == {
        "test_avg": 85.0,
        "gap": None,
        "choice": "lam=0.3",
    }
    table = summary_markdown(rows, TASKS)
    assert table.count("| n/a |") == 3 and "%" not in table.split("\n", 2)[2]
    # a gap of 0.4 points (under evaluation.MIN_GAP) is noise too; 0.6 points is a gap
    assert (
        summary_rows(TASKS, {t: {"probe": {"test": 0.9}, "individual": {"test": 0.904}} for t in TASKS}, {})[0][
            "gap_recovered"
        ]
        is None
    )
    assert summary_rows(TASKS, {t: {"probe": {"test": 0.9}, "individual": {"test": 0.906}} for t in TASKS}, {})[1][
        "gap_recovered"
    ] == pytest.approx(1.0)


def _row(hp, average):
    return {"hyperparameters": hp, "accuracy": {}, "average": average}


def test_validation_records_follow_the_coefficient_at_the_other_chosen_values():
    metrics = {
        "kind": "single",
        "grid": {"rank_ratio": [0.1, 0.2], "lam": [0.5, 1.0]},
        "searched": {"rank_ratio": 0.2, "lam": 1.0},
        "val_curve": [
            _row({"rank_ratio": 0.1, "lam": 0.5}, 0.5),
            _row({"rank_ratio": 0.1, "lam": 1.0}, 0.9),
            _row({"rank_ratio": 0.2, "lam": 0.5}, 0.6),
            _row({"rank_ratio": 0.2, "lam": 1.0}, 0.7),
        ],
    }
    assert validation_records(metrics, "lam") == [
        {"hyperparameter": "lam", "value": 0.5, "val_avg": 60.0, "chosen": False},
        {"hyperparameter": "lam", "value": 1.0, "val_avg": 70.0, "chosen": True},
    ]
    one = {"kind": "single", "grid": {}, "searched": {}, "val_curve": [_row({"p": 0.9}, 0.4)]}
    assert validation_records(one, None) == [
        {"hyperparameter": "(one setting)", "value": 0, "val_avg": 40.0, "chosen": True}
    ]


def test_validation_records_of_negation_average_targets_and_controls():
    curve_a = [{"lam": 0.5, "target": 0.4, "control": 0.8}, {"lam": 1.0, "target": 0.2, "control": 0.6}]
    curve_b = [{"lam": 0.5, "target": 0.6, "control": 0.7}, {"lam": 1.0, "target": 0.4, "control": 0.5}]
    metrics = {
        "kind": "negation",
        "grid": {"lam": [0.5, 1.0]},
        "per_task": {"a": {"curve": curve_a}, "b": {"curve": curve_b}},
    }
    assert validation_records(metrics, "lam") == [
        {"hyperparameter": "lam", "value": 0.5, "val_avg": 50.0, "control_avg": 75.0},
        {"hyperparameter": "lam", "value": 1.0, "val_avg": 30.0, "control_avg": 55.0},
    ]
