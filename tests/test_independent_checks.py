"""Independent checks (issue 58) for the methods no reference implementation covers: each against values computed
by hand on a tiny tensor (derived in the comments), an identity from its paper, or the reference's formula written
out here in numpy or plain torch. No mergeflow helper computes an expected value; the methods are called through
the registry only. Every test uses several tasks and a case that is not degenerate (no single task, no full rank,
no k = 1 trim where the method's point is the trim)."""

import copy

import numpy as np
import pytest
import torch

from mergeflow.ml.merging import REGISTRY, MergeData

T = torch.tensor


def f64(x):
    return torch.tensor(x, dtype=torch.float64)


def close(a, b, atol=1e-10):
    return torch.allclose(a.double(), torch.as_tensor(b, dtype=torch.float64), rtol=0, atol=atol)


# ------------------------------------------------------------------ Consensus (TA) with per-task lambdas
# tau_a = [1, 0, 2], tau_b = [1, 1, -1], tau_c = [0.2, 1, 1]: tau_MTL = [2.2, 2, 2];
# |tau_MTL - tau_t| = a [1.2, 2, 0], b [1.2, 1, 3], c [2, 1, 1].
# lambda a 0.5, b 1.0, c 0.3:
#   m_a: [1, 0, 2] >= [0.6, 1, 0]      -> [T, F, T]
#   m_b: [1, 1, 1] >= [1.2, 1, 3]      -> [F, T, F]
#   m_c: [0.2, 1, 1] >= [0.6, 0.3, 0.3] -> [F, T, T]
# votes [1, 2, 2]: k = 2 keeps entries 1 and 2 of tau_MTL, k = 3 none, k = 1 all.
# One lambda 0.5 for every task instead: m_b = [T, T, F], m_c = [F, T, T], votes [2, 2, 2]: all kept.
CONSENSUS_TAUS = {"a": {"w": T([1.0, 0.0, 2.0])}, "b": {"w": T([1.0, 1.0, -1.0])}, "c": {"w": T([0.2, 1.0, 1.0])}}
CONSENSUS_LAMBDAS = {"a": 0.5, "b": 1.0, "c": 0.3}


@pytest.mark.parametrize(
    "lambdas, min_tasks, kept",
    [
        (CONSENSUS_LAMBDAS, 2, [0.0, 2.0, 2.0]),
        (CONSENSUS_LAMBDAS, 3, [0.0, 0.0, 0.0]),
        (CONSENSUS_LAMBDAS, 1, [2.2, 2.0, 2.0]),
        (0.5, 2, [2.2, 2.0, 2.0]),
        # the lambdas of b and c swapped: m_b = [T, T, T] at 0.3, m_c = [F, T, T] at 1.0, votes [2, 3, 3]: all kept
        ({"a": 0.5, "b": 0.3, "c": 1.0}, 2, [2.2, 2.0, 2.0]),
    ],
)
def test_consensus_ta_with_a_lambda_per_task_by_hand(lambdas, min_tasks, kept):
    theta0 = {"w": T([1.0, -1.0, 0.5])}
    merged = REGISTRY["consensus_ta"](theta0, CONSENSUS_TAUS, tall_lambda=lambdas, min_tasks=min_tasks, alpha=0.5)
    assert close(merged["w"], theta0["w"].double() + 0.5 * f64(kept), atol=1e-6)


def test_consensus_ta_per_task_models_show_each_tall_mask_by_hand():
    # the model lambda_t is chosen on: theta0 + alpha (m_t * tau_MTL), the masks above
    theta0 = {"w": T([1.0, -1.0, 0.5])}
    model_of = REGISTRY["consensus_ta"].task_models(theta0, CONSENSUS_TAUS, alpha=0.5)
    mtl = f64([2.2, 2.0, 2.0])
    masks = {"a": [1.0, 0.0, 1.0], "b": [0.0, 1.0, 0.0], "c": [0.0, 1.0, 1.0]}
    for task, mask in masks.items():
        got = model_of(task, {"tall_lambda": CONSENSUS_LAMBDAS[task]})["w"]
        assert close(got, theta0["w"].double() + 0.5 * f64(mask) * mtl, atol=1e-6), task


# ------------------------------------------------------------------ TIES' vector with a real trim, TALL masks on it
# tau_a = [3, -1, 0.5, 2, 0], tau_b = [-2, -4, 1, 0.1, 0.3], tau_c = [1.2, 0.2, -3, 2.5, 0.4]; ties_k 0.4 with
# 'floor' rounding keeps floor(0.4 x 5) = 2 entries of each (per tensor):
#   a [3, 0, 0, 2, 0], b [-2, -4, 0, 0, 0], c [0, 0, -3, 2.5, 0]; sum [1, -4, -3, 4.5, 0]: signs [+, -, -, +, 0];
#   disjoint mean [3, -4, -3, (2 + 2.5) / 2, 0] = [3, -4, -3, 2.25, 0] = tau_TIES.
# TALL masks on the untrimmed tau_t, m_t = |tau_t| >= lambda_t |tau_TIES - tau_t|:
#   |tau_TIES - tau_a| = [0, 3, 3.5, 0.25, 0], |.. - tau_b| = [5, 0, 4, 2.15, 0.3],
#   |.. - tau_c| = [1.8, 4.2, 0, 0.25, 0.4]
#   lambda 0.5: m_a [T, F, F, T, T], m_b [F, T, F, F, T], m_c [T (1.2 >= 0.9), F, T, T, T]; votes [2, 1, 1, 2, 3]
#   (masks on the trimmed vectors would give m_c[0] = 0 >= 1.5: F, and drop entry 0 from the consensus)
#   lambda b 0.1: m_b [T, T, T, F, T]; lambda c 2.0: m_c [F, F, T, T, F]
TRIM_TAUS = {
    "a": {"w": T([3.0, -1.0, 0.5, 2.0, 0.0])},
    "b": {"w": T([-2.0, -4.0, 1.0, 0.1, 0.3])},
    "c": {"w": T([1.2, 0.2, -3.0, 2.5, 0.4])},
}
TIES_KW = {"ties_k": 0.4, "trim_scope": "tensor", "rounding": "floor"}
TAU_TIES = [3.0, -4.0, -3.0, 2.25, 0.0]


def test_consensus_ties_trims_elects_and_masks_by_hand():
    theta0 = {"w": torch.ones(5)}
    merged = REGISTRY["consensus_ties"](theta0, TRIM_TAUS, tall_lambda=0.5, min_tasks=2, alpha=1.5, **TIES_KW)
    # votes >= 2 keep entries 0, 3 (and 4, where tau_TIES is 0)
    assert close(merged["w"], 1 + 1.5 * f64([3.0, 0.0, 0.0, 2.25, 0.0]), atol=1e-6)
    merged = REGISTRY["consensus_ties"](theta0, TRIM_TAUS, tall_lambda=0.5, min_tasks=1, alpha=1.0, **TIES_KW)
    assert close(merged["w"], 1 + f64(TAU_TIES), atol=1e-6)  # every entry has a vote: TIES itself


def test_tall_ties_store_and_models_with_a_lambda_per_task_by_hand():
    theta0 = {"w": torch.ones(5)}
    method = REGISTRY["tall_ties"]
    store = method(theta0, TRIM_TAUS, tall_lambda={"a": 0.5, "b": 0.1, "c": 2.0}, lam=2.0, **TIES_KW)
    assert close(store["shared/w"], TAU_TIES, atol=1e-6)
    masks = {"a": [1, 0, 0, 1, 1], "b": [1, 1, 1, 0, 1], "c": [0, 0, 1, 1, 0]}
    for task, mask in masks.items():
        assert store[f"mask/{task}/w"].tolist() == [bool(m) for m in mask], task
        expected = 1 + 2.0 * f64(mask) * f64(TAU_TIES)  # a [7, 1, 1, 5.5, 1], b [7, -7, -5, 1, 1], c [1, 1, -5, 5.5, 1]
        assert close(method.reconstruct(store, theta0, task)["w"], expected, atol=1e-6), task
    # the per-task models the search chooses lambda_t on are the stored ones at that lambda_t
    model_of = method.task_models(theta0, TRIM_TAUS, lam=2.0, **TIES_KW)
    assert close(model_of("c", {"tall_lambda": 2.0})["w"], [1.0, 1.0, -5.0, 5.5, 1.0], atol=1e-6)
    assert close(model_of("c", {"tall_lambda": 0.5})["w"], [7.0, 1.0, -5.0, 5.5, 1.0], atol=1e-6)


# ------------------------------------------------------------------ TSV-C and CART-Indexing below full rank
def test_tsv_c_keeps_each_tasks_top_floor_r_over_t_components_by_hand():
    # 3 x 3 matrices, 3 tasks: k = floor(3 / 3) = 1 of each task's 3 components (indices 0-based, e_i the unit vectors).
    # a = diag(3, 2, 1) keeps diag(3, 0, 0); b = 5 e1 e2^T - 4 e2 e1^T (singular values 5, 4) keeps 5 e1 e2^T;
    # c = diag(1, 1.5, -2) keeps -2 e2 e2^T. The bias is kept whole.
    key, bias = "blocks.0.mlp.fc1.weight", "blocks.0.mlp.fc1.bias"
    theta0 = {key: torch.eye(3, dtype=torch.float64), bias: f64([1.0, 2.0, 3.0])}
    b = torch.zeros(3, 3, dtype=torch.float64)
    b[1, 2], b[2, 1] = 5.0, -4.0
    taus = {
        "a": {key: torch.diag(f64([3.0, 2.0, 1.0])), bias: f64([0.1, 0.2, 0.3])},
        "b": {key: b, bias: f64([-1.0, 0.0, 1.0])},
        "c": {key: torch.diag(f64([1.0, 1.5, -2.0])), bias: f64([0.0, 0.5, 0.0])},
    }
    kept = {"a": torch.diag(f64([3.0, 0.0, 0.0])), "b": torch.zeros(3, 3, dtype=torch.float64)}
    kept["b"][1, 2] = 5.0
    kept["c"] = torch.diag(f64([0.0, 0.0, -2.0]))
    method = REGISTRY["tsv_c"]
    store = method(theta0, taus)
    for task in taus:
        model = method.reconstruct(store, theta0, task)
        assert close(model[key], torch.eye(3, dtype=torch.float64) + kept[task]), task
        assert close(model[bias], theta0[bias] + taus[task][bias]), task


def test_cart_indexing_adds_a_rank_k_piece_of_each_centred_vector_by_hand():
    # tau_t = M + c_t with c_a = diag(3, 1, 0), c_b = diag(-3, 0, 2), c_c = diag(0, -1, -2) (sum 0): the mean is M,
    # theta_avg = theta0 + M, and the centred vectors are the c_t. rank_ratio 0.3: k = ceil(0.9) = 1, so
    # SVD_1(c_a) = diag(3, 0, 0), SVD_1(c_b) = diag(-3, 0, 0), SVD_1(c_c) = diag(0, 0, -2). The bias: theta_avg's.
    key, bias = "blocks.0.attn.proj.weight", "blocks.0.attn.proj.bias"
    m = f64([[1.0, 2.0, 0.0], [0.0, 1.0, 0.0], [1.0, 0.0, -1.0]])
    theta0 = {key: f64([[0.5, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]), bias: f64([1.0, 0.0, -1.0])}
    centred = {"a": [3.0, 1.0, 0.0], "b": [-3.0, 0.0, 2.0], "c": [0.0, -1.0, -2.0]}
    biases = {"a": f64([0.3, 0.0, 0.0]), "b": f64([0.0, 0.6, 0.0]), "c": f64([0.0, 0.0, 0.9])}
    taus = {t: {key: m + torch.diag(f64(c)), bias: biases[t]} for t, c in centred.items()}
    top = {"a": [3.0, 0.0, 0.0], "b": [-3.0, 0.0, 0.0], "c": [0.0, 0.0, -2.0]}
    method = REGISTRY["cart_indexing"]
    store = method(theta0, taus, rank_ratio=0.3)
    for task in taus:
        model = method.reconstruct(store, theta0, task)
        assert close(model[key], theta0[key] + m + torch.diag(f64(top[task]))), task
        assert close(model[bias], theta0[bias] + f64([0.1, 0.2, 0.3])), task


# ------------------------------------------------------------------ task negation
def test_task_negation_removes_the_scaled_vector_from_every_tensor_in_float64():
    # theta0 - lam tau on each tensor, whatever its shape:
    # [[1, 2], [3, 4]] - 0.25 [[4, -8], [0, 2]] = [[0, 4], [3, 3.5]]; [0.5] - 0.25 [2] = [0]
    theta0 = {"w": f64([[1.0, 2.0], [3.0, 4.0]]), "b": f64([0.5])}
    merged = REGISTRY["task_negation"](
        theta0, {"forget": {"w": f64([[4.0, -8.0], [0.0, 2.0]]), "b": f64([2.0])}}, lam=0.25
    )
    assert merged["w"].dtype == torch.float64 and torch.equal(merged["w"], f64([[0.0, 4.0], [3.0, 3.5]]))
    assert torch.equal(merged["b"], f64([0.0]))


# ------------------------------------------------------------------ DARE with p > 0
def _observed_masks(tasks, keys, shape, p, seed):
    """Each task's DARE mask, observed from a one-task merge of a task vector of ones: the masks depend on (seed,
    task, key) only, so they are the ones a merge of several tasks draws."""
    masks = {}
    for t in tasks:
        out = REGISTRY["dare_linear"](
            {k: torch.zeros(shape, dtype=torch.float64) for k in keys},
            {t: {k: torch.ones(shape, dtype=torch.float64) for k in keys}},
            p=p,
            seed=seed,
            lam=1.0,
        )
        for k in keys:
            kept = out[k].numpy() != 0
            # a survivor is rescaled by 1 / (1 - p), a dropped entry is 0: nothing else
            assert np.allclose(out[k].numpy()[kept], 1 / (1 - p), rtol=0, atol=1e-12)
            masks[t, k] = kept
    return masks


@pytest.mark.parametrize("p", [0.3, 0.7])
def test_dare_merges_several_tasks_from_their_own_dropped_vectors(p):
    """dare_linear = theta0 + lam sum_t m_t tau_t / (1 - p); dare_ties = theta0 + lam disjoint_mean(m_t tau_t /
    (1 - p)) (TIES without a trim), written out in numpy on the masks each task draws alone."""
    tasks, keys, shape, seed, lam = (
        ["a", "b", "c"],
        ["blocks.0.mlp.fc1.weight", "blocks.0.norm1.bias"],
        (40, 25),
        11,
        0.7,
    )
    masks = _observed_masks(tasks, keys, shape, p, seed)
    for t in tasks:  # each drops about p of its entries, and the tasks and tensors draw different masks
        assert abs(masks[t, keys[0]].mean() - (1 - p)) < 0.06
    assert not np.array_equal(masks["a", keys[0]], masks["b", keys[0]])
    assert not np.array_equal(masks["a", keys[0]], masks["a", keys[1]])
    rng = np.random.default_rng(5)
    theta0 = {k: torch.from_numpy(rng.normal(size=shape)) for k in keys}
    taus = {t: {k: torch.from_numpy(rng.normal(size=shape)) for k in keys} for t in tasks}
    linear = REGISTRY["dare_linear"](theta0, taus, p=p, seed=seed, lam=lam)
    ties = REGISTRY["dare_ties"](theta0, taus, p=p, seed=seed, lam=lam)
    for k in keys:
        dropped = np.stack([taus[t][k].numpy() * masks[t, k] / (1 - p) for t in tasks])
        np.testing.assert_allclose(linear[k].numpy(), theta0[k].numpy() + lam * dropped.sum(0), rtol=0, atol=1e-12)
        sign = np.sign(dropped.sum(0))
        agree = np.sign(dropped) == sign
        agree &= dropped != 0
        mean = np.where(agree, dropped, 0).sum(0) / np.maximum(agree.sum(0), 1)
        np.testing.assert_allclose(ties[k].numpy(), theta0[k].numpy() + lam * mean, rtol=0, atol=1e-12)


def test_dare_is_task_arithmetic_in_expectation():
    # the paper's point: E[m / (1 - p)] = 1, so the mean of DARE over seeds tends to task arithmetic (200 seeds of
    # a 2-task merge, p = 0.5: each entry's mean has standard deviation |tau| / sqrt(200) per task)
    theta0 = {"w": torch.zeros(50, dtype=torch.float64)}
    taus = {
        "a": {"w": torch.full((50,), 1.0, dtype=torch.float64)},
        "b": {"w": torch.full((50,), -3.0, dtype=torch.float64)},
    }
    mean = sum(REGISTRY["dare_linear"](theta0, taus, p=0.5, seed=s, lam=1.0)["w"] for s in range(200)) / 200
    # TA = -2 everywhere; the average over 50 entries of the seed means has sd sqrt(10) / sqrt(200 x 50) = 0.03
    assert abs(float(mean.mean()) + 2.0) < 0.15 and float((mean + 2).abs().max()) < 1.0


# ------------------------------------------------------------------ LiNeS with beta != 0 on TIES' vector
def test_lines_on_ties_with_depth_scaling_by_hand():
    # tau_a = [2, -1], tau_b = [-1, -3], tau_c = [1, 1] in every block: sum [2, -3] (L1 5), TIES at k = 1 (no trim):
    # signs [+, -], disjoint mean [(2 + 1) / 2, (-1 - 3) / 2] = [1.5, -2] (L1 3.5). head.w: a [4, 0], the others 0:
    # sum [4, 0], TIES [4, 0]. alpha = (L1 of the sums / L1 of TIES) / T = ((3 x 5 + 4) / (3 x 3.5 + 4)) / 3 = 38/87.
    # Depths l / (L - 1): blocks.0 0, blocks.1 0.5, blocks.2 1; head.w is outside the blocks (alpha alone).
    vec = {"a": [2.0, -1.0], "b": [-1.0, -3.0], "c": [1.0, 1.0]}
    head = {"a": [4.0, 0.0], "b": [0.0, 0.0], "c": [0.0, 0.0]}
    keys = ["blocks.0.w", "blocks.1.w", "blocks.2.w"]
    theta0 = {k: f64([1.0, 1.0]) for k in keys} | {"head.w": f64([0.0, 1.0])}
    taus = {t: {k: f64(vec[t]) for k in keys} | {"head.w": f64(head[t])} for t in vec}
    beta, alpha = 0.6, 38 / 87
    merged = REGISTRY["lines"](theta0, taus, base="ties", ties_k=1.0, beta=beta)
    for k, depth in zip(keys, [0.0, 0.5, 1.0]):
        assert close(merged[k], 1 + (alpha + beta * depth) * f64([1.5, -2.0])), k
    assert close(merged["head.w"], f64([0.0, 1.0]) + alpha * f64([4.0, 0.0]))
    # task arithmetic's base: alpha = 1/T whatever the signs, tau_MTL the sum [2, -3]
    merged = REGISTRY["lines"](theta0, taus, base="task_arithmetic", beta=beta)
    for k, depth in zip(keys, [0.0, 0.5, 1.0]):
        assert close(merged[k], 1 + (1 / 3 + beta * depth) * f64([2.0, -3.0])), k


# ------------------------------------------------------------------ KnOTS-TIES against the paper written out
def _ties_numpy(rows: list[np.ndarray], k: float) -> np.ndarray:
    """TIES on T flat rows: keep floor(k n) largest |.| per row, elect the sign of the sum, disjoint mean."""
    trimmed = []
    for r in rows:
        keep = np.argsort(-np.abs(r), kind="stable")[: int(k * r.size)]
        t = np.zeros_like(r)
        t[keep] = r[keep]
        trimmed.append(t)
    trimmed = np.stack(trimmed)
    sign = np.sign(trimmed.sum(0))
    agree = (np.sign(trimmed) == sign) & (trimmed != 0)
    return np.where(agree, trimmed, 0).sum(0) / np.maximum(agree.sum(0), 1)


def test_knots_ties_on_low_rank_updates_against_the_papers_construction():
    """Per matrix: one SVD of [tau_1 | ... | tau_T] in numpy, its null directions dropped, coefficients S V_t^T;
    TIES over each task's coefficients of every matrix at once (a global trim), mapped back by U; the bias by TIES
    apart. LoRA-like updates (rank 1 in a 6 x 5 matrix, 3 tasks: the concatenation has rank 3 of 6) make the count
    of coefficients, and so the trim's cut, depend on dropping the null directions."""
    rng = np.random.default_rng(0)
    shapes = {"blocks.0.attn.qkv.weight": (6, 5, 1), "blocks.0.mlp.fc1.weight": (4, 6, 2)}
    tasks, k, lam = ["a", "b", "c"], 0.3, 0.8
    theta0 = {key: rng.normal(size=s[:2]) for key, s in shapes.items()} | {"blocks.0.mlp.fc1.bias": rng.normal(size=4)}
    taus = {
        t: {key: rng.normal(size=(s[0], s[2])) @ rng.normal(size=(s[2], s[1])) for key, s in shapes.items()}
        | {"blocks.0.mlp.fc1.bias": rng.normal(size=4)}
        for t in tasks
    }
    bases, coefficients = {}, {t: [] for t in tasks}
    for key, (m, n, _) in shapes.items():
        u, s, vh = np.linalg.svd(np.concatenate([taus[t][key] for t in tasks], 1), full_matrices=False)
        rank = int((s > 1e-9 * s[0]).sum())
        assert rank == min(m, len(tasks) * shapes[key][2])  # 3 of 6 for qkv, 4 of 4 for fc1
        bases[key] = u[:, :rank]
        c = s[:rank, None] * vh[:rank]
        for i, t in enumerate(tasks):
            coefficients[t].append(c[:, i * n : (i + 1) * n])
    sizes = [c.size for c in coefficients[tasks[0]]]
    merged = _ties_numpy([np.concatenate([c.ravel() for c in coefficients[t]]) for t in tasks], k)
    parts = np.split(merged, np.cumsum(sizes)[:-1])
    expected = {
        key: theta0[key] + lam * bases[key] @ part.reshape(bases[key].shape[1], -1) for key, part in zip(shapes, parts)
    }
    bias = "blocks.0.mlp.fc1.bias"
    expected[bias] = theta0[bias] + lam * _ties_numpy([taus[t][bias] for t in tasks], k)
    got = REGISTRY["knots"](
        {kk: torch.from_numpy(v) for kk, v in theta0.items()},
        {t: {kk: torch.from_numpy(v) for kk, v in tv.items()} for t, tv in taus.items()},
        base="ties",
        k=k,
        trim_scope="global",
        rounding="floor",
        lam=lam,
    )
    for key, want in expected.items():
        np.testing.assert_allclose(got[key].numpy(), want, rtol=0, atol=1e-10, err_msg=key)


# ------------------------------------------------------------------ PCB through the registry (global scope, lam)
def _pcb_merge_authors(rows: np.ndarray, ratio: float, clamp_ratio: float) -> np.ndarray:
    """pcb-merging.py's PCB_merge (its inter-balancing tanh(tau_t * sum_s tau_s)), written out in numpy."""

    def normalize(x):
        return (x - x.min(1, keepdims=True)) / (x.max(1, keepdims=True) - x.min(1, keepdims=True))

    def clamp(x, lo, hi):
        d = x.shape[1]
        s = np.sort(x, 1)
        return np.minimum(np.maximum(x, s[:, int(d * lo)][:, None]), s[:, int(d * (1 - hi) - 1)][:, None])

    n = rows.shape[0]
    mags = clamp(np.abs(rows), clamp_ratio, clamp_ratio)
    clamped = np.sign(rows) * mags
    task_pcb = np.exp(n * normalize(mags) ** 2) * np.tanh(rows * rows.sum(0))
    scale = normalize(clamp(task_pcb, 1 - ratio, 0))
    return (clamped * scale).sum(0) / np.maximum(scale.sum(0), 1e-12)


def test_pcb_global_scope_flattens_the_whole_model_into_one_row_per_task():
    rng = np.random.default_rng(8)
    shapes = {"blocks.0.mlp.fc1.weight": (6, 10), "blocks.0.mlp.fc1.bias": (6,), "cls_token": (1, 1, 4)}
    tasks = ["a", "b", "c"]
    theta0 = {k: rng.normal(size=s) for k, s in shapes.items()}
    taus = {t: {k: rng.normal(size=s) * (0.3 + 0.2 * i) for k, s in shapes.items()} for i, t in enumerate(tasks)}
    rows = np.stack([np.concatenate([taus[t][k].ravel() for k in shapes]) for t in tasks])  # 3 x 70
    merged = _pcb_merge_authors(rows, 0.3, 0.05)
    parts = np.split(merged, np.cumsum([int(np.prod(s)) for s in shapes.values()])[:-1])
    got = REGISTRY["pcb"](
        {k: torch.from_numpy(v) for k, v in theta0.items()},
        {t: {k: torch.from_numpy(v) for k, v in tv.items()} for t, tv in taus.items()},
        ratio=0.3,
        clamp_ratio=0.05,
        inter="sum",
        scope="global",
        lam=1.2,
    )
    for (k, s), part in zip(shapes.items(), parts):
        np.testing.assert_allclose(got[k].numpy(), theta0[k] + 1.2 * part.reshape(s), rtol=0, atol=1e-12, err_msg=k)
    # each tensor alone (scope tensor) is another merge: the cuts are per tensor
    per_tensor = REGISTRY["pcb"](
        {k: torch.from_numpy(v) for k, v in theta0.items()},
        {t: {k: torch.from_numpy(v) for k, v in tv.items()} for t, tv in taus.items()},
        ratio=0.3,
        clamp_ratio=0.05,
        inter="sum",
        scope="tensor",
        lam=1.2,
    )
    w = "blocks.0.mlp.fc1.weight"
    alone = _pcb_merge_authors(np.stack([taus[t][w].ravel() for t in tasks]), 0.3, 0.05).reshape(shapes[w])
    np.testing.assert_allclose(per_tensor[w].numpy(), theta0[w] + 1.2 * alone, rtol=0, atol=1e-12)
    assert not np.allclose(per_tensor[w].numpy(), got[w].numpy())


# ------------------------------------------------------------------ AdaRank's masked sum (TA / CART components)
def test_adarank_masked_components_each_scaled_by_their_tasks_lambda_by_hand():
    # directions: a = diag(3, 2, 1) (components 3 e0 e0^T, 2 e1 e1^T, 1 e2 e2^T), b = 5 e1 e2^T - 4 e2 e1^T
    # (components 5 e1 e2^T, 4 e2 (-e1)^T, and a zero one). rank_ratio 0.34: floor(0.34 x 3) = 1 component each kept
    # at the start. lambda a 0.5, b 2.0 on the matrix: 0.5 diag(3, 0, 0) + 2.0 x 5 e1 e2^T; b's second component
    # switched on (logit +0.3): + 2.0 x (-4) e2 e1^T; a's first switched off (logit -0.3): its 1.5 goes.
    # The bias (not a matrix): base + 0.7 bias_a + 1.1 bias_b (its own column of lambda).
    from mergeflow.ml.merging.adarank import parametrisation

    key, bias = "blocks.0.mlp.fc1.weight", "blocks.0.mlp.fc1.bias"
    base = {key: torch.ones(3, 3, dtype=torch.float64), bias: f64([0.0, 1.0, 2.0])}
    b = torch.zeros(3, 3, dtype=torch.float64)
    b[1, 2], b[2, 1] = 5.0, -4.0
    directions = {
        "a": {key: torch.diag(f64([3.0, 2.0, 1.0])), bias: f64([1.0, 0.0, 0.0])},
        "b": {key: b, bias: f64([0.0, 0.0, 1.0])},
    }
    module = parametrisation(0.34, 1.0, 10.0)(base, directions, torch.device("cpu"))
    w, v = module.keys.index(key), module.keys.index(bias)
    with torch.no_grad():
        module.lam[:, w] = f64([0.5, 2.0])
        module.lam[:, v] = f64([0.7, 1.1])
    expected = torch.ones(3, 3, dtype=torch.float64)
    expected[0, 0] += 1.5
    expected[1, 2] += 10.0
    out = module()
    assert close(out[key], expected)
    assert close(out[bias], f64([0.7, 1.0, 3.1]))
    logits = module.logits[key.replace(".", "/")]
    with torch.no_grad():
        logits[1, 1] = 0.3
        logits[0, 0] = -0.3
    expected[2, 1] -= 8.0
    expected[0, 0] -= 1.5
    assert close(module()[key], expected)
    assert module.kept() == {"a": {key: 0}, "b": {key: 2}}


# ------------------------------------------------------------------ FW-Merging over several steps
def _fw_setup():
    from mergeflow.ml.merging._adaptive import EntropyObjective

    from .test_data_aware import _tiny_setup

    theta0, taus, objective = _tiny_setup(torch.float64)
    g = torch.Generator().manual_seed(7)
    images = objective.inputs["test"]
    labels = {
        t: torch.randint(0, head.out_features, (len(images[t]),), generator=g) for t, head in objective.heads.items()
    }
    return (
        theta0,
        taus,
        EntropyObjective(objective.backbone, objective.heads, {"train": images}, objective.device),
        labels,
    )


def _plain_gradient(objective, labels, state):
    """The gradient of the mean cross-entropy over every task's examples, on a copy of the backbone whose weights
    are loaded as a state dict (plain autograd, no functional call)."""
    backbone = copy.deepcopy(objective.backbone).double()
    backbone.net.load_state_dict(state)
    heads = {t: copy.deepcopy(h).double() for t, h in objective.heads.items()}
    total = sum(len(y) for y in labels.values())
    loss = 0.0
    for t, x in objective.inputs["train"].items():
        logits = heads[t](backbone.embed(backbone.net(backbone.normalise(x).double())))
        loss = loss + torch.nn.functional.cross_entropy(logits, labels[t], reduction="sum")
    (loss / total).backward()
    return {k: p.grad.clone() for k, p in backbone.net.named_parameters()}


def test_fw_merging_three_steps_follow_the_frank_wolfe_schedule():
    """theta_{k+1} = theta_k + gamma_k (s_k - theta_k), gamma_k = 2 / (k + 2) step_size scaling, s_k the vertex
    (a fine-tuned model, or the fixed start) of least <grad(theta_k), v>: three steps, simulated with full models. One
    step cannot tell 2 / (k + 2) from 1 / (k + 1); the later steps can."""
    theta0, taus, objective, labels = _fw_setup()
    scaling, step_size = 0.3, 1.5
    start = {k: theta0[k] + scaling * sum(tv[k] for tv in taus.values()) for k in theta0}
    vertices = {t: {k: theta0[k] + tv[k] for k in theta0} for t, tv in taus.items()} | {"initial": start}
    theta, picked = dict(start), []
    for step in range(3):
        grad = _plain_gradient(objective, labels, theta)
        best = min(vertices, key=lambda v: sum(float((grad[k] * vertices[v][k]).sum()) for k in grad))
        picked.append(best)
        gamma = 2 / (step + 2) * step_size * scaling
        theta = {k: theta[k] + gamma * (vertices[best][k] - theta[k]) for k in theta}
    data = MergeData(objective=copy.copy(objective), train_labels=labels)
    merged = REGISTRY["fw_merging"].with_data(data)(
        theta0, taus, steps=3, step_size=step_size, scaling=scaling, examples=24, batch_size=7
    )
    assert data.learned[0]["selected"] == picked
    for k in theta0:
        torch.testing.assert_close(merged[k], theta[k], rtol=1e-9, atol=1e-10)


# ------------------------------------------------------------------ RegMean++ block by block, every block fine-tuned
def test_regmean_plusplus_each_block_is_regmean_on_the_merged_prefixs_inputs():
    """For every block l: its linear weights are (sum_t W_t G~_t)(sum_t G~_t)^-1, G~ = alpha G + (1 - alpha) diag(G),
    G_t = X^T X of the inputs each linear layer of block l sees when task t's images go through the merged
    embeddings and merged blocks < l (the method's own output) and then task t's own block l; captured here by forward
    hooks on a plain timm model in float64 and solved in numpy. Its other tensors and everything outside the
    blocks: the mean of the fine-tuned models. (The existing tests cover only the first block, with the embeddings
    not fine-tuned, and one task.)"""
    from mergeflow.config import BackboneConfig
    from mergeflow.ml.models import build_backbone

    vit = BackboneConfig(
        model="vit_tiny_patch16_224",
        kwargs={"img_size": 16, "patch_size": 8, "embed_dim": 16, "depth": 3, "num_heads": 2},
    )
    torch.manual_seed(0)
    backbone = build_backbone(vit).double()
    theta0 = {k: v.detach().clone() for k, v in backbone.net.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    tasks, alpha = ["a", "b", "c"], 0.8
    taus = {t: {k: 0.1 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in theta0.items()} for t in tasks}
    images = {t: torch.randint(0, 256, (12, 16, 16, 3), generator=g, dtype=torch.uint8) for t in tasks}
    merged = REGISTRY["regmean_plusplus"].with_data(MergeData(backbone=backbone, train_inputs=images))(
        theta0, taus, alpha=alpha
    )
    models = {t: {k: theta0[k] + taus[t][k] for k in theta0} for t in tasks}
    mean = {k: sum(models[t][k] for t in tasks) / len(tasks) for k in theta0}
    linears = ["attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"]
    for k in theta0:
        if not any(k == f"blocks.{l}.{name}.weight" for l in range(3) for name in linears):
            torch.testing.assert_close(merged[k], mean[k], rtol=0, atol=1e-12)
    for l in range(3):
        grams = {}
        for t in tasks:
            prefix = {k: (models[t][k] if k.startswith(f"blocks.{l}.") else merged[k]) for k in theta0}
            net = copy.deepcopy(backbone)
            net.net.load_state_dict(prefix)
            seen = {}

            def hook(name):
                def capture(module, args):
                    x = args[0].reshape(-1, args[0].shape[-1]).double()
                    seen[name] = seen.get(name, 0) + x.T @ x

                return capture

            block = net.net.blocks[l]
            handles = [block.get_submodule(name).register_forward_pre_hook(hook(name)) for name in linears]
            with torch.no_grad():
                net.net.forward_features(net.normalise(images[t]).double())
            for h in handles:
                h.remove()
            grams[t] = seen
        for name in linears:
            key = f"blocks.{l}.{name}.weight"
            shrunk = [alpha * grams[t][name] + (1 - alpha) * torch.diag(torch.diagonal(grams[t][name])) for t in tasks]
            lhs = sum(shrunk).numpy()
            rhs = sum(models[t][key] @ s for t, s in zip(tasks, shrunk)).numpy()
            expected = np.linalg.solve(lhs.T, rhs.T).T  # W (sum G~) = sum W_t G~_t
            np.testing.assert_allclose(merged[key].numpy(), expected, rtol=1e-7, atol=1e-9, err_msg=key)
            assert not np.allclose(expected, mean[key].numpy(), atol=1e-3)  # the regression is not the average
