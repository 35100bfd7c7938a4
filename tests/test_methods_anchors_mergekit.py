"""mergekit's Arcee Fusion, RAM and RAM+, and FusionBench's ExPO: each against values computed by hand on tiny
tensors, against its reference's formula written out independently, and its identities."""

import math

import pytest
import torch

from mergeflow.ml.merging import REGISTRY
from mergeflow.ml.merging.arcee_fusion import dynamic_threshold, fusion_mask

T = torch.tensor


def close(a, b, atol=1e-6):
    return torch.allclose(a, b, atol=atol)


def _random(tasks=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    theta0 = {
        "blocks.0.mlp.fc1.weight": torch.randn(6, 5, generator=g),
        "blocks.0.mlp.fc1.bias": torch.randn(6, generator=g),
        "norm.weight": torch.randn(5, generator=g),
    }
    tvs = {f"t{i}": {k: 0.1 * torch.randn(v.shape, generator=g) for k, v in theta0.items()} for i in range(tasks)}
    return theta0, tvs


# ------------------------------------------------------------------ Arcee Fusion
def test_arcee_fusion_threshold_takes_quantiles_at_floor_of_q_times_n_minus_one():
    # sorted [1, 2, 3, 4]: indices floor(0.25 * 3) = 0, floor(0.5 * 3) = 1, floor(0.75 * 3) = 2 -> 1, 2, 3;
    # c = 2 + 1.5 * (3 - 1) = 5 (interpolated quantiles would give a median of 2.5)
    assert float(dynamic_threshold(T([4.0, 1.0, 3.0, 2.0]))) == 5.0
    # n = 5: indices 1, 2, 3 of [0.1, 0.2, 0.3, 0.4, 5] -> 0.3 + 1.5 * 0.2 = 0.6
    assert math.isclose(float(dynamic_threshold(T([0.3, 5.0, 0.1, 0.4, 0.2]))), 0.6, rel_tol=1e-6)


def test_arcee_fusion_by_hand_on_one_row_keeps_the_outlier_change():
    # one row: KL is one positive number k, s = k |tau|, so m = [|tau| >= 0.3 + 1.5 (0.4 - 0.2) = 0.6]: only the 5
    theta0 = {"w": T([0.0, 1.0, 0.5, -1.0, 2.0])}
    tau = T([0.1, -0.2, 0.3, 0.4, -5.0])
    merged = REGISTRY["arcee_fusion"](theta0, {"a": {"w": tau}})["w"]
    assert close(merged, T([0.0, 1.0, 0.5, -1.0, -3.0]))
    # n = 4, |tau| sorted [1, 2, 3, 5.1]: c = 2 + 1.5 (3 - 1) = 5 keeps the 5.1, where interpolated quantiles
    # (2.5 + 1.5 (3.525 - 1.75) = 5.1625) would keep nothing
    merged = REGISTRY["arcee_fusion"]({"w": torch.zeros(4)}, {"a": {"w": T([1.0, -2.0, 3.0, 5.1])}})["w"]
    assert close(merged, T([0.0, 0.0, 0.0, 5.1]))


def _mergekit_fusion(base, model):
    """mergekit's ArceeFusionMergeTask on two models, written out in plain Python (math, lists) for a matrix."""
    rows = []
    for b_row, m_row in zip(base.tolist(), model.tolist()):

        def softmax(xs):
            top = max(xs)
            e = [math.exp(x - top) for x in xs]
            return [v / sum(e) + 1e-8 for v in e]

        p, q = softmax(m_row), softmax(b_row)
        kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
        rows.append([abs(m - b) * kl for b, m in zip(b_row, m_row)])
    flat = sorted(s for row in rows for s in row)
    n = len(flat)
    c = flat[int(0.5 * (n - 1))] + 1.5 * (flat[int(0.75 * (n - 1))] - flat[int(0.25 * (n - 1))])
    fused = [
        [b + (m - b) * (s >= c) for b, m, s in zip(b_row, m_row, s_row)]
        for b_row, m_row, s_row in zip(base.tolist(), model.tolist(), rows)
    ]
    return T(fused)


def test_arcee_fusion_of_two_models_is_mergekits_formula():
    g = torch.Generator().manual_seed(3)
    base = torch.randn(4, 6, generator=g, dtype=torch.float64)
    tau = 0.3 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    tau[1] *= 8  # one row moves far more: its KL lifts its entries over the threshold
    merged = REGISTRY["arcee_fusion"]({"w": base}, {"m": {"w": tau}})["w"]
    expected = _mergekit_fusion(base, base + tau).double()
    kept = fusion_mask(base, tau)
    assert 0 < int(kept.sum()) < tau.numel()  # the case selects some entries, not all or none
    assert torch.allclose(merged, expected, atol=1e-12)


def test_arcee_fusion_of_identical_models_returns_the_model_and_keeps_a_constant_shift_whole():
    theta0, _ = _random()
    same = REGISTRY["arcee_fusion"](theta0, {"m": {k: torch.zeros_like(v) for k, v in theta0.items()}})
    assert all(torch.equal(same[k], theta0[k]) for k in theta0)
    # every entry moved by 0.5: softmax unchanged, all scores equal, every one at the threshold: tau kept whole
    shifted = REGISTRY["arcee_fusion"]({"w": T([0.0, 1.0, 2.0])}, {"m": {"w": T([0.5, 0.5, 0.5])}})["w"]
    assert close(shifted, T([0.5, 1.5, 2.5]))
    scalar = REGISTRY["arcee_fusion"]({"s": T(2.0)}, {"m": {"s": T(0.25)}})["s"]
    assert scalar.shape == () and close(scalar, T(2.25))


def test_arcee_fusion_of_several_tasks_sums_the_pairwise_masked_task_vectors():
    theta0, tvs = _random()
    pairwise = {t: REGISTRY["arcee_fusion"](theta0, {t: tv}) for t, tv in tvs.items()}
    merged = REGISTRY["arcee_fusion"](theta0, tvs, lam=1 / 3)
    for k in theta0:
        mean_of_merges = torch.stack([pairwise[t][k] for t in tvs]).mean(0)
        assert close(merged[k], mean_of_merges, 1e-6)
    summed = REGISTRY["arcee_fusion"](theta0, tvs, lam=1.0)
    w = "blocks.0.mlp.fc1.weight"
    assert close(summed[w], theta0[w] + sum(pairwise[t][w] - theta0[w] for t in tvs), 1e-6)


# ------------------------------------------------------------------ RAM, RAM+
def _ram_case():
    # 3 tasks, 4 entries, epsilon 1e-5: entry 0 only a (unique), entry 1 a and b (shared), entry 2 all three,
    # entry 3 nobody (c's 1e-6 is under epsilon)
    theta0 = {"w": T([1.0, 1.0, 1.0, 1.0])}
    tvs = {
        "a": {"w": T([0.4, 0.2, 0.3, 0.0])},
        "b": {"w": T([0.0, -0.6, 0.6, 0.0])},
        "c": {"w": T([0.0, 0.0, -0.3, 1e-6])},
    }
    return theta0, tvs


def test_ram_by_hand():
    theta0, tvs = _ram_case()
    # unique 0.4; shared mean(0.2, -0.6) = -0.2; mean(0.3, 0.6, -0.3) = 0.2; nothing
    assert close(REGISTRY["ram"](theta0, tvs)["w"], T([1.4, 0.8, 1.2, 1.0]))
    assert close(REGISTRY["ram"](theta0, tvs, lam=2.0)["w"], T([1.8, 0.6, 1.4, 1.0]))
    # epsilon 0: c's 1e-6 is its own unique update
    assert close(REGISTRY["ram"](theta0, tvs, epsilon=0.0)["w"], T([1.4, 0.8, 1.2, 1.000001]), atol=1e-7)


def test_ram_plus_by_hand():
    theta0, tvs = _ram_case()
    # a: shared 2 (entries 1, 2), unique 1 (entry 0): rho 2; lambda = 1 + r min(rho, alpha)
    merged = REGISTRY["ram_plus"](theta0, tvs, r=0.5, alpha=1.5)["w"]
    assert close(merged, T([1.0 + 0.4 * 1.75, 0.8, 1.2, 1.0]))
    merged = REGISTRY["ram_plus"](theta0, tvs)["w"]  # mergekit's r 0.1, alpha 0.2: lambda 1.02
    assert close(merged, T([1.0 + 0.4 * 1.02, 0.8, 1.2, 1.0]))


def test_ram_keeps_each_tasks_update_where_the_updates_are_disjoint():
    theta0 = {"w": T([[1.0, 2.0], [3.0, 4.0]])}
    tvs = {"a": {"w": T([[0.5, 0.0], [0.0, 0.0]])}, "b": {"w": T([[0.0, -1.0], [0.0, 2.0]])}}
    expected = T([[1.5, 1.0], [3.0, 6.0]])
    assert torch.equal(REGISTRY["ram"](theta0, tvs)["w"], expected)
    # RAM+ with no shared entry: rho 0, lambda 1
    assert torch.equal(REGISTRY["ram_plus"](theta0, tvs, r=5.0, alpha=10.0)["w"], expected)


def test_ram_of_dense_task_vectors_is_weight_averaging_and_ram_plus_at_r_zero_is_ram():
    theta0, tvs = _random()
    ram, wa = REGISTRY["ram"](theta0, tvs), REGISTRY["weight_averaging"](theta0, tvs)
    assert all(close(ram[k], wa[k]) for k in theta0)
    sparse = {t: {k: torch.where(v.abs() > 0.1, v, 0.0) for k, v in tv.items()} for t, tv in tvs.items()}
    ram, plus = REGISTRY["ram"](theta0, sparse), REGISTRY["ram_plus"](theta0, sparse, r=0.0)
    assert all(torch.equal(ram[k], plus[k]) for k in theta0)
    assert not all(close(ram[k], wa[k]) for k in theta0)


def test_ram_plus_scope_counts_rho_per_tensor_or_over_the_model():
    # tensor u: a unique on 1 entry, shared on 1 (rho_u 1); tensor v: a unique on 3 (rho_v 0).
    # tensor scope: a's unique entry in u scaled 1 + 0.5 * 1, in v by 1; global: rho 1/4, both by 1.125
    theta0 = {"u": torch.zeros(2), "v": torch.zeros(3)}
    tvs = {"a": {"u": T([1.0, 1.0]), "v": T([1.0, 1.0, 1.0])}, "b": {"u": T([0.0, 3.0]), "v": torch.zeros(3)}}
    local = REGISTRY["ram_plus"](theta0, tvs, r=0.5, alpha=2.0, scope="tensor")
    assert close(local["u"], T([1.5, 2.0])) and close(local["v"], T([1.0, 1.0, 1.0]))
    whole = REGISTRY["ram_plus"](theta0, tvs, r=0.5, alpha=2.0, scope="global")
    assert close(whole["u"], T([1.125, 2.0])) and close(whole["v"], T([1.125, 1.125, 1.125]))


def _mergekit_ramplus_tl(base, tensors, r=0.1, alpha=0.2, epsilon=1e-5):
    """mergekit's ``ramplus_tl_merge`` written out: masks over the flattened stack, rho per tensor with the unique
    count clamped at epsilon, each task's update divided by the count where shared."""
    tv = torch.stack([t - base for t in tensors]).reshape(len(tensors), -1)
    nonzero = tv.abs() > epsilon
    counts = nonzero.sum(0, keepdim=True)
    overlap, unique = counts > 1, counts == 1
    rho = (nonzero & overlap).sum(1) / (nonzero & unique).sum(1).clamp(min=epsilon)
    lam = 1 + r * rho.clamp(min=0, max=alpha)
    tv_z = tv * nonzero
    merged = (tv_z * unique * lam.unsqueeze(-1) + tv_z * overlap / counts.clamp(min=1)).sum(0)
    return base + merged.reshape(base.shape)


def test_ram_plus_per_tensor_is_mergekits_ramplus_tl_even_for_a_task_with_no_unique_entry():
    g = torch.Generator().manual_seed(2)
    base = torch.randn(5, 8, generator=g, dtype=torch.float64)
    taus = [
        torch.where(torch.rand(5, 8, generator=g) < 0.4, torch.randn(5, 8, generator=g), 0.0).double() for _ in "abc"
    ]
    taus.append(taus[0] * 0.5)  # task d updates only where a does: no unique entry (rho clamps to alpha there)
    hp = {"r": 0.3, "alpha": 0.8}
    ours = REGISTRY["ram_plus"]({"w": base}, {t: {"w": tau} for t, tau in zip("abcd", taus)}, **hp)["w"]
    assert torch.allclose(ours, _mergekit_ramplus_tl(base, [base + tau for tau in taus], **hp), atol=1e-12)


def _authors_rescale_v2(base, taus, threshold=1e-5, r=1.05):
    """The authors' ram-main.py ``agentic_reinforcement_merge_rescale_v2``, written out: global overlap ratios,
    rescale 1 + (r - 1) min(1, ratio) on unique entries, the mean on shared ones."""
    n = len(taus)
    changed, overlap = [0] * n, [0] * n
    for key in base:
        mask = [(tv[key].abs() > threshold) for tv in taus]
        count = sum(m.int() for m in mask)
        for j in range(n):
            changed[j] += int(mask[j].sum())
            overlap[j] += int((mask[j] & (count >= 2)).sum())
    rescale = [1.0 + (r - 1.0) * min(1.0, o / (c - o)) for o, c in zip(overlap, changed)]
    out = {}
    for key in base:
        mask = [(tv[key].abs() > threshold).float() for tv in taus]
        count = sum(mask)
        total = sum(tv[key] * m for tv, m in zip(taus, mask))
        scaled = sum(tv[key] * m * s for tv, m, s in zip(taus, mask, rescale))
        diff = torch.where(count >= 2, total / count.clamp(min=1), torch.where(count == 1, scaled, 0.0))
        out[key] = base[key] + diff
    return out


def test_ram_plus_global_at_the_authors_settings_is_their_rescale_v2():
    theta0, tvs = _random(seed=5)
    sparse = [{k: torch.where(v.abs() > 0.12, v, 0.0) for k, v in tv.items()} for tv in tvs.values()]
    ours = REGISTRY["ram_plus"](theta0, dict(zip(tvs, sparse)), scope="global", r=0.05, alpha=1.0)
    theirs = _authors_rescale_v2(theta0, sparse)
    assert all(close(ours[k], theirs[k]) for k in theta0)


def test_ram_refuses_a_negative_threshold_naming_it():
    theta0, tvs = _ram_case()
    with pytest.raises(ValueError, match=r"^merge\.ram\.epsilon: expected an update threshold >= 0, got -1"):
        REGISTRY["ram"](theta0, tvs, epsilon=-1.0)
    with pytest.raises(ValueError, match=r"^merge\.ram_plus\.scope: expected one of 'tensor', 'global'"):
        REGISTRY["ram_plus"](theta0, tvs, scope="row")


# ------------------------------------------------------------------ ExPO
def test_expo_by_hand():
    # average of tau: [0.5, 1]; alpha 0.5 extrapolates it by 1.5: [0.75, 1.5]
    theta0 = {"w": T([1.0, 2.0])}
    tvs = {"a": {"w": T([1.0, 0.0])}, "b": {"w": T([0.0, 2.0])}}
    assert close(REGISTRY["expo"](theta0, tvs, alpha=0.5)["w"], T([1.75, 3.5]))
    assert close(REGISTRY["expo"](theta0, tvs)["w"], T([1.55, 3.1]))  # FusionBench's alpha 0.1


def test_expo_at_alpha_zero_is_weight_averaging_in_either_scope():
    theta0, tvs = _random()
    wa = REGISTRY["weight_averaging"](theta0, tvs)
    for scope in ("all", "matrices"):
        merged = REGISTRY["expo"](theta0, tvs, alpha=0.0, scope=scope)
        assert all(torch.equal(merged[k], wa[k]) for k in theta0)


def test_expo_is_fusionbenchs_extrapolation_of_the_average_and_task_arithmetic_at_one_plus_alpha_over_t():
    theta0, tvs = _random()
    merged = REGISTRY["expo"](theta0, tvs, alpha=0.7)
    ta = REGISTRY["task_arithmetic"](theta0, tvs, lam=1.7 / 3)
    for k in theta0:
        rlhf = torch.stack([theta0[k] + tv[k] for tv in tvs.values()]).mean(0)  # SimpleAverageAlgorithm
        assert close(merged[k], rlhf + 0.7 * (rlhf - theta0[k]), 1e-6) and close(merged[k], ta[k], 1e-6)
    one = REGISTRY["expo"](theta0, {"t0": tvs["t0"]}, alpha=0.3)  # one model: the paper's theta_1 + alpha tau
    assert all(close(one[k], theta0[k] + 1.3 * tvs["t0"][k]) for k in theta0)


def test_expo_matrices_scope_extrapolates_only_the_linear_weights():
    theta0, tvs = _random()
    merged = REGISTRY["expo"](theta0, tvs, alpha=1.0, scope="matrices")
    w = "blocks.0.mlp.fc1.weight"
    mean = {k: torch.stack([tv[k] for tv in tvs.values()]).mean(0) for k in theta0}
    assert close(merged[w], theta0[w] + 2 * mean[w])
    for k in ("blocks.0.mlp.fc1.bias", "norm.weight"):  # 1-D: at the average
        assert close(merged[k], theta0[k] + mean[k])
