"""More seeds (params.yaml's seeds): the fine-tunes and merges again with each (stage replicate@<seed>), each
method's mean and spread over the seeds in the summary and the headline, and the studies' margins set against it."""

from __future__ import annotations

import json

import pytest

from mergeflow.params import parse_params
from mergeflow.studies import Claim, against_spread
from mergeflow.report.summary import over_seeds, pooled_sd, seeds_markdown

from .conftest import copy_project, run


def test_mean_and_spread_over_seeds_by_hand():
    per_seed = {
        0: {"ties": {"test_avg": 70.0}, "cart": {"test_avg": 60.0}},
        1: {"ties": {"test_avg": 72.0}, "cart": {"test_avg": 61.0}},
        2: {"ties": {"test_avg": 74.0}, "cart": {"test_avg": 62.0}, "only_here": {"test_avg": 1.0}},
    }
    table = over_seeds(per_seed)
    assert set(table) == {"ties", "cart"}  # a name some seed lacks is left out
    assert table["ties"] == {
        "seeds": 3,
        "mean": 72.0,
        "sd": 2.0,
        "min": 70.0,
        "max": 74.0,
        "values": {"0": 70.0, "1": 72.0, "2": 74.0},
    }
    assert table["cart"]["sd"] == 1.0 and pooled_sd(table) == round(((4 + 1) / 2) ** 0.5, 2)
    text = seeds_markdown(table, [0, 1, 2])
    assert (
        "| ties | **72.00 ± 2.00** | 70.0 | 74.0 | 70.0 | 72.0 | 74.0 |" in text
        and "**1.58** points" in text
        and "(3.16)" in text
    )
    assert (
        over_seeds({0: {"ties": {"test_avg": 70.0}}})["ties"]["sd"] is None
        and pooled_sd(over_seeds({0: {"ties": {"test_avg": 70.0}}})) is None
    )


def test_a_margin_is_set_against_the_spread():
    claim = Claim("x.1", "A beats B", True, {"a": 1}, "A 71.0 > B 70.0", margin=0.01)
    inside = against_spread(claim, 1.0, 3, 2.0)
    assert (
        inside.detail.endswith("margin +1.0 points inside the spread over 3 seeds (2 x sd 1.00 = 2.00)")
        and inside.numbers["inside_spread"] is True
    )
    outside = against_spread(Claim("x.1", "A beats B", True, {}, "A 73.0 > B 70.0", margin=0.03), 1.0, 3, 2.0)
    assert "outside the spread" in outside.detail and outside.holds is True  # the verdict stays; the note says how sure
    assert "not measured (params.yaml's seeds: none)" in against_spread(claim, None, 1, 2.0).detail
    assert against_spread(Claim("x.2", "no margin", True, {}, "d"), 1.0, 3, 2.0).detail == "d"


def test_seeds_are_other_seeds_each_once(repo_root):
    import yaml

    raw = yaml.safe_load((repo_root / "params.yaml").read_text())
    from mergeflow.core.errors import MergeflowError

    with pytest.raises(MergeflowError, match="seeds: 0 is the run's own seed"):
        parse_params(raw | {"seeds": [0, 1]})
    with pytest.raises(MergeflowError, match="seeds: 2 is listed twice"):
        parse_params(raw | {"seeds": [2, 1, 2]})
    assert parse_params(raw | {"seeds": [1, 2]}).seeds == [1, 2]


def test_a_replicate_seed_runs_the_fine_tunes_and_merges_again(tmp_path, tiny_reference, tiny_env):
    """seeds: [1] on the tiny run: replicate@1 and what reads it run again; the seed-1 fine-tunes are other models,
    the probe heads the same (Newton's optimum does not depend on the seed), and the summary and the headline give
    the mean and spread over the two seeds."""
    root = copy_project(tiny_reference[0], tmp_path / "project")
    params = root / "params.yaml"
    params.write_text(params.read_text().replace("seeds: []", "seeds:\n- 1"))
    out = run("mergeflow repro", root, tiny_env)
    assert "Running stage 'replicate@1'" in out or "replicate@1" in out
    assert (root / "models/finetuned/digits.safetensors").read_bytes() != (
        root / "replicates/1/models/finetuned/digits.safetensors"
    ).read_bytes()
    assert (root / "models/heads/digits.safetensors").read_bytes() == (
        root / "replicates/1/models/heads/digits.safetensors"
    ).read_bytes()
    seed1 = json.loads((root / "metrics/replicates/1.json").read_text())["headline"]
    seed0 = json.loads((root / "metrics/headline/ties.json").read_text())
    values = [seed0["test_avg"], seed1["ties"]["test_avg"]]
    assert (
        seed0["seeds"] == 2
        and seed0["test_avg_mean"] == round(sum(values) / 2, 2)
        and seed0["test_avg_sd"] == round(abs(values[0] - values[1]) / 2**0.5, 2)
    )
    assert "### Over 2 seeds (0, 1): test accuracy, %" in (root / "results/summary.md").read_text()
    # the leaderboard carries the same spread beside each score's interval over the test examples
    board = {e["method"]: e for e in json.loads((root / "results/leaderboard.json").read_text())["boards"]["standard"]}
    assert (
        board["ties"]["seeds"] == {"seeds": 2, "mean": seed0["test_avg_mean"], "sd": seed0["test_avg_sd"]}
        and board["Individual"]["seeds"]["seeds"] == 2
    )
    assert "2 seeds: mean ± sd" in (root / "results/leaderboard.md").read_text()
