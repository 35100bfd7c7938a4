"""The registry of training-time regimes: ways of producing the T task models from theta0.

A regime is one module in this package: a function ``(theta0, tasks, train, *, on_round_end=None, resume=None,
**hyperparameters) -> RegimeResult`` decorated with ``@register``, which records its paper and defaults as data.
Modules are discovered by name, as the merge methods are (mergeflow.merging), so adding a regime means adding one
file. No regime does I/O or knows the model: every fine-tune goes through the caller's ``train``.

The trainer, ``train(task, state, budget, carry) -> (new_state, carry)``, fine-tunes a copy of ``state`` on
``task`` for ``budget`` (a ``Budget``: steps or epochs, and where in which learning-rate schedule they fall) and
returns the new state with its ``carry``: whatever it wants back on that task's next call (optimiser state),
opaque to the regime, None on a first call or a reset. It must be a function of its arguments only (a data order
seeded from the task and ``budget.round``, not from a global generator), so that a resumed run repeats an
uninterrupted one bit for bit. The pipeline builds one on training.train_loop; the tests use tiny exact ones
(``full_batch_gd_trainer``). A trainer may also have ``map(calls) -> [(new_state, carry), ...]``, which runs a
round's independent calls at once (in processes, say) with the same results as calling it on each in turn.

Regimes run in rounds (standard and one_epoch are one round). In round r every task trains from the round's
start state; the regime then combines the T models into the next start (MIMA: their uniform average; ATM:
theta + alpha * sum of the round's task vectors). After each finished round ``on_round_end(checkpoint)`` is
called with a ``Checkpoint`` holding everything a later round needs; ``resume=checkpoint`` continues from it,
so a run killed between rounds restarts from its last finished round. Writing checkpoints (atomically) is the
caller's job: ``save_checkpoint`` / ``load_checkpoint`` (one safetensors file, written atomically).
"""

from __future__ import annotations

import importlib
import math
import pkgutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mergeflow.io import StateDict
from mergeflow.regimes._checkpoint import load_checkpoint, save_checkpoint
from mergeflow.regimes._trainers import full_batch_gd_trainer
from mergeflow.regimes._types import Budget, Checkpoint, RoundRecord, Trainer


@dataclass
class RegimeResult:
    task_states: dict[str, StateDict]  # the final task models, theta_t; their vectors theta_t - theta0 go to the merges
    model: StateDict | None  # the regime's own model (ATM after round R, MIMA's last average); None for one-shot regimes
    rounds: list[RoundRecord]


RegimeFn = Callable[..., RegimeResult]


@dataclass(frozen=True)
class Regime:
    name: str
    fn: RegimeFn  # (theta0, tasks, train, *, on_round_end, resume, **hyperparameters) -> RegimeResult
    paper: str  # citation
    defaults: Mapping[str, Any]  # every hyperparameter, at its default

    @property
    def formula(self) -> str:
        """The first line of the module's docstring: what the regime computes."""
        module = importlib.import_module(self.fn.__module__)
        return (module.__doc__ or "").strip().splitlines()[0] if module.__doc__ else ""

    def __call__(self, theta0: StateDict, tasks: Sequence[str], train: Trainer, **kwargs) -> RegimeResult:
        unknown = set(kwargs) - set(self.defaults) - {"on_round_end", "resume"}
        if unknown:
            raise ValueError(f"regime {self.name}: unknown hyperparameter(s) {sorted(unknown)} (allowed: {', '.join(self.defaults) or 'none'})")
        return self.fn(theta0, list(tasks), train, **{**self.defaults, **kwargs})

    def describe(self) -> str:
        hp = ", ".join(f"{k}={v!r}" for k, v in self.defaults.items())
        return f"{self.name:<12} {hp or '(no hyperparameters)'}  [{self.paper}]"


REGISTRY: dict[str, Regime] = {}


def register(name: str, *, paper: str, defaults: Mapping[str, Any] | None = None):
    def wrap(fn: RegimeFn) -> RegimeFn:
        if name in REGISTRY:
            raise RuntimeError(f"regime '{name}' registered twice")
        REGISTRY[name] = Regime(name, fn, paper, dict(defaults or {}))
        return fn

    return wrap


# --- the shared round loop -------------------------------------------------------------------------------------


def difference(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> StateDict:
    """a - b, key by key over b's keys (floating tensors; others are taken from a): tensors a has beyond b (a LoRA
    trainer's factors) are not part of the model's change."""
    return {k: a[k] - b[k] if a[k].is_floating_point() else a[k] for k in b}


def uniform_average(states: Sequence[Mapping[str, torch.Tensor]]) -> StateDict:
    """(1/T) sum_t states[t], summed in task order (floating tensors; others are taken from the first)."""
    out = {}
    for k, first in states[0].items():
        if not first.is_floating_point():
            out[k] = first
            continue
        total = first.clone()
        for s in states[1:]:
            total += s[k]
        out[k] = total / len(states)
    return out


def _flat(state: Mapping[str, torch.Tensor], keys: list[str]) -> torch.Tensor:
    return torch.cat([state[k].detach().reshape(-1).to(torch.float64) for k in keys])


def _norms_and_cosines(vectors: Mapping[str, Mapping[str, torch.Tensor]]) -> tuple[dict[str, float], dict[tuple[str, str], float]]:
    first = next(iter(vectors.values()))
    keys = [k for k, v in first.items() if v.is_floating_point()]  # one order for every vector, whatever each dict's
    flats = {t: _flat(v, keys) for t, v in vectors.items()}
    norms = {t: float(f.norm()) for t, f in flats.items()}
    tasks = list(flats)
    cosines = {}
    for i, a in enumerate(tasks):
        for b in tasks[i + 1 :]:
            denom = norms[a] * norms[b]
            cosines[(a, b)] = float(flats[a] @ flats[b]) / denom if denom > 0 else math.nan
    return norms, cosines


def run_rounds(
    theta0: StateDict,
    tasks: list[str],
    train: Trainer,
    *,
    n_rounds: int,
    budget: Callable[[int], Budget],
    combine: Callable[[StateDict, dict[str, StateDict]], StateDict] | None,
    carry_optimizer: bool = False,
    keep_updates: bool = False,
    on_round_end: Callable[[Checkpoint], None] | None = None,
    resume: Checkpoint | None = None,
) -> RegimeResult:
    """Rounds ``resume.round + 1 .. n_rounds`` (all of them without ``resume``): every task trains
    ``budget(r)`` from the round's start, then ``combine(start, {task: theta_t})`` is the next round's start."""
    if not tasks:
        raise ValueError("a regime needs at least one task")
    if n_rounds < 1:
        raise ValueError(f"{n_rounds} rounds: expected at least 1")
    if resume is None:
        start, carries, records, task_states, first = theta0, {t: None for t in tasks}, [], {}, 1
    else:
        if resume.round > n_rounds or list(resume.task_states) != tasks:
            raise ValueError(f"cannot resume from round {resume.round} of tasks {list(resume.task_states)}: this run has {n_rounds} rounds of {tasks}")
        start, carries, records, task_states, first = resume.next_start, dict(resume.carries), list(resume.records), dict(resume.task_states), resume.round + 1
    for r in range(first, n_rounds + 1):
        # every task starts from its own copy, so a trainer that works in place cannot touch the others' start
        calls = [(task, {k: v.clone() for k, v in start.items()}, budget(r), carries[task] if carry_optimizer else None) for task in tasks]
        # the round's fine-tunes are independent: a trainer with a ``map`` runs them at once (stages.regime's pool)
        trained = train.map(calls) if hasattr(train, "map") else [train(*call) for call in calls]
        task_states = {}
        for task, (state, carry) in zip(tasks, trained):
            task_states[task] = state
            carries[task] = carry if carry_optimizer else None
        updates = {t: difference(s, start) for t, s in task_states.items()}
        update_norms, update_cosines = _norms_and_cosines(updates)
        tv_norms, tv_cosines = _norms_and_cosines({t: difference(s, theta0) for t, s in task_states.items()})
        combined = combine(start, task_states) if combine is not None else None
        records.append(RoundRecord(r, start, combined, update_norms, update_cosines, tv_norms, tv_cosines, updates if keep_updates else None))
        start = combined if combined is not None else start
        if on_round_end is not None:
            on_round_end(Checkpoint(r, task_states, start, dict(carries), list(records)))
    return RegimeResult(task_states, records[-1].combined, records)


def _discover() -> None:
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")


_discover()

# what the stages and the studies use to run a regime on the pipeline's data, imported when first asked for (the
# fine-tuning trainer loads the models and timm)
_RUNNERS = {"regime_identity": "_checkpoint", "resume_from": "_checkpoint", "LazyAnchors": "_finetune", "finetune_trainer": "_finetune", "PoolTrainer": "_pool"}


def __getattr__(name: str) -> Any:
    if name in _RUNNERS:
        return getattr(importlib.import_module(f"{__name__}.{_RUNNERS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["REGISTRY", "Budget", "Checkpoint", "Regime", "RegimeResult", "RoundRecord", "Trainer", "full_batch_gd_trainer", "load_checkpoint", "register", "run_rounds", "save_checkpoint", "uniform_average"]
