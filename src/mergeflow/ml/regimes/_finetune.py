"""The regimes' trainer on the pipeline's own fine-tune (training.finetune): a timm backbone under a task's frozen
linear head, trained on the task's training images."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from mergeflow.config import BackboneConfig, FinetuneConfig
from mergeflow.core.io import StateDict
from mergeflow.ml.lora import attach, merge_in
from mergeflow.ml.models import backbone_state, build_backbone
from mergeflow.ml.regimes import Budget, Trainer
from mergeflow.ml.training import FeatureAnchor, finetune, total_steps


def data_seed(task_seed: int, first_round: int) -> int:
    """The seed of the data order of a schedule begun in ``first_round``: round 1's is the task's own seed, so that
    a one-round regime draws exactly today's fine-tune; later rounds' are mixed from (task seed, round)."""
    if first_round == 1:
        return task_seed
    words = np.random.SeedSequence([task_seed, first_round]).generate_state(2, np.uint32)
    return (int(words[0]) << 31) | (int(words[1]) >> 1)  # 62 bits: finetune adds 1 for the anchor's draws


class LazyAnchors(Mapping):
    """{task: ``build(task)``}, each built on first use and kept: a pool worker builds only the anchors of the tasks
    it trains (on 2 workers, the default run's MIMA took 6 s longer in its first round than in the next three,
    against 14 s when each built all eight), and an anchor does not depend on which process builds it (each worker
    runs the same thread count)."""

    def __init__(self, tasks, build):
        self._tasks, self._build, self._built = list(tasks), build, {}

    def __getitem__(self, task: str):
        if task not in self._tasks:
            raise KeyError(task)
        if task not in self._built:
            self._built[task] = self._build(task)
        return self._built[task]

    def __iter__(self):
        return iter(self._tasks)

    def __len__(self) -> int:
        return len(self._tasks)


def finetune_trainer(
    backbone_cfg: BackboneConfig,
    heads: Mapping[str, nn.Linear],
    train_sets: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    cfg: FinetuneConfig,
    *,
    seeds: Mapping[str, int],
    device: torch.device,
    anchors: Mapping[str, FeatureAnchor] | None = None,
) -> Trainer:
    """``train(task, state, budget, carry)``: ``training.finetune`` of a backbone holding ``state`` under
    ``heads[task]`` (frozen) on ``train_sets[task]`` = (uint8 images, labels), with ``cfg``'s optimiser, batch size,
    learning rate, weight decay and warm-up, ``seeds[task]`` (the pipeline's per-task seed) and ``anchors[task]``
    when given. Returns the trained state (on the CPU) and, as the carry, the optimiser's ``state_dict``; a carry
    passed in is loaded into the fresh optimiser (None: a fresh one).

    Length: ``Budget()`` is ``cfg``'s own schedule (``training.finetune`` exactly); ``budget.steps`` steps or
    ``budget.epochs`` epochs otherwise. The learning rate follows one warm-up + cosine schedule
    ``budget.schedule_length`` steps long (None: the call's own steps), from position ``budget.schedule_start``.

    Data order: one stream per schedule, as in one uninterrupted fine-tune. A call at ``schedule_start`` 0 begins a
    schedule with a data order drawn from (task seed, ``budget.round``); a call at ``schedule_start`` p > 0 continues
    a schedule begun by equal calls in earlier rounds (MIMA's one_schedule: round i at (i-1)K), so it takes
    batches p.. of the order drawn in round ``budget.round - p // steps``. The rounds of one schedule thus see the
    batches one fine-tune of the whole schedule sees, and every call is a function of its arguments only.

    LoRA (``budget.adapter``): only the adapters of the named linear layers train (A drawn from the data order's
    seed), at the adapter's learning rate when it has one; the returned state is W0 + s B A with the factors beside
    it under their peft keys."""
    with torch.random.fork_rng(devices=[]):  # the template's random init is overwritten on every call
        template = build_backbone(backbone_cfg)

    def train(task: str, state: StateDict, budget: Budget, carry: Any) -> tuple[StateDict, Any]:
        images, labels = train_sets[task]
        if budget.steps is not None:
            call_cfg = cfg.model_copy(update={"steps": budget.steps, "epochs": None})
        elif budget.epochs is not None:
            call_cfg = cfg.model_copy(update={"epochs": budget.epochs})
        else:
            call_cfg = cfg
        if budget.adapter is not None and budget.adapter.lr is not None:
            call_cfg = call_cfg.model_copy(update={"lr": budget.adapter.lr})
        steps = total_steps(call_cfg, len(images), call_cfg.optimizer == "gd")
        if budget.schedule_start % steps:
            raise ValueError(
                f"{task}: a call of {steps} steps at schedule position "
                f"{budget.schedule_start}: a schedule's calls must be of equal steps"
            )
        first_round = budget.round - budget.schedule_start // steps
        if first_round < 1:
            raise ValueError(
                f"{task}: round {budget.round} at schedule position "
                f"{budget.schedule_start} would continue a schedule begun before round 1"
            )
        backbone = copy.deepcopy(template)
        backbone.net.load_state_dict(state)
        seed = data_seed(seeds[task], first_round)
        if budget.adapter is not None:
            attach(backbone.net, budget.adapter, seed=seed)
        curve = finetune(
            backbone,
            copy.deepcopy(heads[task]),
            images,
            labels,
            call_cfg,
            seed=seed,
            device=device,
            desc=f"finetune {task} round {budget.round}",
            anchor=anchors.get(task) if anchors is not None else None,
            start=budget.schedule_start,
            schedule_length=budget.schedule_length,
            optimizer_state=carry,
        )
        factors = merge_in(backbone.net) if budget.adapter is not None else {}
        return backbone_state(backbone.cpu()) | {k: v.cpu() for k, v in factors.items()}, curve.optimizer_state

    return train
