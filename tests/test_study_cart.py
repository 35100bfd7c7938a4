"""Study cart (seed 002): its metrics where the answer is known, and its verdicts on hand-made numbers."""

import math

import pytest
import torch

from mergeflow.studies import REGISTRY
from mergeflow.studies.cart import (
    CartSettings,
    LayerSpectra,
    claim_indexing,
    claim_interference,
    claim_rank_curve,
    claim_ranking,
    claim_scaling,
    claim_tradeoff,
    draw_subsets,
    energy_kept,
    interference,
    reconstruction,
    spectra,
    steep_then_flat,
    svd_stack,
)

S = CartSettings()
RATIOS = list(S.ratios)


def test_registered_with_its_settings():
    assert REGISTRY["cart"].settings_model is CartSettings
    assert REGISTRY["cart"].settings({}, where="studies.cart") == S


@pytest.mark.parametrize(
    "bad",
    [
        {"ratios": [0.1, 0.5, 1.0]},
        {"ratios": [0.0, 1.0]},
        {"subset_sizes": [1, 2]},
        {"cart_lambdas": []},
        {"unknown": 1},
    ],
)
def test_bad_settings_refused(bad):
    with pytest.raises(ValueError):
        REGISTRY["cart"].settings(bad, where="studies.cart")


def test_disjoint_row_spaces_have_no_interference():
    g = torch.Generator().manual_seed(0)
    a, b = torch.zeros(6, 8), torch.zeros(6, 8)
    a[:, :4] = torch.randn(6, 4, generator=g)  # row space in the first 4 coordinates
    b[:, 4:] = torch.randn(6, 4, generator=g)  # row space in the last 4
    s, vh = svd_stack(torch.stack([a, b]))
    for k in range(1, 5):
        assert interference(s, vh, k) == pytest.approx(0.0, abs=1e-12)
        assert interference(s, vh, k, top_only=True) == pytest.approx(0.0, abs=1e-12)
    same, vh2 = svd_stack(torch.stack([a, a]))
    assert interference(same, vh2, 1, top_only=True) == pytest.approx(
        2.0
    )  # two ordered pairs, unit-norm top-1 values, one vector
    frac = float(same[0, 0] ** 2 / (same[0] ** 2).sum())
    assert interference(same, vh2, 1) == pytest.approx(2 * frac)  # top value over the whole spectrum's norm
    p = same[0] ** 2 / (same[0] ** 2).sum()
    full = 2 * float(p.pow(2).sum().sqrt())  # ||S~^2||_F for each ordered pair
    assert interference(same, vh2, 4) == pytest.approx(full) and interference(
        same, vh2, 4, top_only=True
    ) == pytest.approx(full)  # full rank: one reading
    assert interference(s, vh, 0) == 0.0


def test_rank_one_update_reconstructs_at_rank_one():
    g = torch.Generator().manual_seed(1)
    u, v = torch.randn(7, 1, generator=g, dtype=torch.float64), torch.randn(1, 5, generator=g, dtype=torch.float64)
    s, _ = svd_stack((u @ v)[None])
    assert reconstruction(s, 0) == pytest.approx(float(((u @ v) ** 2).sum()), rel=1e-9)
    assert reconstruction(s, 1) == pytest.approx(0.0, abs=1e-12)
    assert energy_kept(s, 1) == pytest.approx(1.0)


def test_centring_identical_vectors_gives_zero():
    g = torch.Generator().manual_seed(2)
    tau = torch.randn(12, 10, generator=g)
    pretrained = {"blocks.0.mlp.fc1.weight": torch.zeros(12, 10), "blocks.0.norm.bias": torch.zeros(10)}
    vectors = {t: {"blocks.0.mlp.fc1.weight": tau.clone(), "blocks.0.norm.bias": torch.ones(10)} for t in "abc"}
    (layer,) = spectra(pretrained, vectors, list("abc"), RATIOS, 0.08)  # the bias is not a matrix
    assert layer.ranks == [0, 1, 1, 1, 2, 4, 7, 10]
    assert all(v == pytest.approx(0.0, abs=1e-9) for v in layer.i_centred)
    assert all(v == 0.0 for v in layer.r_centred)  # R(0) = 0: nothing to reconstruct
    assert all(v > 0 for v in layer.i_original[1:])  # the original vectors are all the same: maximal overlap
    assert all(b >= a for a, b in zip(layer.i_original, layer.i_original[1:]))  # partial sums: I(k) grows with k
    assert layer.norm_ratio == pytest.approx(0.0, abs=1e-9)


def _spectra(i_centred, i_original, r_centred) -> LayerSpectra:
    return LayerSpectra(
        "blocks.0.mlp.fc1.weight",
        (512, 128),
        [0, 3, 6, 11, 21, 41, 82, 128],
        i_centred,
        i_original,
        r_centred,
        0.5,
        0.4,
        0.1,
    )


def test_rank_curve_verdicts():
    wa = 0.70
    bell = [0.70, 0.74, 0.78, 0.80, 0.77, 0.74, 0.72, 0.701]
    rise = [0.65, 0.68, 0.70, 0.72, 0.73, 0.74, 0.745, 0.75]
    c = claim_rank_curve(RATIOS, bell, rise, wa, S)
    assert c.holds and c.numbers["cart_peak_ratio"] == 0.08
    assert not claim_rank_curve(RATIOS, bell[:-1] + [0.73], rise, wa, S).holds  # does not return to WA
    assert not claim_rank_curve(RATIOS, [0.70, 0.70, 0.70, 0.701, 0.70, 0.70, 0.70, 0.70], rise, wa, S).holds  # no peak
    assert not claim_rank_curve(
        RATIOS, [0.70, 0.70, 0.70, 0.71, 0.72, 0.78, 0.75, 0.70], rise, wa, S
    ).holds  # peak at 32%: not low
    peaked = [0.65, 0.70, 0.80, 0.78, 0.76, 0.75, 0.75, 0.75]
    c = claim_rank_curve(RATIOS, bell, peaked, wa, S)
    assert not c.holds and not c.numbers["lrta_rises_no_peak"]


def test_interference_verdict():
    below = _spectra([0, 1, 2, 3, 4, 5, 6, 7], [0, 2, 3, 4, 5, 6, 7, 8], [1] * 8)
    assert claim_interference([below, below], RATIOS, S).holds
    one_above = _spectra([0, 1, 2, 3, 4, 5, 6, 9], [0, 2, 3, 4, 5, 6, 7, 8], [1] * 8)
    c = claim_interference([below, one_above], RATIOS, S)
    assert not c.holds and c.numbers["centred_below"] == 13 and c.numbers["points"] == 14
    assert claim_interference([below, one_above], RATIOS, CartSettings(interference_fraction=0.9)).holds


def test_tradeoff_verdict():
    steep = [1.0, 0.7, 0.5, 0.3, 0.25, 0.2, 0.1, 0.0]
    assert steep_then_flat(RATIOS, steep, 0.08) == pytest.approx((0.7 / 0.08) / (0.3 / 0.92))
    rising = [0, 1, 2, 3, 4, 5, 6, 7]
    assert claim_tradeoff([_spectra(rising, rising, steep)], RATIOS, S).holds
    linear = [1 - r for r in RATIOS]  # a flat spectrum: R falls at the same rate everywhere
    assert not claim_tradeoff([_spectra(rising, rising, linear)], RATIOS, S).holds
    falling = [0, 1, 2, 3, 2.5, 4, 5, 6]
    c = claim_tradeoff([_spectra(falling, falling, steep)], RATIOS, S)
    assert not c.holds and c.numbers["steep_then_flat"] and not c.numbers["i_rises_after_knee"]


def test_indexing_verdict():
    assert claim_indexing(0.85, 0.80, 0.855, S).holds
    assert not claim_indexing(0.80, 0.77, 0.855, S).holds  # 5.5 points below the individual models
    assert not claim_indexing(0.85, 0.86, 0.855, S).holds  # below EMR
    assert claim_indexing(None, 0.8, 0.85, S).holds is None
    assert claim_indexing(0.85, None, 0.855, S).holds is None  # close, EMR not run


def test_scaling_verdict():
    norm = {
        "weight_averaging": [0.95, 0.85],
        "task_arithmetic": [0.96, 0.87],
        "ties": [0.97, 0.88],
        "cart": [0.97, 0.93],
    }
    c = claim_scaling([2, 8], norm)
    assert c.holds and c.numbers["drop"]["cart"] == pytest.approx(0.04)
    assert not claim_scaling([2, 8], {**norm, "ties": [0.97, 0.94]}).holds
    assert claim_scaling([8], {m: v[:1] for m, v in norm.items()}).holds is None
    three = claim_scaling([2, 4, 8], {m: [v[0], v[0], v[1]] for m, v in norm.items()})
    assert three.holds and three.numbers["drop_from_second_size"]["cart"] == pytest.approx(0.04)


def test_cart_is_weight_averaging_for_two_tasks():
    from mergeflow.ml.merging import REGISTRY as METHODS

    g = torch.Generator().manual_seed(3)
    pretrained = {"blocks.0.mlp.fc1.weight": torch.randn(6, 5, generator=g), "blocks.0.norm.bias": torch.zeros(5)}
    vectors = {t: {k: torch.randn(v.shape, generator=g) for k, v in pretrained.items()} for t in "ab"}
    wa = METHODS["weight_averaging"](pretrained, vectors)
    for ratio in (0.2, 0.6):
        merged = METHODS["cart"](pretrained, vectors, rank_ratio=ratio, lam=2.0)
        assert all(torch.allclose(merged[k], wa[k], atol=1e-5) for k in wa)


def test_ranking_verdict():
    layers = [_spectra([0] * 8, [0] * 8, [1] * 8)]
    seed_like = {"cart": 0.85, "consensus_ta": 0.75, "ties": 0.72, "task_arithmetic": 0.69, "weight_averaging": 0.66}
    c = claim_ranking(seed_like, layers, S)
    assert c.holds and c.numbers["median_energy_top_ratio"]["centred"] == 0.5
    assert c.numbers["orthogonal_norm_ratio"] == pytest.approx(math.sqrt(7 / 8), abs=1e-6)
    ours = {"cart": 0.731, "consensus_ta": 0.739, "ties": 0.726, "task_arithmetic": 0.743, "weight_averaging": 0.71}
    c = claim_ranking(ours, layers, S)
    assert not c.holds and c.numbers["ranking"] == [
        "task_arithmetic",
        "consensus_ta",
        "cart",
        "ties",
        "weight_averaging",
    ]
    assert claim_ranking({"cart": 0.8}, layers, S).holds is None


def test_subsets_distinct_deterministic_and_capped():
    tasks = list("abcdefgh")
    subs = draw_subsets(tasks, [2, 4, 8, 9], 3, 0)
    assert sorted(subs) == [2, 4, 8]  # 9 > the suite: dropped
    assert len(subs[8]) == 1 and subs[8][0] == tuple(tasks)
    assert all(len(set(v)) == len(v) == 3 for n, v in subs.items() if n < 8)
    assert subs == draw_subsets(tasks, [2, 4, 8, 9], 3, 0) and subs != draw_subsets(tasks, [2, 4, 8, 9], 3, 1)
    assert math.comb(3, 2) == len(draw_subsets(list("abc"), [2], 5, 0)[2])


def test_table_2_claim_on_a_text_suite_by_hand():
    from mergeflow.studies.cart.claims import claim_glue

    per_task = {
        "cart": {"a": 0.8, "b": 0.6},
        "task_arithmetic": {"a": 0.7, "b": 0.65},
        "ties": {"a": 0.5, "b": 0.5},
        "weight_averaging": {"a": 0.4, "b": 0.7},
    }
    acc = {m: sum(v.values()) / 2 for m, v in per_task.items()}  # CART 0.70, TA 0.675, TIES 0.50, WA 0.55
    claim = claim_glue(acc, per_task)
    assert claim.holds and claim.numbers["tasks_cart_above"] == {"task_arithmetic": 1, "ties": 2, "weight_averaging": 1}
    assert claim.margin == pytest.approx(0.025)
    per_task["task_arithmetic"]["b"] = 0.75  # TA 0.725: above CART
    acc["task_arithmetic"] = 0.725
    assert claim_glue(acc, per_task).holds is False
    del acc["ties"]
    assert claim_glue(acc, per_task).holds is None
