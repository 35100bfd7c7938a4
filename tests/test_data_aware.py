"""Data-aware merging (Fisher, RegMean, AdaMerging, AdaMerging + CART) and the statistics they read: each checked
against a formula by hand or an independent route (the papers' identities)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mergeflow.config import BackboneConfig
from mergeflow.ml.merging import REGISTRY, MergeData
from mergeflow.ml.merging._adaptive import EntropyObjective, MergedParameters
from mergeflow.ml.models import build_backbone
from mergeflow.ml.statistics import fisher_diagonal, input_grams

TINY_VIT = BackboneConfig(
    model="vit_tiny_patch16_224", kwargs={"img_size": 16, "patch_size": 8, "embed_dim": 16, "depth": 1, "num_heads": 2}
)


def _stats(**per_task):
    return MergeData(statistics=per_task)


# ---------------------------------------------------------------- Fisher
def test_fisher_with_equal_fishers_is_weight_averaging():
    g = torch.Generator().manual_seed(0)
    theta0 = {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)}
    taus = {t: {k: torch.randn(v.shape, generator=g) for k, v in theta0.items()} for t in "abc"}
    same = {k: torch.rand(v.shape, generator=g) + 0.1 for k, v in theta0.items()}
    data = _stats(**{t: {"fisher_sampled": same, "fisher_empirical": same} for t in taus})
    merged = REGISTRY["fisher"].with_data(data)(theta0, taus)
    average = REGISTRY["weight_averaging"](theta0, taus)
    for k in theta0:
        torch.testing.assert_close(merged[k], average[k])


def test_fisher_two_entries_by_hand():
    # theta0 = (1, 2); tau_a = (2, 0), tau_b = (-1, 4); F_a = (3, 0), F_b = (1, 1e-9 -> floor 1e-6)
    theta0 = {"w": torch.tensor([1.0, 2.0])}
    taus = {"a": {"w": torch.tensor([2.0, 0.0])}, "b": {"w": torch.tensor([-1.0, 4.0])}}
    fishers = {"a": {"w": torch.tensor([3.0, 0.0])}, "b": {"w": torch.tensor([1.0, 1e-9])}}
    data = _stats(**{t: {"fisher_sampled": fishers[t], "fisher_empirical": fishers[t]} for t in taus})
    merged = REGISTRY["fisher"].with_data(data)(theta0, taus)["w"]
    # entry 0: (3*3 + 1*0) / 4 = 2.25; entry 1: both at the floor 1e-6 -> the plain mean of 2 and 6 = 4
    torch.testing.assert_close(merged, torch.tensor([2.25, 4.0]))


def test_fisher_per_model_weights_by_hand():
    # the example above with lambda_a = 3 (lambda_b = 1, not named): entry 0: (3*3*2 + 1*1*(-1)) / (9 + 1) = 1.7 away;
    # entry 1: both at the floor, weights 3e-6 and 1e-6 -> (3 * 0 + 1 * 4) / 4 = 1 away
    theta0 = {"w": torch.tensor([1.0, 2.0], dtype=torch.float64)}
    taus = {
        "a": {"w": torch.tensor([2.0, 0.0], dtype=torch.float64)},
        "b": {"w": torch.tensor([-1.0, 4.0], dtype=torch.float64)},
    }
    fishers = {"a": {"w": torch.tensor([3.0, 0.0])}, "b": {"w": torch.tensor([1.0, 1e-9])}}
    data = _stats(**{t: {"fisher_sampled": fishers[t], "fisher_empirical": fishers[t]} for t in taus})
    merged = REGISTRY["fisher"].with_data(data)(theta0, taus, weights={"a": 3.0})["w"]
    torch.testing.assert_close(merged, torch.tensor([2.7, 3.0], dtype=torch.float64), rtol=0, atol=1e-12)
    # equal weights are the plain merge; a task not merged is named
    torch.testing.assert_close(
        REGISTRY["fisher"].with_data(data)(theta0, taus, weights={"a": 2.0, "b": 2.0})["w"],
        REGISTRY["fisher"].with_data(data)(theta0, taus)["w"],
    )
    with pytest.raises(ValueError, match="merge.fisher.weights: no task 'c' among the merged tasks"):
        REGISTRY["fisher"].with_data(data)(theta0, taus, weights={"c": 1.0})


def test_fisher_with_fusionbench_normalisation_and_floor_by_hand():
    # |F_a| = 3, |F_b| = 1: c = (1/3, 1) / (4/3) = (1/4, 3/4) (the 1e-6 guards aside); F + 1e-6
    #   entry 0: weights 0.75, 0.75 -> theta0 + (0.75 * 2 - 0.75 * 1) / 1.5 = 1.5
    #   entry 1: both Fishers 0 -> weights 0.25e-6, 0.75e-6 -> 2 + 0.75 * 4 = 5
    theta0 = {"w": torch.tensor([1.0, 2.0], dtype=torch.float64)}
    taus = {
        "a": {"w": torch.tensor([2.0, 0.0], dtype=torch.float64)},
        "b": {"w": torch.tensor([-1.0, 4.0], dtype=torch.float64)},
    }
    fishers = {"a": {"w": torch.tensor([3.0, 0.0])}, "b": {"w": torch.tensor([1.0, 0.0])}}
    data = _stats(**{t: {"fisher_sampled": fishers[t], "fisher_empirical": fishers[t]} for t in taus})
    merged = REGISTRY["fisher"].with_data(data)(theta0, taus, normalize="global_norm", floor_rule="add")["w"]
    c = torch.tensor([1 / (3 + 1e-6), 1 / (1 + 1e-6)], dtype=torch.float64)
    c = c / c.sum()
    w0, w1 = c * torch.tensor([3 + 1e-6, 1 + 1e-6], dtype=torch.float64), c * 1e-6
    expected = torch.stack([1 + (w0[0] * 2 - w0[1]) / w0.sum(), 2 + w1[1] * 4 / w1.sum()])
    torch.testing.assert_close(merged, expected, rtol=0, atol=1e-12)
    assert abs(float(merged[0]) - 1.5) < 1e-5 and abs(float(merged[1]) - 5.0) < 1e-5
    # without the normalisation, F + floor: entry 0 is (3 * 2 - 1) / 4 away, as with max(F, floor)
    plain = REGISTRY["fisher"].with_data(data)(theta0, taus, floor_rule="add")["w"]
    assert abs(float(plain[0]) - 2.25) < 1e-5


def test_fisher_diagonal_of_a_linear_model_matches_the_closed_form():
    """log p(y|x) = log softmax(H W x)[y]: d/dW = H^T (e_y - p) x^T, squared and averaged over examples."""
    g = torch.Generator().manual_seed(1)
    net = nn.Linear(5, 4, bias=False)
    head = nn.Linear(4, 3, bias=False)
    backbone = _LinearBackbone(net)
    x, y = torch.randn(7, 5, generator=g), torch.randint(3, (7,), generator=g)
    fisher = fisher_diagonal(backbone, head, x, y, generator=g, device=torch.device("cpu"))
    expected = torch.zeros(4, 5)
    with torch.no_grad():
        for xi, yi in zip(x, y):
            p = torch.softmax(head(net(xi)), -1)
            expected += torch.outer(head.weight.T @ (nn.functional.one_hot(yi, 3).float() - p), xi).square()
    torch.testing.assert_close(fisher["weight"], expected / len(x))


def test_sampled_fisher_draws_its_labels_from_the_model():
    """A head that puts all its mass on class 2: the sampled Fisher is the empirical one with every label 2."""
    net, head = nn.Linear(3, 2), nn.Linear(2, 3)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.copy_(torch.tensor([-50.0, -50.0, 50.0]))
        net.weight.normal_()
    x = torch.randn(6, 3)
    sampled = fisher_diagonal(
        _LinearBackbone(net), head, x, None, generator=torch.Generator().manual_seed(0), device=torch.device("cpu")
    )
    empirical = fisher_diagonal(
        _LinearBackbone(net), head, x, torch.full((6,), 2), generator=torch.Generator(), device=torch.device("cpu")
    )
    for k in sampled:
        torch.testing.assert_close(sampled[k], empirical[k])


class _LinearBackbone(nn.Module):
    """The two things mergeflow.ml.statistics uses of a Backbone (normalise, net) around a plain module."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def normalise(self, x):
        return x

    def forward(self, x):
        return self.net(x)


# ---------------------------------------------------------------- RegMean
def test_input_grams_are_x_transpose_x_over_every_row():
    g = torch.Generator().manual_seed(2)
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    x = torch.randn(9, 3, 4, generator=g)  # 9 examples x 3 tokens
    grams = input_grams(_LinearBackbone(net), x, batch_size=4, device=torch.device("cpu"))
    rows = x.reshape(-1, 4)
    hidden = torch.relu(net[0](rows)).detach()
    torch.testing.assert_close(grams["0.weight"], rows.T @ rows)
    torch.testing.assert_close(grams["2.weight"], hidden.T @ hidden)


def _regmean(theta0, taus, grams, alpha=1.0):
    return REGISTRY["regmean"].with_data(_stats(**{t: {"gram": grams[t]} for t in taus}))(theta0, taus, alpha=alpha)


def test_regmean_with_identity_grams_is_weight_averaging_and_one_task_gives_its_own_weights():
    g = torch.Generator().manual_seed(3)
    theta0 = {
        "fc.weight": torch.randn(3, 4, generator=g, dtype=torch.float64),
        "fc.bias": torch.randn(3, generator=g, dtype=torch.float64),
    }
    taus = {t: {k: torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in theta0.items()} for t in "abc"}
    identity = {t: {"fc.weight": torch.eye(4)} for t in taus}
    merged = _regmean(theta0, taus, identity, alpha=0.95)
    average = REGISTRY["weight_averaging"](theta0, taus)
    for k in theta0:
        torch.testing.assert_close(merged[k], average[k])
    gram = torch.randn(10, 4, generator=g)
    one = _regmean(theta0, {"a": taus["a"]}, {"a": {"fc.weight": gram.T @ gram}}, alpha=0.5)
    torch.testing.assert_close(one["fc.weight"], theta0["fc.weight"] + taus["a"]["fc.weight"])


def test_regmean_is_least_squares_on_the_union_of_the_tasks_inputs():
    """Jin et al.'s derivation: min_W sum_t ||X_t W^T - X_t W_t^T||^2 = (sum_t G_t)^-1 sum_t G_t W_t^T (alpha = 1)."""
    g = torch.Generator().manual_seed(4)
    theta0 = {"fc.weight": torch.zeros(2, 5, dtype=torch.float64)}
    xs = {t: torch.randn(n, 5, generator=g, dtype=torch.float64) for t, n in (("a", 12), ("b", 30), ("c", 7))}
    ws = {t: torch.randn(2, 5, generator=g, dtype=torch.float64) for t in xs}
    grams = {t: {"fc.weight": x.T @ x} for t, x in xs.items()}
    merged = _regmean(theta0, {t: {"fc.weight": ws[t]} for t in xs}, grams)["fc.weight"]
    inputs = torch.cat([xs[t] for t in xs])
    targets = torch.cat([xs[t] @ ws[t].T for t in xs])
    union = torch.linalg.lstsq(inputs, targets).solution.T
    torch.testing.assert_close(merged, union, rtol=1e-9, atol=1e-9)


def test_regmean_alpha_zero_keeps_only_the_diagonal():
    theta0 = {"fc.weight": torch.zeros(1, 2, dtype=torch.float64)}
    taus = {
        "a": {"fc.weight": torch.tensor([[1.0, 0.0]], dtype=torch.float64)},
        "b": {"fc.weight": torch.tensor([[0.0, 1.0]], dtype=torch.float64)},
    }
    grams = {
        "a": {"fc.weight": torch.tensor([[3.0, 1.0], [1.0, 1.0]])},
        "b": {"fc.weight": torch.tensor([[1.0, 1.0], [1.0, 3.0]])},
    }
    # diagonals (3, 1) and (1, 3): per input, w = sum_t G_t,ii W_t,i / sum_t G_t,ii -> (3/4, 3/4)
    torch.testing.assert_close(
        _regmean(theta0, taus, grams, alpha=0.0)["fc.weight"], torch.tensor([[0.75, 0.75]], dtype=torch.float64)
    )


def test_regmean_gives_an_input_no_task_activates_the_weights_average():
    """Input 2 is zero in every example (a dead ReLU unit): the least-squares fit on inputs 0-1 is unchanged (the
    same as without input 2) and the free column is the average of the models' columns."""
    g = torch.Generator().manual_seed(5)
    xs = {
        t: torch.cat([torch.randn(n, 2, generator=g, dtype=torch.float64), torch.zeros(n, 1, dtype=torch.float64)], 1)
        for t, n in (("a", 9), ("b", 6))
    }
    ws = {t: torch.randn(3, 3, generator=g, dtype=torch.float64) for t in xs}
    theta0 = {"fc.weight": torch.zeros(3, 3, dtype=torch.float64)}
    merged = _regmean(
        theta0, {t: {"fc.weight": ws[t]} for t in xs}, {t: {"fc.weight": x.T @ x} for t, x in xs.items()}, alpha=0.9
    )["fc.weight"]
    live = _regmean(
        {"fc.weight": torch.zeros(3, 2, dtype=torch.float64)},
        {t: {"fc.weight": ws[t][:, :2]} for t in xs},
        {t: {"fc.weight": (x.T @ x)[:2, :2]} for t, x in xs.items()},
        alpha=0.9,
    )["fc.weight"]
    torch.testing.assert_close(merged[:, :2], live, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(merged[:, 2], (ws["a"][:, 2] + ws["b"][:, 2]) / 2, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- AdaMerging
def _tiny_setup(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    backbone = build_backbone(TINY_VIT).to(dtype)
    theta0 = {k: v.detach().clone() for k, v in backbone.net.state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    tasks = ["a", "b", "c"]
    taus = {t: {k: 0.05 * torch.randn(v.shape, generator=g, dtype=dtype) for k, v in theta0.items()} for t in tasks}
    heads = {t: nn.Linear(backbone.num_features, 3 + i).to(dtype) for i, t in enumerate(tasks)}
    images = {t: torch.randint(0, 256, (24, 16, 16, 3), generator=g, dtype=torch.uint8) for t in tasks}
    objective = EntropyObjective(backbone, heads, {"test": images, "val": images}, torch.device("cpu"))
    return theta0, taus, objective


@pytest.mark.parametrize("method", ["adamerging", "adamerging_task"])
def test_adamerging_with_learning_rate_zero_is_task_arithmetic_at_its_init(method):
    theta0, taus, objective = _tiny_setup()
    data = MergeData(objective=objective)
    merged = REGISTRY[method].with_data(data)(theta0, taus, lr=0.0, steps=3)
    ta = REGISTRY["task_arithmetic"](theta0, taus, lam=0.3)
    for k in theta0:
        torch.testing.assert_close(merged[k], ta[k])
    assert len(data.learned) == 1 and len(data.learned[0]["entropy"]) == 3
    assert all(v == 0.3 for per_task in data.learned[0]["coefficients"].values() for v in per_task.values())


def test_adamerging_cart_with_learning_rate_zero_is_cart_at_its_init():
    theta0, taus, objective = _tiny_setup()
    merged = REGISTRY["adamerging_cart"].with_data(MergeData(objective=objective))(
        theta0, taus, lr=0.0, steps=2, init=1.5, rank_ratio=0.25
    )
    cart = REGISTRY["cart"](theta0, taus, lam=1.5, rank_ratio=0.25)
    for k in theta0:
        torch.testing.assert_close(merged[k], cart[k], rtol=1e-5, atol=1e-6)


def test_entropy_gradient_with_respect_to_lambda_matches_a_finite_difference():
    theta0, taus, objective = _tiny_setup(torch.float64)
    merged = MergedParameters(theta0, taus, layer_wise=True, init=0.3, device=torch.device("cpu"))
    batch = {t: x[:8] for t, x in objective.inputs["test"].items()}
    loss = objective.loss(merged(), batch)
    (gradient,) = torch.autograd.grad(loss, merged.lam)
    eps = 1e-6
    for i, j in [(0, 0), (1, 3), (2, len(merged.keys) - 1), (0, len(merged.keys) // 2)]:
        with torch.no_grad():
            merged.lam[i, j] += eps
            up = objective.loss(merged(), batch)
            merged.lam[i, j] -= 2 * eps
            down = objective.loss(merged(), batch)
            merged.lam[i, j] += eps
        assert float(gradient[i, j]) == pytest.approx(float((up - down) / (2 * eps)), rel=1e-5, abs=1e-9)


def test_adamerging_learns_one_coefficient_per_task_and_tensor_or_per_task():
    theta0, taus, objective = _tiny_setup()
    for method, per_task in (("adamerging", len(theta0)), ("adamerging_task", 1)):
        data = MergeData(objective=copy.copy(objective))
        REGISTRY[method].with_data(data)(theta0, taus, steps=2)
        assert {len(c) for c in data.learned[0]["coefficients"].values()} == {per_task}


def test_a_data_aware_method_called_without_its_data_names_what_it_reads():
    theta0, taus, _ = _tiny_setup()
    with pytest.raises(ValueError, match="adamerging.*test inputs"):
        REGISTRY["adamerging"](theta0, taus)


# ---------------------------------------------------------------- through the pipeline (the tiny profile)
def test_entropy_falls_on_the_embedded_suite_and_the_pipeline_records_what_was_learned(tiny_reference):
    """On the tiny pipeline's own models and test inputs, with each step seeing a task's whole test split (so the
    objective is the same every step), Adam on the layer-wise coefficients lowers the entropy."""
    import json

    from mergeflow.params import load_params
    from mergeflow.pipeline.binding import bind_data as _merge_data
    from mergeflow.core.layout import Layout
    from mergeflow.ml.data import load_tasks as _load_tasks
    from mergeflow.ml.models import load_heads as _load_heads
    from mergeflow.ml.task_vectors import load_task_vectors as _load_task_vectors

    root, _ = tiny_reference
    params, layout = load_params(root / "params.yaml"), Layout(root)
    tasks = _load_tasks(params, layout)
    heads = _load_heads(params, layout, build_backbone(params.backbone).num_features, tasks)
    theta0, taus = _load_task_vectors(params, layout)
    data = _merge_data(params, REGISTRY["adamerging"], layout, tasks, heads, torch.device("cpu"))
    n_test = params.suite.n_test
    REGISTRY["adamerging"].with_data(data)(theta0, taus, lr=0.05, steps=20, batch_size=n_test)
    entropy = data.learned[0]["entropy"]
    assert entropy[-1] < 0.98 * entropy[0], entropy
    assert all(b <= a + 1e-6 for a, b in zip(entropy, entropy[1:])), entropy  # monotone at this small step

    chosen = json.loads((root / "metrics" / "merge" / "adamerging_cart.json").read_text())
    assert chosen["reads"] == "test_inputs" and len(chosen["learned"]["entropy"]) == 10
    assert set(chosen["learned"]["coefficients"]) == set(params.suite.tasks)
    summary = (root / "results" / "summary.md").read_text()
    assert (
        "| standard | adamerging_cart | test inputs (TTA) |" in summary
        and "| standard | fisher | train stats |" in summary
    )
    stats = json.loads((root / "metrics" / "statistics.json").read_text())
    assert stats["examples"] == dict.fromkeys(params.suite.tasks, 32) and stats["read_by"] == ["fisher", "regmean"]
