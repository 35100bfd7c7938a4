"""The regime stage's parts (``pipeline.train.regime``): the trainer its regimes call, and each variant's metrics
and files."""

from __future__ import annotations

import torch

from mergeflow.config import Params, task_seed as _task_seed
from mergeflow.core.io import save_state_dict
from mergeflow.core.files import write_json
from mergeflow.core.layout import Layout
from mergeflow.ml.data import load_tasks as _load_tasks
from mergeflow.ml.evaluation import mean
from mergeflow.ml.lora import split_factors
from mergeflow.ml.models import backbone_metadata, build_backbone, load_backbone, load_heads as _load_heads
from mergeflow.ml.task_vectors import save_task_vectors, statistics as vector_statistics
from mergeflow.ml.training import score
from mergeflow.pipeline._finetune import feature_anchor


def _pairs(cosines: dict[tuple[str, str], float]) -> dict[str, float]:
    return {f"{a}|{b}": c for (a, b), c in cosines.items()}


def regime_trainer(params: Params, layout: Layout, device: str):
    """The regimes' trainer (regimes._finetune.finetune_trainer) on the pipeline's data: each task's training split,
    its probe head (frozen) and seed, and the feature-preservation anchor the standard fine-tune uses, so that a
    one-round regime of finetune.steps is that fine-tune."""
    from mergeflow.ml.regimes import LazyAnchors, finetune_trainer

    tasks = _load_tasks(params, layout)
    backbone = load_backbone(params.backbone, layout.pretrained)
    heads = _load_heads(params, layout, backbone.num_features, tasks)
    seeds = {t: _task_seed(params.seed, t) for t in tasks}
    anchors = LazyAnchors(tasks, lambda t: feature_anchor(params, layout, backbone, seeds[t], torch.device(device)))
    return finetune_trainer(
        params.backbone,
        heads,
        {t: (d.train.inputs, d.train.labels) for t, d in tasks.items()},
        params.finetune,
        seeds=seeds,
        device=torch.device(device),
        anchors=anchors,
    )


def variant_record(params: Params, result, kwargs: dict, tasks: dict, heads: dict, device) -> dict:
    """A variant's metrics: its task models' accuracies, its own model's (where it has one), per-round norms and
    cosines."""
    bs = params.runtime.eval_batch_size

    def accuracies(state, task):
        model = build_backbone(params.backbone, split_factors(state)[0])
        return {
            s: score(
                model,
                heads[task],
                tasks[task].split(s).inputs,
                tasks[task].split(s).labels,
                batch_size=bs,
                device=device,
                metric=tasks[task].metric,
            )
            for s in ("val", "test")
        }

    individual = {t: accuracies(result.task_states[t], t) for t in tasks}
    own = None
    if result.model is not None:
        own_acc = {s: {t: accuracies(result.model, t)[s] for t in tasks} for s in ("val", "test")}
        own = {"accuracy": own_acc, "average": {s: mean(own_acc[s].values()) for s in own_acc}}
    return {
        "hyperparameters": kwargs,
        "individual": individual,
        "individual_average": {s: mean(individual[t][s] for t in tasks) for s in ("val", "test")},
        "model": own,
        "rounds": [
            {
                "round": r.round,
                "update_norms": r.update_norms,
                "update_cosines": _pairs(r.update_cosines),
                "task_vector_norms": r.task_vector_norms,
                "task_vector_cosines": _pairs(r.task_vector_cosines),
            }
            for r in result.rounds
        ],
    }


def save_variant(
    params: Params, layout: Layout, folder, name: str, variant: str, result, theta0, record: dict, cfg
) -> None:
    """A variant's task vectors (LoRA's as their factors) and their statistics, its own model, ATM's per-round
    updates, into ``folder``; its vectors' storage into ``record``."""
    meta = {"regime": name, "variant": variant}
    tvs, storage = save_task_vectors(
        folder / "vectors",
        theta0,
        result.task_states,
        adapter=cfg.adapter(record["hyperparameters"]),
        meta=meta,
        pretrained_name=str(layout.pretrained),
    )
    record["storage_bytes"] = storage
    write_json(folder / "vectors" / "stats.json", vector_statistics(theta0, tvs))
    if result.model is not None:
        save_state_dict(folder / "model.safetensors", result.model, backbone_metadata(params.backbone) | meta)
    for rec in result.rounds:
        for t, update in (rec.updates or {}).items():
            save_state_dict(
                folder / "updates" / f"round{rec.round}" / f"{t}.safetensors",
                update,
                meta | {"task": t, "round": str(rec.round)},
            )
