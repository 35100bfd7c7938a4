"""Representation Surgery (merging/surgery.py): with nothing learned it is its base merge (W_up starts at zero); the
correction is z - W_up ReLU(W_down z); Adam's first step, on every input at once, moves W_up by -lr g / (|g| + eps), g
the L1 loss's gradient, computed here by hand, and leaves W_down (whose gradient is zero while W_up is) where it
started; learning brings the merged features nearer the task's own model's, and the evaluation applies it."""

import copy

import pytest
import torch

from mergeflow.ml.merging import REGISTRY, MergeData

from .test_data_aware import _tiny_setup


def _own_features(objective, state, images):
    backbone = copy.deepcopy(objective.backbone)
    backbone.net.load_state_dict(state)
    with torch.no_grad():
        return backbone.embed(backbone.net(backbone.normalise(images).to(next(iter(state.values())).dtype)))


def _run(theta0, taus, objective, **hp):
    data = MergeData(objective=copy.copy(objective))
    store = REGISTRY["surgery"].with_data(data)(theta0, taus, **{"base": "task_arithmetic"} | hp)
    return store, data


def test_with_nothing_learned_it_is_its_base_merge():
    theta0, taus, objective = _tiny_setup(torch.float64)
    store, data = _run(theta0, taus, objective, steps=0)
    surgery = REGISTRY["surgery"]
    ta = REGISTRY["task_arithmetic"](theta0, taus)  # at its default lam
    z = torch.randn(5, objective.backbone.num_features, dtype=torch.float64)
    for t in taus:
        model = surgery.reconstruct(store, theta0, t)
        assert all(torch.equal(model[k], ta[k]) for k in theta0)
        torch.testing.assert_close(surgery.features(store, t)(z), z)
    assert data.learned[0]["base"] == "task_arithmetic" and data.learned[0]["entropy"] == []


def test_the_correction_by_hand():
    store = {
        "surgery/a/down": torch.tensor([[1.0, -1.0], [0.0, 2.0]]),
        "surgery/a/up": torch.tensor([[1.0, 0.0], [3.0, 1.0]]),
    }
    z = torch.tensor([[2.0, 1.0], [1.0, -1.0]])
    # row 1: down z = (1, 2), relu (1, 2), up (1, 5): (2, 1) -
    # (1, 5) = (1, -4); row 2: down z = (2, -2) -> (2, 0) -> (2, 6)
    torch.testing.assert_close(REGISTRY["surgery"].features(store, "a")(z), torch.tensor([[1.0, -4.0], [-1.0, -7.0]]))


def test_adams_first_step_is_minus_lr_times_the_sign_of_the_l1_gradient():
    theta0, taus, objective = _tiny_setup(torch.float64)
    lr, n = 1e-2, 24
    start, _ = _run(theta0, taus, objective, steps=0, rank=4, seed=5)
    store, _ = _run(theta0, taus, objective, steps=1, rank=4, seed=5, lr=lr, batch_size=n)
    ta = REGISTRY["task_arithmetic"](theta0, taus)
    for t, tau in taus.items():
        images = objective.inputs["test"][t]
        z = _own_features(objective, ta, images)
        y = _own_features(objective, {k: theta0[k] + tau[k] for k in theta0}, images)
        down = start[f"surgery/{t}/down"]
        hidden = torch.relu(z @ down.T)
        gradient = -(torch.sign(z - y).T @ hidden) / z.numel()  # d mean|z - W_up h - y| / d W_up at W_up = 0
        # Adam's first step: -lr m/(sqrt(v) + eps) with m = g, v = g^2 after bias correction
        torch.testing.assert_close(
            store[f"surgery/{t}/up"], -lr * gradient / (gradient.abs() + 1e-8), rtol=1e-6, atol=1e-12
        )
        torch.testing.assert_close(store[f"surgery/{t}/down"], down)


def test_learning_brings_the_features_nearer_the_tasks_own_model():
    theta0, taus, objective = _tiny_setup(torch.float64)
    store, data = _run(theta0, taus, objective, steps=60, lr=1e-2, rank=8)
    surgery = REGISTRY["surgery"]
    for t, tau in taus.items():
        images = objective.inputs["test"][t]
        z = _own_features(objective, surgery.reconstruct(store, theta0, t), images)
        y = _own_features(objective, {k: theta0[k] + tau[k] for k in theta0}, images)
        assert (surgery.features(store, t)(z) - y).abs().mean() < 0.8 * (z - y).abs().mean()
    losses = data.learned[0]["entropy"]
    assert len(losses) == 60 and losses[-1] < losses[0]


def test_on_adamerging_the_bases_coefficients_are_kept_in_its_one_record():
    theta0, taus, objective = _tiny_setup()
    data = MergeData(objective=copy.copy(objective))
    REGISTRY["surgery"].with_data(data)(theta0, taus, steps=3, batch_size=8)
    (record,) = data.learned
    assert record["base"] == "adamerging" and len(record["entropy"]) == 3 and len(record["base_objective"]) == 500
    assert set(record["coefficients"]) == set(taus) and record["layer_wise"]


def test_a_batch_larger_than_a_tasks_inputs_is_refused():
    theta0, taus, objective = _tiny_setup()
    with pytest.raises(ValueError, match="surgery: batch_size 25 is more than the 24 test inputs of a task"):
        _run(theta0, taus, objective, steps=1, batch_size=25)


def test_the_evaluation_applies_each_tasks_correction_and_a_routed_network():
    """MultiTaskEvaluator: a per-task model's features pass through its task's map before the head; a routed
    method's network is evaluated as one model. Checked against the head applied by hand."""
    from mergeflow.ml.data import Split, TaskData
    from mergeflow.ml.evaluation import MultiTaskEvaluator
    from mergeflow.ml.merging.wemoe import network

    from .test_data_aware import TINY_VIT

    theta0, taus, objective = _tiny_setup()
    g = torch.Generator().manual_seed(4)
    tasks = {}
    for t, head in objective.heads.items():
        images = objective.inputs["test"][t]
        tasks[t] = TaskData(
            t,
            [str(i) for i in range(head.out_features)],
            None,
            None,
            Split(images, torch.randint(0, head.out_features, (len(images),), generator=g)),
        )
    evaluator = MultiTaskEvaluator(TINY_VIT, tasks, objective.heads, "test", torch.device("cpu"))

    def by_hand(features_of):
        return {
            t: float((objective.heads[t](features_of(t)).argmax(1) == d.test.labels).float().mean())
            for t, d in tasks.items()
        }

    store, _ = _run(theta0, taus, objective, steps=40, lr=5e-2, rank=8)
    surgery = REGISTRY["surgery"]
    acc = evaluator.per_task(lambda t: surgery.reconstruct(store, theta0, t), surgery.feature_maps(store))
    with torch.no_grad():
        expected = by_hand(
            lambda t: surgery.features(store, t)(
                _own_features(objective, surgery.reconstruct(store, theta0, t), tasks[t].test.inputs).float()
            )
        )
    assert acc == pytest.approx(expected)

    routed = REGISTRY["wemoe"].with_data(MergeData(objective=copy.copy(objective)))(
        theta0, taus, steps=3, batch_size=8, lr=0.05
    )
    acc = evaluator.network(lambda backbone: network(routed, backbone))
    model = network(routed, objective.backbone)
    with torch.no_grad():
        expected = by_hand(lambda t: model(tasks[t].test.inputs))
    assert acc == pytest.approx(expected)
