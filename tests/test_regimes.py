"""Training-time regimes (mergeflow.ml.regimes) on a tiny float64 MLP regression: seed 000's identities, MIMA against
standard fine-tuning and by hand, ATM against task arithmetic, and resuming from a round's checkpoint."""

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call

from mergeflow.ml.merging import REGISTRY as MERGES
from mergeflow.ml.regimes import REGISTRY, Budget, Checkpoint, full_batch_gd_trainer
from mergeflow.ml.training import warmup_cosine

TASKS = ["a", "b", "c"]
LR = 0.05


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()


MODEL = make_model()


def theta0() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in MODEL.state_dict().items()}


def task_data(task: str, n: int = 24):
    g = torch.Generator().manual_seed(100 + TASKS.index(task))
    x = torch.randn(n, 4, generator=g, dtype=torch.float64)
    w = torch.randn(4, 2, generator=g, dtype=torch.float64)
    return x, torch.tanh(x @ w)


DATA = {t: task_data(t) for t in TASKS}


def mean_loss(task: str, params, idx=None) -> torch.Tensor:
    x, y = DATA[task]
    if idx is not None:
        x, y = x[idx], y[idx]
    return ((functional_call(MODEL, params, (x,)) - y) ** 2).mean()


LOSSES = {t: (lambda params, t=t: mean_loss(t, params)) for t in TASKS}


def sgd_trainer(lr: float = LR, momentum: float = 0.9, batch_size: int = 8, warmup: int = 2):
    """Minibatch SGD with momentum and warm-up + cosine, following the budget's schedule position; the carry is
    the momentum buffers; the data order is seeded from (task, round), so a call depends on its arguments only."""
    per_epoch = len(DATA[TASKS[0]][0]) // batch_size

    def train(task, state, budget, carry):
        steps = budget.steps if budget.steps is not None else (budget.epochs or 3) * per_epoch
        length = budget.schedule_length or steps
        g = torch.Generator().manual_seed(1000 * TASKS.index(task) + budget.round)
        velocity = carry if carry is not None else {k: torch.zeros_like(v) for k, v in state.items()}
        velocity = {k: v.clone() for k, v in velocity.items()}
        order = torch.cat([torch.randperm(len(DATA[task][0]), generator=g) for _ in range(steps // per_epoch + 1)])
        for s in range(steps):
            params = {k: v.detach().requires_grad_() for k, v in state.items()}
            loss = mean_loss(task, params, order[s * batch_size : (s + 1) * batch_size])
            grads = torch.autograd.grad(loss, list(params.values()))
            step_lr = lr * warmup_cosine(budget.schedule_start + s, length, warmup)
            for (k, p), grad in zip(params.items(), grads):
                velocity[k] = momentum * velocity[k] + grad
                state[k] = p.detach() - step_lr * velocity[k]
        return state, velocity

    return train


def gradient(loss_fn, state):
    """grad of loss_fn at state, by autograd, independently of the regimes' trainer."""
    params = {k: v.detach().clone().requires_grad_() for k, v in state.items()}
    return dict(zip(params, torch.autograd.grad(loss_fn(params), list(params.values()))))


def multitask_gd(state, lr, steps):
    """``steps`` GD steps on sum_t L_t at step size ``lr``."""
    for _ in range(steps):
        g = gradient(lambda p: sum(mean_loss(t, p) for t in TASKS), state)
        state = {k: v - lr * g[k] for k, v in state.items()}
    return state


def close(a, b, **tolerance):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], **(tolerance or {"rtol": 1e-12, "atol": 1e-13}))


def equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def minus(a, b):
    return {k: a[k] - b[k] for k in a}


def test_one_epoch_gd_task_vector_is_the_scaled_negative_gradient_and_their_sum_one_multitask_step():
    """Seed 000, identity 1: tau_t(1) = -eta grad L_t(theta0); theta0 + alpha sum_t tau_t = one multi-task GD step
    at alpha * eta."""
    base, alpha = theta0(), 0.7
    result = REGISTRY["one_epoch"](base, TASKS, full_batch_gd_trainer(LOSSES, LR))
    taus = {t: minus(s, base) for t, s in result.task_states.items()}
    for t in TASKS:
        close(taus[t], {k: -LR * g for k, g in gradient(LOSSES[t], base).items()})
        assert any(v.abs().max() > 1e-3 for v in taus[t].values())  # a real step, not a vacuous identity
    merged = {k: base[k] + alpha * sum(taus[t][k] for t in TASKS) for k in base}
    close(merged, multitask_gd(base, alpha * LR, 1))


@pytest.mark.parametrize("rounds", [1, 3])
def test_atm_with_one_gd_step_per_round_is_multitask_gd(rounds):
    """Seed 000, identity 2: R rounds of ATM, one full-batch GD step per task per round, are R multi-task GD
    steps at alpha * eta."""
    base, alpha = theta0(), 0.5
    result = REGISTRY["atm"](base, TASKS, full_batch_gd_trainer(LOSSES, LR), rounds=rounds, steps=1, alpha=alpha)
    close(result.model, multitask_gd(base, alpha * LR, rounds))
    assert len(result.rounds) == rounds and all(set(r.updates) == set(TASKS) for r in result.rounds)


def test_atm_with_one_round_is_task_arithmetic():
    base, alpha = theta0(), 0.4
    result = REGISTRY["atm"](base, TASKS, sgd_trainer(), rounds=1, steps=6, alpha=alpha)
    taus = {t: minus(s, base) for t, s in result.task_states.items()}
    close(result.model, MERGES["task_arithmetic"](base, taus, lam=alpha))
    close(result.rounds[0].updates["a"], taus["a"])  # round 1's vectors are relative to theta0


def test_mima_with_one_round_is_standard_bit_for_bit():
    base, steps = theta0(), 9
    standard = REGISTRY["standard"](base, TASKS, sgd_trainer(), steps=steps)
    for optimizer_state in ("reset", "carry"):
        for schedule in ("one_schedule", "restart"):
            mima = REGISTRY["mima"](
                base,
                TASKS,
                sgd_trainer(),
                rounds=1,
                total_steps=steps,
                schedule=schedule,
                optimizer_state=optimizer_state,
            )
            for t in TASKS:
                equal(mima.task_states[t], standard.task_states[t])


def test_mima_average_after_each_round_by_hand():
    """Two tasks, three rounds of K = 4 steps on one schedule over S = 12: every round starts both tasks from
    the previous average, and the record's average is (theta_a + theta_b) / 2."""
    tasks, train, k, n = ["a", "b"], sgd_trainer(), 4, 3
    result = REGISTRY["mima"](theta0(), tasks, train, rounds=n, total_steps=k * n, keep_updates=True)
    average = theta0()
    for i in range(1, n + 1):
        budget = Budget(steps=k, schedule_start=(i - 1) * k, schedule_length=k * n, round=i)
        a, _ = train("a", dict(average), budget, None)
        b, _ = train("b", dict(average), budget, None)
        record = result.rounds[i - 1]
        equal(record.start, average)
        equal(record.updates["a"], minus(a, average))
        average = {key: (a[key] + b[key]) / 2 for key in a}
        equal(record.combined, average)
        delta = torch.cat([(a[key] - record.start[key]).reshape(-1) for key in a])
        assert record.update_norms["a"] == pytest.approx(float(delta.norm()), rel=1e-12)
    equal(result.model, average)
    equal(result.task_states["a"], a)
    equal(result.task_states["b"], b)


def test_mima_hands_the_trainer_the_schedule_and_optimizer_state_it_was_asked_for():
    calls = []

    def spy(task, state, budget, carry):
        calls.append((task, budget, carry))
        return state, f"{task}{budget.round}"

    REGISTRY["mima"](
        theta0(), ["a", "b"], spy, rounds=2, total_steps=10, schedule="one_schedule", optimizer_state="carry"
    )
    assert [(b.steps, b.schedule_start, b.schedule_length, b.round) for t, b, _ in calls if t == "a"] == [
        (5, 0, 10, 1),
        (5, 5, 10, 2),
    ]
    assert [c for t, _, c in calls if t == "b"] == [None, "b1"]
    calls.clear()
    REGISTRY["mima"](theta0(), ["a", "b"], spy, rounds=2, total_steps=10, schedule="restart", optimizer_state="reset")
    assert [(b.steps, b.schedule_start, b.schedule_length) for t, b, _ in calls if t == "a"] == [(5, 0, 5), (5, 0, 5)]
    assert all(c is None for _, _, c in calls)
    with pytest.raises(ValueError, match="divide"):
        REGISTRY["mima"](theta0(), ["a"], spy, rounds=3, total_steps=10)


class Killed(Exception):
    pass


def saved(checkpoint: Checkpoint) -> Checkpoint:
    """The checkpoint as a resumed job gets it: nothing shared with the killed one (the pipeline will write it as
    safetensors; no pickle)."""
    return copy.deepcopy(checkpoint)


@pytest.mark.parametrize(
    "name, hyperparameters",
    [
        ("mima", {"rounds": 4, "total_steps": 12, "optimizer_state": "carry"}),
        ("mima", {"rounds": 4, "total_steps": 12, "schedule": "restart"}),
        ("atm", {"rounds": 4, "steps": 3, "alpha": 0.5}),
    ],
)
def test_a_run_killed_after_a_round_resumes_to_the_same_weights(name, hyperparameters):
    regime, kill_after = REGISTRY[name], 2
    uninterrupted = regime(theta0(), TASKS, sgd_trainer(), **hyperparameters)
    last = {}

    def checkpoint_then_die(checkpoint):
        last["checkpoint"] = saved(checkpoint)
        if checkpoint.round == kill_after:
            raise Killed

    with pytest.raises(Killed):
        regime(theta0(), TASKS, sgd_trainer(), on_round_end=checkpoint_then_die, **hyperparameters)
    assert last["checkpoint"].round == kill_after
    rounds_run = []
    resumed = regime(
        theta0(),
        TASKS,
        sgd_trainer(),
        resume=last["checkpoint"],
        on_round_end=lambda c: rounds_run.append(c.round),
        **hyperparameters,
    )
    assert rounds_run == [3, 4]
    for t in TASKS:
        equal(resumed.task_states[t], uninterrupted.task_states[t])
    equal(resumed.model, uninterrupted.model)
    assert [r.round for r in resumed.rounds] == [1, 2, 3, 4]
    assert [r.update_norms for r in resumed.rounds] == [r.update_norms for r in uninterrupted.rounds]


EXAMPLE_HYPERPARAMETERS = {
    "standard": {"steps": 4},
    "one_epoch": {},
    "atm": {"rounds": 2, "steps": 2},
    "mima": {"rounds": 2, "total_steps": 4},
    "lora": {"rank": 1, "steps": 4},
}


def test_every_regime_is_registered_with_its_formula_and_paper():
    assert set(REGISTRY) == {"standard", "one_epoch", "atm", "mima", "lora"} == set(EXAMPLE_HYPERPARAMETERS)
    for regime in REGISTRY.values():
        assert "=" in regime.formula and "theta" in regime.formula, regime.name
        assert regime.paper and regime.name in regime.describe()
    assert "sum_t theta_t(i)" in REGISTRY["mima"].formula
    assert "alpha * sum_t tau_t(r)" in REGISTRY["atm"].formula
    with pytest.raises(ValueError, match="unknown hyperparameter"):
        REGISTRY["atm"](theta0(), TASKS, sgd_trainer(), lam=0.3)


@pytest.mark.parametrize("name", sorted(EXAMPLE_HYPERPARAMETERS))
def test_every_regime_keeps_keys_shapes_dtypes_and_leaves_theta0_alone(name):
    base = theta0()
    before = {k: v.clone() for k, v in base.items()}
    result = REGISTRY[name](base, TASKS, sgd_trainer(), **EXAMPLE_HYPERPARAMETERS[name])
    equal(base, before)  # theta0 is not trained in place
    assert list(result.task_states) == TASKS
    for state in [*result.task_states.values(), *([result.model] if result.model is not None else [])]:
        assert {k: (v.shape, v.dtype) for k, v in state.items()} == {k: (v.shape, v.dtype) for k, v in base.items()}
        assert all(torch.isfinite(v).all() for v in state.values())
    assert any(not torch.equal(result.task_states["a"][k], base[k]) for k in base)
