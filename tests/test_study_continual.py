"""Study continual: its settings, the numbers it reads from its runs (average, forgetting, backward transfer) on
hand-made accuracies, its claims, and the whole study on a tiny layout, where sequential weight averaging's last model
must score what the one-shot weight average scores (an independent route)."""

import json
import math

import pytest
import torch

from mergeflow.core.files import write_json
from mergeflow.core.io import save_state_dict
from mergeflow.studies import REGISTRY, StudyContext
from mergeflow.studies import continual as C

from .test_study_ctl import tiny_pipeline

WHERE = "studies.continual"


def test_registered_with_its_settings():
    spec = REGISTRY["continual"]
    assert spec.settings_model is C.ContinualSettings and spec.settings({}, where=WHERE).methods == C.METHODS
    assert spec.settings({}, where=WHERE).order_of(["a", "b"]) == ["a", "b"]
    assert spec.settings({"order": ["b", "a"]}, where=WHERE).order_of(["a", "b", "c"]) == ["b", "a"]


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"methods": ["opcm", "nope"]}, "unknown continual method 'nope'"),
        ({"methods": ["opcm", "opcm"]}, "a method named twice"),
        ({"order": ["a", "a"]}, "a task named twice"),
        ({"hyperparameters": {"dop": {"lr": 0.1}}, "methods": ["opcm"]}, "hyperparameters.dop: not among methods"),
        ({"hyperparameters": {"opcm": {"alpha": 2.0}}}, "hyperparameters.opcm.alpha: expected a number in [0, 1]"),
        ({"unknown": 1}, "unknown"),
    ],
)
def test_bad_settings_refused_in_one_line(bad, message):
    with pytest.raises(ValueError) as err:
        REGISTRY["continual"].settings(bad, where=WHERE)
    assert message in str(err.value) and str(err.value).startswith(WHERE) and "\n" not in str(err.value)


def test_an_order_outside_the_suite_is_named():
    s = REGISTRY["continual"].settings({"order": ["a", "z"]}, where=WHERE)
    with pytest.raises(ValueError, match=r"studies.continual.order: 'z' is not in suite.tasks \(a, b\)"):
        s.order_of(["a", "b"])


def hand_run(method: str, rows: list[dict]) -> C.Run:
    return C.Run(method, {}, ["a", "b", "c"], rows)


ROWS = [{"a": 0.9}, {"a": 0.7, "b": 0.8}, {"a": 0.6, "b": 0.5, "c": 0.9}]


def test_average_forgetting_and_backward_transfer_by_hand():
    run = hand_run("x", ROWS)
    assert [round(run.average(t), 10) for t in range(3)] == [0.9, 0.75, round(2.0 / 3, 10)]
    assert run.just_after("b") == 0.8 and run.forgetting("a") == pytest.approx(-0.3)
    assert run.backward_transfer() == pytest.approx((-0.3 - 0.3) / 2)  # the last task is not averaged in
    assert C.Run("x", {}, ["a"], [{"a": 0.5}]).backward_transfer() is None


def test_claims_follow_the_numbers():
    better = [{"a": 0.9}, {"a": 0.85, "b": 0.8}, {"a": 0.8, "b": 0.75, "c": 0.9}]
    runs = {"weight_averaging": hand_run("w", ROWS), "task_arithmetic": hand_run("t", ROWS)}
    runs["opcm"] = hand_run("opcm", better)
    accuracy, forgetting, dop = C.claims(runs)
    assert accuracy.holds and forgetting.holds and dop.holds is None
    assert accuracy.margin == pytest.approx((0.8 + 0.75 + 0.9) / 3 - 2.0 / 3)
    runs["dop"] = hand_run("dop", ROWS)
    assert C.claims(runs)[2].holds is False
    runs["opcm"] = hand_run("opcm", ROWS)  # a tie is not "above"
    assert not C.claims(runs)[0].holds and not C.claims(runs)[1].holds
    assert C.claims({"opcm": hand_run("opcm", ROWS)})[0].holds is None


def test_tables_by_hand():
    runs = {"weight_averaging": hand_run("w", ROWS)}
    table = C.accuracy_table(runs, {"a": 1.0, "b": 0.8, "c": 0.6})
    assert "| weight_averaging | 90.0 | 75.0 | 66.7 | -30.0 |" in table
    assert "| fine-tuned models | 100.0 | 90.0 | 80.0 | |" in table
    assert "| a | 90.0 → 60.0 (-30.0) |" in C.forgetting_table(runs)


def test_the_study_runs_on_a_tiny_layout(tmp_path, repo_root, capsys):
    params, layout = tiny_pipeline(tmp_path / "project", repo_root)
    from mergeflow.core.io import load_state_dict

    theta0 = load_state_dict(layout.pretrained)
    for t in params.suite.tasks:
        theta = load_state_dict(layout.finetuned(t))
        save_state_dict(layout.vectors / f"{t}.safetensors", {k: theta[k] - theta0[k] for k in theta0})
        write_json(layout.metrics("finetune", t), {"individual": {"test": 0.5}})
    order = list(params.suite.tasks)[::-1]
    settings = REGISTRY["continual"].settings(
        {"order": order, "hyperparameters": {"dop": {"num_steps": 3}}}, where=WHERE
    )
    out = tmp_path / "out"
    out.mkdir()
    result = C.continual_study(StudyContext(params, layout, settings, out, torch.device("cpu")))
    assert [c.id for c in result.claims] == ["opcm.1", "opcm.2", "dop.1"]
    assert all(c.verdict in ("holds", "fails") for c in result.claims)
    assert (out / "arrivals.png").stat().st_size > 0 and "(arrivals.png)" in result.body
    assert "study continual: dop over 3 arrivals" in capsys.readouterr().out
    record = json.loads((out / "accuracy.json").read_text())
    assert list(record) == C.METHODS
    for run in record.values():
        assert [list(step) for step in run["accuracy"]] == [order[: k + 1] for k in range(len(order))]
        a = run["accuracy"]
        by_hand = sum(a[-1][t] - a[i][t] for i, t in enumerate(order[:-1])) / (len(order) - 1)
        assert math.isclose(run["backward_transfer"], by_hand, abs_tol=2e-6)
    # sequential weight averaging after the last arrival is the one-shot weight average: the same test accuracies
    from mergeflow.ml.evaluation import MultiTaskEvaluator
    from mergeflow.ml.merging import REGISTRY as METHODS
    from mergeflow.ml.models import build_backbone, load_heads
    from mergeflow.ml.data import load_tasks
    from mergeflow.ml.task_vectors import load_task_vectors

    pretrained, vectors = load_task_vectors(params, layout)
    tasks = load_tasks(params, layout)
    heads = load_heads(params, layout, build_backbone(params.backbone).num_features, tasks)
    evaluator = MultiTaskEvaluator(params.backbone, {t: tasks[t] for t in order}, heads, "test", torch.device("cpu"))
    one_shot = evaluator(METHODS["weight_averaging"](pretrained, vectors))
    assert record["weight_averaging"]["accuracy"][-1] == pytest.approx(one_shot, abs=1e-6)
    assert "| fine-tuned models | 50.0 | 50.0 | 50.0 | |" in result.body
