"""Study ctl (seed 003, cross-task linearity): the metric where the answer is known (identical models, a model
linear in its parameters), the verdicts on hand-made numbers, and the whole study on tiny inputs."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from mergeflow.params import parse_params
from mergeflow.core.io import save_state_dict
from mergeflow.core.files import write_json
from mergeflow.ml.models import backbone_state, build_backbone
from mergeflow.pipeline.stages import Layout
from mergeflow.studies import REGISTRY, StudyContext
from mergeflow.studies import ctl as C

from .profiles import tiny_params

S = C.CtlSettings()
ALPHAS = [0.25, 0.5, 0.75]


def test_registered_with_its_settings():
    assert REGISTRY["ctl"].settings_model is C.CtlSettings
    assert REGISTRY["ctl"].settings({}, where="studies.ctl") == S


@pytest.mark.parametrize(
    "bad",
    [
        {"alphas": [0.25, 0.75]},
        {"alphas": [0.5, 1.0]},
        {"average_sizes": [1, 3]},
        {"scratch_pair": ["a", "a"]},
        {"ctl_ratio": 0},
        {"unknown": 1},
    ],
)
def test_bad_settings_refused(bad):
    with pytest.raises(ValueError):
        REGISTRY["ctl"].settings(bad, where="studies.ctl")


# ---------------------------------------------------------------- the metric
def test_cosine_and_coefficient_on_known_features():
    g = torch.Generator().manual_seed(0)
    f = torch.randn(5, 3, 4, generator=g)
    d, coef = C.linearity(2.5 * f, f)  # proportional: d = 0, coef = the factor
    assert torch.allclose(d, torch.zeros(5, dtype=torch.float64), atol=1e-12) and torch.allclose(
        coef, torch.full((5,), 2.5, dtype=torch.float64)
    )
    a, b = torch.tensor([[1.0, 0.0], [0.0, 0.0]]), torch.tensor([[0.0, 3.0], [0.0, 0.0]])
    d, coef = C.linearity(a, b)
    assert d.tolist() == [1.0, 0.0] and coef.tolist() == [
        0.0,
        1.0,
    ]  # orthogonal: d = 1, coef = 0; two zero rows: identical
    assert C.cosine_rows(-a, a)[0] == -1.0


def tiny_vit(seed: int = 0):
    from mergeflow.config import BackboneConfig

    torch.manual_seed(seed)
    cfg = BackboneConfig(kwargs={"img_size": 16, "patch_size": 8, "embed_dim": 16, "depth": 3, "num_heads": 2})
    model = build_backbone(cfg)
    return model, C.Probe(model, model.net, list(model.net.blocks), 64)


def perturbed(state, scale: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in state.items()}


def images(n: int, seed: int = 0, size: int = 16) -> torch.Tensor:
    return torch.randint(0, 256, (n, size, size, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def test_two_identical_models_give_zero():
    model, probe = tiny_vit()
    theta = perturbed(backbone_state(model), 0.05, 1)
    x = images(12)
    for a in ALPHAS:
        terms = C.ctl_at(probe, theta, dict(theta), x, a)
        assert len(terms) == 3  # one per block
        for t in terms:
            assert float(t["d"].abs().max()) < 1e-6 and float(t["baseline"].abs().max()) < 1e-6
            assert float((t["coef"] - 1).abs().max()) < 1e-5
    f, _ = probe.run(theta, x)
    for L in range(3):
        avg = C.average_terms(f[L], [f[L]] * 4)
        assert float(avg["d"].abs().max()) < 1e-9 and float(avg["baseline"].abs().max()) < 1e-9
        neg = C.negation_terms(f[L], f[L], f[L])  # tau = 0: theta0 +- lam tau are theta0
        assert float(neg["d"].abs().max()) < 1e-9


def test_a_linear_model_is_exactly_cross_task_linear():
    torch.manual_seed(0)
    lin = nn.Linear(7, 5).double()
    probe = C.Probe(lin, lin, [lin], 16)
    theta_i = perturbed({k: v.detach() for k, v in lin.state_dict().items()}, 1.0, 1)
    theta_j = perturbed(theta_i, 1.0, 2)
    theta_0 = perturbed(theta_i, 1.0, 3)
    x = torch.randn(20, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    for a in ALPHAS:
        (t,) = C.ctl_at(probe, theta_i, theta_j, x, a)
        assert float(t["d"].abs().max()) < 1e-12 and float((t["coef"] - 1).abs().max()) < 1e-12
        assert float(t["baseline"].min()) > 1e-3  # the two models differ: the baseline is not 0
    f = {name: probe.run(s, x)[0][0] for name, s in {"i": theta_i, "j": theta_j, "0": theta_0}.items()}
    (f_avg,), _ = probe.run(C.mix([(1 / 3, theta_i), (1 / 3, theta_j), (1 / 3, theta_0)]), x)
    avg = C.average_terms(f_avg, [f["i"], f["j"], f["0"]])
    assert float(avg["d"].abs().max()) < 1e-12 and float((avg["coef"] - 1).abs().max()) < 1e-12

    def edit(*parts):
        return {k: theta_0[k] + sum(w * (s[k] - theta_0[k]) for w, s in parts) for k in theta_0}

    lam = 0.3
    (f_sum,), _ = probe.run(edit((lam, theta_i), (lam, theta_j)), x)
    (f_2i,), _ = probe.run(edit((2 * lam, theta_i)), x)
    (f_2j,), _ = probe.run(edit((2 * lam, theta_j)), x)
    add = C.addition_terms(f_sum, f_2i, f_2j)
    assert float(add["d"].abs().max()) < 1e-12 and float((add["coef"] - 1).abs().max()) < 1e-12
    (f_plus,), _ = probe.run(edit((lam, theta_i)), x)
    (f_minus,), _ = probe.run(edit((-lam, theta_i)), x)
    neg = C.negation_terms(f["0"], f_plus, f_minus)
    assert float(neg["d"].abs().max()) < 1e-12 and float((neg["coef"] - 1).abs().max()) < 1e-12


def test_a_nonlinear_model_is_not_exactly_cross_task_linear():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(7, 16), nn.Tanh(), nn.Linear(16, 5)).double()
    probe = C.Probe(net, net, [net[0], net[2]], 16)
    theta_i = perturbed({k: v.detach() for k, v in net.state_dict().items()}, 1.0, 1)
    theta_j = perturbed(theta_i, 1.0, 2)
    x = torch.randn(20, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    first, second = C.ctl_at(probe, theta_i, theta_j, x, 0.5)
    assert float(first["d"].abs().max()) < 1e-12  # the first layer is linear in its own parameters
    assert float(second["d"].mean()) > 1e-4  # after a nonlinearity, interpolated weights are not interpolated features


def test_stitching_replaces_one_block_output():
    model, probe = tiny_vit()
    theta0, theta1 = backbone_state(model), perturbed(backbone_state(model), 0.05, 1)
    x = images(10)
    (f0,), out0 = probe.run(theta0, x, keep=[1])
    (f1,), out1 = probe.run(theta1, x, keep=[1])
    _, same = probe.run(theta0, x, replace=(1, f0), keep=[])
    assert torch.equal(same, out0)  # its own features back: the same output
    _, stitched = probe.run(theta0, x, replace=(1, f1), keep=[])
    assert not torch.allclose(stitched, out0) and not torch.allclose(
        stitched, out1
    )  # theta1's features through theta0's last block
    (after,), _ = probe.run(theta0, x, replace=(1, f1), keep=[1])
    assert torch.equal(after, f1)


# ---------------------------------------------------------------- rules and verdicts on hand-made numbers
def layer(d, baseline, coef=1.0):
    return {
        "d": d,
        "baseline": baseline,
        "coef_median": coef,
        "d_q": [d] * 3,
        "baseline_q": [baseline] * 3,
        "coef_q": [coef] * 3,
    }


def test_barrier_and_recovery():
    assert C.loss_barrier(1.0, 1.5, 2.0) == 0.0 and C.loss_barrier(1.0, 2.0, 1.0) == 1.0
    assert C.recovery([0.8, 0.8], [0.9, 0.9], [0.5, 0.5]) == pytest.approx(0.75)
    assert math.isnan(C.recovery([0.5], [0.5], [0.5]))


def test_ctl_claims_follow_the_thresholds():
    good = {a: [layer(0.001, 0.1), layer(0.02, 0.1)] for a in ALPHAS}
    assert C.claim_ctl(good, S).holds and C.claim_coef(good, S).holds
    bad = {**good, 0.75: [layer(0.001, 0.1), layer(0.03, 0.1, coef=1.2)]}  # 0.3 x the baseline at one layer and alpha
    assert not C.claim_ctl(bad, S).holds and not C.claim_coef(bad, S).holds
    assert C.claim_ctl(bad, C.CtlSettings(ctl_ratio=0.5)).holds
    assert C.claim_average({3: [layer(0.001, 0.1)], 4: [layer(0.001, 0.1)]}, S).holds
    assert not C.claim_average({3: [layer(0.001, 0.1)], 4: [layer(0.001, 0.1, coef=0.8)]}, S).holds
    assert C.claim_average({}, S).holds is None
    assert (
        C.claim_addition([layer(0.001, 0.1)], S, 0.3).holds and not C.claim_negation([layer(0.05, 0.1)], S, 0.3).holds
    )


def test_barrier_claim_needs_a_barrier_and_ctl():
    assert C.claim_barrier([0.2, 0.1], True, S).holds
    assert not C.claim_barrier([0.2, 0.1], False, S).holds
    assert not C.claim_barrier([-0.1, 0.08], True, S).holds  # mean -0.01 <= 0.05


def test_stitching_and_scratch_claims():
    row = {"layer": 1, "avg_i": 0.8, "avg_j": 0.7, "own_i": 0.9, "own_j": 0.8, "other_i": 0.5, "other_j": 0.4}
    assert C.claim_stitching([row], S).holds  # recovery (0.3 + 0.3) / (0.4 + 0.4) = 0.75
    assert not C.claim_stitching([dict(row, avg_i=0.55, avg_j=0.45)], S).holds
    acc = {"scratch": {"a": 0.5, "b": 0.6}, "finetuned": {"a": 0.9, "b": 0.8}}
    assert C.claim_scratch(("a", "b"), [layer(0.05, 0.5)], [layer(0.01, 0.1)], acc, S).holds
    assert not C.claim_scratch(("a", "b"), [layer(0.015, 0.5)], [layer(0.01, 0.1)], acc, S).holds


def test_pairs_subsets_and_lam(tmp_path):
    tasks = list("abcdef")
    assert C.choose_pairs(tasks, None, 0) == C.choose_pairs(tasks, 99, 0) and len(C.choose_pairs(tasks, None, 0)) == 15
    drawn = C.choose_pairs(tasks, 4, 0)
    assert (
        len(drawn) == 4
        and drawn == C.choose_pairs(tasks, 4, 0)
        and drawn == sorted(drawn, key=C.choose_pairs(tasks, None, 0).index)
    )
    sub = C.choose_subset(tasks, 3, 0)
    assert len(set(sub)) == 3 and sub == sorted(sub, key=tasks.index)
    layout = Layout(tmp_path)
    assert C.pipeline_lam(layout, 0.3)[0] == 0.3
    write_json(layout.metrics("merge", "task_arithmetic"), {"hyperparameters": {"lam": 0.6}})
    assert C.pipeline_lam(layout, 0.3) == (0.6, "metrics/merge/task_arithmetic.json")


# ---------------------------------------------------------------- the study on tiny inputs
def tiny_pipeline(root: Path, repo_root: Path):
    """A tiny profile's layout written by hand: random task data, a random theta0, theta_t = theta0 + noise, random
    heads, and task arithmetic's chosen lambda."""
    params = parse_params(tiny_params(repo_root / "params.yaml"))
    layout = Layout(root)
    from mergeflow.ml.data import save_task

    size = params.suite.image_size
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    backbone = build_backbone(params.backbone)
    theta0 = backbone_state(backbone)
    save_state_dict(layout.pretrained, theta0)
    for k, t in enumerate(params.suite.tasks):
        arrays = {}
        for split, n in (("train", 40), ("val", 8), ("test", 24)):
            arrays[f"{split}_x"] = rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)
            arrays[f"{split}_y"] = rng.integers(0, 3, n)
        save_task(layout.task_data(t), t, arrays, ["x", "y", "z"], size)
        save_state_dict(layout.finetuned(t), perturbed(theta0, 0.01, 10 + k))
        head = nn.Linear(backbone.num_features, 3)
        save_state_dict(layout.head(t), {"weight": head.weight.detach(), "bias": head.bias.detach()})
    write_json(layout.metrics("merge", "task_arithmetic"), {"hyperparameters": {"lam": 0.4}})
    return params, layout


def test_the_study_runs_on_tiny_inputs_and_is_reproducible(tmp_path, repo_root, capsys):
    params, layout = tiny_pipeline(tmp_path / "project", repo_root)
    settings = REGISTRY["ctl"].settings(
        {"examples": 8, "stitch_examples": 12, "scratch_steps": 3, "average_sizes": [3]}, where="studies.ctl"
    )
    results = []
    for run in ("a", "b"):
        out = tmp_path / run
        out.mkdir()
        torch.manual_seed(0)
        results.append((C.ctl_study(StudyContext(params, layout, settings, out, torch.device("cpu"))), out))
    (res, out), (res2, _) = results
    assert [c.id for c in res.claims] == [f"003.{k}" for k in range(1, 9)]
    assert all(c.verdict in ("holds", "fails") for c in res.claims)  # everything is measured on a full layout
    assert res.claims[3].numbers["lam"] == 0.4  # task arithmetic's chosen lambda
    for fig in res.figures:
        assert (out / fig).stat().st_size > 0 and f"({fig})" in res.body
    assert res.body.index("Thresholds") < res.body.index("## 1")  # the thresholds come before the numbers
    assert " s," not in res.body and "study ctl:" in capsys.readouterr().out  # times go to stdout, not the report
    assert res.body == res2.body  # byte-reproducible
    assert json.dumps([c.record() for c in res.claims]) == json.dumps([c.record() for c in res2.claims])
