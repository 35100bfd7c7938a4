"""Seed 000's study (mergeflow.studies.gradients): its measurements on a tiny ViT with random task data (the
identities through the pipeline's trainer in float32, the eta^2 scaling and the gradients in float64), and the
verdicts of the claims read from the pipeline's outputs on hand-made metrics, not-measured cases included."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from mergeflow.config import BackboneConfig, FinetuneConfig
from mergeflow.ml.models import backbone_state, build_backbone
from mergeflow.ml.regimes._finetune import finetune_trainer
from mergeflow.pipeline.stages import Layout
from mergeflow.studies import REGISTRY
from mergeflow.studies import gradients as G

CFG = BackboneConfig(kwargs={"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 1, "num_heads": 2})
TASKS = ["a", "b", "c"]
N, CLASSES = 48, 4
SEEDS = {t: 10 + i for i, t in enumerate(TASKS)}
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    backbone = build_backbone(CFG)
    gen = torch.Generator().manual_seed(1)
    data = {
        t: (
            torch.randint(0, 256, (N, 32, 32, 3), generator=gen, dtype=torch.uint8),
            torch.randint(0, CLASSES, (N,), generator=gen),
        )
        for t in TASKS
    }
    heads = {}
    for i, t in enumerate(TASKS):
        torch.manual_seed(100 + i)
        heads[t] = nn.Linear(backbone.num_features, CLASSES)
    return SimpleNamespace(backbone=backbone, theta0=backbone_state(backbone), data=data, heads=heads)


def grad_fn(tiny, task, dtype=torch.float64, chunk=16):
    x, y = tiny.data[task]
    return lambda state: G.loss_gradient(tiny.backbone, tiny.heads[task], x, y, state, chunk=chunk, dtype=dtype)


def mean_loss(tiny, task, state):
    x, y = tiny.data[task]
    params = {k: v.to(torch.float64) for k, v in state.items()}
    with torch.no_grad():
        feats = torch.func.functional_call(
            tiny.backbone.net.eval(), params, (tiny.backbone.normalise(x).to(torch.float64),)
        )
        logits = feats @ tiny.heads[task].weight.double().T + tiny.heads[task].bias.double()
        return float(nn.functional.cross_entropy(logits, y))


def trainer(tiny, **cfg):
    config = FinetuneConfig(
        **{"optimizer": "gd", "lr": 0.05, "weight_decay": 0.0, "warmup_steps": 0, "epochs": 1, **cfg}
    )
    return finetune_trainer(CFG, tiny.heads, tiny.data, config, seeds=SEEDS, device=CPU)


def test_loss_gradient_is_the_gradient_of_the_mean_loss(tiny):
    theta = {k: v.double() for k, v in tiny.theta0.items()}
    g = grad_fn(tiny, "a")(theta)
    torch.manual_seed(5)
    direction = {k: torch.randn_like(v) for k, v in theta.items()}
    eps = 1e-6
    plus = mean_loss(tiny, "a", {k: v + eps * direction[k] for k, v in theta.items()})
    minus = mean_loss(tiny, "a", {k: v - eps * direction[k] for k, v in theta.items()})
    predicted = float(G._flat(g) @ G._flat(direction, list(g)))
    assert (plus - minus) / (2 * eps) == pytest.approx(predicted, rel=1e-6)
    # the chunking does not matter (float64)
    whole = grad_fn(tiny, "a", chunk=N)(theta)
    assert G.errors(g, whole)["relative"] < 1e-12


def test_one_epoch_of_gd_through_the_trainer_is_minus_eta_times_the_gradient(tiny):
    grads = {t: grad_fn(tiny, t, torch.float32)(tiny.theta0) for t in TASKS}
    result = G.one_epoch_identity(tiny.theta0, TASKS, trainer(tiny), grads, eta=0.05, alpha=1 / 3)
    for e in [*result["tasks"].values(), result["multitask"]]:
        assert e["ulps"] <= 4 and e["relative"] < 1e-4
    # the measurement sees a trainer that is not plain GD: weight decay adds eta * wd * theta0 to each tau_t
    decayed = G.one_epoch_identity(tiny.theta0, TASKS, trainer(tiny, weight_decay=0.1), grads, eta=0.05, alpha=1 / 3)
    assert min(e["ulps"] for e in decayed["tasks"].values()) > 100


def test_atm_with_one_gd_step_per_round_is_multitask_gd(tiny):
    fns = {t: grad_fn(tiny, t, torch.float32) for t in TASKS}
    rounds = G.atm_identity(tiny.theta0, TASKS, trainer(tiny), fns, eta=0.05, alpha=1 / 3, rounds=3)
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert all(r["ulps"] <= 4 * r["round"] for r in rounds)
    # against the wrong multi-task step size (eta instead of alpha * eta) the errors are large
    wrong = G.atm_identity(tiny.theta0, TASKS, trainer(tiny), fns, eta=0.05 / 3, alpha=1 / 3, rounds=1)
    assert wrong[0]["relative"] > 0.5


def test_ta_multitask_gap_is_exact_at_one_epoch_and_second_order_after(tiny):
    theta = {k: v.double() for k, v in tiny.theta0.items()}
    fns = {t: grad_fn(tiny, t) for t in TASKS[:2]}
    grads0 = {t: f(theta) for t, f in fns.items()}
    gaps = {eta: G.ta_mt_gaps(theta, fns, eta=eta, alpha=1 / 2, epochs=2, grads0=grads0) for eta in (1e-2, 1e-3)}
    for g in gaps.values():
        assert g[0]["gap"] < 1e-12 * g[0]["mt_step"]  # epoch 1: Proposition 1, in float64
        assert g[1]["gap"] > 1e-9 * g[1]["mt_step"]  # epoch 2: a real, nonzero gap
    ratio = gaps[1e-2][1]["gap"] / gaps[1e-3][1]["gap"]
    assert 80 < ratio < 125  # ten times smaller eta: about a hundred times smaller gap
    assert G.log_slope([1e-3, 1e-2], [gaps[1e-3][1]["gap"], gaps[1e-2][1]["gap"]]) == pytest.approx(math.log10(ratio))
    # the step sizes' own scale: eta u'Hu is far below 1 here
    assert 1e-2 * abs(G.directional_curvature(fns["a"], theta, grads0["a"])) < 0.5


def test_log_slope():
    assert G.log_slope([1e-3, 1e-2, 1e-1], [5e-6, 5e-4, 5e-2]) == pytest.approx(2.0)
    assert G.log_slope([1.0, 10.0], [3.0, 30.0]) == pytest.approx(1.0)


def test_one_adamw_step_is_the_sign_of_the_gradient_and_more_steps_turn_away(tiny):
    grads = {t: grad_fn(tiny, t, torch.float32)(tiny.theta0) for t in TASKS[:2]}
    trainers = {N // b: trainer(tiny, optimizer="adamw", lr=1e-3, batch_size=b) for b in (N, 8)}
    cos = G.minibatch_cosines(tiny.theta0, TASKS[:2], trainers, grads)
    assert sorted(cos) == [1, N // 8]
    for t in TASKS[:2]:
        sign = G.cosine(torch.sign(G._flat(grads[t])), G._flat(grads[t]))
        assert cos[1][t] == pytest.approx(sign, abs=2e-3)  # Adam's first step is -lr g / |g|
        assert cos[N // 8][t] < 1


def test_epoch_updates_and_the_trajectory_verdict():
    zero = {"w": torch.zeros(2)}
    a, b = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])
    states = [zero, {"w": a}, {"w": a + b}, {"w": a + 2 * b}]
    u = G.epoch_updates(states)
    assert u["update_norms"] == pytest.approx([2.0, math.sqrt(2), math.sqrt(2)])
    assert u["cos_first"] == pytest.approx([1.0, 1 / math.sqrt(2), 1 / math.sqrt(2)])
    assert u["tau_norms"] == pytest.approx([2.0, math.sqrt(10), math.sqrt(20)])
    holds, checks = G.trajectory_claim({"t": u}, threshold=0.7, cosine_epochs=5)
    assert holds and all(checks["t"].values())
    holds, checks = G.trajectory_claim({"t": u}, threshold=0.8, cosine_epochs=5)
    assert not holds and checks["t"] == {"first_largest": True, "aligned": False, "tau_grows": True}
    # a larger second update fails the first check; a shrinking task vector the third
    u2 = G.epoch_updates([zero, {"w": b}, {"w": b + a}, {"w": b}])
    holds, checks = G.trajectory_claim({"t": u2}, threshold=-1, cosine_epochs=5)
    assert not holds and not checks["t"]["first_largest"] and not checks["t"]["tau_grows"]


def evaluation(avg):
    return {"accuracy": {"x": avg}, "average": avg, "normalized_average": avg}


FINETUNE = {t: {"individual": {"val": 0.85, "test": 0.84}} for t in TASKS}


def regime_metrics(individual_test):
    return {
        "regime": "one_epoch",
        "variants": {"one_epoch": {"individual_average": {"val": 0.7, "test": individual_test}}},
    }


def test_claim_one_epoch_merge():
    c = G.claim_one_epoch_merge(regime_metrics(0.75), evaluation(0.73), evaluation(0.743), FINETUNE, tolerance=0.03)
    assert (
        c.holds is True
        and c.numbers["ta_one_epoch"] == 0.73
        and c.numbers["individual_converged"] == pytest.approx(0.84)
    )
    assert (
        G.claim_one_epoch_merge(
            regime_metrics(0.75), evaluation(0.694), evaluation(0.743), FINETUNE, tolerance=0.03
        ).holds
        is False
    )
    assert (
        G.claim_one_epoch_merge(
            regime_metrics(0.75), evaluation(0.76), evaluation(0.743), FINETUNE, tolerance=0.03
        ).holds
        is True
    )  # better is fine
    assert (
        G.claim_one_epoch_merge(
            regime_metrics(0.86), evaluation(0.76), evaluation(0.743), FINETUNE, tolerance=0.03
        ).holds
        is False
    )  # not weaker alone
    c = G.claim_one_epoch_merge(
        None, None, None, None, tolerance=0.03, missing=["regime one_epoch did not run (add one_epoch to regimes.run)"]
    )
    assert c.holds is None and c.verdict == "not measured" and "regimes.run" in c.detail
    c = G.claim_one_epoch_merge(
        regime_metrics(0.75), evaluation(0.73), evaluation(0.743), FINETUNE, tolerance=0.03, missing=["x.json missing"]
    )
    assert c.holds is None


BASE = {
    "task_arithmetic": evaluation(0.743),
    "ties": evaluation(0.726),
    "breadcrumbs": {"average": {"val": 0.9, "test": 0.725}},
}


def test_claim_atm_budget():
    c = G.claim_atm_budget({2: evaluation(0.75), 4: evaluation(0.77)}, BASE)
    assert (
        c.holds is True
        and c.numbers["atm"] == {"2": 0.75, "4": 0.77}
        and c.numbers["baselines"]["breadcrumbs"] == 0.725
    )
    assert G.claim_atm_budget({2: evaluation(0.75), 4: evaluation(0.735)}, BASE).holds is False  # below task arithmetic
    assert G.claim_atm_budget({2: evaluation(0.78), 4: evaluation(0.77)}, BASE).holds is False  # falls with R
    one = G.claim_atm_budget({4: evaluation(0.77)}, BASE)
    assert one.holds is True and "trend in R not measured" in one.detail
    c = G.claim_atm_budget({4: evaluation(0.77)}, {**BASE, "breadcrumbs": None})
    assert c.holds is None and "breadcrumbs" in c.detail and "merge.methods" in c.detail
    assert G.claim_atm_budget({}, BASE, missing=["regime atm did not run (add atm to regimes.run)"]).holds is None


def fake_params(
    run,
    one_epoch_methods=("task_arithmetic",),
    atm_methods=("atm", "task_arithmetic"),
    merge_methods=("task_arithmetic", "ties", "breadcrumbs"),
    atm_rounds=(2, 4),
):
    """Real, validated Params with these regimes and methods (finetune.steps 200)."""
    from mergeflow.params import parse_params

    return parse_params(
        {
            "suite": {"tasks": TASKS},
            "finetune": {"steps": 200},
            "merge": {"methods": list(merge_methods)},
            "regimes": {
                "run": list(run),
                "methods": {"one_epoch": list(one_epoch_methods), "atm": list(atm_methods)},
                "atm": {"rounds": list(atm_rounds)},
            },
        }
    )


def write(path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def test_pipeline_claims_read_the_layout_and_say_what_to_run(tmp_path):
    layout = Layout(tmp_path)
    assert "add one_epoch to regimes.run" in G._pipeline_claim_6(fake_params([]), layout, 0.03).detail
    assert (
        "regimes.methods.one_epoch"
        in G._pipeline_claim_6(fake_params(["one_epoch"], one_epoch_methods=("ties",)), layout, 0.03).detail
    )
    missing = G._pipeline_claim_6(fake_params(["one_epoch"]), layout, 0.03)
    assert missing.holds is None and "one_epoch.json missing" in missing.detail
    write(layout.metrics("regime", "one_epoch"), regime_metrics(0.75))
    write(layout.merge_run("task_arithmetic", "one_epoch", "one_epoch").evaluation, evaluation(0.73))
    write(layout.merge_run("task_arithmetic").evaluation, evaluation(0.743))
    for t in TASKS:
        write(layout.metrics("finetune", t), FINETUNE[t])
    assert G._pipeline_claim_6(fake_params(["one_epoch"]), layout, 0.03).holds is True
    assert G.one_epoch_rows(fake_params(["one_epoch"]), layout) == [("task_arithmetic", 0.73, 0.743)]
    assert G.one_epoch_rows(fake_params([]), layout) == []

    assert "add atm to regimes.run" in G._pipeline_claim_7(fake_params(["one_epoch"]), layout).detail
    assert (
        "add to merge.methods"
        in G._pipeline_claim_7(fake_params(["atm"], merge_methods=("task_arithmetic",)), layout).detail
    )
    write(layout.merge_run("ties").evaluation, BASE["ties"])
    write(layout.merge_run("breadcrumbs").evaluation, BASE["breadcrumbs"])
    write(layout.merge_run("atm", "atm", "atm_r2").evaluation, evaluation(0.75))
    assert "atm_r4" in G._pipeline_claim_7(fake_params(["atm"]), layout).detail  # R = 4 not evaluated yet
    write(layout.merge_run("atm", "atm", "atm_r4").evaluation, evaluation(0.77))
    c = G._pipeline_claim_7(fake_params(["atm"]), layout)
    assert c.holds is True and c.numbers["atm"] == {"2": 0.75, "4": 0.77}


def test_registered_with_its_settings():
    study = REGISTRY["gradients"]
    assert study.settings_model is G.GradientsSettings and "Task Vectors and Gradients" in study.paper
    assert study.settings({}, where="studies.gradients").gd_lr == 1e-4
    with pytest.raises(ValueError, match="studies.gradients.slope_range"):
        study.settings({"slope_range": [2.3, 1.7]}, where="studies.gradients")
    with pytest.raises(ValueError, match="studies.gradients.examples"):
        study.settings({"examples": 0}, where="studies.gradients")
    with pytest.raises(ValueError, match="studies.gradients.batch_sizes"):
        study.settings({"batch_sizes": [64, 0]}, where="studies.gradients")
    with pytest.raises(ValueError, match="studies.gradients.nonsense"):
        study.settings({"nonsense": 1}, where="studies.gradients")
