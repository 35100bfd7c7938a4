"""The finetune stage's parts (``pipeline.train.finetune``): the frozen head, a published fine-tune imported in
place of training, the feature-preservation anchor, and the files the stage writes."""

from __future__ import annotations

import json

import torch

from mergeflow.config import Params
from mergeflow.core.errors import MergeflowError
from mergeflow.core.files import atomic_path, write_json
from mergeflow.core.hub import hub_access
from mergeflow.core.io import LazyStateDict, save_state_dict
from mergeflow.core.layout import Layout
from mergeflow.ml import data as data_mod
from mergeflow.ml.models import Backbone, backbone_metadata, backbone_state, build_backbone
from mergeflow.ml.probes import fit_probe
from mergeflow.ml.training import Curve, FeatureAnchor


def frozen_head(
    params: Params, task: str, data: data_mod.TaskData, feats: dict[str, torch.Tensor], seed: int, device: torch.device
):
    """The task's frozen head and its record: a linear probe fitted on theta0's features (C chosen on val), CLIP's
    zero-shot head from the task's class names and prompt templates, or a text-to-text model's verbalizer (its
    answers' logits)."""
    if params.finetune.head == "verbalizer":
        from mergeflow.ml.seq2seq_models import verbalizer_head

        if data.answers is None:
            raise MergeflowError(
                f"finetune.head: verbalizer reads a text-to-text task's answer words, and {task}'s file names none "
                "(suite.source: text2text writes them)"
            )
        return verbalizer_head(feats["val"].shape[1], data.answers), {
            "head": "verbalizer",
            "answers": data.answers,
        }  # the features: the vocabulary's logits
    if params.finetune.head == "zeroshot":
        from mergeflow.ml import zeroshot
        from mergeflow.ml.data import benchmark

        # the papers' templates for a benchmark dataset; your own data: CLIP's generic one
        templates = (
            benchmark.templates(task) if params.suite.source == "torchvision" else list(benchmark.GENERIC_TEMPLATES)
        )
        with hub_access(params.downloads()):
            text = zeroshot.text_model(params.backbone, seed=seed)
        head = zeroshot.zeroshot_head(
            text, zeroshot.open_clip_architecture(params.backbone.model), data.classes, templates, device=device
        )
        return head, {"head": "zeroshot", "templates": len(templates)}
    probe = fit_probe(
        feats["train"],
        data.train.labels,
        feats["val"],
        data.val.labels,
        params.probe,
        seed=seed,
        num_classes=len(data.classes),
        metric=data.metric,
    )
    print(probe.convergence_line(task))
    return probe.head, {"head": "probe", "C": probe.c}


def imported_model(params: Params, task: str, backbone: Backbone) -> Backbone:
    """The published fine-tune finetune.checkpoints names for ``task``, in the backbone's naming and checked
    against it (mergeflow.ml.checkpoints)."""
    from mergeflow.ml import checkpoints

    spec = params.finetune.checkpoints[task]
    try:
        path = checkpoints.resolve_source(spec, download=params.downloads())
    except MergeflowError as err:
        raise MergeflowError(f"finetune.checkpoints.{task}: {err}") from None
    theta0 = backbone_state(backbone)
    # a checkpoint without CLIP's projection (FusionBench's) keeps theta0's: its task vector there is zero
    state = checkpoints.read_checkpoint(
        path,
        reference=theta0,
        projection_from=theta0 if params.backbone.embedding == "clip" else None,
        source=f"finetune.checkpoints.{task}: {spec}",
    )
    return build_backbone(params.backbone, state, source=spec)


def feature_anchor(
    params: Params, layout: Layout, backbone: Backbone, seed: int, device: torch.device
) -> FeatureAnchor | None:
    """The feature-preservation anchor (finetune.preserve_features) on the pretraining corpus' images, or None at
    weight 0."""
    cfg = params.finetune.preserve_features
    if cfg.weight == 0:
        return None
    lazy_corpus = LazyStateDict(layout.pretrain_corpus)
    data_mod.check_corpus(lazy_corpus.specs(), str(layout.pretrain_corpus), params.suite.image_size)
    corpus = lazy_corpus["images"]
    if len(corpus) == 0:
        raise MergeflowError(
            f"{layout.pretrain_corpus}: finetune.preserve_features needs pretraining-corpus images and this corpus is "
            "empty (a pretrained backbone has none); set finetune.preserve_features.weight to 0"
        )
    return FeatureAnchor.build(
        backbone, corpus, cfg, seed=seed, device=device, eval_batch_size=params.runtime.eval_batch_size
    )


def save_finetune(
    params: Params,
    task: str,
    layout: Layout,
    data: data_mod.TaskData,
    model: Backbone,
    head: torch.nn.Linear,
    predictions: dict[str, torch.Tensor],
    epoch_states: dict[int, dict],
    curve: Curve | None,
) -> None:
    """The fine-tune's files: its weights, test predictions and head, its kept epochs (with their list) and its loss
    curve."""
    meta = backbone_metadata(params.backbone) | {"task": task}
    save_state_dict(layout.finetuned(task), backbone_state(model.cpu()), meta)
    save_state_dict(layout.predictions("finetune", task), predictions, {"task": task, "metric": data.metric})
    save_state_dict(
        layout.head(task),
        {"weight": head.weight.detach().cpu(), "bias": head.bias.detach().cpu()},
        {"task": task, "classes": json.dumps(data.classes)},
    )
    with atomic_path(layout.epochs(task), directory=True) as tmp:
        for epoch, state in epoch_states.items():
            save_state_dict(tmp / f"epoch{epoch:03d}.safetensors", state, meta | {"epoch": str(epoch)})
        # what the folder holds, also when finetune.checkpoint_every_epoch is off (DVC warns on an empty output)
        write_json(
            tmp / "epochs.json",
            {
                "task": task,
                "checkpoint_every_epoch": params.finetune.checkpoint_every_epoch,
                "epochs": sorted(epoch_states),
            },
        )
    write_json(layout.log("finetune", task), curve.records() if curve else [])
