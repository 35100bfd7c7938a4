"""Fidelity to the papers and their reference code (issue 22), and hyperparameter ranges checked at load (issue 16).

- Iso-CTS sizes its subspaces so that c + T s = r (full rank) and scales by the mean of the kept singular values;
- CART, low-rank TA and CART-Indexing take k = ceil(gamma r) (seed 002, Algorithm 1);
- each top-k and band rounding keeps the count worked out by hand;
- float64 inputs merge in float64: every element-wise and SVD method against the same formula evaluated here in
  numpy float64, to 1e-12, with untouched entries equal to theta0 bit for bit;
- every hyperparameter's range is checked when params.yaml is loaded, naming the key the user wrote.
"""

import re

import numpy as np
import pytest
import torch

from mergeflow.params import parse_params
from mergeflow.core.errors import MergeflowError
from mergeflow.ml.merging import REGISTRY, Choice, PerTask, Range
from mergeflow.ml.merging._rounding import top_k_count
from mergeflow.ml.merging._tensors import rank_of_ratio, seed_of
from mergeflow.ml.merging.dare import keep_cut
from mergeflow.ml.merging.iso import iso_cts_factors, iso_cts_matrix, subspace_sizes

from .test_methods_by_hand import _dare_words

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


# ------------------------------------------------------------------ float64 stays float64
def _vit_like(dtype=torch.float64, tasks=3, seed=0):
    """theta0 and task vectors with 2-D, 1-D, 3-D and 4-D tensors; every task leaves every 7th entry untouched."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        MATRIX: (12, 10),
        "blocks.0.norm1.bias": (10,),
        "pos_embed": (1, 3, 10),
        "patch_embed.proj.weight": (4, 3, 2, 2),
    }
    theta0 = {k: torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for k, s in shapes.items()}
    tvs = {}
    for i in range(tasks):
        tv = {k: 0.1 * torch.randn(s, generator=g, dtype=torch.float64) for k, s in shapes.items()}
        for v in tv.values():
            v.view(-1)[::7] = 0
        tvs[f"t{i}"] = {k: v.to(dtype) for k, v in tv.items()}
    return theta0, tvs


def _np(state):
    return {k: v.numpy() for k, v in state.items()}


def _low_rank(x: np.ndarray, k: int) -> np.ndarray:
    u, s, vh = np.linalg.svd(x, full_matrices=False)
    return (u[:, :k] * s[:k]) @ vh[:k]


def _ties_vectors(taus: dict[str, np.ndarray], count_of) -> dict[str, np.ndarray]:
    """TIES' merged vector per key, in numpy: taus {key: [T, ...]}, trimmed over the keys together (a global
    trim) or each alone, keeping count_of(n) entries by sorting."""
    keys = list(taus)
    T = next(iter(taus.values())).shape[0]
    flat = np.concatenate([taus[k].reshape(T, -1) for k in keys], 1)
    trimmed = np.zeros_like(flat)
    for t in range(T):
        top = np.argsort(-np.abs(flat[t]), kind="stable")[: count_of(flat.shape[1])]
        trimmed[t, top] = flat[t, top]
    elected = np.sign(trimmed.sum(0))
    agree = trimmed * elected > 0
    merged = np.where(agree, trimmed, 0).sum(0) / np.maximum(agree.sum(0), 1)
    sizes = np.cumsum([taus[k][0].size for k in keys])[:-1]
    return {k: m.reshape(taus[k].shape[1:]) for k, m in zip(keys, np.split(merged, sizes))}


def _ties_by_hand(taus, scope):
    count = lambda n: int(0.2 * n) + 1  # noqa: E731  the default rounding, 'ties_original'
    if scope == "global":
        return _ties_vectors(taus, count)
    return {k: _ties_vectors({k: v}, count)[k] for k, v in taus.items()}


def _band_by_hand(tau: np.ndarray, gamma=0.1, beta=0.2) -> np.ndarray:
    """Breadcrumbs' row mask at its defaults (floor band) for one task's tensor."""
    rows = tau.reshape(-1, tau.shape[-1]) if tau.ndim > 1 else tau.reshape(1, -1)
    n = rows.shape[1]
    rank = np.argsort(np.argsort(-np.abs(rows), 1, kind="stable"), 1)
    lo = int(n * gamma)
    return ((rank >= lo) & (rank < lo + int(n * beta))).reshape(tau.shape)


def _consensus_by_hand(taus, mtl, lam=0.4, min_tasks=2):
    votes = (np.abs(taus) >= lam * np.abs(mtl - taus)).sum(0)
    return np.where(votes >= min_tasks, mtl, 0)


def _dropped(taus, tasks, key, p=0.9, seed=0):
    words = [_dare_words(seed_of(seed, t, key), taus[0].size).reshape(taus[0].shape) for t in tasks]
    return np.stack([tau * (w >= keep_cut(p)) / (1 - p) for tau, w in zip(taus, words)])


def _element_wise_by_hand(name, theta0, taus, tasks):
    """The merged models of the element-wise methods at their defaults, in numpy float64 ({key: [T, ...]} taus)."""
    if name == "task_arithmetic":
        return {k: theta0[k] + 0.4 * taus[k].sum(0) for k in theta0}
    if name == "weight_averaging":
        return {k: theta0[k] + taus[k].mean(0) for k in theta0}
    if name in ("ties", "ties_tensor"):
        vectors = _ties_by_hand(taus, "tensor" if name == "ties_tensor" else "global")
        return {k: theta0[k] + 1.0 * vectors[k] for k in theta0}
    if name == "dare_linear":
        return {k: theta0[k] + 0.4 * _dropped(taus[k], tasks, k).sum(0) for k in theta0}
    if name == "dare_ties":
        vectors = {k: _ties_vectors({k: _dropped(taus[k], tasks, k)}, lambda n: n)[k] for k in theta0}
        return {k: theta0[k] + 1.0 * vectors[k] for k in theta0}
    if name == "breadcrumbs":
        return {k: theta0[k] + 0.4 * sum(tau * _band_by_hand(tau) for tau in taus[k]) for k in theta0}
    if name == "magmax":
        return {k: theta0[k] + 1.0 * np.take_along_axis(taus[k], np.abs(taus[k]).argmax(0)[None], 0)[0] for k in theta0}
    if name == "consensus_ta":
        return {k: theta0[k] + 0.4 * _consensus_by_hand(taus[k], taus[k].sum(0)) for k in theta0}
    if name == "consensus_ties":
        vectors = _ties_by_hand(taus, "global")
        return {k: theta0[k] + 1.0 * _consensus_by_hand(taus[k], vectors[k]) for k in theta0}
    raise KeyError(name)


ELEMENT_WISE = [
    "task_arithmetic",
    "weight_averaging",
    "ties",
    "ties_tensor",
    "dare_linear",
    "dare_ties",
    "breadcrumbs",
    "magmax",
    "consensus_ta",
    "consensus_ties",
]


@pytest.mark.parametrize("name", ELEMENT_WISE)
def test_float64_element_wise_merge_equals_the_formula_in_float64(name):
    theta0, tvs = _vit_like()
    method, hp = (REGISTRY["ties"], {"trim_scope": "tensor"}) if name == "ties_tensor" else (REGISTRY[name], {})
    merged = method(theta0, tvs, **hp)
    taus = {k: np.stack([tv[k].numpy() for tv in tvs.values()]) for k in theta0}
    expected = _element_wise_by_hand(name, _np(theta0), taus, list(tvs))
    for k in theta0:
        assert merged[k].dtype == torch.float64
        assert np.allclose(merged[k].numpy(), expected[k], rtol=0, atol=1e-12), k
        untouched = theta0[k].reshape(-1)[::7]
        assert torch.equal(merged[k].reshape(-1)[::7], untouched), k  # theta0 + lam * 0, bit for bit


def _svd_by_hand(name, theta0, taus, T):
    """The SVD methods at their defaults in numpy float64: {key: merged} (per-task methods: {task index: model})."""
    out = {}
    for k, x0 in theta0.items():
        tau = taus[k]
        is_matrix = k == MATRIX
        r = min(x0.shape) if is_matrix else 0
        if name == "low_rank_ta":
            out[k] = x0 + 0.4 * (sum(_low_rank(t, int(np.ceil(0.08 * r))) for t in tau) if is_matrix else tau.sum(0))
        elif name == "cart":
            avg = x0 + tau.mean(0)
            out[k] = (
                avg + 2.0 * sum(_low_rank(c, int(np.ceil(0.08 * r))) for c in tau - tau.mean(0)) if is_matrix else avg
            )
        elif name == "tsv_m":
            if is_matrix:
                svds = [np.linalg.svd(t, full_matrices=False) for t in tau]
                kk = max(1, r // T)
                u = np.concatenate([s[0][:, :kk] for s in svds], 1)
                sv = np.concatenate([s[1][:kk] for s in svds])
                v = np.concatenate([s[2][:kk].T for s in svds], 1)
                out[k] = x0 + 1.0 * (_polar(u) * sv) @ _polar(v).T
            else:
                out[k] = x0 + 1.0 * tau.mean(0)
        elif name == "iso_c":
            if is_matrix:
                u, sv, vh = np.linalg.svd(tau.sum(0), full_matrices=False)
                out[k] = x0 + 1.0 * sv.mean() * u @ vh
            else:
                out[k] = x0 + 1.0 * tau.mean(0)
        elif name == "iso_cts":
            out[k] = x0 + 1.0 * (_iso_cts_by_hand(tau, *subspace_sizes(r, T, 0.8))[0] if is_matrix else tau.mean(0))
        elif name == "cart_indexing":
            avg = x0 + tau.mean(0)
            out[k] = [avg + _low_rank(c, int(np.ceil(0.08 * r))) if is_matrix else avg for c in tau - tau.mean(0)]
        elif name == "tsv_c":
            out[k] = [x0 + (_low_rank(t, max(1, r // T)) if is_matrix else t) for t in tau]
    return out


@pytest.mark.parametrize("name", ["low_rank_ta", "cart", "tsv_m", "iso_c", "iso_cts", "cart_indexing", "tsv_c"])
def test_float64_svd_merge_equals_the_formula_in_float64(name):
    theta0, tvs = _vit_like(tasks=4)
    taus = {k: np.stack([tv[k].numpy() for tv in tvs.values()]) for k in theta0}
    expected = _svd_by_hand(name, _np(theta0), taus, len(tvs))
    method = REGISTRY[name]
    out = method(theta0, tvs)
    models = [method.reconstruct(out, theta0, t) for t in tvs] if method.kind == "per_task" else None
    for k in theta0:
        for i, want in enumerate(expected[k] if models else [expected[k]]):
            got = models[i][k] if models else out[k]
            assert got.dtype == torch.float64
            assert np.allclose(got.numpy(), want, rtol=0, atol=1e-12), (k, i)
            if k != MATRIX and name not in ("cart", "cart_indexing", "tsv_c"):  # theta_avg, theta0 + tau_t: not theta0
                assert torch.equal(got.reshape(-1)[::7], theta0[k].reshape(-1)[::7]), k


@pytest.mark.parametrize("name", ["emr", "tall_ties"])
def test_float64_per_task_element_wise_models_stay_float64(name):
    theta0, tvs = _vit_like()
    method = REGISTRY[name]
    store = method(theta0, tvs)
    taus = {k: np.stack([tv[k].numpy() for tv in tvs.values()]) for k in theta0}
    if name == "emr":
        elected = {k: np.sign(v.sum(0)) for k, v in taus.items()}
        agree = {k: v * elected[k] > 0 for k, v in taus.items()}
        uni = {k: elected[k] * (np.abs(v) * agree[k]).max(0) for k, v in taus.items()}
        scale = [
            sum(np.abs(v[t]).sum() for v in taus.values()) / sum(np.abs(agree[k][t] * uni[k]).sum() for k in taus)
            for t in range(len(tvs))
        ]
        expected = [{k: theta0[k].numpy() + scale[t] * agree[k][t] * uni[k] for k in taus} for t in range(len(tvs))]
    else:
        vectors = _ties_by_hand(taus, "global")
        masks = {k: np.abs(v) >= 0.4 * np.abs(vectors[k] - v) for k, v in taus.items()}
        expected = [{k: theta0[k].numpy() + 1.0 * masks[k][t] * vectors[k] for k in taus} for t in range(len(tvs))]
    for t, task in enumerate(tvs):
        model = method.reconstruct(store, theta0, task)
        for k in theta0:
            assert model[k].dtype == torch.float64 and np.allclose(
                model[k].numpy(), expected[t][k], rtol=0, atol=1e-12
            ), (task, k)
            assert torch.equal(model[k].reshape(-1)[::7], theta0[k].reshape(-1)[::7])


@pytest.mark.parametrize("name", ["task_arithmetic", "ties", "breadcrumbs", "iso_c"])
def test_bf16_inputs_compute_in_float32(name):
    theta0, tvs = _vit_like(dtype=torch.bfloat16)
    merged = REGISTRY[name](theta0, tvs)
    upcast = REGISTRY[name](
        {k: v.float() for k, v in theta0.items()}, {t: {k: v.float() for k, v in tv.items()} for t, tv in tvs.items()}
    )
    assert all(
        merged[k].dtype == torch.bfloat16 and torch.equal(merged[k], upcast[k].to(torch.bfloat16)) for k in theta0
    )


def test_float32_merges_are_unchanged_by_a_float64_model_beside_them():
    # a float64 key gets its own buffer and kernels; the float32 keys merge exactly as in a float32-only model
    theta0, tvs = _vit_like(dtype=torch.float32)
    mixed0 = {**theta0, "extra": torch.randn(5, dtype=torch.float64)}
    mixed = {t: {**tv, "extra": torch.randn(5, dtype=torch.float64)} for t, tv in tvs.items()}
    for name, hp in (
        ("ties", {"trim_scope": "tensor"}),
        ("breadcrumbs", {}),
        ("consensus_ties", {"trim_scope": "tensor"}),
    ):
        alone, beside = REGISTRY[name](theta0, tvs, **hp), REGISTRY[name](mixed0, mixed, **hp)
        assert all(torch.equal(alone[k], beside[k]) for k in theta0) and beside["extra"].dtype == torch.float64


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


def test_float64_stays_float64_from_the_task_vectors_through_the_search():
    """The pipeline's own steps keep float64: task vectors of float64 checkpoints, and the search's interpolated
    candidates (float32 checkpoints keep float32 task vectors, as before)."""
    from mergeflow.ml.merging.search import merged_candidates
    from mergeflow.ml.task_vectors import task_vector

    theta0, tvs = _vit_like()
    finetuned = {k: theta0[k] + tvs["t0"][k] for k in theta0}
    tau = task_vector(theta0, finetuned, pretrained_name="p", finetuned_name="f")
    assert all(
        tau[k].dtype == torch.float64 and torch.allclose(tau[k], tvs["t0"][k], rtol=0, atol=1e-15) for k in theta0
    )
    single = task_vector(
        {k: v.float() for k, v in theta0.items()},
        {k: v.float() for k, v in finetuned.items()},
        pretrained_name="p",
        finetuned_name="f",
    )
    assert all(v.dtype == torch.float32 for v in single.values())
    fixed, grid = REGISTRY["ties"].search_space({"lam": [0.3, 0.7]})
    for hp, merged in merged_candidates(REGISTRY["ties"], fixed, grid, theta0, tvs):
        direct = REGISTRY["ties"](theta0, tvs, **hp)
        assert all(
            merged[k].dtype == torch.float64 and torch.allclose(merged[k], direct[k], rtol=0, atol=1e-12)
            for k in theta0
        )
