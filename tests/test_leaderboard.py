"""The leaderboard's uncertainty: the bootstrap's scores against each metric's own formula, its intervals against
the binomial standard error, the paired differences, and the ranking with its baselines and ties."""

import math

import pytest
import torch

from mergeflow.ml.metrics import score_predicted
from mergeflow.report.leaderboard import board, board_markdown, board_table, board_text, versus_table
from mergeflow.report.uncertainty import interval, resample_indices, resampled_averages, resampled_scores


@pytest.mark.parametrize("metric", ["accuracy", "matthews", "accuracy_f1", "pearson_spearman"])
def test_each_resample_scores_as_the_metric_does(metric):
    g = torch.Generator().manual_seed(0)
    n = 60
    if metric == "pearson_spearman":
        labels, predicted = torch.rand(n, generator=g), torch.rand(n, generator=g)
    else:
        classes = 3 if metric == "matthews" else 2
        labels, predicted = torch.randint(0, classes, (n,), generator=g), torch.randint(0, classes, (n,), generator=g)
    indices = resample_indices({"t": n}, resamples=7, seed=1)["t"]
    got = resampled_scores(metric, predicted, labels, indices)
    by_hand = [score_predicted(metric, predicted[i], labels[i]) for i in indices]
    assert got.tolist() == pytest.approx(by_hand, abs=1e-12)


def test_matthews_of_a_constant_prediction_is_zero_on_every_resample():
    labels, predicted = torch.tensor([0, 1] * 10), torch.zeros(20, dtype=torch.long)
    assert resampled_scores("matthews", predicted, labels, resample_indices({"t": 20}, 5)["t"]).abs().max() == 0


def test_accuracy_interval_matches_the_binomial_standard_error():
    # 400 examples, 300 right: the bootstrap's 95% interval is p +- 1.96 sqrt(p(1-p)/n) to within resampling noise
    n, p = 400, 0.75
    labels = torch.zeros(n, dtype=torch.long)
    predicted = torch.cat([torch.zeros(300, dtype=torch.long), torch.ones(100, dtype=torch.long)])
    samples = resampled_averages(
        {"m": {"t": predicted}}, {"t": labels}, {"t": "accuracy"}, resample_indices({"t": n}, 4000, seed=3)
    )["m"]
    low, high = interval(samples)
    half = 1.96 * math.sqrt(p * (1 - p) / n)
    assert low == pytest.approx(p - half, abs=0.006) and high == pytest.approx(p + half, abs=0.006)


def test_paired_difference_is_narrow_when_two_models_agree():
    # two models that differ on 4 of 400 examples (b right, a wrong): their scores' own intervals overlap widely,
    # the paired interval of b - a is [0.25, 1.75]% or so and excludes 0 only because every disagreement favours b
    n = 400
    labels = torch.zeros(n, dtype=torch.long)
    a = torch.cat([torch.zeros(296, dtype=torch.long), torch.ones(104, dtype=torch.long)])
    b = a.clone()
    b[296:300] = 0
    samples = resampled_averages(
        {"a": {"t": a}, "b": {"t": b}}, {"t": labels}, {"t": "accuracy"}, resample_indices({"t": n}, 2000, seed=5)
    )
    low, high = interval(samples["b"] - samples["a"])
    assert 0 < low and high < 0.025
    a_low, a_high = interval(samples["a"])
    assert a_high - a_low > 4 * (high - low)


def _rows(averages: dict[str, float]) -> list[dict]:
    return [
        {
            "regime": "standard",
            "method": m,
            "data": "none",
            "average": v,
            "chosen": "lam=0.3" if m == "task_arithmetic" else "",
            "storage_models": 8.0 if m == "Individual" else 1.0,
        }
        for m, v in averages.items()
    ]


def _predictions(right: dict[str, int], n: int = 200):
    labels = {"t": torch.zeros(n, dtype=torch.long)}
    preds = {
        m: {"t": torch.cat([torch.zeros(k, dtype=torch.long), torch.ones(n - k, dtype=torch.long)])}
        for m, k in right.items()
    }
    return preds, labels


def test_board_ranks_methods_with_baselines_beside_them():
    right = {"Pretrained (linear probe)": 150, "Individual": 190, "task_arithmetic": 160, "ties": 161, "tsv_m": 180}
    preds, labels = _predictions(right)
    entries = board(
        _rows({m: k / 200 for m, k in right.items()}),
        preds,
        labels,
        {"t": "accuracy"},
        resample_indices({"t": 200}, 1000, seed=0),
    )
    assert [e["method"] for e in entries] == [
        "Individual",
        "tsv_m",
        "ties",
        "task_arithmetic",
        "Pretrained (linear probe)",
    ]
    assert [e["rank"] for e in entries] == [None, 1, 2, 3, None]
    by = {e["method"]: e for e in entries}
    # differences by hand: 160/200 - 180/200 = -10 points; ties is one example from task arithmetic (a tie)
    assert by["task_arithmetic"]["vs_best"]["delta"] == -10.0 and not by["task_arithmetic"]["vs_best"]["tie"]
    assert by["ties"]["vs_reference"]["delta"] == 0.5 and by["ties"]["vs_reference"]["tie"]
    assert by["tsv_m"]["vs_best"]["delta"] is None and by["task_arithmetic"]["vs_reference"]["delta"] is None
    assert by["tsv_m"]["low"] < 90.0 < by["tsv_m"]["high"]
    table = board_table(entries)
    assert table[0][3] == "Δ best" and table[1][:2] == ["-", "Individual"] and table[3][4] == "+0.5 ≈"


def test_a_row_without_predictions_has_no_interval():
    right = {"Pretrained (linear probe)": 150, "task_arithmetic": 160}
    preds, labels = _predictions(right)
    rows = _rows({"Pretrained (linear probe)": 0.75, "task_arithmetic": 0.8, "mima": 0.85})
    entries = board(rows, preds, labels, {"t": "accuracy"}, resample_indices({"t": 200}, 100))
    assert entries[0]["method"] == "mima" and entries[0]["low"] is None
    assert entries[1]["vs_best"] == {"delta": -5.0, "low": None, "high": None, "tie": False}


def test_rendered_boards_fit_the_terminal_and_name_the_test_sets():
    right = {"Pretrained (linear probe)": 150, "task_arithmetic": 160, "consensus_ta": 170}
    preds, labels = _predictions(right)
    rows = _rows({m: k / 200 for m, k in right.items()})
    rows[2]["chosen"] = "alpha=0.6, tall_lambda=per task, " * 4
    entries = board(rows, preds, labels, {"t": "accuracy"}, resample_indices({"t": 200}, 100))
    text = board_text({"standard": entries}, {"t": 200}, "accuracy", width=120)
    assert max(len(line) for line in text.splitlines()) <= 120
    assert "200 test examples per task" in text
    markdown = board_markdown({"standard": entries}, {"t": 200}, "accuracy")
    assert "### Standard fine-tune: best consensus_ta" in markdown and "| 1 | consensus_ta" in markdown


def test_two_runs_side_by_side_rank_by_the_second_and_mark_changes_within_noise():
    def entry(method, score, half, rank):
        return {
            "method": method,
            "score": score,
            "low": None if half is None else score - half,
            "high": None if half is None else score + half,
            "rank": rank,
        }

    before = [entry("ties", 70.0, 2.0, 1), entry("task_arithmetic", 69.0, 2.0, 2), entry("Individual", 80.0, 2.0, None)]
    after = [
        entry("Individual", 80.0, 2.0, None),
        entry("task_arithmetic", 74.0, 2.0, 1),
        entry("ties", 71.0, 2.0, 2),
        entry("cart", 72.0, None, 3),
    ]
    table = versus_table(before, after, ("main", "exp"))
    assert table[0] == ["#", "method", "main", "exp", "change"]
    # by hand: +5 is past sqrt(2^2 + 2^2) = 2.83, +1 is within it; cart is new (no change), Individual unchanged
    assert [row[1] for row in table[1:]] == ["Individual", "task_arithmetic", "ties", "cart"]
    assert [row[4] for row in table[1:]] == ["0.0 ≈", "+5.0", "+1.0 ≈", ""]
    assert table[4][2:4] == ["-", "72.0"] and table[2][0] == "1" and table[1][0] == "-"


def test_a_run_over_seeds_shows_each_score_mean_and_spread():
    right = {"Pretrained (linear probe)": 150, "task_arithmetic": 160}
    preds, labels = _predictions(right)
    spread = {"task_arithmetic": {"seeds": 3, "mean": 79.5, "sd": 1.25, "min": 78.0, "max": 81.0}}
    entries = board(
        _rows({m: k / 200 for m, k in right.items()}),
        preds,
        labels,
        {"t": "accuracy"},
        resample_indices({"t": 200}, 100),
        spread,
    )
    table = board_table(entries)
    assert (
        table[0][3] == "3 seeds: mean ± sd"
        and table[1][:4] == ["1", "task_arithmetic", table[1][2], "79.5 ± 1.2"]
        and table[2][3] == ""
    )
    assert "3 seeds: mean ± sd" in board_markdown({"standard": entries}, {"t": 200}, "accuracy")
