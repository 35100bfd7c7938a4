"""The methods of issue 3 against values computed by hand on tiny tensors, and the papers' identities."""

import math

import numpy as np
import pytest
import torch

from mergeflow.ml.merging import REGISTRY
from mergeflow.ml.merging._tensors import gram_svd, low_rank, seed_of
from mergeflow.ml.merging.dare import keep_cut
from mergeflow.ml.merging.cart import centred
from mergeflow.ml.merging.iso import iso_c_matrix, iso_cts_matrix
from mergeflow.ml.merging.tsv_m import task_singular_vectors, tsv_merge_matrix

T = torch.tensor


def close(a, b, atol=1e-5):
    return torch.allclose(a, b, atol=atol)


def _models(n_tasks=3, seed=0, shape=(6, 5)):
    g = torch.Generator().manual_seed(seed)
    theta0 = {
        "blocks.0.mlp.fc1.weight": torch.randn(*shape, generator=g),
        "blocks.0.norm1.bias": torch.randn(shape[1], generator=g),
    }
    tvs = {f"t{i}": {k: 0.1 * torch.randn(v.shape, generator=g) for k, v in theta0.items()} for i in range(n_tasks)}
    return theta0, tvs


M = "blocks.0.mlp.fc1.weight"


# ------------------------------------------------------------------ element-wise
def test_magmax_keeps_the_largest_magnitude():
    merged = REGISTRY["magmax"](
        {"w": torch.zeros(2)}, {"a": {"w": T([1.0, -3.0])}, "b": {"w": T([-2.0, 2.0])}}, lam=1.0
    )
    assert close(merged["w"], T([-2.0, -3.0]))


def test_breadcrumbs_drops_outliers_and_small_entries_per_row():
    row = T([5.0, -4.0, 3.0, -2.0, 1.0, 0.5, 0.1, 0.05, 0.02, 0.01])
    merged = REGISTRY["breadcrumbs"](
        {"w": torch.zeros(2, 10)}, {"a": {"w": torch.stack([row, -row])}}, gamma=0.1, beta=0.2, scope="row", alpha=1.0
    )
    expected = torch.zeros(10)
    expected[1], expected[2] = -4.0, 3.0
    assert close(merged["w"], torch.stack([expected, -expected]))


def test_breadcrumbs_tensor_scope_ranks_the_whole_tensor():
    w = T([[10.0, 1.0], [2.0, 3.0]])  # n = 4: gamma 0.25 drops 10, beta 0.5 keeps 3 and 2
    merged = REGISTRY["breadcrumbs"](
        {"w": torch.zeros(2, 2)}, {"a": {"w": w}}, gamma=0.25, beta=0.5, scope="tensor", alpha=1.0
    )
    assert close(merged["w"], T([[0.0, 0.0], [2.0, 3.0]]))


def test_dare_with_p_zero_is_task_arithmetic():
    theta0, tvs = _models()
    dare = REGISTRY["dare_linear"](theta0, tvs, p=0.0, seed=0, lam=0.3)
    ta = REGISTRY["task_arithmetic"](theta0, tvs, lam=0.3)
    assert all(close(dare[k], ta[k]) for k in theta0)


def test_dare_drops_a_fraction_p_and_rescales_survivors():
    theta0 = {"w": torch.zeros(20000)}
    tvs = {"a": {"w": torch.ones(20000)}}
    merged = REGISTRY["dare_linear"](theta0, tvs, p=0.9, seed=3, lam=1.0)["w"]
    assert torch.all((merged == 0) | torch.isclose(merged, torch.tensor(10.0)))
    assert (merged != 0).float().mean().item() == pytest.approx(0.1, abs=0.01)
    again = REGISTRY["dare_linear"](theta0, tvs, p=0.9, seed=3, lam=1.0)["w"]
    other = REGISTRY["dare_linear"](theta0, tvs, p=0.9, seed=4, lam=1.0)["w"]
    assert torch.equal(merged, again) and not torch.equal(merged, other)


def test_consensus_ta_keeps_only_weights_two_tasks_rely_on():
    # tau = [[1, 0], [1, 0], [0.1, 1]]: tau_MTL = [2.1, 1]; with lambda 0.5 the masks are [T,F], [T,F], [F,T]:
    # entry 0 is claimed by two tasks (kept), entry 1 by one (dropped)
    theta0 = {"w": torch.zeros(2)}
    tvs = {"a": {"w": T([1.0, 0.0])}, "b": {"w": T([1.0, 0.0])}, "c": {"w": T([0.1, 1.0])}}
    merged = REGISTRY["consensus_ta"](theta0, tvs, tall_lambda=0.5, min_tasks=2, alpha=1.0)
    assert close(merged["w"], T([2.1, 0.0]))
    per_task = REGISTRY["consensus_ta"](theta0, tvs, tall_lambda={"a": 0.5, "b": 0.5, "c": 0.5}, min_tasks=2, alpha=1.0)
    assert close(per_task["w"], merged["w"])


def test_tall_per_task_models_mask_one_task_at_each_lambda():
    # the models lambda_t is chosen on: theta0 + alpha (m_t * tau_MTL), m_t = |tau_t| >= lambda_t |tau_MTL - tau_t|.
    # tau_MTL = [2.1, 1]; for c = [0.1, 1]: |tau_MTL - tau_c| = [2, 0], so m_c = [F, T] at lambda 0.5 and [T, T] at
    # 0.05 (0.1 >= 0.05 x 2). TIES' vector (k = 1: the disjoint mean) is [0.7, 1]
    theta0 = {"w": T([1.0, -1.0])}
    tvs = {"a": {"w": T([1.0, 0.0])}, "b": {"w": T([1.0, 0.0])}, "c": {"w": T([0.1, 1.0])}}
    model_of = REGISTRY["consensus_ta"].task_models(theta0, tvs, tall_lambda=0.4, min_tasks=2, alpha=0.5)
    assert close(model_of("c", {"tall_lambda": 0.5})["w"], T([1.0, -0.5]))
    assert close(model_of("c", {"tall_lambda": 0.05})["w"], T([2.05, -0.5]))
    assert close(
        model_of("a", {"tall_lambda": 0.5})["w"], T([2.05, -1.0])
    )  # |tau_MTL - tau_a| = [1.1, 1]: m_a = [T, F]
    ties_of = REGISTRY["tall_ties"].task_models(theta0, tvs, tall_lambda=0.4, ties_k=1.0, trim_scope="tensor", lam=2.0)
    store = REGISTRY["tall_ties"](theta0, tvs, tall_lambda=0.5, ties_k=1.0, trim_scope="tensor", lam=2.0)
    for task in tvs:  # the same model as the stored one with lambda_t = 0.5 for every task
        assert close(
            ties_of(task, {"tall_lambda": 0.5})["w"], REGISTRY["tall_ties"].reconstruct(store, theta0, task)["w"]
        )
    assert close(ties_of("c", {"tall_lambda": 0.5})["w"], T([1.0, 1.0]))


def test_emr_reproduces_the_sign_mask_and_scale_rules():
    # sum = [3, 2, 0] elects [+, +, 0]; tau_uni = [2, 3, 0]; M_a = [1, 0, 0], M_b = [1, 1, 0];
    # lambda_a = 3.5 / 2 = 1.75, lambda_b = 4.5 / 5 = 0.9
    theta0 = {"w": torch.zeros(3)}
    tvs = {"a": {"w": T([2.0, -1.0, 0.5])}, "b": {"w": T([1.0, 3.0, -0.5])}}
    method = REGISTRY["emr"]
    store = method(theta0, tvs)
    assert close(store["shared/w"], T([2.0, 3.0, 0.0]))
    assert store["mask/a/w"].tolist() == [True, False, False] and store["mask/b/w"].tolist() == [True, True, False]
    assert close(method.reconstruct(store, theta0, "a")["w"], T([3.5, 0.0, 0.0]))
    assert close(method.reconstruct(store, theta0, "b")["w"], T([1.8, 2.7, 0.0]))


def test_emr_tensor_means_rescale_weights_each_tensor_by_its_size():
    # w as above (3 entries) and v = [4] in a: sum |tau_a| over the model 3.5 + 4 = 7.5, kept |M_a tau_uni| 2 + 4 = 6
    #   model sums: lambda_a = 7.5 / 6; tensor means (FusionBench): (3.5/3 + 4/1) / (2/3 + 4/1) = 31/28
    theta0 = {"w": torch.zeros(3), "v": torch.zeros(1)}
    tvs = {"a": {"w": T([2.0, -1.0, 0.5]), "v": T([4.0])}, "b": {"w": T([1.0, 3.0, -0.5]), "v": T([-1.0])}}
    method = REGISTRY["emr"]
    sums, means = method(theta0, tvs), method(theta0, tvs, rescale="tensor_means")
    assert close(sums["scale/a"].float(), T(7.5 / 6)) and close(means["scale/a"].float(), T(31 / 28))
    assert torch.equal(sums["shared/w"], means["shared/w"]) and torch.equal(sums["mask/b/v"], means["mask/b/v"])


def test_tall_ties_masks_each_task():
    theta0 = {"w": torch.zeros(2)}
    tvs = {"a": {"w": T([1.0, 0.0])}, "b": {"w": T([1.0, 0.0])}, "c": {"w": T([0.1, 1.0])}}
    method = REGISTRY["tall_ties"]
    store = method(theta0, tvs, tall_lambda=0.5, ties_k=1.0, trim_scope="tensor", lam=1.0)
    # TIES with k = 1: all positive, disjoint mean = [0.7, 1.0]; masks |tau_t| >= 0.5 |tau_TIES - tau_t|
    assert close(store["shared/w"], T([0.7, 1.0]))
    assert close(method.reconstruct(store, theta0, "a")["w"], T([0.7, 0.0]))
    assert close(method.reconstruct(store, theta0, "c")["w"], T([0.0, 1.0]))


def test_task_negation_subtracts():
    theta0 = {"w": T([1.0, 1.0])}
    assert close(REGISTRY["task_negation"](theta0, {"a": {"w": T([2.0, -1.0])}}, lam=0.5)["w"], T([0.0, 1.5]))
    with pytest.raises(ValueError, match="one task vector at a time"):
        REGISTRY["task_negation"](theta0, {"a": {"w": T([1.0, 1.0])}, "b": {"w": T([1.0, 1.0])}}, lam=0.5)


def test_slerp_of_orthogonal_unit_vectors():
    merged = REGISTRY["slerp"]({"w": torch.zeros(2)}, {"a": {"w": T([1.0, 0.0])}, "b": {"w": T([0.0, 1.0])}}, t=0.5)
    assert close(merged["w"], T([math.sqrt(0.5), math.sqrt(0.5)]))
    with pytest.raises(ValueError, match="exactly two models"):
        REGISTRY["slerp"]({"w": torch.zeros(2)}, {t: {"w": T([1.0, 0.0])} for t in "abc"}, t=0.5)


# ------------------------------------------------------------------ low rank and spectra
def test_centred_task_vectors_sum_to_zero():
    _, tvs = _models()
    taus = torch.stack([tv[M] for tv in tvs.values()])
    assert close(centred(taus).sum(0), torch.zeros_like(taus[0]))


@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_cart_with_rank_zero_or_full_is_weight_averaging(ratio):
    theta0, tvs = _models()
    cart = REGISTRY["cart"](theta0, tvs, rank_ratio=ratio, lam=1.0 if ratio else 2.5)
    wa = REGISTRY["weight_averaging"](theta0, tvs)
    assert all(close(cart[k], wa[k]) for k in theta0)


def test_cart_low_rank_by_hand():
    theta0, tvs = _models(n_tasks=2)
    cart = REGISTRY["cart"](theta0, tvs, rank_ratio=0.2, lam=1.5)  # k = ceil(0.2 * 5) = 1
    taus = torch.stack([tv[M] for tv in tvs.values()])
    expected = theta0[M] + taus.mean(0) + 1.5 * sum(low_rank(c, 1) for c in taus - taus.mean(0))
    assert close(cart[M], expected)
    assert close(
        cart["blocks.0.norm1.bias"],
        theta0["blocks.0.norm1.bias"] + torch.stack([tv["blocks.0.norm1.bias"] for tv in tvs.values()]).mean(0),
    )


def test_low_rank_ta_at_full_rank_is_task_arithmetic():
    theta0, tvs = _models()
    lr = REGISTRY["low_rank_ta"](theta0, tvs, rank_ratio=1.0, lam=0.3)
    ta = REGISTRY["task_arithmetic"](theta0, tvs, lam=0.3)
    assert all(close(lr[k], ta[k]) for k in theta0)


def test_cart_indexing_at_full_rank_rebuilds_each_finetuned_model():
    theta0, tvs = _models()
    method = REGISTRY["cart_indexing"]
    store = method(theta0, tvs, rank_ratio=1.0)
    for t, tv in tvs.items():
        model = method.reconstruct(store, theta0, t)
        assert close(model[M], theta0[M] + tv[M])


def test_tsv_c_with_one_task_keeps_full_rank():
    theta0, tvs = _models(n_tasks=1)
    method = REGISTRY["tsv_c"]
    model = method.reconstruct(method(theta0, tvs), theta0, "t0")
    assert all(close(model[k], theta0[k] + tvs["t0"][k]) for k in theta0)


def test_tsv_m_merged_matrix_has_orthonormal_singular_vectors():
    _, tvs = _models(n_tasks=2, shape=(8, 6))
    taus = torch.stack([tv[M] for tv in tvs.values()])
    u, s, vh = task_singular_vectors(taus, 3)  # k = 6 // 2
    merged = tsv_merge_matrix(taus)
    # with orthonormal factors the merged matrix's singular values are exactly the kept task singular values
    assert close(
        torch.linalg.svdvals(merged), torch.sort(s.cpu(), descending=True).values, atol=1e-4
    )  # s: on the SVD device


def test_iso_c_flattens_the_spectrum():
    _, tvs = _models(shape=(7, 5))
    taus = torch.stack([tv[M] for tv in tvs.values()])
    sv = torch.linalg.svdvals(iso_c_matrix(taus))
    assert close(sv, torch.full_like(sv, torch.linalg.svdvals(taus.sum(0)).mean().item()), atol=1e-4)


def test_iso_cts_flattens_the_spectrum_over_common_and_task_subspaces():
    _, tvs = _models(n_tasks=2, shape=(12, 10))
    taus = torch.stack([tv[M] for tv in tvs.values()])
    sv = torch.linalg.svdvals(iso_cts_matrix(taus, 0.8))  # c = 8, then (10 - 8) / 2 = 1 per task: rank 10
    u, s, _ = torch.linalg.svd(taus.sum(0))
    kept = [s[:8]] + [
        torch.linalg.svdvals(tau - u[:, :8] @ (u[:, :8].T @ tau))[:1] for tau in taus
    ]  # the authors' scale
    assert close(sv, torch.full_like(sv, torch.cat(kept).mean().item()), atol=1e-4)


@pytest.mark.parametrize("scope", ["row", "tensor"])
def test_breadcrumbs_thresholds_match_ranks(scope):
    taus = torch.randn(3, 7, 50, generator=torch.Generator().manual_seed(1))
    mags = taus.abs().reshape(3, 7, 50) if scope == "row" else taus.abs().reshape(3, 1, 350)
    n = mags.shape[-1]
    ranks = mags.argsort(-1, descending=True).argsort(-1)  # 0 = largest
    expected = (ranks >= round(0.1 * n)) & (ranks < round(0.4 * n))
    for tau, keep in zip(taus, expected.reshape(taus.shape)):
        merged = REGISTRY["breadcrumbs"](
            {"w": torch.zeros(7, 50)}, {"a": {"w": tau}}, gamma=0.1, beta=0.3, scope=scope, alpha=1.0
        )
        assert torch.equal(merged["w"], tau * keep)


def _rank(r, m, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, r, generator=g) @ torch.randn(r, n, generator=g)


@pytest.mark.parametrize(
    "name, matrix",
    [
        ("tall", _rank(30, 40, 30)),
        ("wide", _rank(30, 30, 40)),
        ("square", _rank(25, 25, 25)),
        ("rank 2", _rank(2, 40, 30)),
        ("rank 2 wide", _rank(2, 30, 40)),
        ("zeros", torch.zeros(20, 30)),
        ("one row", _rank(1, 1, 20)),
        # condition number 1e10: the Gram matrix's is 1e20, beyond float64's 1e16
        ("ill-conditioned", _rank(30, 50, 30) @ torch.diag(torch.logspace(0, -10, 30))),
    ],
)
def test_gram_svd_matches_lapack_and_stays_orthonormal(name, matrix):
    """gram_svd (the SVD-based methods' CUDA route, checked here on the CPU) against LAPACK's float64 SVD."""
    u, s, vh = gram_svd(matrix)
    x = matrix.double()
    r = min(x.shape)
    assert u.shape == (x.shape[0], r) and s.shape == (r,) and vh.shape == (r, x.shape[1]) and u.dtype == torch.float32
    scale = max(x.norm().item(), 1e-30)
    assert ((u.double() * s.double()) @ vh.double() - x).norm() <= 1e-6 * scale
    assert (u.double().T @ u.double() - torch.eye(r, dtype=torch.float64)).abs().max() <= 1e-6
    assert (vh.double() @ vh.double().T - torch.eye(r, dtype=torch.float64)).abs().max() <= 1e-6
    assert (s.double() - torch.linalg.svdvals(x)).abs().max() <= 1e-6 * scale
    assert (s[:-1] >= s[1:]).all()


def _spectrum(m, n, decay, seed=0):
    """A float32 matrix with singular values i^-decay (i = 1..r) between random orthonormal bases."""
    g = torch.Generator().manual_seed(seed)
    r = min(m, n)
    q1, _ = torch.linalg.qr(torch.randn(m, r, generator=g, dtype=torch.float64))
    q2, _ = torch.linalg.qr(torch.randn(n, r, generator=g, dtype=torch.float64))
    return ((q1 * torch.arange(1, r + 1, dtype=torch.float64) ** -decay) @ q2.T).float()


@pytest.mark.parametrize(
    "name, matrix, k, gram_route",
    [
        ("tall, top 12", _spectrum(96, 48, 0.7), 12, True),
        ("wide, top 12", _spectrum(48, 96, 0.7), 12, True),
        ("top 30 of 40, more than half: LAPACK", _spectrum(60, 40, 0.7), 30, False),
        ("top 12 beyond the floor: LAPACK", _spectrum(60, 40, 3.0), 12, False),
        ("rank 2, top 5: LAPACK", _rank(2, 40, 30), 5, False),
        ("zeros: LAPACK", torch.zeros(20, 30), 3, False),
    ],
)
def test_top_singular_matches_float64_lapack(name, matrix, k, gram_route, monkeypatch):
    """The float32 CPU route through the Gram against float64 LAPACK, and LAPACK's float32 SVD where it does not
    apply."""
    from mergeflow.ml.merging import _tensors

    calls = []
    real_svd = _tensors.svd
    monkeypatch.setattr(_tensors, "svd", lambda a: calls.append(1) or real_svd(a))
    u, s, vh = _tensors.top_singular(matrix, k)
    assert (not calls) == gram_route
    x = matrix.double()
    ru, rs, rvh = torch.linalg.svd(x, full_matrices=False)
    scale = max(float(x.norm()), 1e-30)
    assert u.dtype == torch.float32 and u.shape == (x.shape[0], k) and s.shape == (k,) and vh.shape == (k, x.shape[1])
    assert ((u.double() * s.double()) @ vh.double() - (ru[:, :k] * rs[:k]) @ rvh[:k]).norm() <= 1e-5 * scale
    assert (s.double() - rs[:k]).abs().max() <= 1e-6 * scale


@pytest.mark.parametrize(
    "name, matrix, gram_route",
    [
        ("cond 5, tall", _spectrum(96, 48, 0.42), True),
        ("cond 5, wide", _spectrum(48, 96, 0.42), True),
        ("cond 15: LAPACK", _spectrum(96, 48, 0.7), False),
        ("cond 1e4: LAPACK", _spectrum(96, 40, 2.5), False),
        ("square: LAPACK", _spectrum(48, 48, 0.7), False),
    ],
)
def test_polar_matches_float64_lapack(name, matrix, gram_route, monkeypatch):
    from mergeflow.ml.merging import _tensors

    calls = []
    real_svd = _tensors.svd
    monkeypatch.setattr(_tensors, "svd", lambda a: calls.append(1) or real_svd(a))
    p = _tensors.polar(matrix)
    assert (not calls) == gram_route
    ru, _, rvh = torch.linalg.svd(matrix.double(), full_matrices=False)
    u32, _, vh32 = torch.linalg.svd(matrix, full_matrices=False)

    def error(x):
        return float((x.double() - ru @ rvh).norm() / (ru @ rvh).norm())

    # as accurate as LAPACK's float32 SVD (whose own error grows with the condition number: 6e-5 at 1e4)
    assert p.dtype == torch.float32 and error(p) <= max(1e-5, 1.5 * error(u32 @ vh32))


def _dare_words(stream: int, n: int) -> np.ndarray:
    """DARE's mask words, in numpy: fmix32(stream + i * 0x9E3779B9) (the kernels' drop_word)."""
    w = (np.uint64(stream) + np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B9)) & np.uint64(0xFFFFFFFF)
    w ^= w >> np.uint64(16)
    w = (w * np.uint64(0x85EBCA6B)) & np.uint64(0xFFFFFFFF)
    w ^= w >> np.uint64(13)
    w = (w * np.uint64(0xC2B2AE35)) & np.uint64(0xFFFFFFFF)
    return w ^ (w >> np.uint64(16))


@pytest.mark.parametrize("name", ["dare_linear", "dare_ties"])
def test_dare_masks_follow_the_documented_counter_based_rule(name):
    """Each task's mask from its stream seed_of(seed, task, key) and the entry's index, rescaled by 1 / (1 - p);
    then task arithmetic, or TIES' election and disjoint mean, computed here in numpy."""
    theta0, tvs = _models(n_tasks=4, shape=(30, 20))
    p, seed, lam = 0.6, 7, 0.5
    merged = REGISTRY[name](theta0, tvs, p=p, seed=seed, lam=lam)
    for key in theta0:
        dropped = np.stack(
            [
                tv[key].numpy().reshape(-1)
                * (_dare_words(seed_of(seed, task, key), tv[key].numel()) >= keep_cut(p))
                / np.float32(1 - p)
                for task, tv in tvs.items()
            ]
        )
        if name == "dare_linear":
            direction = dropped.sum(0)
        else:
            elected = np.sign(dropped.sum(0))
            agree = (dropped * elected) > 0
            direction = elected * (dropped * agree * elected).sum(0) / np.maximum(agree.sum(0), 1)
        expected = theta0[key].numpy().reshape(-1) + lam * direction
        assert np.allclose(merged[key].numpy().reshape(-1), expected, atol=1e-6), key
