"""Evaluation of a backbone on every task with each task's own head, and the summary table of those scores
(absolute and normalized accuracy, the gap recovered); its plots are in mergeflow.report.plots. The search on validation
that calls the evaluator is mergeflow.ml.merging.search."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from mergeflow.config import BackboneConfig
from mergeflow.ml.data import TaskData
from mergeflow.core.io import StateDict
from mergeflow.ml.models import build_backbone
from mergeflow.core.devices import resident_stack
from mergeflow.ml.training import extract_features, head_predictions, head_score


@dataclass
class MultiTaskEvaluator:
    """Each task's score (accuracy; a text task's GLUE metric) of a backbone state on one split of every task: one
    forward pass over all tasks' inputs.

    On CUDA the images are moved to the device once (when they fit in half its free memory) and stay there for
    every candidate; ``bf16``: the forward passes run under bfloat16 autocast there (the validation search; the
    chosen model's test accuracy is float32). ``keep_predictions``: each task's predictions on its split are kept in
    ``predictions`` (the last model's; the test evaluation saves them for the leaderboard's bootstrap)."""

    backbone_cfg: BackboneConfig
    tasks: Mapping[str, TaskData]
    heads: Mapping[str, nn.Linear]
    split: str
    device: torch.device
    batch_size: int = 512
    bf16: bool = False
    keep_predictions: bool = False
    predictions: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        parts = [self.tasks[t].split(self.split) for t in self.tasks]
        self._images = resident_stack([p.inputs for p in parts], self.device)
        self._labels = [p.labels for p in parts]
        self._sizes = [len(p.labels) for p in parts]
        self._model = build_backbone(self.backbone_cfg)

        offsets = [0, *itertools.accumulate(self._sizes)]
        self._slices = {t: slice(a, b) for t, a, b in zip(self.tasks, offsets, offsets[1:])}
        self._task_labels = dict(zip(self.tasks, self._labels))
        self._metrics = {t: self.tasks[t].metric for t in self.tasks}

    def __call__(self, state: StateDict) -> dict[str, float]:
        """Every task, one model."""
        self._model.net.load_state_dict(state)
        feats = extract_features(
            self._model, self._images, batch_size=self.batch_size, device=self.device, bf16=self.bf16
        )
        return {t: self._score(t, f) for t, f in zip(self.tasks, feats.split(self._sizes))}

    def _score(self, task: str, features: torch.Tensor) -> float:
        if self.keep_predictions:
            self.predictions[task] = head_predictions(self.heads[task], features, self._metrics[task])
        return head_score(self.heads[task], features, self._task_labels[task], self._metrics[task])

    def task(
        self, task: str, state: StateDict, feature_map: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> float:
        """One task, on its own split only; ``feature_map``: applied to the features before the head (Surgery)."""
        self._model.net.load_state_dict(state)
        feats = extract_features(
            self._model,
            self._images[self._slices[task]],
            batch_size=self.batch_size,
            device=self.device,
            bf16=self.bf16,
        )
        if feature_map is not None:
            with torch.no_grad():
                feats = feature_map(feats)
        return self._score(task, feats)

    def network(self, build: Callable[[nn.Module], nn.Module]) -> dict[str, float]:
        """Every task through one network that ``build(backbone)`` makes (a routed method's), images -> features."""
        model = build(self._model)
        feats = extract_features(model, self._images, batch_size=self.batch_size, device=self.device, bf16=self.bf16)
        return {t: self._score(t, f) for t, f in zip(self.tasks, feats.split(self._sizes))}

    def per_task(
        self, model_of: Callable[[str], StateDict], feature_maps: Callable[[str], Callable] | None = None
    ) -> dict[str, float]:
        """Each task with its own model (per-task methods), and its own map on the features where the method has one."""
        return {t: self.task(t, model_of(t), feature_maps(t) if feature_maps else None) for t in self.tasks}


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


# Below half a point the individual models do not beat the probe by more than a test split's noise, and the share
# of that gap a merge recovers means nothing (a 0.05-point gap turns a 1-point difference into 2000%).
MIN_GAP = 0.005


def gap_recovered(average: float, probe_average: float, individual_average: float) -> float | None:
    """(average - probe) / (individual - probe): the share of the probe-to-individual gap closed; None ("n/a")
    when the individual models do not beat the probe by MIN_GAP."""
    gap = individual_average - probe_average
    return (average - probe_average) / gap if gap >= MIN_GAP else None


def normalized(accuracy: Mapping[str, float], individual: Mapping[str, float]) -> dict[str, float | None]:
    """Per task, accuracy / the individual model's; None where that model scores 0 (a broken import)."""
    return {t: accuracy[t] / individual[t] if individual[t] > 0 else None for t in accuracy}


def normalized_average(accuracy: Mapping[str, float], individual: Mapping[str, float]) -> float | None:
    ratios = list(normalized(accuracy, individual).values())
    return None if None in ratios else mean(ratios)
