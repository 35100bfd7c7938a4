"""Training against independent routes: seed 000's identity for full-batch GD, the schedule by hand, the probe
against scikit-learn."""

import math

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression

from mergeflow.config import BackboneConfig, FinetuneConfig, PreserveFeaturesConfig, ProbeConfig
from mergeflow.ml.models import backbone_state, build_backbone, make_head
from mergeflow.ml.probes import fit_probe
from mergeflow.ml.training import FeatureAnchor, batches, extract_features, finetune, warmup_cosine

TINY = BackboneConfig(kwargs={"img_size": 16, "patch_size": 8, "embed_dim": 16, "depth": 1, "num_heads": 2})


def _images(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 16, 16, 3), generator=g, dtype=torch.uint8), torch.randint(0, 3, (n,), generator=g)


def test_warmup_cosine_by_hand():
    assert warmup_cosine(0, 10, 2) == pytest.approx(0.5)
    assert warmup_cosine(1, 10, 2) == pytest.approx(1.0)
    assert warmup_cosine(2, 10, 2) == pytest.approx(1.0)
    assert warmup_cosine(6, 10, 2) == pytest.approx(0.5)  # half-way through the cosine
    assert warmup_cosine(10, 10, 2) == pytest.approx(0.0)
    assert warmup_cosine(0, 1, 0) == pytest.approx(1.0)


def test_batches_cover_each_epoch_once():
    seen = torch.cat(list(batches(10, 5, 2, torch.Generator().manual_seed(0))))
    assert sorted(seen.tolist()) == list(range(10))


def test_one_epoch_of_full_batch_gd_gives_minus_lr_times_gradient():
    """Seed 000: with full-batch GD one epoch is one step, so tau = theta_1 - theta_0 = -eta * grad L(theta_0)."""
    torch.manual_seed(0)
    images, labels = _images(24)
    backbone = build_backbone(TINY)
    head = make_head(backbone.num_features, 3)
    theta0 = backbone_state(backbone)

    loss = torch.nn.functional.cross_entropy(head(backbone(images)), labels)
    names = [n for n, _ in backbone.net.named_parameters()]
    grads = dict(zip(names, torch.autograd.grad(loss, list(backbone.net.parameters()))))

    lr = 0.05
    cfg = FinetuneConfig(optimizer="gd", epochs=1, lr=lr, weight_decay=0.0, warmup_steps=0)
    curve = finetune(backbone, head, images, labels, cfg, seed=0, device=torch.device("cpu"))
    assert len(curve.step) == 1
    theta1 = backbone_state(backbone)
    for name in names:
        assert torch.allclose(theta1[name] - theta0[name], -lr * grads[name], atol=1e-6, rtol=1e-4), name


def test_head_is_frozen_during_finetuning():
    images, labels = _images(16)
    backbone = build_backbone(TINY)
    head = make_head(backbone.num_features, 3)
    before = head.weight.detach().clone()
    finetune(
        backbone,
        head,
        images,
        labels,
        FinetuneConfig(steps=3, batch_size=8, lr=1e-2),
        seed=0,
        device=torch.device("cpu"),
    )
    assert torch.equal(head.weight, before)


def test_probe_head_on_raw_features_matches_sklearn_on_standardised_features():
    g = np.random.default_rng(0)
    x = torch.tensor(g.normal(3.0, 2.0, (120, 5)), dtype=torch.float32)
    y = (x[:, 0] + x[:, 1] > 6).long() + (x[:, 2] > 3).long()
    result = fit_probe(x[:80], y[:80], x[80:], y[80:], ProbeConfig(c_grid=[1.0]), seed=0)
    mu, sd = x[:80].mean(0), x[:80].std(0) + 1e-6
    ref = LogisticRegression(C=1.0, max_iter=500).fit(((x[:80] - mu) / sd).numpy(), y[:80].numpy())
    expected = ref.predict(((x - mu) / sd).numpy())
    assert (result.head(x).argmax(1).numpy() == expected).all()
    assert result.val_accuracy == pytest.approx(float((expected[80:] == y[80:].numpy()).mean()))


def test_features_are_deterministic_and_batch_independent():
    images, _ = _images(10)
    backbone = build_backbone(TINY)
    a = extract_features(backbone, images, batch_size=3, device=torch.device("cpu"))
    b = extract_features(backbone, images, batch_size=10, device=torch.device("cpu"))
    assert a.shape == (10, 16) and torch.allclose(a, b, atol=1e-5)
    assert not math.isnan(a.sum().item())


def test_finetuning_is_seeded_and_deterministic_on_cpu():
    images, labels = _images(32)
    results = []
    for _ in range(2):
        torch.manual_seed(0)
        backbone = build_backbone(TINY)
        head = make_head(backbone.num_features, 3)
        finetune(
            backbone,
            head,
            images,
            labels,
            FinetuneConfig(steps=4, batch_size=8, lr=1e-3, warmup_steps=1),
            seed=5,
            device=torch.device("cpu"),
        )
        results.append(backbone_state(backbone))
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])


def test_sgd_and_epochs_schedule():
    images, labels = _images(20)
    backbone = build_backbone(TINY)
    head = make_head(backbone.num_features, 3)
    curve = finetune(
        backbone,
        head,
        images,
        labels,
        FinetuneConfig(optimizer="sgd", momentum=0.9, epochs=3, batch_size=8, lr=1e-2),
        seed=0,
        device=torch.device("cpu"),
    )
    assert len(curve.step) == 3 * 2  # 20 // 8 = 2 full batches an epoch; the partial one is dropped


def _anchor(backbone, weight, n=12):
    corpus, _ = _images(40, seed=7)
    cfg = PreserveFeaturesConfig(weight=weight, images=n, batch_size=n)
    return FeatureAnchor.build(backbone, corpus, cfg, seed=0, device=torch.device("cpu"), eval_batch_size=5)


def test_feature_anchor_penalty_by_hand():
    torch.manual_seed(0)
    backbone = build_backbone(TINY)
    anchor = _anchor(backbone, weight=3.0)
    idx = torch.arange(len(anchor.images))
    assert anchor.penalty(backbone, idx, torch.device("cpu")).item() == pytest.approx(
        0.0, abs=1e-12
    )  # theta0: no change
    with torch.no_grad():
        backbone.net.patch_embed.proj.bias.add_(0.5)
    f0, f1 = anchor.features, extract_features(backbone, anchor.images, batch_size=5, device=torch.device("cpu"))
    by_hand = 3.0 * ((f1 - f0) ** 2).sum() / f1.numel() / (((f0 - f0.mean(0)) ** 2).sum(0) / (len(f0) - 1)).mean()
    assert anchor.penalty(backbone, idx, torch.device("cpu")).item() == pytest.approx(by_hand.item(), rel=1e-5)


def test_feature_anchor_leaves_the_first_gd_step_unchanged():
    """The penalty is a square with its minimum at theta0: its gradient there is zero, so seed 000's identity
    tau = -eta grad L still holds for one epoch of full-batch GD."""
    images, labels = _images(24)
    cfg = FinetuneConfig(optimizer="gd", epochs=1, lr=0.05, weight_decay=0.0, warmup_steps=0)
    states = []
    for weight in (0.0, 10.0):
        torch.manual_seed(0)
        backbone = build_backbone(TINY)
        head = make_head(backbone.num_features, 3)
        finetune(
            backbone, head, images, labels, cfg, seed=0, device=torch.device("cpu"), anchor=_anchor(backbone, weight)
        )
        states.append(backbone_state(backbone))
    assert all(torch.allclose(states[0][k], states[1][k], atol=1e-7) for k in states[0])


def test_feature_anchor_keeps_features_on_its_images():
    images, labels = _images(32)
    cfg = FinetuneConfig(steps=30, batch_size=8, lr=3e-3, warmup_steps=0)
    change = {}
    for weight in (0.0, 30.0):
        torch.manual_seed(0)
        backbone = build_backbone(TINY)
        head = make_head(backbone.num_features, 3)
        anchor = _anchor(backbone, weight)
        finetune(backbone, head, images, labels, cfg, seed=0, device=torch.device("cpu"), anchor=anchor)
        change[weight] = (
            (extract_features(backbone, anchor.images, batch_size=5, device=torch.device("cpu")) - anchor.features)
            .pow(2)
            .mean()
            .item()
        )
    assert change[30.0] < 0.5 * change[0.0]


def test_the_probe_reaches_the_optimum_so_last_bits_barely_move_it():
    """Newton's method ends at the L2-regularised optimum, where the objective's gradient (C x sum of cross-entropies
    + |W|^2 / 2, by hand in float64) vanishes; features perturbed by 1e-6 (last bits) then move the head by well
    under 1e-3 (L-BFGS stopped on its path moved the default suite's heads by ~1e-2)."""
    from mergeflow.config import ProbeConfig
    from mergeflow.ml.probes import fit_probe

    g = torch.Generator().manual_seed(0)
    centres = 1.5 * torch.randn(4, 16, generator=g)
    y = torch.arange(400) % 4
    x = centres[y] + torch.randn(400, 16, generator=g)
    xp = x * (1 + 1e-6 * torch.randn(x.shape, generator=g))
    cfg = ProbeConfig(c_grid=[10.0], max_iter=100)
    head, moved = (
        fit_probe(x[:300], y[:300], x[300:], y[300:], cfg, seed=0).head,
        fit_probe(xp[:300], y[:300], xp[300:], y[300:], cfg, seed=0).head,
    )
    mu, sd = x[:300].mean(0).double(), x[:300].std(0).double() + 1e-6
    xs = (x[:300].double() - mu) / sd
    coef, bias = head.weight.detach().double() * sd, head.bias.detach().double() + head.weight.detach().double() @ mu
    residual = torch.softmax(xs @ coef.T + bias, 1) - torch.nn.functional.one_hot(y[:300], 4).double()
    grad_w, grad_b = 10.0 * residual.T @ xs + coef, 10.0 * residual.sum(0)
    assert (
        grad_w.abs().max() / coef.abs().max() < 1e-2 and grad_b.abs().max() < 1e-2
    )  # the solver's tolerance, float32 heads
    assert ((head.weight - moved.weight).abs().max() / head.weight.abs().max()).item() < 1e-3
