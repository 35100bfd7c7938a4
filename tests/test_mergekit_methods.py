"""mergekit's methods and LiNeS: DELLA, Breadcrumbs-TIES, SCE, NuSLERP, NearSwap and LiNeS, each against values
computed by hand on tiny tensors and an identity from its paper or tool."""

import math

import pytest
import torch

from mergeflow.ml.merging import REGISTRY
from mergeflow.ml.merging.della import keep_probabilities, magprune

T = torch.tensor


def close(a, b, atol=1e-6):
    return torch.allclose(a, b, atol=atol)


def _random(tasks=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    theta0 = {
        "blocks.0.w": torch.randn(6, 5, generator=g),
        "blocks.1.w": torch.randn(6, 5, generator=g),
        "norm.bias": torch.randn(5, generator=g),
    }
    tvs = {f"t{i}": {k: 0.1 * torch.randn(v.shape, generator=g) for k, v in theta0.items()} for i in range(tasks)}
    return theta0, tvs


# ------------------------------------------------------------------ DELLA
def test_della_keep_probabilities_rise_with_the_magnitude_rank_over_a_window_centred_on_one_minus_p():
    # |tau| ascending: 0.1 (rank 0), 0.2 (1/2), -0.4 (1): keep = 0.7 - 0.1 + 0.2 r
    assert close(keep_probabilities(T([[0.1, -0.4, 0.2]]), p=0.3, epsilon=0.2), T([[0.6, 0.8, 0.7]]))
    # a 1-D tensor is one row; tied magnitudes rank by position
    assert close(keep_probabilities(T([0.5, -0.5, 0.1]), p=0.5, epsilon=0.4), T([0.5, 0.7, 0.3]))


def test_della_ranks_along_dim_1_as_mergekit_does_when_asked():
    # a [1, 3, 2] tensor: along the last axis each [0, j] pair ranks alone; along dim 1 (mergekit's della_magprune)
    # each column's three entries rank together. keep = 0.7 - 0.1 + 0.2 r (p 0.3, epsilon 0.2), by hand
    tau = T([[[0.1, 0.9], [0.3, 0.2], [0.2, 0.5]]])
    assert close(keep_probabilities(tau, p=0.3, epsilon=0.2), T([[[0.6, 0.8], [0.8, 0.6], [0.6, 0.8]]]))
    assert close(
        keep_probabilities(tau, p=0.3, epsilon=0.2, rank_axis="dim1"), T([[[0.6, 0.8], [0.8, 0.6], [0.7, 0.7]]])
    )
    matrix = T([[0.1, -0.4, 0.2], [0.3, 0.1, 0.2]])  # on a matrix the two agree
    assert close(keep_probabilities(matrix, 0.3, 0.2, "dim1"), keep_probabilities(matrix, 0.3, 0.2))


def test_magprune_keeps_each_entry_with_its_probability_and_is_unbiased():
    g = torch.Generator().manual_seed(1)
    tau = torch.rand(1, 20_000, generator=g) + 0.5
    pruned = magprune(tau, p=0.5, epsilon=0.4, rescale="keep_probability", seed=3)
    keep = keep_probabilities(tau, 0.5, 0.4)
    kept = pruned != 0
    assert close(pruned[kept], (tau / keep)[kept])
    order = tau[0].argsort()
    smallest, largest = kept[0, order[:2000]].float().mean(), kept[0, order[-2000:]].float().mean()
    assert abs(smallest - 0.32) < 0.03 and abs(largest - 0.68) < 0.03  # keep 0.3 + 0.4 r over those ranks
    assert abs(pruned.mean() / tau.mean() - 1) < 0.02  # E[kept / k] = tau


def test_magprune_l1_rescale_keeps_the_tensors_l1_norm():
    tau = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    pruned = magprune(tau, p=0.6, epsilon=0.2, rescale="l1", seed=0)
    assert (pruned == 0).any() and math.isclose(float(pruned.abs().sum()), float(tau.abs().sum()), rel_tol=1e-5)


def test_della_without_drop_is_ties_disjoint_mean_and_della_linear_is_task_arithmetic():
    theta0, tvs = _random()
    della = REGISTRY["della"](theta0, tvs, p=0.0, epsilon=0.0, lam=1.3)
    ties = REGISTRY["ties"](theta0, tvs, k=1.0, trim_scope="tensor", lam=1.3)
    linear = REGISTRY["della_linear"](theta0, tvs, p=0.0, epsilon=0.0, lam=0.3)
    ta = REGISTRY["task_arithmetic"](theta0, tvs, lam=0.3)
    assert all(close(della[k], ties[k], 1e-5) and close(linear[k], ta[k], 1e-5) for k in theta0)


def test_della_drops_differently_per_seed_and_refuses_a_window_outside_the_probabilities():
    theta0, tvs = _random()
    a, b = (REGISTRY["della"](theta0, tvs, seed=s) for s in (0, 1))
    assert not torch.equal(a["blocks.0.w"], b["blocks.0.w"])
    with pytest.raises(ValueError, match=r"merge\.della: need 0 <= p - epsilon/2"):
        REGISTRY["della"](theta0, tvs, p=0.05, epsilon=0.2)


# ------------------------------------------------------------------ Breadcrumbs-TIES
def test_breadcrumbs_ties_by_hand():
    # n = 5, gamma 0.2, beta 0.4 (floor): ranks [1, 3) from the largest are kept
    #   a = [5, 3, -2, 1, .5] keeps 3, -2; b = [-1, 4, 2, -6, .1] keeps 4, 2
    #   totals [0, 7, 0, 0, 0]: entry 1 elects + (3 and 4 agree), entry 2 sums to 0 and elects nothing
    theta0 = {"w": torch.zeros(5)}
    tvs = {"a": {"w": T([5.0, 3.0, -2.0, 1.0, 0.5])}, "b": {"w": T([-1.0, 4.0, 2.0, -6.0, 0.1])}}
    hp = {"gamma": 0.2, "beta": 0.4, "lam": 0.5}
    assert close(REGISTRY["breadcrumbs_ties"](theta0, tvs, fuse="sum", **hp)["w"], T([0.0, 3.5, 0.0, 0.0, 0.0]))
    assert close(REGISTRY["breadcrumbs_ties"](theta0, tvs, fuse="mean", **hp)["w"], T([0.0, 1.75, 0.0, 0.0, 0.0]))


def test_breadcrumbs_ties_without_sign_conflict_is_breadcrumbs():
    theta0, tvs = _random()
    positive = {t: {k: v.abs() for k, v in tv.items()} for t, tv in tvs.items()}
    for scope in ("row", "tensor"):
        bt = REGISTRY["breadcrumbs_ties"](theta0, positive, scope=scope, lam=0.7)
        bc = REGISTRY["breadcrumbs"](theta0, positive, scope=scope, alpha=0.7)
        assert all(close(bt[k], bc[k], 1e-5) for k in theta0)


# ------------------------------------------------------------------ SCE
def test_sce_by_hand():
    theta0 = {"w": torch.zeros(4)}
    tvs = {"a": {"w": T([1.0, 2.0, -1.0, 0.0])}, "b": {"w": T([3.0, -1.0, -1.0, 0.0])}}
    # all selected: energies 6/4 and 11/4, w = [6, 11] / 17; signs elected [+, +, -, none]
    w = T([6.0, 11.0]) / 17
    expected = T([w[0] * 1 + w[1] * 3, 2.0, -1.0, 0.0])
    assert close(REGISTRY["sce"](theta0, tvs)["w"], expected)
    # select_topk 0.5: variances [1, 2.25, 0, 0], two nonzero, floor(1) kept: entry 1 only; a's 2 outweighs b's -1
    assert close(REGISTRY["sce"](theta0, tvs, select_topk=0.5, lam=1.5)["w"], T([0.0, 3.0, 0.0, 0.0]))


def test_sce_with_equal_energies_is_ties_disjoint_mean():
    theta0, tvs = _random(tasks=2)
    a = tvs["t0"]
    flipped = {k: v.flatten().flip(0).reshape(v.shape) for k, v in a.items()}  # same entries: same energy per tensor
    tvs = {"a": a, "b": flipped}
    sce = REGISTRY["sce"](theta0, tvs, lam=1.2)
    ties = REGISTRY["ties"](theta0, tvs, k=1.0, trim_scope="tensor", lam=1.2)
    assert all(close(sce[k], ties[k], 1e-5) for k in theta0)


def test_sce_with_mergekits_energy_floor_weights_tiny_task_vectors_uniformly():
    # the by-hand case scaled down 1e4: energies ~1e-8, under mergekit's 1e-6 guard: uniform weights, TIES' mean
    theta0 = {"w": torch.zeros(4)}
    tvs = {"a": {"w": 1e-4 * T([1.0, 2.0, -1.0, 0.0])}, "b": {"w": 1e-4 * T([3.0, -1.0, -1.0, 0.0])}}
    ours = REGISTRY["sce"](theta0, tvs)["w"]
    mergekit = REGISTRY["sce"](theta0, tvs, energy_floor=1e-6)["w"]
    w = T([6.0, 11.0]) / 17
    assert close(ours, 1e-4 * T([w[0] * 1 + w[1] * 3, 2.0, -1.0, 0.0]), atol=1e-10)
    assert close(mergekit, 1e-4 * T([2.0, 2.0, -1.0, 0.0]), atol=1e-10)  # (1 + 3) / 2 on entry 0


# ------------------------------------------------------------------ NuSLERP
def test_nuslerp_on_rows_and_columns_by_hand():
    theta0 = {"w": torch.zeros(2, 2)}
    tvs = {"a": {"w": T([[1.0, 0.0], [0.0, 1.0]])}, "b": {"w": T([[0.0, 1.0], [0.0, 2.0]])}}
    s = math.sqrt(0.5)
    # rows: (1,0)-(0,1) orthogonal, slerp at 1/2 = (s, s); (0,1)-(0,2) parallel: lerp (0, 1.5)
    assert close(REGISTRY["nuslerp"](theta0, tvs, vectors="rows")["w"], T([[s, s], [0.0, 1.5]]))
    # columns: (1,0)-(0,0): a zero vector is at a right angle, sin(pi/4) (1,0); (0,1)-(1,2): cos = 2/sqrt(5),
    # slerp at 1/2 = (a + b) / (2 cos(omega/2))
    factor = 1 / (2 * math.sqrt((1 + 2 / math.sqrt(5)) / 2))
    assert close(REGISTRY["nuslerp"](theta0, tvs, vectors="columns")["w"], T([[s, factor], [0.0, 3 * factor]]))


def test_nuslerp_on_whole_tensors_is_slerp_and_merges_two_models_only():
    theta0, tvs = _random(tasks=2)
    for t in (0.25, 0.5, 0.9):
        nu, sl = REGISTRY["nuslerp"](theta0, tvs, t=t), REGISTRY["slerp"](theta0, tvs, t=t)
        assert all(close(nu[k], sl[k], 1e-5) for k in theta0)
    with pytest.raises(ValueError, match="exactly two models, got 3"):
        REGISTRY["nuslerp"](*_random(tasks=3))


# ------------------------------------------------------------------ NearSwap
def test_nearswap_by_hand_and_as_mergekit_for_one_model():
    theta0 = {"w": torch.zeros(3)}
    a = T([0.5e-4, 2e-4, -4e-4])
    # weights clamp(1e-4 / |tau|, 0, 1) = [1, 0.5, 0.25]
    assert close(REGISTRY["nearswap"](theta0, {"a": {"w": a}}, t=1e-4)["w"], T([0.5e-4, 1e-4, -1e-4]), atol=1e-10)
    # mergekit's formula on (base, model): weight * model + (1 - weight) * base
    base, model = torch.randn(50, generator=torch.Generator().manual_seed(0)), None
    model = base + 1e-3 * torch.randn(50, generator=torch.Generator().manual_seed(1))
    weight = (3e-4 / (base - model).abs().clamp(min=1e-6)).clamp(0, 1)
    ours = REGISTRY["nearswap"]({"w": base}, {"m": {"w": model - base}}, t=3e-4)["w"]
    assert close(ours, weight * model + (1 - weight) * base)
    # two tasks: the mean of the two pairwise merges
    b = T([1e-4, -1e-4, 1e-3])
    two = REGISTRY["nearswap"](theta0, {"a": {"w": a}, "b": {"w": b}}, t=1e-4)["w"]
    assert close(two, (T([0.5e-4, 1e-4, -1e-4]) + T([1e-4, -1e-4, 1e-4])) / 2, atol=1e-10)


# ------------------------------------------------------------------ LiNeS
def test_lines_scales_each_block_by_its_depth_by_hand():
    theta0 = {
        "blocks.0.w": torch.zeros(2),
        "blocks.2.w": torch.zeros(2),
        "blocks.1.w": torch.zeros(2),
        "norm.w": torch.zeros(2),
    }
    ones = {k: torch.ones(2) for k in theta0}
    tvs = {"a": ones, "b": {k: 3 * torch.ones(2) for k in theta0}}
    # base task arithmetic: tau_MTL = sum = 4, alpha = 1 / T = 0.5; depths 0, 1, 0.5 and none (alpha)
    merged = REGISTRY["lines"](theta0, tvs, beta=0.4)
    expected = {"blocks.0.w": 0.5 * 4, "blocks.2.w": (0.5 + 0.4) * 4, "blocks.1.w": (0.5 + 0.2) * 4, "norm.w": 0.5 * 4}
    assert all(close(merged[k], torch.full((2,), v)) for k, v in expected.items())


def test_lines_alpha_gives_tau_mtl_the_mean_task_vectors_l1_norm():
    theta0, tvs = _random()
    at_zero = REGISTRY["lines"](theta0, tvs, base="ties", ties_k=0.5, beta=0.0)
    ties = REGISTRY["ties"](theta0, tvs, k=0.5, lam=1.0)
    mean_l1 = sum(float(sum(tv[k] for tv in tvs.values()).abs().sum()) for k in theta0) / len(tvs)
    moved = {k: at_zero[k] - theta0[k] for k in theta0}
    assert math.isclose(sum(float(v.abs().sum()) for v in moved.values()), mean_l1, rel_tol=1e-5)
    # ... in TIES' direction, and with base task arithmetic at beta 0 it is weight averaging
    ratio = float(moved["blocks.0.w"].norm() / (ties["blocks.0.w"] - theta0["blocks.0.w"]).norm())
    assert all(close(moved[k], ratio * (ties[k] - theta0[k]), 1e-5) for k in theta0)
    wa, lines = REGISTRY["weight_averaging"](theta0, tvs), REGISTRY["lines"](theta0, tvs, beta=0.0)
    assert all(close(wa[k], lines[k], 1e-5) for k in theta0)


@pytest.mark.parametrize(
    "name, hp",
    [
        ("della", {"p": 0.0, "epsilon": 0.0}),
        ("della_linear", {"p": 0.0, "epsilon": 0.0, "lam": 0.5}),
        ("breadcrumbs_ties", {"gamma": 0.0, "beta": 1.0, "fuse": "mean", "lam": 1.0}),
        ("sce", {}),
        ("nuslerp", {}),
        ("nearswap", {"t": 1.0}),
        ("lines", {"beta": 0.0}),
    ],
)
def test_float64_merges_of_copies_stay_float64_and_exact(name, hp):
    theta0, tvs = _random(tasks=2)
    theta0 = {k: v.double() for k, v in theta0.items()}
    tau = {k: v.double() for k, v in tvs["t0"].items()}
    copies = {"a": tau, "b": tau}
    scale = 2 * hp.get("lam", 1.0) if name == "della_linear" else (hp.get("lam", 1.1) if name == "della" else 1.0)
    merged = REGISTRY[name](theta0, copies, **hp)
    assert all(
        merged[k].dtype == torch.float64 and torch.allclose(merged[k], theta0[k] + scale * tau[k], rtol=0, atol=1e-12)
        for k in theta0
    )


# ------------------------------------------------------------------ WUDI
def test_wudi_gradient_is_fusionbench_autograd_and_exact_solves_the_normal_equations():
    from mergeflow.ml.merging.wudi import interference, normal_equations, solve_exact

    g = torch.Generator().manual_seed(4)
    taus = torch.randn(3, 5, 2, generator=g, dtype=torch.float64) @ torch.randn(
        3, 2, 6, generator=g, dtype=torch.float64
    )  # rank 2 each
    merged = torch.randn(5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    interference(merged, taus).backward()  # FusionBench's loss, by autograd
    s, b = normal_equations(taus)
    assert torch.allclose(merged.grad, 2 * (merged.detach() @ s - b), atol=1e-10)
    # S has rank 6 = in here (three rank-2 vectors): the unique minimiser, where the gradient vanishes
    exact = solve_exact(taus)
    assert torch.allclose(exact @ s, b, atol=1e-10) and float(interference(exact, taus)) < float(
        interference(taus.sum(0), taus)
    )


def test_wudi_keeps_the_start_outside_the_task_vectors_row_space_and_adam_descends():
    from mergeflow.ml.merging.wudi import interference, normal_equations, solve_adam, solve_exact

    g = torch.Generator().manual_seed(5)
    taus = torch.zeros(2, 4, 3, dtype=torch.float64)
    taus[:, :, :2] = torch.randn(
        2, 4, 2, generator=g, dtype=torch.float64
    )  # rows in span(e1, e2): e3 is S's null space
    exact = solve_exact(taus)
    s, b = normal_equations(taus)
    assert torch.allclose(exact[:, 2], taus.sum(0)[:, 2]) and torch.allclose(exact @ s, b, atol=1e-10)
    losses = [float(interference(solve_adam(taus, steps, 1e-2), taus)) for steps in (0, 50, 2000)]
    assert losses[0] > losses[1] > losses[2] and losses[2] < float(interference(exact, taus)) + 1e-6


def test_wudi_averages_what_is_not_a_matrix():
    theta0, tvs = _random()
    merged = REGISTRY["wudi"](theta0, tvs, steps=3)
    assert close(merged["norm.bias"], theta0["norm.bias"] + sum(tv["norm.bias"] for tv in tvs.values()) / 3)


# ------------------------------------------------------------------ DOGE-TA
def test_doge_gradient_is_fusionbench_autograd_and_descends():
    from mergeflow.ml.merging.doge_ta import conflict, correction

    g = torch.Generator().manual_seed(6)
    taus = torch.randn(3, 5, 4, generator=g, dtype=torch.float64)
    lambdas = torch.tensor([0.5, 0.2, 0.3], dtype=torch.float64)
    delta = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    conflict(delta, taus, lambdas).backward()
    one_step = correction(
        taus, lambdas, torch.zeros(5, 0, dtype=torch.float64), steps=1, lr=1e-3
    )  # Adam's first step: -lr sign(g)
    merged = (lambdas[:, None, None] * taus).sum(0)
    grad0 = -2 * lambdas.sum() * (((taus * taus).sum(-1) - (taus * merged).sum(-1))[:, :, None] * taus).sum(0)
    assert torch.allclose(one_step, -1e-3 * torch.sign(grad0), atol=1e-9)
    zero = torch.zeros(5, 4, dtype=torch.float64, requires_grad=True)
    conflict(zero, taus, lambdas).backward()
    assert torch.allclose(zero.grad, grad0, atol=1e-10)  # the closed form is FusionBench's loss differentiated
    losses = [
        float(conflict(correction(taus, lambdas, torch.zeros(5, 0, dtype=torch.float64), steps, 1e-2), taus, lambdas))
        for steps in (0, 20, 200)
    ]
    assert losses[0] > losses[1] > losses[2]


def test_doge_shared_basis_by_hand():
    from mergeflow.ml.merging.doge_ta import shared_basis

    # rank-1 task vectors with left vectors e1 and (e1 + e2)/sqrt 2: [u1, u2]'s top left singular vector bisects them
    e1, e12 = T([1.0, 0.0, 0.0]), T([1.0, 1.0, 0.0]) / math.sqrt(2)
    taus = torch.stack([torch.outer(e1, T([2.0, 0.0])), torch.outer(e12, T([0.0, 1.0]))]).double()
    basis = shared_basis(taus, subspace=2)  # r = 2: one vector per task, r // 2 = 1 shared
    expected = (e1 + e12) / (e1 + e12).norm()
    assert basis.shape == (3, 1) and torch.allclose(basis[:, 0].abs().float(), expected.abs(), atol=1e-6)


def test_doge_without_steps_is_masked_norm_scaled_task_arithmetic_by_hand():
    # one task, two matrices: |tau| over both = [4, .5, 2, .1,
    # 3, 1, .2, .3]; k = 0.4 keeps int(3.2) + 1 = 4 (|tau| >= 1)
    theta0 = {"a.weight": torch.zeros(2, 2), "b.weight": torch.zeros(2, 2), "bias": torch.ones(2)}
    tv = {"a.weight": T([[4.0, -0.5], [2.0, 0.1]]), "b.weight": T([[-3.0, 1.0], [0.2, 0.3]]), "bias": T([5.0, 5.0])}
    merged = REGISTRY["doge_ta"](theta0, {"t": tv}, lam=0.7, k=0.4, steps=0)
    norm_a, norm_b = math.sqrt(16 + 0.25 + 4 + 0.01), math.sqrt(9 + 1 + 0.04 + 0.09)
    assert close(merged["a.weight"], 0.7 / norm_a * T([[4.0, 0.0], [2.0, 0.0]]))
    assert close(merged["b.weight"], 0.7 / norm_b * T([[-3.0, 1.0], [0.0, 0.0]]))
    assert torch.equal(merged["bias"], theta0["bias"])  # not a matrix: theta0's, as FusionBench's
    # timm's head (CLIP's projection) is not the encoder's: theta0's, and outside the cut
    with_head = REGISTRY["doge_ta"](
        {**theta0, "head.weight": torch.zeros(2, 2)},
        {"t": {**tv, "head.weight": T([[9.0, 8.0], [7.0, 6.0]])}},
        lam=0.7,
        k=0.4,
        steps=0,
    )
    assert torch.equal(with_head["head.weight"], torch.zeros(2, 2)) and torch.equal(
        with_head["a.weight"], merged["a.weight"]
    )


@pytest.mark.parametrize("name", ["slerp", "nuslerp"])
def test_slerp_of_the_weights_themselves_without_a_base(name):
    # theta0 = (1, 0), theta_a = (0, 1), theta_b = theta0: on the weights, the arc between (0, 1) and (1, 0) at t = 1/2
    # is (1, 1)/sqrt(2). On the task vectors tau_b = 0: SLERP falls back to the line, theta0 + tau_a / 2 = (1/2, 1/2);
    # NuSLERP (mergekit's norm clamp) takes the zero vector as orthogonal, theta0 + sin(pi/4) tau_a
    theta0 = {"w": T([1.0, 0.0])}
    tvs = {"a": {"w": T([-1.0, 1.0])}, "b": {"w": T([0.0, 0.0])}}
    assert close(REGISTRY[name](theta0, tvs, t=0.5, space="weights")["w"], T([2**-0.5, 2**-0.5]))
    around_theta0 = T([0.5, 0.5]) if name == "slerp" else T([1 - 2**-0.5, 2**-0.5])
    assert close(REGISTRY[name](theta0, tvs, t=0.5)["w"], around_theta0)
