"""Evaluation of a backbone on every task with each task's own head; hyperparameter search on validation;
the summary table (absolute and normalized accuracy) and its bar chart."""

from __future__ import annotations

import csv
import io as _io
import itertools
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from mergeflow.config import BackboneConfig
from mergeflow.data import TaskData
from mergeflow.io import StateDict
from mergeflow.merging import MergeMethod
from mergeflow.models import build_backbone
from mergeflow.training import extract_features, head_accuracy


@dataclass
class MultiTaskEvaluator:
    """Accuracy of a backbone state on one split of every task: one forward pass over all tasks' images."""

    backbone_cfg: BackboneConfig
    tasks: Mapping[str, TaskData]
    heads: Mapping[str, nn.Linear]
    split: str
    device: torch.device
    batch_size: int = 512

    def __post_init__(self) -> None:
        parts = [self.tasks[t].split(self.split) for t in self.tasks]
        self._images = torch.cat([p.images for p in parts])
        self._labels = [p.labels for p in parts]
        self._sizes = [len(p.labels) for p in parts]
        self._model = build_backbone(self.backbone_cfg)

    def __call__(self, state: StateDict) -> dict[str, float]:
        self._model.net.load_state_dict(state)
        feats = extract_features(self._model, self._images, batch_size=self.batch_size, device=self.device)
        return {t: head_accuracy(self.heads[t], f, y) for t, f, y in zip(self.tasks, feats.split(self._sizes), self._labels)}


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def _candidates(method: MergeMethod, overrides: Mapping, pretrained, task_vectors):
    """(hyperparameters, merged state) for every grid point; a method's coefficient is swept by interpolation."""
    fixed, grid = method.search_space(overrides)
    coef = method.coefficient if method.coefficient in grid else None
    others = [k for k in grid if k != coef]
    for values in itertools.product(*(grid[k] for k in others)):
        hp = {**fixed, **dict(zip(others, values))}
        if coef is None:
            yield hp, method(pretrained, task_vectors, **hp)
            continue
        base = method(pretrained, task_vectors, **hp, **{coef: 0.0})
        unit = method(pretrained, task_vectors, **hp, **{coef: 1.0})
        direction = {k: unit[k].float() - base[k].float() for k in base}
        del unit
        for c in grid[coef]:
            yield {**hp, coef: c}, {k: (base[k].float() + c * direction[k]).to(base[k].dtype) for k in base}


def search(method: MergeMethod, overrides: Mapping, pretrained: StateDict, task_vectors: Mapping[str, StateDict], evaluate: MultiTaskEvaluator):
    """Grid search on validation; the best average accuracy wins (first in grid order on ties)."""
    curve, best = [], None
    for hp, merged in _candidates(method, overrides, pretrained, task_vectors):
        acc = evaluate(merged)
        row = {"hyperparameters": hp, "accuracy": acc, "average": mean(acc.values())}
        curve.append(row)
        if best is None or row["average"] > best[0]["average"]:
            best = (row, merged)
    return best[0], best[1], curve


def plot_validation_curve(method: str, curve: list[dict], grid_keys: list[str], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    if len(grid_keys) == 1:
        key = grid_keys[0]
        ax.plot([r["hyperparameters"][key] for r in curve], [100 * r["average"] for r in curve], marker="o")
        ax.set_xlabel(key)
    else:
        ax.plot(range(len(curve)), [100 * r["average"] for r in curve], marker="o")
        ax.set_xlabel("candidate (" + ", ".join(grid_keys) + ")" if grid_keys else "single setting")
    ax.set_ylabel("avg. validation accuracy (%)")
    ax.set_title(f"{method}: validation search")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)


def summary_rows(tasks: list[str], finetune: Mapping[str, dict], evaluations: Mapping[str, dict]) -> list[dict]:
    """Rows Pretrained (linear probe), Individual and one per method: accuracy per task, average, normalized
    accuracy (merged / individual, averaged) and the fraction of the probe-to-individual gap recovered."""
    individual = {t: finetune[t]["individual"]["test"] for t in tasks}
    probe = {t: finetune[t]["probe"]["test"] for t in tasks}
    gap = mean(individual.values()) - mean(probe.values())

    def row(name: str, acc: Mapping[str, float], chosen: str = "") -> dict:
        avg = mean(acc[t] for t in tasks)
        return {
            "method": name,
            **{t: acc[t] for t in tasks},
            "average": avg,
            "normalized": mean(acc[t] / individual[t] for t in tasks),
            "gap_recovered": (avg - mean(probe.values())) / gap if gap else float("nan"),
            "chosen": chosen,
        }

    rows = [row("Pretrained (linear probe)", probe), row("Individual", individual)]
    for name, ev in evaluations.items():
        chosen = ", ".join(f"{k}={v}" for k, v in ev["searched"].items())
        rows.append(row(name, ev["accuracy"], chosen))
    return rows


def summary_markdown(rows: list[dict], tasks: list[str]) -> str:
    head = ["method", *tasks, "avg", "norm.", "gap rec.", "chosen (val)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["method"], *(f"{100 * r[t]:.1f}" for t in tasks), f"**{100 * r['average']:.1f}**", f"{100 * r['normalized']:.1f}", f"{100 * r['gap_recovered']:.0f}%", r["chosen"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def summary_csv(rows: list[dict], tasks: list[str]) -> str:
    buf = _io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=["method", *tasks, "average", "normalized", "gap_recovered", "chosen"])
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def plot_summary(rows: list[dict], tasks: list[str], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = 0.8 / len(rows)
    xs = range(len(tasks) + 1)
    fig, ax = plt.subplots(figsize=(2 + 1.1 * (len(tasks) + 1), 4))
    for i, r in enumerate(rows):
        ax.bar([x + i * width for x in xs], [100 * r[t] for t in tasks] + [100 * r["average"]], width, label=r["method"])
    ax.set_xticks([x + 0.4 - width / 2 for x in xs], [*tasks, "average"], rotation=30, ha="right")
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("Merged models on every task (each task's own head)")
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)
