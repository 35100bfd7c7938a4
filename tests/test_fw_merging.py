"""FW-Merging (merging/fw_merging.py): with no step it is its start (task arithmetic at the scaling, or theta0); a
step is the Frank-Wolfe update toward the vertex that minimises the linear model of the loss, checked against the
gradient of a model loaded the ordinary way and every vertex built in full."""

import copy

import pytest
import torch

from mergeflow.ml.merging import REGISTRY, MergeData
from mergeflow.ml.merging._adaptive import EntropyObjective

from .test_data_aware import _tiny_setup


def _setup():
    theta0, taus, objective = _tiny_setup(torch.float64)
    g = torch.Generator().manual_seed(3)
    images = objective.inputs["test"]
    labels = {
        t: torch.randint(0, head.out_features, (len(images[t]),), generator=g) for t, head in objective.heads.items()
    }
    train = EntropyObjective(objective.backbone, objective.heads, {"train": images}, objective.device)
    return theta0, taus, train, labels


def _run(theta0, taus, objective, labels, **hp):
    data = MergeData(objective=copy.copy(objective), train_labels=labels)
    merged = REGISTRY["fw_merging"].with_data(data)(theta0, taus, **{"examples": 24, "batch_size": 7} | hp)
    return merged, data.learned[0]


def _gradient(objective, labels, state):
    """The mean cross-entropy's gradient, the backbone loaded with ``state`` (no functional_call)."""
    backbone = copy.deepcopy(objective.backbone)
    backbone.net.load_state_dict(state)
    count = sum(len(y) for y in labels.values())
    loss = (
        sum(
            torch.nn.functional.cross_entropy(
                objective.heads[t](backbone.embed(backbone.net(backbone.normalise(x).double()))),
                labels[t],
                reduction="sum",
            )
            for t, x in objective.inputs["train"].items()
        )
        / count
    )
    loss.backward()
    return {k: p.grad for k, p in backbone.net.named_parameters()}


def test_with_no_step_it_is_its_start():
    theta0, taus, objective, labels = _setup()
    merged, learned = _run(theta0, taus, objective, labels, steps=0, scaling=0.3)
    ta = REGISTRY["task_arithmetic"](theta0, taus, lam=0.3)
    for k in theta0:
        torch.testing.assert_close(merged[k], ta[k])
    assert learned["entropy"] == [] and learned["selected"] == []
    merged, _ = _run(theta0, taus, objective, labels, steps=0, init="base")
    for k in theta0:
        torch.testing.assert_close(merged[k], theta0[k])


@pytest.mark.parametrize("alignment", ["inner_product", "tensor_cosine"])
def test_one_step_moves_toward_the_vertex_the_gradient_picks(alignment):
    theta0, taus, objective, labels = _setup()
    scaling, step_size = 0.3, 0.5
    start = {k: theta0[k] + scaling * sum(tv[k] for tv in taus.values()) for k in theta0}
    vertices = {t: {k: theta0[k] + tv[k] for k in theta0} for t, tv in taus.items()} | {"initial": start}
    grad = _gradient(objective, labels, start)

    def score(v):
        if alignment == "inner_product":
            return sum(float((grad[k] * v[k]).sum()) for k in v)
        return sum(float((grad[k] * v[k]).sum() / (grad[k].norm() * v[k].norm())) for k in v)

    best = min(vertices, key=lambda name: score(vertices[name]))
    merged, learned = _run(
        theta0, taus, objective, labels, steps=1, scaling=scaling, step_size=step_size, alignment=alignment
    )
    assert learned["selected"] == [best]
    gamma = 2 / 2 * step_size * scaling
    for k in theta0:
        torch.testing.assert_close(merged[k], start[k] + gamma * (vertices[best][k] - start[k]))


def test_layer_granularity_picks_a_vertex_per_tensor():
    theta0, taus, objective, labels = _setup()
    start = {k: theta0[k] + 0.3 * sum(tv[k] for tv in taus.values()) for k in theta0}
    vertices = {t: {k: theta0[k] + tv[k] for k in theta0} for t, tv in taus.items()} | {"initial": start}
    grad = _gradient(objective, labels, start)
    merged, learned = _run(theta0, taus, objective, labels, steps=1, granularity="layer", step_size=1.0)
    counts = dict.fromkeys(vertices, 0)
    for k in theta0:
        best = min(vertices, key=lambda name: float((grad[k] * vertices[name][k]).sum()))
        counts[best] += 1
        torch.testing.assert_close(merged[k], start[k] + 0.3 * (vertices[best][k] - start[k]))
    assert learned["selected"] == [counts] and learned["layer_wise"]
    assert learned["coefficients"]["a"].keys() == theta0.keys()


def test_more_examples_than_the_training_split_takes_all_of_it():
    theta0, taus, objective, labels = _setup()
    merged, learned = _run(theta0, taus, objective, labels, steps=1, examples=1000)
    every, _ = _run(theta0, taus, objective, labels, steps=1, examples=24)
    assert learned["examples"] == dict.fromkeys(taus, 24)
    for k in theta0:
        torch.testing.assert_close(merged[k], every[k])
