"""The data a data-aware method reads, bound by the merge stage (``MergeMethod.with_data``): the statistics stage's
per-task Fisher diagonals and Grams for ``reads="train_statistics"``, AdaMerging's entropy objective on each task's
unlabelled validation and test inputs for ``reads="test_inputs"``, the backbone and each task's first training
examples for ``reads="train_inputs"``, the backbone, heads and each task's labelled training split for
``reads="train_examples"``."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from mergeflow.core.errors import MergeflowError
from mergeflow.ml.merging import MergeData

if TYPE_CHECKING:
    from mergeflow.config import Params
    from mergeflow.core.layout import Layout


def bind_data(params: Params, spec, layout: Layout, tasks, heads, device) -> MergeData:
    """What a data-aware method reads (merging.MergeData): the statistics stage's outputs, or AdaMerging's entropy
    objective on each task's unlabelled validation and test inputs."""
    from mergeflow.core.io import load_state_dict
    from mergeflow.ml.merging import EntropyObjective
    from mergeflow.ml.models import build_backbone
    from mergeflow.ml.statistics import KINDS

    if spec.reads == "train_statistics":
        stats = {}
        for t in params.suite.tasks:
            path = layout.statistics(t)
            if not path.is_file():
                raise MergeflowError(f"{path}: no statistics for task '{t}' (run the stage statistics)")
            state = load_state_dict(path)
            stats[t] = {
                kind: {k.removeprefix(f"{kind}/"): v for k, v in state.items() if k.startswith(f"{kind}/")}
                for kind in KINDS
            }
        return MergeData(statistics=stats)
    if spec.reads == "train_inputs":
        from mergeflow.ml.data import load_tasks

        n = params.statistics.examples
        train = {t: d.split("train").inputs[:n] for t, d in load_tasks(params, layout, ("train",)).items()}
        return MergeData(backbone=build_backbone(params.backbone), train_inputs=train)
    if spec.reads == "train_examples":
        from mergeflow.ml.data import load_tasks

        train = {t: d.split("train") for t, d in load_tasks(params, layout, ("train",)).items()}
        objective = EntropyObjective(
            build_backbone(params.backbone),
            {t: copy.deepcopy(h) for t, h in heads.items()},
            {"train": {t: s.inputs for t, s in train.items()}},
            device,
        )
        return MergeData(objective=objective, train_labels={t: s.labels for t, s in train.items()})
    inputs = {s: {t: d.split(s).inputs for t, d in tasks.items()} for s in ("val", "test")}
    objective = EntropyObjective(
        build_backbone(params.backbone), {t: copy.deepcopy(h) for t, h in heads.items()}, inputs, device
    )
    return MergeData(objective=objective)
