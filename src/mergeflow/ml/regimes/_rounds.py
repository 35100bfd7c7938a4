"""The round loop every regime runs (``run_rounds``), and the combinations it uses: torch at the top, so the
registry (mergeflow.ml.regimes) imports this module only when a regime runs."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch

from mergeflow.core.io import StateDict
from mergeflow.ml.regimes._types import Budget, Checkpoint, RegimeResult, RoundRecord, Trainer


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


def _norms_and_cosines(
    vectors: Mapping[str, Mapping[str, torch.Tensor]],
) -> tuple[dict[str, float], dict[tuple[str, str], float]]:
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
            raise ValueError(
                f"cannot resume from round {resume.round} of tasks "
                f"{list(resume.task_states)}: this run has {n_rounds} rounds of {tasks}"
            )
        start, carries, records, task_states, first = (
            resume.next_start,
            dict(resume.carries),
            list(resume.records),
            dict(resume.task_states),
            resume.round + 1,
        )
    for r in range(first, n_rounds + 1):
        # every task starts from its own copy, so a trainer that works in place cannot touch the others' start
        calls = [
            (task, {k: v.clone() for k, v in start.items()}, budget(r), carries[task] if carry_optimizer else None)
            for task in tasks
        ]
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
        records.append(
            RoundRecord(
                r,
                start,
                combined,
                update_norms,
                update_cosines,
                tv_norms,
                tv_cosines,
                updates if keep_updates else None,
            )
        )
        start = combined if combined is not None else start
        if on_round_end is not None:
            on_round_end(Checkpoint(r, task_states, start, dict(carries), list(records)))
    return RegimeResult(task_states, records[-1].combined, records)
