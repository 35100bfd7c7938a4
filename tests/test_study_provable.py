"""Seed 004's study (mergeflow.studies.provable): each measurement where the answer is known (the data's labels,
the model against a loop over eq. 4, rank-1 spectra, lambda = 0 task arithmetic, condition (7) and the closed form),
and the whole study on tiny settings, its verdicts computed from the numbers (they flip with the thresholds)."""

import math
from types import SimpleNamespace

import pytest
import torch

from mergeflow.studies import REGISTRY, StudyContext
from mergeflow.studies import provable as P

TINY = {
    "d": 8, "tokens": 10, "relevant": 4, "confusion": 1, "m": 32, "steps": 80, "batch": 32, "test_examples": 64,
    "alphas": [-0.5, 0.0, 0.5], "lambda_step": 0.5, "ood_targets": [(0.8, -0.5), (-0.6, -0.6)], "ood_lambda_step": 1.0,
}


def settings(**kw) -> P.ProvableSettings:
    return REGISTRY["provable"].settings({**TINY, **kw}, where="studies.provable")


def test_registered_with_checked_settings():
    study = REGISTRY["provable"]
    assert study.settings_model is P.ProvableSettings and "seed 004" in study.paper.lower()
    assert study.settings({}, where="studies.provable").steps == 200
    with pytest.raises(ValueError, match="studies.provable: confusion 6 must be below relevant 6"):
        study.settings({"confusion": 6}, where="studies.provable")
    with pytest.raises(ValueError, match="alphas must hold 0"):
        study.settings({"alphas": [0.5, -0.5]}, where="studies.provable")
    with pytest.raises(ValueError, match="ood_targets"):
        study.settings({"ood_targets": [[0.9, 0.9]]}, where="studies.provable")


def test_grid_and_patterns():
    assert P.grid(-2, 2, 0.5) == [-2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0]
    assert len(P.grid(-2, 2, 0.1)) == 41
    for alpha in (-0.8, 0.0, 0.3):
        mu1, mu2 = P.patterns(alpha, 6)
        assert float(mu1 @ mu2) == pytest.approx(alpha) and float(mu2.norm()) == pytest.approx(1.0)
    mu = P.target_pattern(0.6, -0.6, 6)
    assert float(mu.norm()) == pytest.approx(1.0) and mu[:2].tolist() == pytest.approx([0.6, -0.6])
    irr = P.irrelevant_directions(6)
    assert torch.allclose(irr @ irr.T, torch.eye(3)) and float((irr @ mu).abs().max()) == 0


def test_labels_are_the_majority_sign_by_construction():
    gen = torch.Generator().manual_seed(0)
    mu = P.patterns(0.4, 8)[1]
    irr = P.irrelevant_directions(8)
    X, y = P.make_data(mu, irr, 200, tokens=10, relevant=4, confusion=1, gen=gen)
    assert X.shape == (200, 10, 8) and set(y.tolist()) == {-1.0, 1.0}
    assert torch.allclose(X.norm(dim=2), torch.ones(200, 10))
    assert torch.equal(P.majority_sign(X, mu), y)
    proj = X @ mu
    assert torch.equal((proj * y[:, None] > 0.999).sum(1), torch.full((200,), 4)) and torch.equal((proj * y[:, None] < -0.999).sum(1), torch.full((200,), 1))
    assert not torch.equal(X[0], X[1])  # positions shuffled, irrelevant tokens drawn


def test_forward_is_eq_4():
    gen = torch.Generator().manual_seed(1)
    params, a = P.init_model(5, 7, 0.5, gen)
    X = torch.randn(3, 4, 5, generator=gen)
    expected = torch.zeros(3)
    for n in range(3):
        for l in range(4):
            logits = torch.stack([X[n, s] @ params["W"] @ X[n, l] for s in range(4)])
            z = sum(X[n, s] * w for s, w in enumerate(torch.softmax(logits, 0)))
            expected[n] += a @ torch.relu(params["V"] @ z) / 4
    assert torch.allclose(P.forward(params, a, X), expected, atol=1e-6)
    assert set((a.abs() * math.sqrt(7)).tolist()) == {1.0}


def test_rank_one_spectra():
    mu = P.patterns(0.0, 6)[0]
    u = torch.arange(1.0, 9.0)
    M = torch.outer(u, mu)  # a rank-1 update along mu
    assert P.top_energy(M) == pytest.approx(1.0) and P.residual(M, 1) == pytest.approx(0.0, abs=1e-12)
    assert P.alignment(M, mu)[1] == pytest.approx(1.0) and math.isnan(P.alignment(M, mu)[0])
    assert P.alignment(torch.outer(mu, mu), mu) == pytest.approx((1.0, 1.0))
    R = torch.randn(8, 6, generator=torch.Generator().manual_seed(2))
    assert P.top_energy(R) < 1 and 0 < P.residual(R, 2) < P.residual(R, 1)
    assert int(torch.linalg.matrix_rank(P.truncate(R, 2))) == 2 and P.residual(R, 6) == pytest.approx(0.0, abs=1e-6)
    e = torch.eye(8)
    v = P.irrelevant_directions(6)[0]
    assert P.second_alignment(2 * torch.outer(e[0], mu) + torch.outer(e[1], v), v) == pytest.approx(1.0)  # orthogonal rank-1 parts, the smaller along v


def test_lambda_zero_is_the_pretrained_model():
    s = settings(steps=5)
    gen = torch.Generator().manual_seed(3)
    theta0, a = P.init_model(s.d, s.m, s.init_std, gen)
    irr = P.irrelevant_directions(s.d)
    mu1, mu2 = P.patterns(0.5, s.d)
    d1 = P.delta(P.finetune(theta0, a, mu1, irr, s, gen), theta0)
    d2 = P.delta(P.finetune(theta0, a, mu2, irr, s, gen), theta0)
    test1 = P.make_data(mu1, irr, 50, tokens=s.tokens, relevant=s.relevant, confusion=s.confusion, gen=gen)
    test2 = P.make_data(mu2, irr, 50, tokens=s.tokens, relevant=s.relevant, confusion=s.confusion, gen=gen)
    merged = P.merge(theta0, [d1, d2], [0.0, 0.0])
    assert all(torch.equal(merged[k], theta0[k]) for k in theta0)
    assert P.evaluate(merged, a, *test1) == P.evaluate(theta0, a, *test1)
    l1, l2 = P.addition_map(theta0, a, d1, d2, [0.0], test1, test2)  # theta0 + d1: the fine-tuned model 1
    assert l1[0] == pytest.approx(P.evaluate(P.merge(theta0, [d1], [1.0]), a, *test1)[0], abs=1e-6)
    assert l2[0] == pytest.approx(P.evaluate(P.merge(theta0, [d1], [1.0]), a, *test2)[0], abs=1e-6)


def test_ood_condition_and_closed_form():
    c, beta = 0.02, 0.01
    assert P.ood_condition([2.0, 0.0], [0.8, -0.55], c, beta)  # 1.6 and 1.28 >= 1.02
    assert not P.ood_condition([1.0, 0.0], [0.8, -0.55], c, beta)  # 0.8 < 1.02
    assert not P.ood_condition([2.5, 0.0], [0.8, -0.55], c, beta)  # |lambda| beta > c
    assert not P.ood_condition([1.0, 1.0], [0.0, 0.0], c, beta)  # condition (A)
    for gammas in ([0.8, -0.55], [0.6, 0.6], [-0.6, 0.7]):
        lam = P.closed_form_lambdas(gammas, c)
        assert sum(x * g for x, g in zip(lam, gammas)) == pytest.approx(1 + c)  # (68) with equality, as printed
    assert P.closed_form_lambdas([-0.6, -0.6], c) is None and P.impossible([-0.6, -0.6]) and not P.impossible([0.6, 0.6])
    # all gammas equal and negative: no lambda satisfies both sums (the theorem's impossible case)
    assert not any(P.ood_condition([l1, l2], [-0.6, -0.6], c, beta) for l1 in P.grid(-2, 3, 0.25) for l2 in P.grid(-2, 3, 0.25))


def test_onset():
    lams = [-1.0, 0.0, 1.0, 2.0]
    assert P.onset(lams, [False, False, True, True]) == 1.0
    assert P.onset(lams, [True, False, True, True]) == 1.0
    assert P.onset(lams, [True, True, True, False]) is None
    assert P.onset(lams, [True] * 4) == -1.0


def test_whole_study_on_tiny_settings(tmp_path):
    s = settings()
    result = REGISTRY["provable"].fn(StudyContext(SimpleNamespace(seed=0), None, s, tmp_path, torch.device("cpu")))
    assert [c.id for c in result.claims] == ["004.1", "004.2", "004.3", "004.4", "004.5"]
    assert all(c.verdict in ("holds", "fails") for c in result.claims)
    for name in result.figures:
        assert (tmp_path / name).stat().st_size > 0 and f"]({name})" in result.body
    assert result.claims[0].numbers["accuracy"].keys() == {"T1", "T2(α=-0.5)", "T2(α=0)", "T2(α=0.5)"}

    # the verdicts come from the numbers: the same measurements judged under other thresholds
    m = P.measure(s, 0)
    assert P.claim_finetune(m, s.model_copy(update={"accuracy_min": 1e-3})).holds
    worst = min(ft.accuracy for ft in m.finetunes)
    assert not P.claim_finetune(m, s.model_copy(update={"accuracy_min": min(1.0, worst + 1e-3)})).holds or worst == 1.0
    spectra = [ft.spectrum() for ft in m.finetunes]
    lowest = min(min(v["energy_W"], v["energy_V"]) for v in spectra)
    assert not P.claim_low_rank(m, s.model_copy(update={"energy_min": min(1.0, lowest + 1e-6)})).holds
    assert P.claim_low_rank(m, s.model_copy(update={"energy_min": 1e-3, "alignment_min": 1e-3, "small_loss": 10.0, "large_loss": 20.0})).holds
    # every loss "small": contradictory pairs then make both small, so claim 2 fails; nothing is ever "large", so claim 3 fails
    loose = s.model_copy(update={"small_loss": 100.0, "large_loss": 200.0})
    assert not P.claim_addition(m, loose).holds and not P.claim_negation(m, loose).holds


def test_claims_not_measured_without_the_cases_they_need(tmp_path):
    s = settings(alphas=[0.0, 0.3], ood_targets=[(0.8, -0.5)], steps=20)
    m = P.measure(s, 1)
    assert P.claim_addition(m, s).holds is None  # no contradictory alpha
    assert P.claim_negation(m, s).holds is None  # no alpha >= negation_aligned_min
    assert P.claim_ood(m, s).holds is None  # no impossible target
    assert P.claim_finetune(m, s).holds is not None and P.claim_low_rank(m, s).holds is not None
