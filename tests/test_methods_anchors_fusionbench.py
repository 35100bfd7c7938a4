"""TATR, RanDeS and gossip (FusionBench's methods) against values computed by hand on tiny tensors, identities,
and an independent route (the reference's loops written out)."""

import pytest
import torch

from mergeflow.ml.merging import REGISTRY
from mergeflow.ml.merging._tensors import store_bytes
from mergeflow.ml.merging.gossip import mixing, neighbours, reach
from mergeflow.ml.merging.randes import is_target
from mergeflow.ml.merging.tatr import conflict

from .test_merging import _random_models, _toy_data

T = torch.tensor


def close(a, b, atol=1e-6):
    return torch.allclose(a, b, atol=atol)


# ------------------------------------------------------------------ TATR
def test_tatr_by_hand():
    # Omega = 2 |a| |b| = [2, 4, 0, 18]; q = 0.5 of n = 4: sorted position 2 -> c = 4
    theta0 = {"w": torch.zeros(4)}
    tvs = {"a": {"w": T([1.0, 2.0, 0.0, 3.0])}, "b": {"w": T([1.0, -1.0, 5.0, 3.0])}}
    strict = REGISTRY["tatr"](theta0, tvs, quantile=0.5, cut="strict", lam=1.0)
    assert torch.equal(strict["w"], T([2.0, 0.0, 5.0, 0.0]))  # Omega < 4: entries 0 and 2
    inclusive = REGISTRY["tatr"](theta0, tvs, quantile=0.5, cut="inclusive", lam=0.5)
    assert torch.equal(inclusive["w"], T([1.0, 0.5, 2.5, 0.0]))  # Omega <= 4: entries 0, 1, 2, halved


def test_tatr_cuts_over_the_whole_model_not_per_tensor():
    # Omega: key a [1, 100], key b [2, 3]; q = 0.75 of n = 4 -> c = 100: only a[1] leaves the trust region
    theta0 = {"a": torch.zeros(2), "b": torch.zeros(2)}
    tvs = {"s": {"a": T([1.0, 10.0]), "b": T([1.0, 1.0])}, "t": {"a": T([0.5, 5.0]), "b": T([1.0, 1.5])}}
    merged = REGISTRY["tatr"](theta0, tvs, quantile=0.75, cut="strict", lam=1.0)
    assert torch.equal(merged["a"], T([1.5, 0.0])) and torch.equal(merged["b"], T([2.0, 2.5]))


def test_tatr_conflict_is_the_references_double_loop():
    g = torch.Generator().manual_seed(3)
    taus = torch.randn(4, 5, 3, generator=g, dtype=torch.float64)
    loop = sum(taus[i].abs() * taus[j].abs() for i in range(4) for j in range(4) if i != j)
    assert close(conflict(taus), loop, atol=1e-12)


def test_tatr_with_an_empty_mask_is_task_arithmetic():
    theta0, tvs = _random_models()
    tatr = REGISTRY["tatr"](theta0, tvs, quantile=1.0, cut="inclusive", lam=0.3)
    ta = REGISTRY["task_arithmetic"](theta0, tvs, lam=0.3)
    assert all(close(tatr[k], ta[k]) for k in theta0)


def test_tatr_strict_cut_drops_the_largest_conflict_even_at_q_one():
    # the reference's rule (Omega < its maximum): the most conflicting entry leaves, the rest is task arithmetic
    theta0, tvs = _random_models()
    merged = REGISTRY["tatr"](theta0, tvs, quantile=1.0, cut="strict", lam=1.0)
    ta = REGISTRY["task_arithmetic"](theta0, tvs, lam=1.0)
    omegas = {k: conflict(torch.stack([tv[k] for tv in tvs.values()])) for k in theta0}
    top = max(omegas, key=lambda k: omegas[k].max())
    for k in theta0:
        dropped = omegas[k] == omegas[top].max()
        assert torch.equal(merged[k][dropped], theta0[k][dropped])
        assert close(merged[k][~dropped], ta[k][~dropped])
    assert int(sum((omegas[k] == omegas[top].max()).sum() for k in theta0)) == 1


def test_tatr_one_task_has_no_conflict():
    # Omega = 0 everywhere: the strict cut (< 0) keeps nothing, the inclusive one everything
    theta0, tvs = _random_models(T_=1)
    strict = REGISTRY["tatr"](theta0, tvs, quantile=0.99, cut="strict", lam=1.0)
    inclusive = REGISTRY["tatr"](theta0, tvs, quantile=0.99, cut="inclusive", lam=1.0)
    assert all(torch.equal(strict[k], theta0[k]) for k in theta0)
    assert all(close(inclusive[k], theta0[k] + tvs["t0"][k]) for k in theta0)


def test_tatr_names_the_task_and_key_at_fault():
    theta0, tvs = _random_models(T_=2)
    del tvs["t1"]["pos_embed"]
    with pytest.raises(ValueError, match="^tatr: task vector 't1' has no tensor 'pos_embed'$"):
        REGISTRY["tatr"](theta0, tvs)


# ------------------------------------------------------------------ RanDeS
def _store_and_models(theta0, tvs, **hp):
    method = REGISTRY["randes"]
    store = method(theta0, tvs, **hp)
    return store, {t: method.reconstruct(store, theta0, t) for t in tvs}


def test_randes_one_task_is_retrieved_exactly():
    theta0, tvs = _random_models(T_=1)
    _, models = _store_and_models(theta0, tvs, lam=1.0)
    assert all(torch.equal(models["t0"][k], theta0[k] + tvs["t0"][k]) for k in theta0)


def test_randes_retrieval_is_the_task_plus_sign_flipped_others():
    # theta_a = theta0 + lam (tau_a + tau_b s_b s_a) on a target (signs along the input dimension), and
    # theta0 + lam (tau_a + tau_b) elsewhere
    theta0, tvs = _random_models(T_=2)
    store, models = _store_and_models(theta0, tvs, lam=0.5)
    key = "blocks.0.attn.qkv.weight"
    sign = {t: store[f"sign/{t}/{key}"].double() * 2 - 1 for t in tvs}
    assert sign["t0"].shape == (4,) and not torch.equal(sign["t0"], sign["t1"])
    for t, other in (("t0", "t1"), ("t1", "t0")):
        expected = theta0[key] + 0.5 * (tvs[t][key] + tvs[other][key] * (sign[other] * sign[t]).float())
        assert close(models[t][key], expected)
        for k in ("blocks.0.norm1.bias", "pos_embed"):
            assert close(models[t][k], theta0[k] + 0.5 * (tvs["t0"][k] + tvs["t1"][k]))


def test_randes_signs_are_fair_coins_fixed_by_the_seed():
    theta0 = {"blocks.0.mlp.fc1.weight": torch.zeros(2, 4000)}
    tvs = {t: {"blocks.0.mlp.fc1.weight": torch.ones(2, 4000)} for t in ("a", "b")}
    first, _ = _store_and_models(theta0, tvs, seed=1)
    again, _ = _store_and_models(theta0, tvs, seed=1)
    other, _ = _store_and_models(theta0, tvs, seed=2)
    signs = first["sign/a/blocks.0.mlp.fc1.weight"]
    assert torch.equal(signs, again["sign/a/blocks.0.mlp.fc1.weight"])
    assert not torch.equal(signs, other["sign/a/blocks.0.mlp.fc1.weight"])
    assert 0.45 < signs.float().mean() < 0.55  # 4000 fair coins: 5 standard deviations is 0.04


def test_randes_store_is_one_model_plus_a_bit_per_column_and_task():
    theta0, tvs = _random_models(T_=3)
    store, _ = _store_and_models(theta0, tvs)
    model = sum(v.numel() * 4 for v in theta0.values())
    assert store_bytes(store) == model + 8 + 3 * 1  # float64 lam; 3 tasks x 4 columns of qkv: 1 byte each


def test_randes_targets():
    w = torch.zeros(3, 3)
    assert is_target("blocks.0.attn.qkv.weight", w, "mlp_attn") and is_target("blocks.1.mlp.fc2.weight", w, "mlp_attn")
    assert not is_target("blocks.0.attn.qkv.bias", torch.zeros(3), "mlp_attn")
    assert not is_target("blocks.0.norm1.weight", torch.zeros(3), "mlp_attn")
    bert = "encoder.layer.0.attention.self.query.weight"
    assert not is_target(bert, w, "mlp_attn") and is_target(bert, w, "matrices")
    assert not is_target("embeddings.word_embeddings.weight", w, "matrices")


# ------------------------------------------------------------------ gossip
def _gossip_models(name, theta0, tvs, **hp):
    method = REGISTRY[name]
    store = method(theta0, tvs, **hp)
    return {t: method.reconstruct(store, theta0, t) for t in tvs}


def test_gossip_ring_of_four_two_rounds_by_hand():
    # ring of 4: node 0 merges [1, 0, 3]; A^2 row 0 = [3, 2, 2, 2] (the 2-step walks from node 0)
    assert neighbours(0, 4, "ring") == [1, 0, 3] and neighbours(2, 5, "rotate_2") == [2, 3, 4]
    assert torch.equal(mixing(4, "ring", 0.5, 2)[0], T([3.0, 2.0, 2.0, 2.0], dtype=torch.float64) / 4)
    theta0 = {"w": torch.zeros(4)}
    tvs = {f"t{i}": {"w": torch.eye(4)[i]} for i in range(4)}
    models = _gossip_models("gossip", theta0, tvs, rounds=2, weight=0.5)
    assert close(models["t0"]["w"], T([0.75, 0.5, 0.5, 0.5]))


def test_gossip_is_the_references_round_by_round_loop():
    theta0, tvs = _random_models(T_=5)
    tasks = list(tvs)
    current = [tvs[t] for t in tasks]
    for _ in range(3):  # all nodes from the previous round's vectors (the reference's store, then update_models)
        current = [
            {k: sum(0.3 * current[j][k] for j in neighbours(i, 5, "rotate_2")) for k in theta0} for i in range(5)
        ]
    models = _gossip_models("gossip", theta0, tvs, topology="rotate_2", rounds=3, weight=0.3)
    for i, t in enumerate(tasks):
        assert all(close(models[t][k], theta0[k] + current[i][k]) for k in theta0)


def test_gossip_ring_of_two_counts_the_neighbour_twice():
    theta0 = {"w": torch.zeros(1)}
    tvs = {"a": {"w": T([1.0])}, "b": {"w": T([10.0])}}
    models = _gossip_models("gossip", theta0, tvs, rounds=1, weight=0.3)
    assert close(models["a"]["w"], T([0.3 + 6.0])) and close(models["b"]["w"], T([3.0 + 0.6]))


def test_gossip_without_rounds_gives_each_task_its_own_model():
    theta0, tvs = _random_models()
    models = _gossip_models("gossip", theta0, tvs, rounds=0)
    assert all(torch.equal(models[t][k], theta0[k] + tvs[t][k]) for t in tvs for k in theta0)


def test_gossip_reach_grows_one_hop_a_round():
    assert reach(5, "ring", 0)[0] == {4, 0, 1} and reach(5, "ring", 1)[0] == {0, 1, 2, 3, 4}
    assert reach(5, "rotate_1", 1)[0] == {0, 1, 2}


def test_gossip_adamerging_without_learning_is_data_free_gossip():
    # lr 0: each local merge stays at init on its (distinct) neighbours
    theta0, tvs = _random_models()
    data = _toy_data(list(tvs))
    method = REGISTRY["gossip_adamerging"].with_data(data)
    store = method(theta0, tvs, rounds=2, lr=0.0, steps=2, init=0.3)
    learned = {t: method.reconstruct(store, theta0, t) for t in tvs}
    free = _gossip_models("gossip", theta0, tvs, rounds=2, weight=0.3)
    assert all(close(learned[t][k], free[t][k], atol=1e-5) for t in tvs for k in theta0)
    assert len(data.learned) == 2 * 4 and set(data.learned[0]["coefficients"]) == {"t1", "t0", "t3"}


def test_gossip_adamerging_learns_on_the_tasks_in_reach():
    theta0, tvs = _random_models(T_=5)
    data = _toy_data(list(tvs))
    seen = []
    loss = data.objective.loss
    data.objective.loss = lambda params, batches: seen.append(sorted(batches)) or loss(params, batches)
    REGISTRY["gossip_adamerging"].with_data(data)(theta0, tvs, rounds=2, steps=1, batch_size=4)
    assert seen[0] == ["t0", "t1", "t4"] and seen[5] == ["t0", "t1", "t2", "t3", "t4"]
    assert any(v != 0.3 for c in data.learned[0]["coefficients"].values() for v in c.values())  # it learned
    seen.clear()
    REGISTRY["gossip_adamerging"].with_data(data)(theta0, tvs, rounds=1, steps=1, batch_size=4, entropy_on="all")
    assert seen[0] == ["t0", "t1", "t2", "t3", "t4"]


# ------------------------------------------------------------------ AdaSVD
QKV = "blocks.0.attn.qkv.weight"


def _ada_svd(theta0, tvs, **hp):
    data = _toy_data(list(tvs))
    return REGISTRY["ada_svd"].with_data(data)(theta0, tvs, **hp), data


def test_ada_svd_one_task_is_its_model():
    # one expert: routing weight 1, so the linear layers are the task's; the norms theta0's unless averaged
    theta0, tvs = _random_models(T_=1)
    own = {k: theta0[k] + tvs["t0"][k] for k in theta0}
    merged, _ = _ada_svd(theta0, tvs)
    assert close(merged[QKV], own[QKV]) and all(torch.equal(merged[k], theta0[k]) for k in theta0 if k != QKV)
    averaged, _ = _ada_svd(theta0, tvs, others="average", scaling=1.0)
    assert all(close(averaged[k], own[k]) for k in theta0)


def test_ada_svd_routing_by_an_independent_route():
    # the inputs to qkv: theta0's norm1 over (images + theta0's pos_embed); per token r = softmax_t ||V_t^T x||,
    # V_t the top gate_k right singular vectors of dW_t; W = W0 + scaling * sum_t mean(r_t) dW_t
    theta0, tvs = _random_models(T_=3)
    merged, data = _ada_svd(theta0, tvs, gate_k=2, scaling=0.5)
    x = torch.cat([data.train_inputs[t] for t in tvs]).float() + theta0["pos_embed"]
    x = (torch.nn.functional.layer_norm(x, (4,)) + theta0["blocks.0.norm1.bias"]).reshape(-1, 4)
    norms = torch.stack([(x @ torch.linalg.svd(tvs[t][QKV])[2][:2].T).norm(dim=1) for t in tvs], 1)
    weights = torch.softmax(norms, 1).mean(0)
    expected = theta0[QKV] + 0.5 * sum(w * tvs[t][QKV] for w, t in zip(weights, tvs))
    assert close(merged[QKV], expected, atol=1e-5)
    assert all(torch.equal(merged[k], theta0[k]) for k in theta0 if k != QKV)


def test_ada_svd_keeps_a_layer_no_task_changed():
    theta0, tvs = _random_models(T_=2)
    for tv in tvs.values():
        tv[QKV] = torch.zeros_like(tv[QKV])
    merged, _ = _ada_svd(theta0, tvs, others="average")
    assert torch.equal(merged[QKV], theta0[QKV])
    assert close(merged["pos_embed"], theta0["pos_embed"] + (tvs["t0"]["pos_embed"] + tvs["t1"]["pos_embed"]) / 2)
