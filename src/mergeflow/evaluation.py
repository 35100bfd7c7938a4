"""Evaluation of a backbone on every task with each task's own head, and the summary table of those scores
(absolute and normalized accuracy, the gap recovered); its plots are in mergeflow.plots. The search on validation
that calls the evaluator is mergeflow.merging.search."""

from __future__ import annotations

import csv
import io as _io
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from mergeflow.config import BackboneConfig
from mergeflow.data import TaskData
from mergeflow.io import StateDict
from mergeflow.merging import DATA, REGISTRY
from mergeflow.models import build_backbone
from mergeflow.devices import resident_stack
from mergeflow.training import extract_features, head_accuracy


@dataclass
class MultiTaskEvaluator:
    """Accuracy of a backbone state on one split of every task: one forward pass over all tasks' images.

    On CUDA the images are moved to the device once (when they fit in half its free memory) and stay there for
    every candidate; ``bf16``: the forward passes run under bfloat16 autocast there (the validation search; the
    chosen model's test accuracy is float32)."""

    backbone_cfg: BackboneConfig
    tasks: Mapping[str, TaskData]
    heads: Mapping[str, nn.Linear]
    split: str
    device: torch.device
    batch_size: int = 512
    bf16: bool = False

    def __post_init__(self) -> None:
        parts = [self.tasks[t].split(self.split) for t in self.tasks]
        self._images = resident_stack([p.images for p in parts], self.device)
        self._labels = [p.labels for p in parts]
        self._sizes = [len(p.labels) for p in parts]
        self._model = build_backbone(self.backbone_cfg)

        offsets = [0, *itertools.accumulate(self._sizes)]
        self._slices = {t: slice(a, b) for t, a, b in zip(self.tasks, offsets, offsets[1:])}
        self._task_labels = dict(zip(self.tasks, self._labels))

    def __call__(self, state: StateDict) -> dict[str, float]:
        """Every task, one model."""
        self._model.net.load_state_dict(state)
        feats = extract_features(self._model, self._images, batch_size=self.batch_size, device=self.device, bf16=self.bf16)
        return {t: head_accuracy(self.heads[t], f, y) for t, f, y in zip(self.tasks, feats.split(self._sizes), self._labels)}

    def task(self, task: str, state: StateDict, feature_map: Callable[[torch.Tensor], torch.Tensor] | None = None) -> float:
        """One task, on its own split only; ``feature_map``: applied to the features before the head (Surgery)."""
        self._model.net.load_state_dict(state)
        feats = extract_features(self._model, self._images[self._slices[task]], batch_size=self.batch_size, device=self.device, bf16=self.bf16)
        if feature_map is not None:
            with torch.no_grad():
                feats = feature_map(feats)
        return head_accuracy(self.heads[task], feats, self._task_labels[task])

    def network(self, build: Callable[[nn.Module], nn.Module]) -> dict[str, float]:
        """Every task through one network that ``build(backbone)`` makes (a routed method's), images -> features."""
        model = build(self._model)
        feats = extract_features(model, self._images, batch_size=self.batch_size, device=self.device, bf16=self.bf16)
        return {t: head_accuracy(self.heads[t], f, y) for t, f, y in zip(self.tasks, feats.split(self._sizes), self._labels)}

    def per_task(self, model_of: Callable[[str], StateDict], feature_maps: Callable[[str], Callable] | None = None) -> dict[str, float]:
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


def gap_cell(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.0f}%"


def summary_rows(tasks: list[str], finetune: Mapping[str, dict], evaluations: Mapping[str, dict], *, regime: str = "standard", individual_models: Mapping[str, float] | None = None) -> list[dict]:
    """Rows Pretrained (linear probe), Individual and one per method: accuracy per task, average, normalized
    accuracy (merged / individual, averaged) and the fraction of the probe-to-individual gap recovered.

    ``data``: what a method reads besides the weights (merging.DATA): "none", train statistics, or test inputs
    (test-time adaptation, not comparable with data-free merging).
    A training-time regime's rows (``regime``: its variant, e.g. mima_n4) are its own task models' test accuracies
    (``individual_models``) in place of Pretrained and Individual, then its methods; they are normalized by the
    standard fine-tune's individual models and its probe-to-individual gap, so that every row compares on one scale."""
    individual = {t: finetune[t]["individual"]["test"] for t in tasks}
    probe = {t: finetune[t]["probe"]["test"] for t in tasks}

    def row(name: str, acc: Mapping[str, float], chosen: str = "", storage: float = 1.0, data: str = "") -> dict:
        avg = mean(acc[t] for t in tasks)
        return {
            "regime": regime,
            "method": name,
            "data": data,
            **{t: acc[t] for t in tasks},
            "average": avg,
            "normalized": normalized_average({t: acc[t] for t in tasks}, individual),
            "gap_recovered": gap_recovered(avg, mean(probe.values()), mean(individual.values())),
            "storage_models": storage,
            "chosen": chosen,
        }

    def shown(v) -> str:
        return "per task" if isinstance(v, Mapping) else str(v)

    if individual_models is None:
        rows = [row("Pretrained (linear probe)", probe), row("Individual", individual, storage=float(len(tasks)))]
    else:
        rows = [row("Individual", individual_models, storage=float(len(tasks)))]
    for name, ev in evaluations.items():
        chosen = ", ".join(f"{k}={shown(v)}" for k, v in ev["searched"].items())
        reads = REGISTRY[name].reads if name in REGISTRY else None  # a regime's own model reads no data
        rows.append(row(name, ev["accuracy"], chosen, ev.get("storage_models", 1.0), DATA[reads]))
    return rows


def summary_markdown(rows: list[dict], tasks: list[str]) -> str:
    head = ["regime", "method", "data", *tasks, "avg", "norm.", "gap rec.", "storage (models)", "chosen (val)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["regime"], r["method"], r["data"], *(f"{100 * r[t]:.1f}" for t in tasks), f"**{100 * r['average']:.1f}**", "n/a" if r["normalized"] is None else f"{100 * r['normalized']:.1f}", gap_cell(r["gap_recovered"]), f"{r['storage_models']:.2f}", r["chosen"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def summary_csv(rows: list[dict], tasks: list[str]) -> str:
    buf = _io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=["regime", "method", "data", *tasks, "average", "normalized", "gap_recovered", "storage_models", "chosen"])
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def negation_markdown(method: str, ev: dict, tasks: list[str]) -> str:
    """Forgetting (accuracy on the negated task) against control (the other tasks), pretrained beside negated."""
    lines = [f"\n### {method}: forgetting vs control (test accuracy, %)\n", "| negated task | lam | target: pretrained → negated | control: pretrained → negated |", "|---|---|---|---|"]
    for t in tasks:
        r = ev["per_task"][t]
        lines.append(f"| {t} | {r['lam']:g} | {100 * r['pretrained_target']:.1f} → {100 * r['target']:.1f} | {100 * r['pretrained_control']:.1f} → {100 * r['control']:.1f} |")
    a = ev["average"]
    lines.append(f"| **average** | | {100 * a['pretrained_target']:.1f} → **{100 * a['target']:.1f}** | {100 * a['pretrained_control']:.1f} → **{100 * a['control']:.1f}** |")
    return "\n".join(lines) + "\n"
