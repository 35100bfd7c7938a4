"""Seed 004's study (mergeflow.studies.provable): each measurement where the answer is known (the data's labels,
the model against a loop over eq. 4, rank-1 spectra, lambda = 0 task arithmetic, condition (7) and the closed form),
and the whole study on tiny settings, its verdicts computed from the numbers (they flip with the thresholds)."""

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mergeflow.studies import REGISTRY, StudyContext
from mergeflow.studies import provable as P

TINY = {
    "d": 8,
    "tokens": 10,
    "relevant": 4,
    "confusion": 1,
    "m": 32,
    "steps": 80,
    "batch": 32,
    "test_examples": 64,
    "alphas": [-0.5, 0.0, 0.5],
    "lambda_step": 0.5,
    "ood_targets": [(0.8, -0.5), (-0.6, -0.6)],
    "ood_lambda_step": 1.0,
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
    assert torch.equal((proj * y[:, None] > 0.999).sum(1), torch.full((200,), 4)) and torch.equal(
        (proj * y[:, None] < -0.999).sum(1), torch.full((200,), 1)
    )
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
    assert P.second_alignment(2 * torch.outer(e[0], mu) + torch.outer(e[1], v), v) == pytest.approx(
        1.0
    )  # orthogonal rank-1 parts, the smaller along v


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
    assert (
        P.closed_form_lambdas([-0.6, -0.6], c) is None and P.impossible([-0.6, -0.6]) and not P.impossible([0.6, 0.6])
    )
    # all gammas equal and negative: no lambda satisfies both sums (the theorem's impossible case)
    assert not any(
        P.ood_condition([l1, l2], [-0.6, -0.6], c, beta) for l1 in P.grid(-2, 3, 0.25) for l2 in P.grid(-2, 3, 0.25)
    )


def test_onset():
    lams = [-1.0, 0.0, 1.0, 2.0]
    assert P.onset(lams, [False, False, True, True]) == 1.0
    assert P.onset(lams, [True, False, True, True]) == 1.0
    assert P.onset(lams, [True, True, True, False]) is None
    assert P.onset(lams, [True] * 4) == -1.0


def test_whole_study_on_tiny_settings(tmp_path):
    s = settings()
    result = REGISTRY["provable"].fn(StudyContext(SimpleNamespace(seed=0), None, s, tmp_path, torch.device("cpu")))
    assert [c.id for c in result.claims] == [
        "004.1",
        "004.2",
        "004.3",
        "004.4",
        "004.5",
        "004.6",
        "004.7",
        "004.8",
        "004.9",
    ]
    assert all(c.verdict in ("holds", "fails") for c in result.claims[:5])
    assert all(
        c.verdict == "not measured" and "no pipeline outputs" in c.detail for c in result.claims[5:]
    )  # no layout: no real digits
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
    assert P.claim_low_rank(
        m, s.model_copy(update={"energy_min": 1e-3, "alignment_min": 1e-3, "small_loss": 10.0, "large_loss": 20.0})
    ).holds
    # every loss "small": contradictory pairs then make both small,
    # so claim 2 fails; nothing is ever "large", so claim 3 fails
    loose = s.model_copy(update={"small_loss": 100.0, "large_loss": 200.0})
    assert not P.claim_addition(m, loose).holds and not P.claim_negation(m, loose).holds


def test_claims_not_measured_without_the_cases_they_need(tmp_path):
    s = settings(alphas=[0.0, 0.3], ood_targets=[(0.8, -0.5)], steps=20)
    m = P.measure(s, 1)
    assert P.claim_addition(m, s).holds is None  # no contradictory alpha
    assert P.claim_negation(m, s).holds is None  # no alpha >= negation_aligned_min
    assert P.claim_ood(m, s).holds is None  # no impossible target
    assert P.claim_finetune(m, s).holds is not None and P.claim_low_rank(m, s).holds is not None


# ------------------------------------------------------------------------------------------------ real digits
def test_red_mask_has_the_seeds_proportions():
    labels = torch.tensor([1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 0, 2, 4, 6, 8, 0, 2, 4, 6, 8])  # 10 odd, 10 even
    gen = torch.Generator().manual_seed(0)
    for r_o, red_odd, red_even in ((0.9, 9, 1), (0.5, 5, 5), (0.1, 1, 9), (1.0, 10, 0)):
        red = P.red_mask(labels, r_o, gen)
        assert (
            int(red[:10].sum()) == red_odd and int(red[10:].sum()) == red_even
        )  # r_o of the odd, r_e = 1 - r_o of the even
    a, b = (
        P.red_mask(labels, 0.5, torch.Generator().manual_seed(1)),
        P.red_mask(labels, 0.5, torch.Generator().manual_seed(1)),
    )
    assert torch.equal(a, b) and torch.equal(P.parity(labels), torch.tensor([1] * 10 + [0] * 10))


def test_colour_moves_the_ink_into_one_channel():
    grey = torch.tensor(
        [[[[10, 10, 10], [200, 200, 200]]], [[[0, 0, 0], [90, 90, 90]]]], dtype=torch.uint8
    )  # 2 images of 1 x 2 pixels
    out = P.colour(grey, torch.tensor([True, False]))
    assert out.dtype == torch.uint8
    assert out[0].tolist() == [[[10, 0, 0], [200, 0, 0]]]  # red
    assert out[1].tolist() == [[[0, 0, 0], [0, 90, 0]]]  # green


def test_alpha_hat_is_eq_11():
    g = torch.Generator().manual_seed(2)
    a1, a2 = torch.randn(50, 2, generator=g), torch.randn(60, 2, generator=g)
    assert P.alpha_hat(a1, a1, a2, a2) == pytest.approx(1.0)
    assert P.alpha_hat(a1, -a1, a2, -a2) == pytest.approx(-1.0)
    assert P.alpha_hat(a1, 3 * a1 + 7, a2, -a2) == pytest.approx(0.0)  # centred: offsets and scales do not count
    # by hand: two samples per set, centred outputs (1, 0) / (-1, 0)
    # and (0, 1) / (0, -1): cosines 0 on D1; on D2 identical: 1
    d1a, d1b = torch.tensor([[2.0, 0.0], [0.0, 0.0]]), torch.tensor([[0.0, 1.0], [0.0, -1.0]])
    assert P.alpha_hat(d1a, d1b, d1a, d1a) == pytest.approx(0.5)


def _tiny_pipeline(root: Path, seed: int = 0):
    """A pretrained backbone (random init: what matters is the split and the signs) and a digits task file."""
    from mergeflow.config import BackboneConfig, FinetuneConfig
    from mergeflow.ml.data import save_task
    from mergeflow.ml.data.embedded import make_task
    from mergeflow.core.io import save_state_dict
    from mergeflow.ml.models import backbone_state, build_backbone
    from mergeflow.pipeline.stages import Layout

    layout = Layout(root)
    cfg = BackboneConfig(
        model="vit_tiny_patch16_224",
        kwargs={"img_size": 16, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2},
    )
    torch.manual_seed(seed)
    layout.pretrained.parent.mkdir(parents=True)
    save_state_dict(layout.pretrained, backbone_state(build_backbone(cfg)))
    layout.task_data("digits").parent.mkdir(parents=True)
    save_task(
        layout.task_data("digits"),
        "digits",
        make_task("digits", 240, 60, 120, 16, seed),
        [str(i) for i in range(10)],
        16,
    )
    ft = FinetuneConfig(steps=60, batch_size=32, lr=3e-3, weight_decay=0.0, warmup_steps=5)
    params = SimpleNamespace(
        seed=seed, suite=SimpleNamespace(tasks=["digits"], image_size=16), backbone=cfg, finetune=ft
    )
    return params, layout


def test_real_digits_on_a_tiny_pipeline(tmp_path):
    params, layout = _tiny_pipeline(tmp_path)
    s = settings(real_ood_lambda_step=1.0, real_lambda_step=0.5)
    m = P.measure_real(params, layout, s)
    assert [p.relation for p in m.pairs] == list(P.RELATIONS) and m.depth == 2 and m.blocks == 1
    assert set(m.tasks) == {0.95, 0.5, 0.9, 0.05, 0.85}
    assert m.tasks[0.9].red_share == {"odd": pytest.approx(0.9, abs=0.01), "even": pytest.approx(0.1, abs=0.01)}
    alpha = {p.relation: p.alpha_hat for p in m.pairs}
    assert (
        alpha["aligned"] > 0 > alpha["contradictory"]
    )  # colour is what a tiny model learns: the signs follow the construction
    # lambda = 0 is the fine-tuned T1 on T1, the same in every pair
    i0 = m.lambdas.index(0.0)
    assert all(p.acc1[i0] == pytest.approx(m.tasks[0.95].accuracy) for p in m.pairs)
    # T' (r_o = 0.9) is the aligned pair's T2: its fine-tuned model, and (0, 0) is Psi0 on it
    assert (
        m.ood is not None
        and m.ood.finetuned == m.tasks[0.9].accuracy
        and m.ood.at(0, 0) == pytest.approx(m.tasks[0.9].pretrained_accuracy)
    )
    # not measured without the digits task, or when switched off
    assert "not in suite.tasks" in P.real_skip_reason(
        SimpleNamespace(suite=SimpleNamespace(tasks=["count"])), layout, s
    )
    assert P.real_skip_reason(params, layout, s.model_copy(update={"real": False})) == "real: false in studies.provable"
    assert P.claim_real_addition(None, s, "why").holds is None


def _hand_made(
    acc: dict[str, tuple[list[float], list[float]]], alphas=(0.2, 0.9, -0.8), ood=None
) -> P.RealMeasurements:
    lambdas = [-1.0, -0.5, 0.0, 0.5, 1.0]
    pairs = [
        P.RealPair(rel, r, a, acc[rel][0], acc[rel][1], 0.95, 0.95)
        for rel, r, a in zip(P.RELATIONS, (0.5, 0.9, 0.05), alphas)
    ]
    return P.RealMeasurements("digits", 1, 4, 10, {}, {}, lambdas, {}, pairs, ood, 0.0)


GOOD = {  # accuracies over lambda = -1, -0.5, 0, 0.5, 1 (fine-tuned models: 0.95 each)
    "irrelevant": ([0.94, 0.95, 0.95, 0.94, 0.93], [0.50, 0.52, 0.60, 0.80, 0.90]),
    "aligned": ([0.90, 0.93, 0.95, 0.95, 0.95], [0.85, 0.88, 0.90, 0.93, 0.94]),
    "contradictory": ([0.95, 0.95, 0.95, 0.70, 0.50], [0.05, 0.10, 0.30, 0.60, 0.90]),
}


def test_real_claims_from_hand_made_numbers():
    s = settings()
    m = _hand_made(GOOD)
    assert P.claim_real_alpha(m, s).holds and P.claim_real_addition(m, s).holds and P.claim_real_negation(m, s).holds
    rows = {r["relation"]: r for r in P.real_rows(m, s)}
    assert rows["irrelevant"]["multi_task"]["lambda"] == 1.0 and rows["irrelevant"]["keep_both"] == [1.0]
    assert rows["contradictory"]["unlearning"]["lambda"] == -1.0 and rows["contradictory"]["unlearning"][
        "gap2"
    ] == pytest.approx(-90.0)
    assert rows["aligned"]["forget"] == [] and rows["irrelevant"]["forget"] == [-1.0, -0.5]
    # alpha-hat out of order, or the irrelevant pair the most correlated: claim 6 fails
    assert not P.claim_real_alpha(_hand_made(GOOD, alphas=(0.2, -0.9, 0.8)), s).holds
    assert not P.claim_real_alpha(_hand_made(GOOD, alphas=(0.95, 0.9, -0.8)), s).holds
    # a lambda keeping both contradictory tasks: claim 7 fails; looser keep: aligned negation "forgets" nothing still
    bad = dict(GOOD, contradictory=([0.95, 0.95, 0.95, 0.90, 0.90], [0.05, 0.10, 0.30, 0.88, 0.90]))
    assert not P.claim_real_addition(_hand_made(bad), s).holds
    # T2 of the irrelevant pair falling only 20 points: under the
    # 25-point forget threshold, claim 8 fails; at 15 it holds
    weak = dict(GOOD, irrelevant=([0.94, 0.95, 0.95, 0.94, 0.93], [0.75, 0.76, 0.80, 0.85, 0.90]))
    assert (
        not P.claim_real_negation(_hand_made(weak), s).holds
        and P.claim_real_negation(_hand_made(weak), s.model_copy(update={"real_forget": 15.0})).holds
    )


def test_real_ood_claim_from_hand_made_numbers():
    s = settings()
    lams = [-1.0, 0.0, 1.0]
    acc = [
        [0.1, 0.2, 0.3],
        [0.4, 0.5, 0.6],
        [0.80, 0.85, 0.93],
    ]  # [lambda1][lambda2]: (1, 0) 0.85, (0, 1) 0.6, (1, 1) 0.93
    val = [[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.95]]
    o = P.RealOod((0.85, 0.05, 0.9), 0.1, (0.8, -0.6), 0.92, lams, acc, val)
    assert o.chosen() == (1.0, 1.0) and o.test_best() == (1.0, 1.0, 0.93) and o.at(1, 0) == 0.85
    assert P.claim_real_ood(_hand_made(GOOD, ood=o), s).holds  # 93 >= 85 + 1
    assert not P.claim_real_ood(_hand_made(GOOD, ood=o), s.model_copy(update={"real_ood_gain": 10.0})).holds
    assert P.claim_real_ood(_hand_made(GOOD), s).holds is None  # Table 2 not run
