"""Fidelity to the papers and their reference code (issue 22): float64 inputs merge in float64. Every element-wise
and SVD method against the same formula evaluated here in numpy float64, to 1e-12, with untouched entries equal to
theta0 bit for bit; bf16 inputs compute in float32; the pipeline's task vectors and search keep float64."""

import numpy as np
import pytest
import torch

from mergeflow.ml.merging import REGISTRY
from mergeflow.ml.merging._tensors import seed_of
from mergeflow.ml.merging.dare import keep_cut
from mergeflow.ml.merging.iso import subspace_sizes

from .test_fidelity import MATRIX, _iso_cts_by_hand, _low_rank, _polar
from .test_methods_by_hand import _dare_words


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
