"""The regimes' trainer on the pipeline's fine-tune (mergeflow.ml.regimes._finetune) against training.finetune itself:
the standard regime is today's fine-tune, MIMA's rounds of one schedule with a carried optimiser are one
uninterrupted fine-tune, and a resumed MIMA run repeats an uninterrupted one, all bit for bit."""

import copy

import pytest
import torch

from mergeflow.config import BackboneConfig, FinetuneConfig, PreserveFeaturesConfig
from mergeflow.ml.models import backbone_state, build_backbone, make_head
from mergeflow.ml.regimes import REGISTRY, Budget
from mergeflow.ml.regimes._finetune import data_seed, finetune_trainer
from mergeflow.ml.training import FeatureAnchor, finetune, warmup_cosine

TINY = BackboneConfig(kwargs={"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 1, "num_heads": 2})
CPU = torch.device("cpu")
TASKS = ["digits", "count"]
SEEDS = {"digits": 11, "count": 23}
# 64 images in batches of 16: 4 steps an epoch, so 6 steps cross an epoch boundary (a reshuffle)
ADAMW = FinetuneConfig(steps=6, batch_size=16, lr=3e-3, warmup_steps=2)
SGD = FinetuneConfig(optimizer="sgd", momentum=0.9, steps=6, batch_size=16, lr=3e-2, warmup_steps=2)


def _set(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (64, 32, 32, 3), generator=g, dtype=torch.uint8), torch.randint(
        0, 3, (64,), generator=g
    )


TRAIN_SETS = {t: _set(i) for i, t in enumerate(TASKS)}


def _theta0_and_heads():
    torch.manual_seed(0)
    backbone = build_backbone(TINY)
    heads = {t: make_head(backbone.num_features, 3) for t in TASKS}
    return backbone_state(backbone), heads


THETA0, HEADS = _theta0_and_heads()


def _anchors():
    corpus, _ = _set(99)
    cfg = PreserveFeaturesConfig(weight=1.0, images=16, batch_size=8)
    return {
        t: FeatureAnchor.build(build_backbone(TINY, THETA0), corpus, cfg, seed=SEEDS[t], device=CPU, eval_batch_size=16)
        for t in TASKS
    }


def trainer(cfg, anchors=None):
    return finetune_trainer(TINY, HEADS, TRAIN_SETS, cfg, seeds=SEEDS, device=CPU, anchors=anchors)


def today(task, cfg, anchor=None):
    """training.finetune as the pipeline's finetune stage calls it."""
    backbone = build_backbone(TINY, THETA0)
    curve = finetune(
        backbone, copy.deepcopy(HEADS[task]), *TRAIN_SETS[task], cfg, seed=SEEDS[task], device=CPU, anchor=anchor
    )
    return backbone_state(backbone), curve


def equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("cfg", [ADAMW, SGD], ids=["adamw", "sgd"])
def test_standard_regime_is_todays_finetune_bit_for_bit(cfg):
    anchors = _anchors()
    result = REGISTRY["standard"](THETA0, TASKS, trainer(cfg, anchors))
    for t in TASKS:
        expected, _ = today(t, cfg, anchors[t])
        equal(result.task_states[t], expected)
        assert any(not torch.equal(result.task_states[t][k], THETA0[k]) for k in THETA0)  # it trained


def test_budget_of_epochs_and_the_carry_is_the_optimizer_state():
    train = trainer(ADAMW)
    state, carry = train("digits", dict(THETA0), Budget(epochs=2), None)
    expected, curve = today("digits", ADAMW.model_copy(update={"epochs": 2}))
    assert len(curve.step) == 8
    equal(state, expected)
    assert carry["state"][0]["step"].item() == 8 and set(carry["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("cfg", [ADAMW, SGD], ids=["adamw", "sgd"])
def test_mima_with_one_round_is_standard_bit_for_bit(cfg):
    standard = REGISTRY["standard"](THETA0, TASKS, trainer(cfg), steps=6)
    for schedule in ("one_schedule", "restart"):
        for optimizer_state in ("reset", "carry"):
            mima = REGISTRY["mima"](
                THETA0, TASKS, trainer(cfg), rounds=1, total_steps=6, schedule=schedule, optimizer_state=optimizer_state
            )
            for t in TASKS:
                equal(mima.task_states[t], standard.task_states[t])


@pytest.mark.parametrize("cfg", [ADAMW, SGD], ids=["adamw", "sgd"])
@pytest.mark.parametrize("rounds", [2, 3])
def test_mima_on_one_task_with_one_schedule_and_carried_optimizer_is_one_finetune(cfg, rounds):
    """T = 1: the average of one model is itself, so N rounds of S/N steps on one schedule with the optimiser
    carried are one fine-tune of S steps, provided the schedule's offset, the optimiser state and the data order
    all continue exactly (S = 6 crosses an epoch boundary, so the reshuffle continues too)."""
    anchors = _anchors()
    mima = REGISTRY["mima"](
        THETA0,
        ["digits"],
        trainer(cfg, anchors),
        rounds=rounds,
        total_steps=6,
        schedule="one_schedule",
        optimizer_state="carry",
    )
    expected, _ = today("digits", cfg, anchors["digits"])
    equal(mima.task_states["digits"], expected)
    equal(mima.model, expected)


def test_one_schedule_learning_rates_continue_across_rounds():
    """The learning rates the rounds' optimiser steps used, step by step, are one warm-up + cosine over S."""
    train, carry, rates = trainer(ADAMW), None, []
    state = dict(THETA0)
    for i in (1, 2, 3):
        state, carry = train(
            "digits", state, Budget.of_steps(2, round=i, schedule_start=(i - 1) * 2, schedule_length=6), carry
        )
        # the carry's lr is the one the scheduler set after the call's last step, i.e. the next step's
        rates.append(carry["param_groups"][0]["lr"])
    assert rates == [ADAMW.lr * warmup_cosine(s, 6, 2) for s in (2, 4, 6)]


def test_a_restart_draws_a_fresh_data_order_each_round():
    train = trainer(ADAMW)
    first, _ = train("digits", dict(THETA0), Budget.of_steps(3, round=1), None)
    second, _ = train("digits", dict(THETA0), Budget.of_steps(3, round=2), None)
    assert any(not torch.equal(first[k], second[k]) for k in first)
    assert data_seed(SEEDS["digits"], 1) == SEEDS["digits"] and data_seed(SEEDS["digits"], 2) != data_seed(
        SEEDS["digits"], 3
    )


class Killed(Exception):
    pass


@pytest.mark.parametrize("schedule, optimizer_state", [("one_schedule", "carry"), ("restart", "reset")])
def test_mima_resumed_after_a_round_is_bit_identical(schedule, optimizer_state):
    hyperparameters = {"rounds": 3, "total_steps": 6, "schedule": schedule, "optimizer_state": optimizer_state}
    anchors = _anchors()
    whole = REGISTRY["mima"](THETA0, TASKS, trainer(ADAMW, anchors), **hyperparameters)
    saved = []

    def kill_after_round_one(checkpoint):
        saved.append(copy.deepcopy(checkpoint))  # what a resumed job reads back: nothing shared with this one
        raise Killed

    with pytest.raises(Killed):
        REGISTRY["mima"](THETA0, TASKS, trainer(ADAMW, anchors), on_round_end=kill_after_round_one, **hyperparameters)
    resumed = REGISTRY["mima"](THETA0, TASKS, trainer(ADAMW, anchors), resume=saved[0], **hyperparameters)
    for t in TASKS:
        equal(resumed.task_states[t], whole.task_states[t])
    equal(resumed.model, whole.model)
    assert [r.round for r in resumed.rounds] == [1, 2, 3]


def _adamw_trainer():
    """Built again in each worker process (module-level, so that it pickles by name)."""
    return trainer(ADAMW, _anchors())


def test_a_pool_runs_each_rounds_finetunes_at_once_with_the_same_results():
    from mergeflow.ml.regimes._pool import PoolTrainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' count: a fine-tune's floats depend on it
    try:
        alone = REGISTRY["mima"](THETA0, TASKS, _adamw_trainer(), rounds=2, total_steps=6, optimizer_state="carry")
        with PoolTrainer(_adamw_trainer, workers=2, threads=1) as pool:
            pooled = REGISTRY["mima"](THETA0, TASKS, pool, rounds=2, total_steps=6, optimizer_state="carry")
    finally:
        torch.set_num_threads(threads)
    for t in TASKS:
        equal(pooled.task_states[t], alone.task_states[t])
        assert list(pooled.task_states[t]) == list(THETA0)  # in the caller's key order
    equal(pooled.model, alone.model)
    for a, b in zip(pooled.rounds, alone.rounds):
        assert (a.update_norms, a.update_cosines, a.task_vector_cosines) == (
            b.update_norms,
            b.update_cosines,
            b.task_vector_cosines,
        )


def test_lazy_anchors_build_each_task_once_and_only_when_asked():
    from mergeflow.ml.regimes._finetune import LazyAnchors

    built = []
    anchors = LazyAnchors(["digits", "signs"], lambda t: built.append(t) or f"anchor of {t}")
    assert list(anchors) == ["digits", "signs"] and len(anchors) == 2 and built == []
    assert anchors["digits"] == anchors.get("digits") == "anchor of digits"
    assert built == ["digits"]  # once, and signs never
    assert anchors.get("count") is None
    with pytest.raises(KeyError):
        anchors["count"]
