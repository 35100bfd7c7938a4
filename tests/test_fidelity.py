"""Fidelity to the papers and their reference code (issue 22), and hyperparameter ranges checked at load (issue 16).

- Iso-CTS sizes its subspaces so that c + T s = r (full rank) and scales by the mean of the kept singular values;
- CART, low-rank TA and CART-Indexing take k = ceil(gamma r) (seed 002, Algorithm 1);
- each top-k and band rounding keeps the count worked out by hand;
- every hyperparameter's range is checked when params.yaml is loaded, naming the key the user wrote.

(float64 inputs merging in float64: tests/test_fidelity_float64.py)
"""

import re

import numpy as np
import pytest
import torch

from mergeflow.params import parse_params
from mergeflow.core.errors import MergeflowError
from mergeflow.ml.merging import REGISTRY, Choice, PerTask, Range
from mergeflow.ml.merging._rounding import top_k_count
from mergeflow.ml.merging._tensors import rank_of_ratio
from mergeflow.ml.merging.iso import iso_cts_factors, iso_cts_matrix, subspace_sizes

MATRIX = "blocks.0.mlp.fc1.weight"


# ------------------------------------------------------------------ Iso-CTS
@pytest.mark.parametrize(
    "r, tasks, fraction, sizes",
    [
        (768, 8, 0.8, (616, 19)),  # c0 = floor(614.4) = 614, s = round(154 / 8 = 19.25) = 19, c = 768 - 152
        (48, 4, 0.8, (40, 2)),  # c0 = 38, s = round(2.5) = 2 (half to even), c = 40; the old rule: 38 + 4 x 2 = 46
        (16, 3, 0.8, (13, 1)),  # c0 = 12, s = round(1.33) = 1
        (10, 2, 0.8, (8, 1)),
        (4, 8, 0.5, (4, 0)),  # more tasks than directions: the common subspace takes them all
        (11, 4, 0.1, (3, 2)),  # c0 = 1: round(2.5) x 4 = 8 <= 11
        (9, 4, 0.05, (1, 2)),  # c0 = 0: round(2.25) = 2
        (10, 4, 0.05, (2, 2)),  # c0 = 0: round(2.5) = 2
        (11, 4, 0.05, (3, 2)),  # c0 = 0: round(2.75) = 3 would need 12 > 11 directions: s = floor(11 / 4)
    ],
)
def test_iso_cts_subspaces_fill_the_rank(r, tasks, fraction, sizes):
    assert subspace_sizes(r, tasks, fraction) == sizes
    c, s = sizes
    assert c + tasks * s == r and c >= 0


def _polar(x):
    u, _, vh = np.linalg.svd(x, full_matrices=False)
    return u @ vh


def _iso_cts_by_hand(taus: np.ndarray, c: int, s: int) -> tuple[np.ndarray, float]:
    """The authors' Iso-CTS in numpy: (merged matrix, sigma = the mean of the kept singular values)."""
    u, sv, vh = np.linalg.svd(taus.sum(0), full_matrices=False)
    us, vs, kept = [u[:, :c]], [vh[:c].T], [sv[:c]]
    for tau in taus:
        ut, st, vht = np.linalg.svd(tau - u[:, :c] @ (u[:, :c].T @ tau), full_matrices=False)
        us.append(ut[:, :s]), vs.append(vht[:s].T), kept.append(st[:s])
    sigma = np.concatenate(kept).mean()
    return sigma * _polar(np.concatenate(us, 1)) @ _polar(np.concatenate(vs, 1)).T, sigma


def test_iso_cts_is_full_rank_with_the_kept_singular_values_mean_where_tasks_do_not_divide_the_rest():
    # r = 48, T = 4: r - c0 = 10 is not a multiple of 4. c = 40, s = 2 (the old sizes, c = 38 and s = 2, left rank 46)
    g = torch.Generator().manual_seed(5)
    taus = torch.randn(4, 60, 48, generator=g, dtype=torch.float64)
    merged = iso_cts_matrix(taus, 0.8)
    expected, sigma = _iso_cts_by_hand(taus.numpy(), 40, 2)
    sv = torch.linalg.svdvals(merged)
    assert int((sv > 1e-8 * sv[0]).sum()) == 48
    assert torch.allclose(sv, torch.full_like(sv, sigma), rtol=1e-12, atol=0)
    assert np.allclose(merged.numpy(), expected, rtol=0, atol=1e-12)
    all_mean = torch.linalg.svdvals(taus.sum(0)).mean().item()
    assert abs(sigma - all_mean) > 1e-3 * all_mean  # the scale differs from the mean of all of M's singular values


def test_iso_cts_left_factor_falls_back_to_the_whole_basis_where_a_residual_has_too_low_a_rank():
    # above, full-rank tau_t: [U_c, polar(W)] matched the whole basis' polar factor by hand. Here each tau_t has rank
    # 1 and keeps s = 2 directions: its second is any unit vector off its residual's range, U_c's span included, so
    # the identity does not hold and the whole basis is orthogonalised; U stays orthonormal.
    g = torch.Generator().manual_seed(3)
    taus = torch.stack(
        [torch.outer(torch.randn(40, generator=g), torch.randn(32, generator=g)) for _ in range(4)]
    ).double()
    c, s = subspace_sizes(32, 4, 0.75)
    assert (c, s) == (24, 2)
    u, v, sigma, owner = iso_cts_factors(taus, 0.75)
    eye = torch.eye(32, dtype=torch.float64)
    torch.testing.assert_close(u.T @ u, eye, rtol=0, atol=1e-12)
    torch.testing.assert_close(v.T @ v, eye, rtol=0, atol=1e-12)


# ------------------------------------------------------------------ CART's rank: ceil(gamma r)
@pytest.mark.parametrize(
    "ratio, rank",
    [(0.08, 62), (0.12, 93), (0.04, 31), (0.16, 123), (0.32, 246), (0.25, 192), (0.5, 384), (1.0, 768), (0.0, 0)],
)
def test_rank_is_the_ceiling_of_ratio_times_width(ratio, rank):
    # 0.08 x 768 = 61.44 -> 62 (round gave 61); 0.12 x 768 = 92.16 -> 93; 0.25 x 768 = 192 exactly stays 192
    assert rank_of_ratio(torch.empty(768, 3072), ratio) == rank


def test_rank_ceiling_ignores_float_noise_above_an_integer():
    assert 0.07 * 100 > 7 and rank_of_ratio(torch.empty(100, 200), 0.07) == 7


def _low_rank(x: np.ndarray, k: int) -> np.ndarray:
    u, s, vh = np.linalg.svd(x, full_matrices=False)
    return (u[:, :k] * s[:k]) @ vh[:k]


def test_cart_low_rank_ta_and_cart_indexing_keep_the_ceiling_rank():
    # a 10 x 8 matrix at 0.3: ceil(2.4) = 3 (round gave 2)
    g = torch.Generator().manual_seed(2)
    theta0 = {MATRIX: torch.randn(10, 8, generator=g, dtype=torch.float64)}
    tvs = {f"t{i}": {MATRIX: torch.randn(10, 8, generator=g, dtype=torch.float64)} for i in range(3)}
    taus = np.stack([tv[MATRIX].numpy() for tv in tvs.values()])
    centred = taus - taus.mean(0)
    cart = (
        REGISTRY["cart"](theta0, tvs, rank_ratio=0.3, lam=1.0)[MATRIX].numpy() - theta0[MATRIX].numpy() - taus.mean(0)
    )
    assert np.allclose(cart, sum(_low_rank(c, 3) for c in centred), atol=1e-12)
    low = REGISTRY["low_rank_ta"](theta0, tvs, rank_ratio=0.3, lam=1.0)[MATRIX].numpy() - theta0[MATRIX].numpy()
    assert np.allclose(low, sum(_low_rank(t, 3) for t in taus), atol=1e-12)
    store = REGISTRY["cart_indexing"](theta0, tvs, rank_ratio=0.3)
    assert all(store[f"u/{t}/{MATRIX}"].shape == (10, 3) for t in tvs)


# ------------------------------------------------------------------ rounding of top-k and bands
def _distinct_48(seed=0) -> torch.Tensor:
    """48 entries with distinct magnitudes 1..48, random signs, shuffled."""
    g = torch.Generator().manual_seed(seed)
    values = torch.arange(1.0, 49.0) * torch.where(torch.rand(48, generator=g) < 0.5, -1.0, 1.0)
    return values[torch.randperm(48, generator=g)]


# (k, {rounding: entries kept of 48}), by hand: k n = 9.6, 14.4, 12 (exact), 0.48, 48
TOP_K_COUNTS = [
    (0.2, {"ties_original": 10, "floor": 9, "round": 10}),
    (0.3, {"ties_original": 15, "floor": 14, "round": 14}),
    (0.25, {"ties_original": 13, "floor": 12, "round": 12}),
    (0.01, {"ties_original": 1, "floor": 0, "round": 1}),
    (1.0, {"ties_original": 48, "floor": 48, "round": 48}),
]


@pytest.mark.parametrize("name", ["ties", "consensus_ties", "tall_ties"])
@pytest.mark.parametrize("k, counts", TOP_K_COUNTS)
@pytest.mark.parametrize("rounding", ["ties_original", "floor", "round"])
def test_each_top_k_rounding_keeps_the_count_worked_out_by_hand(name, k, counts, rounding):
    # one task: TIES' vector is the trimmed tau (consensus with min_tasks 1 keeps it whole; TALL + TIES stores it)
    tau = _distinct_48()
    theta0, tvs = {"w": torch.zeros(48)}, {"a": {"w": tau}}
    if name == "ties":
        vector = REGISTRY[name](theta0, tvs, k=k, rounding=rounding, lam=1.0)["w"]
    elif name == "consensus_ties":
        vector = REGISTRY[name](theta0, tvs, ties_k=k, rounding=rounding, min_tasks=1, alpha=1.0)["w"]
    else:
        vector = REGISTRY[name](theta0, tvs, ties_k=k, rounding=rounding)["shared/w"]
    kept = vector != 0
    assert int(kept.sum()) == counts[rounding]
    assert torch.equal(vector[kept], tau[kept])
    assert tau[kept].abs().numpy().min(initial=49) > tau[~kept].abs().numpy().max(initial=0)  # the largest magnitudes


def test_floor_rounding_computes_as_the_tools_do_float_noise_included():
    # int(0.29 * 100) = 28 in PEFT and mergekit (0.29 * 100 = 28.999999999999996)
    assert top_k_count(100, 0.29, "floor") == 28 and top_k_count(100, 0.29, "ties_original") == 29


@pytest.mark.parametrize(
    "gamma, beta, rounding, ranks",
    [
        # gamma n = 4.8, beta n = 9.6, (gamma + beta) n = 14.4
        (0.1, 0.2, "floor", range(4, 13)),  # [4, 4 + 9)
        (0.1, 0.2, "round", range(5, 14)),  # [5, 14)
        # gamma n = 2.4, beta n = 14.4, (gamma + beta) n = 16.8
        (0.05, 0.3, "floor", range(2, 16)),  # [2, 2 + 14)
        (0.05, 0.3, "round", range(2, 17)),  # [2, 17)
    ],
)
def test_each_band_rounding_keeps_the_ranks_worked_out_by_hand(gamma, beta, rounding, ranks):
    tau = _distinct_48()
    merged = REGISTRY["breadcrumbs"](
        {"w": torch.zeros(48)}, {"a": {"w": tau}}, gamma=gamma, beta=beta, rounding=rounding, alpha=1.0
    )["w"]
    rank_of = {int(m): 48 - int(m) for m in tau.abs()}  # |tau| = 48 is rank 0
    assert sorted(rank_of[int(m)] for m in tau[merged != 0].abs()) == list(ranks)
    assert torch.equal(merged[merged != 0], tau[merged != 0])


# ------------------------------------------------------------------ hyperparameter ranges, at load
def _params(name, overrides):
    return {"suite": {"tasks": ["digits"]}, "merge": {"methods": [name], name: overrides}}


def _outside(constraint):
    """A value the constraint rejects, or None (a coefficient: any number)."""
    if isinstance(constraint, Choice):
        return "bogus"
    if isinstance(constraint, PerTask):  # one task's value out of range
        inner = _outside(constraint.each)
        return None if inner is None else {"digits": inner}
    if constraint.low is not None:
        return constraint.low if constraint.low_open else constraint.low - 1
    if constraint.high is not None:
        return constraint.high if constraint.high_open else constraint.high + 1
    return None


BOUNDED = [
    (name, key) for name, m in sorted(REGISTRY.items()) for key, c in m.ranges.items() if _outside(c) is not None
]


def test_every_hyperparameter_declares_a_range_holding_its_default_and_grid():
    for name, method in REGISTRY.items():
        assert set(method.ranges) == set(method.defaults), name
        for key, value in method.defaults.items():
            assert all(
                method.ranges[key].admits(v)
                for v in [value, *method.grid.get(key, []), *method.per_task_grid.get(key, [])]
            ), (name, key)


@pytest.mark.parametrize("name, key", BOUNDED)
@pytest.mark.parametrize("as_grid", [False, True])
def test_every_bounded_hyperparameter_is_checked_at_load_under_its_own_key(name, key, as_grid):
    method = REGISTRY[name]
    bad = _outside(method.ranges[key])
    value = [method.defaults[key], bad] if as_grid else bad
    message = f"merge.{name}.{key}: expected {method.ranges[key]}, got {bad!r}"
    with pytest.raises(MergeflowError, match=re.escape(message)):
        parse_params(_params(name, {key: value}))


def test_out_of_range_values_name_the_key_the_user_wrote():
    with pytest.raises(MergeflowError, match=re.escape("merge.ties.k: expected a fraction in (0, 1], got 1.5")):
        parse_params(_params("ties", {"k": 1.5}))
    with pytest.raises(
        MergeflowError, match=re.escape("merge.dare_linear.p: expected a drop probability in [0, 1), got 1.0")
    ):
        parse_params(_params("dare_linear", {"p": 1.0}))
    with pytest.raises(
        MergeflowError,
        match=re.escape("merge.ties.rounding: expected one of 'ties_original', 'floor', 'round', got 'ceil'"),
    ):
        parse_params(_params("ties", {"rounding": "ceil"}))


def test_breadcrumbs_joint_rule_is_checked_at_load_on_every_grid_combination():
    parse_params(_params("breadcrumbs", {"gamma": [0.1, 0.3], "beta": 0.7}))
    with pytest.raises(
        MergeflowError, match=re.escape("merge.breadcrumbs: need gamma + beta <= 1, got gamma=0.4, beta=0.7")
    ):
        parse_params(_params("breadcrumbs", {"gamma": [0.1, 0.4], "beta": 0.7}))


def test_direct_calls_are_checked_by_the_same_ranges():
    theta0, tvs = {"w": torch.zeros(3)}, {"a": {"w": torch.ones(3)}}
    with pytest.raises(ValueError, match=re.escape("merge.ties.k: expected a fraction in (0, 1], got 1.5")):
        REGISTRY["ties"](theta0, tvs, k=1.5)
    with pytest.raises(
        ValueError, match=re.escape("merge.consensus_ta.tall_lambda: expected a TALL mask threshold >= 0, got -1.0")
    ):
        REGISTRY["consensus_ta"](theta0, tvs, tall_lambda={"a": -1.0})
    with pytest.raises(ValueError, match=re.escape("merge.tall_ties.rounding: expected one of")):
        REGISTRY["tall_ties"].task_models(theta0, tvs, rounding="up")


def test_ranges_are_shown_by_mergeflow_methods():
    assert "rounding='ties_original' (one of 'ties_original', 'floor', 'round')" in REGISTRY["ties"].describe()
    assert "rounding='floor' (one of 'floor', 'round')" in REGISTRY["breadcrumbs"].describe()
    assert (
        isinstance(REGISTRY["ties"].ranges["k"], Range)
        and "k=0.2 (a fraction in (0, 1])" in REGISTRY["ties"].describe()
    )
