"""The regime stage on the tiny profile: a run killed between rounds resumes from its last finished round to the
same task vectors, bit for bit, as an uninterrupted run, and leaves the previous outputs whole meanwhile; a
round count that does not split the budget is refused in one line."""

import os
import signal
import subprocess
import time

import pytest
import torch

from mergeflow.params import apply_overrides, parse_params
from mergeflow.core.errors import MergeflowError
from mergeflow.core.io import load_state_dict
from mergeflow.ml.merging import REGISTRY

from .conftest import copy_project, run
from .profiles import TINY

pytestmark = pytest.mark.e2e
TASKS = TINY["suite"]["tasks"]


def _mima_n4(project):
    apply_overrides(project / "params.yaml", ["regimes.mima.rounds=[4]"])  # 4 rounds of 2 steps
    return ["mergeflow", "regime", "--regime", "mima"]


def test_a_killed_regime_resumes_from_its_last_round(tiny_reference, tiny_env, tmp_path):
    root, _ = tiny_reference
    whole = copy_project(root, tmp_path / "whole")
    run(_mima_n4(whole), whole, tiny_env)
    assert not (whole / "checkpoints/regime/mima/mima_n4.safetensors").exists()  # a finished run removes its checkpoint

    killed = copy_project(root, tmp_path / "killed")
    cmd = _mima_n4(killed)
    checkpoint = killed / "checkpoints/regime/mima/mima_n4.safetensors"
    proc = subprocess.Popen(
        cmd, cwd=killed, env=tiny_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + 300
    while not checkpoint.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert checkpoint.exists(), "the run ended before its first checkpoint could be seen"
    # the previous outputs (the reference's N = 2) are untouched: nothing half-written
    assert sorted(p.name for p in (killed / "regimes/mima").iterdir()) == ["mima_n2"]

    out = run(cmd, killed, tiny_env)
    resumed_after = int(out.split("resuming after round ")[1].split()[0])
    assert 1 <= resumed_after < 4
    assert not checkpoint.exists()
    for t in TASKS:
        a = load_state_dict(killed / f"regimes/mima/mima_n4/vectors/{t}.safetensors")
        b = load_state_dict(whole / f"regimes/mima/mima_n4/vectors/{t}.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), t
    a, b = (load_state_dict(p / "regimes/mima/mima_n4/model.safetensors") for p in (killed, whole))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_round_counts_must_split_the_budget():
    raw = {
        "suite": {"tasks": ["digits"]},
        "merge": {"methods": ["task_arithmetic"]},
        "finetune": {"steps": 8},
        "regimes": {"run": ["mima"], "mima": {"rounds": [2, 3]}},
    }
    with pytest.raises(
        MergeflowError, match=r"^params.yaml: regimes.mima.rounds: 3 rounds must divide finetune.steps = 8"
    ):
        parse_params(raw)
    parse_params(raw | {"regimes": {"run": [], "mima": {"rounds": [3]}}})  # not run: not checked
    with pytest.raises(
        MergeflowError,
        match=rf"^params.yaml: regimes.methods.atm: unknown merge method .mima. \(`mergeflow methods` lists all "
        rf"{len(REGISTRY)}\)$",
    ):
        parse_params(raw | {"regimes": {"run": ["atm"], "methods": {"atm": ["mima"]}}})


def test_studies_are_checked_by_name_and_settings():
    raw = {"suite": {"tasks": ["digits"]}, "merge": {"methods": ["task_arithmetic"]}}
    with pytest.raises(
        MergeflowError, match=r"^params.yaml: studies.run: unknown study 'nope' \(`mergeflow regimes` lists all \d+\)$"
    ):
        parse_params(raw | {"studies": {"run": ["nope"]}})
    with pytest.raises(
        MergeflowError, match=r"^params.yaml: studies.mima.individual_tolerance: Input should be a valid number"
    ):
        parse_params(raw | {"studies": {"run": ["mima"], "mima": {"individual_tolerance": "wide"}}})
    assert (
        parse_params(raw | {"studies": {"run": ["mima"], "mima": {"individual_tolerance": 0.05}}})
        .studies.settings("mima")
        .individual_tolerance
        == 0.05
    )


def test_a_regimes_own_model_has_its_test_predictions_and_interval(tiny_reference, tiny_env, tmp_path):
    """MIMA's own model in regimes.methods.mima: regime_merge evaluates it as it does every merge, keeping its test
    predictions, so the report gives it a bootstrap interval. Its accuracies are those regime@mima measured, and
    those its predictions give against the test labels (an independent route: the fine-tunes' saved labels)."""
    import json

    from mergeflow.core.layout import Layout

    root, _ = tiny_reference
    project = copy_project(root, tmp_path / "own")
    apply_overrides(project / "params.yaml", ["regimes.methods.mima=[mima,task_arithmetic]"])
    run(["mergeflow", "regime_merge", "--regime", "mima"], project, tiny_env)
    run(["mergeflow", "report"], project, tiny_env)
    layout = Layout(project)
    own = layout.merge_run("mima", "mima", "mima_n2")
    evaluation = json.loads(own.evaluation.read_text())
    measured = json.loads(layout.metrics("regime", "mima").read_text())["variants"]["mima_n2"]["model"]
    predictions = load_state_dict(own.predictions)
    for t in TASKS:
        kept = load_state_dict(layout.predictions("finetune", t))
        # the same count of hits (the evaluator's accuracy is a float32's, as every merge's)
        assert evaluation["accuracy"][t] == pytest.approx(measured["accuracy"]["test"][t], abs=1e-7), t
        hits = (predictions[t] == kept["labels"]).double().mean().item()  # the tiny tasks' metric: accuracy
        assert hits == pytest.approx(evaluation["accuracy"][t], abs=1e-7), t
    board = json.loads((project / "results/leaderboard.json").read_text())["boards"]["mima_n2"]
    (entry,) = [e for e in board if e["method"] == "mima"]
    assert entry["low"] is not None and entry["low"] <= entry["score"] <= entry["high"]
