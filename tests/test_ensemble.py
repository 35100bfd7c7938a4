"""The ensembles (merging/ensemble.py): the simple ensemble of copies of one model is that model; the weighted one
with a single weight 1 is that task's model, and keeps no other; the max-model takes the entrywise max of the
members' outputs, by hand; with a linear head, averaging the features is averaging the logits; they are marked as
not merged, and store T models."""

from collections import OrderedDict

import pytest
import torch
from torch import nn

from mergeflow.ml.merging import REGISTRY
from mergeflow.ml.merging._tensors import store_bytes

from .test_data_aware import _tiny_setup
from .test_smile import _Toy

ENSEMBLES = ("simple_ensemble", "weighted_ensemble", "max_model_predictor")


def _features(backbone, state, images):
    backbone.net.load_state_dict(state)
    with torch.no_grad():
        return backbone.embed(backbone.net(backbone.normalise(images).double()))


def _ensemble(name, theta0, taus, backbone, images, **hp):
    spec = REGISTRY[name]
    with torch.no_grad():
        return spec.network(spec(theta0, taus, **hp), backbone)(images)


@pytest.mark.parametrize("name", ENSEMBLES)
def test_an_ensemble_of_copies_of_one_model_is_that_model(name):
    theta0, taus, objective = _tiny_setup(torch.float64)
    copies = {t: taus["a"] for t in taus}
    images = objective.inputs["test"]["b"][:5]
    expected = _features(objective.backbone, {k: theta0[k] + taus["a"][k] for k in theta0}, images)
    torch.testing.assert_close(_ensemble(name, theta0, copies, objective.backbone, images), expected)


def test_weighted_with_one_weight_1_is_that_model_and_keeps_no_other():
    theta0, taus, objective = _tiny_setup(torch.float64)
    images = objective.inputs["test"]["c"][:5]
    weights = {"a": 0.0, "b": 1.0, "c": 0.0}
    store = REGISTRY["weighted_ensemble"](theta0, taus, weights=weights)
    assert {k.split("/")[1] for k in store if k.startswith("base/")} == {"b"}
    expected = _features(objective.backbone, {k: theta0[k] + taus["b"][k] for k in theta0}, images)
    got = _ensemble("weighted_ensemble", theta0, taus, objective.backbone, images, weights=weights)
    torch.testing.assert_close(got, expected)


def test_weights_are_divided_by_their_sum_unless_asked_not_to():
    theta0, taus, _ = _tiny_setup(torch.float64)
    by_sum = REGISTRY["weighted_ensemble"](theta0, taus, weights={"a": 2.0})
    assert by_sum["weights"].tolist() == [0.5, 0.25, 0.25]
    as_given = REGISTRY["weighted_ensemble"](theta0, taus, weights={"a": 2.0}, normalize="none")
    assert as_given["weights"].tolist() == [2.0, 1.0, 1.0]
    assert REGISTRY["simple_ensemble"](theta0, taus)["weights"].tolist() == pytest.approx([1 / 3] * 3)


def test_max_model_takes_each_entrys_largest_output_by_hand():
    backbone = _Toy(nn.Sequential(OrderedDict(fc=nn.Linear(2, 3, bias=False))).double())
    theta0 = {"fc.weight": torch.zeros(3, 2, dtype=torch.float64)}
    taus = {
        "a": {"fc.weight": torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)},
        "b": {"fc.weight": torch.tensor([[0.0, 2.0], [-1.0, 0.0], [0.5, 0.5]], dtype=torch.float64)},
    }
    x = torch.tensor([[1.0, 2.0], [-1.0, 1.0]], dtype=torch.float64)
    # a: [1, 2, 3] and [-1, 1, 0]; b: [4, -1, 1.5] and [2, 1, 0]
    expected = torch.tensor([[4.0, 2.0, 3.0], [2.0, 1.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(_ensemble("max_model_predictor", theta0, taus, backbone, x), expected)


def test_on_pooled_features_a_linear_head_reads_the_average_as_the_average_of_its_logits():
    theta0, taus, objective = _tiny_setup(torch.float64)
    head = objective.heads["b"]
    images = objective.inputs["test"]["b"][:6]
    logits = [head(_features(objective.backbone, {k: theta0[k] + taus[t][k] for k in theta0}, images)) for t in taus]
    averaged = head(_ensemble("simple_ensemble", theta0, taus, objective.backbone, images))
    torch.testing.assert_close(averaged, sum(logits) / 3)


@pytest.mark.parametrize("name", ENSEMBLES)
def test_ensembles_are_references_that_store_every_model(name):
    theta0, taus, _ = _tiny_setup()
    spec = REGISTRY[name]
    assert spec.kind == "routed" and not spec.merged
    store = spec(theta0, taus)
    model = store_bytes(theta0)
    assert all(k.startswith("base/") or k == "weights" for k in store)  # whole models: theta0 is not needed beside
    assert store_bytes(store) == pytest.approx(3 * model, rel=1e-3)


def test_bad_weights_are_refused_in_one_line():
    theta0, taus, _ = _tiny_setup()
    with pytest.raises(ValueError, match=r"^merge\.weighted_ensemble\.weights: no task 'd' among the merged tasks"):
        REGISTRY["weighted_ensemble"](theta0, taus, weights={"d": 1.0})
    with pytest.raises(ValueError, match=r"^merge\.weighted_ensemble\.weights: every weight is 0"):
        REGISTRY["weighted_ensemble"](theta0, taus, weights={t: 0.0 for t in taus})
    with pytest.raises(ValueError, match=r"^merge\.weighted_ensemble\.weights: expected a mapping task -> a model's"):
        REGISTRY["weighted_ensemble"](theta0, taus, weights={"a": -1.0})


def test_the_report_shows_ensembles_beside_the_merges_and_ranks_only_the_merges(tmp_path):
    from mergeflow.report import plots
    from mergeflow.report.leaderboard import board
    from mergeflow.report.summary import summary_rows
    from mergeflow.report.uncertainty import resample_indices

    tasks = ["a", "b"]
    finetune = {t: {"probe": {"test": 0.4}, "individual": {"test": 0.9}} for t in tasks}
    accuracy = {"ties": 0.7, "simple_ensemble": 0.8, "task_arithmetic": 0.6, "max_model_predictor": 0.5}
    evaluations = {m: {"searched": {}, "accuracy": {t: a for t in tasks}} for m, a in accuracy.items()}
    rows = summary_rows(tasks, finetune, evaluations)
    entries = board(rows, {}, {"a": torch.zeros(4), "b": torch.zeros(4)}, {}, resample_indices({"a": 4, "b": 4}, 5))
    by = {e["method"]: e for e in entries}
    assert by["simple_ensemble"]["baseline"] and by["simple_ensemble"]["rank"] is None
    assert [by[m]["rank"] for m in ("ties", "task_arithmetic")] == [1, 2]  # the ensemble above them takes no rank
    assert entries[0]["best"] == "ties"
    assert plots.sorted_methods(rows) == ["ties", "task_arithmetic"]
    assert plots.is_not_merged("simple_ensemble (mima_n4)") and not plots.is_not_merged("ties (mima_n4)")
    order = plots.plot_accuracy_heatmap(rows, tasks, tmp_path / "accuracy.png")
    assert order == ["Individual", "simple_ensemble", "max_model_predictor", "ties", "task_arithmetic"] + [
        rows[0]["method"]
    ]
    averages = ["simple_ensemble", "max_model_predictor", "ties", "task_arithmetic"]
    assert plots.plot_averages(rows, tmp_path / "averages.png") == averages


def test_only_a_routed_method_can_be_marked_not_merged():
    from mergeflow.ml.merging import register

    with pytest.raises(RuntimeError, match="only a routed method can be marked not merged"):
        register("not_a_merge_of_one_model", paper="-", merged=False)(lambda pretrained, task_vectors: pretrained)
    assert "not_a_merge_of_one_model" not in REGISTRY
