"""The stages that make the task models and what the merges read: the data (prepare), the backbone (pretrain),
each fine-tune, the task vectors, the statistics, each merge's sources and the training-time regimes. Each reads
and writes only the paths in ``Layout`` and validates its inputs before writing."""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import shutil
import time

import torch

from mergeflow.ml import data as data_mod

from mergeflow.pipeline import imports
from mergeflow.config import Params, task_seed as _task_seed
from mergeflow.ml.data import load_tasks as _load_tasks
from mergeflow.core.errors import MergeflowError
from mergeflow.ml.evaluation import mean
from mergeflow.core.io import LazyStateDict, load_state_dict, save_state_dict, tensor_specs
from mergeflow.core.files import atomic_path, write_json
from mergeflow.core.layout import Layout
from mergeflow.ml.merging import REGISTRY
from mergeflow.core.parent_death import process_pool
from mergeflow.core.hub import hub_access
from mergeflow.ml.models import (
    Backbone,
    backbone_metadata,
    backbone_state,
    build_backbone,
    new_backbone,
    load_backbone,
    load_heads as _load_heads,
    select_device,
)
from mergeflow.ml.lora import split_factors
from mergeflow.ml.regimes import regime_identity, resume_from
from mergeflow.report.plots import plot_cosine_heatmap
from mergeflow.ml.task_vectors import save_task_vectors, statistics as vector_statistics, task_vector
from mergeflow.ml.training import (
    FeatureAnchor,
    Timer,
    extract_features,
    finetune as finetune_loop,
    fit_probe,
    head_predictions,
    head_score,
    pretrain as pretrain_loop,
    score,
    seed_everything,
)


def _setup(params: Params, seed: int) -> torch.device:
    seed_everything(seed, params.threads())
    return select_device(params.runtime.device)


EVALUATED = ("val", "test")  # what merges read: hyperparameters chosen on val, tested on test


# ---------------------------------------------------------------- prepare
def prepare(params: Params, layout: Layout = Layout()) -> dict:
    """Generate (embedded) or convert (imagefolder, torchvision) every task, and the pretraining corpus: all of them
    or none (each is written to a staging folder, moved into data/ once every one is built)."""
    suite = params.suite
    for (
        task
    ) in suite.tasks:  # a missing dataset or folder, found before any worker starts (as mergeflow check finds it)
        data_mod.check_layout(suite, task, params.downloads())
    data = layout.pretrain_corpus.parent
    # data/'s files under it (<staging>/data/tasks/<task>...), named as a temporary: ignored by DVC, swept if killed
    staging = Layout(data / f".staging.tmp-{os.getpid()}-prepare")
    shutil.rmtree(staging.root, ignore_errors=True)
    try:
        with Timer() as timer:
            sizes, pretrain_images = _build_data(params, staging)
        for built in sorted(p for p in staging.root.rglob("*") if p.is_file()):
            destination = data / built.relative_to(staging.pretrain_corpus.parent)
            destination.parent.mkdir(parents=True, exist_ok=True)
            os.replace(built, destination)
    finally:
        shutil.rmtree(staging.root, ignore_errors=True)
    imports.sync(params, layout.root)  # each fine-tune's dependency on its imported checkpoint (a new task's too)
    metrics = {"tasks": sizes, "pretrain_images": pretrain_images}
    write_json(layout.metrics("prepare"), metrics)
    write_json(layout.timing("prepare"), timer.record())
    return metrics


def _build_data(params: Params, layout: Layout) -> tuple[dict[str, dict[str, int]], int]:
    """Every task and the corpus written under ``layout``'s data/, in worker processes: (split sizes per task, the
    corpus' size)."""
    suite = params.suite
    layout.task_data(suite.tasks[0]).parent.mkdir(parents=True, exist_ok=True)
    # generation is single-threaded numpy: the corpus and the tasks are built in parallel processes (each from its
    # own seed, so the result does not depend on the number of workers). Each worker saves its own file and returns
    # only the sizes: this process never holds a task's arrays. At 224 pixels a task is gigabytes: no more workers
    # than half the memory holds.
    workers = min(len(suite.tasks) + 1, params.threads() or os.cpu_count() or 1)
    with contextlib.suppress(ValueError, OSError, AttributeError):
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        workers = max(1, min(workers, memory // 2 // max(1, data_mod.task_bytes(suite))))
    build_corpus = params.backbone.pretrained is None
    with process_pool(workers) as pool:  # its workers die with the stage, killed or not
        try:
            corpus_job = (
                pool.submit(data_mod.write_pretraining_corpus, layout.pretrain_corpus, suite, params.seed)
                if build_corpus
                else None
            )
            jobs = {
                t: pool.submit(
                    data_mod.write_task,
                    layout.task_data(t),
                    suite,
                    t,
                    _task_seed(params.seed, t),
                    download=params.downloads(),
                    backbone=params.backbone,
                )
                for t in suite.tasks
            }
            sizes = {t: job.result() for t, job in jobs.items()}
            pretrain_images = corpus_job.result() if corpus_job else 0
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)  # one task failed: start no other
            raise
    if not build_corpus:  # a pretrained backbone: an empty corpus
        data_mod.write_pretraining_corpus(layout.pretrain_corpus, suite, params.seed, build=False)
    return sizes, pretrain_images


# ---------------------------------------------------------------- pretrain
def pretrain(params: Params, layout: Layout = Layout()) -> dict:
    """Train the backbone on the formula-driven corpus (text: masked-LM on the text corpus), or load real pretrained
    weights (a file or the hub)."""
    device = _setup(params, params.seed)
    with Timer() as timer:
        if params.backbone.pretrained is not None:
            with hub_access(params.downloads()):
                backbone = new_backbone(params.backbone, pretrained=True)
            curve, head_acc = [], {}
        elif params.suite.modality == "text":
            (backbone, curve), head_acc = _pretrain_text(params, layout, device), {}
        else:
            corpus = load_state_dict(layout.pretrain_corpus, check=False)
            data_mod.check_corpus(
                tensor_specs(corpus), str(layout.pretrain_corpus), params.suite.image_size, labels=corpus
            )
            images = corpus.pop("images")
            if len(images) == 0:
                raise MergeflowError(
                    f"{layout.pretrain_corpus}: the pretraining corpus is empty (suite.pretrain_images = 0)"
                )
            backbone = build_backbone(params.backbone)
            heads, curve_obj = pretrain_loop(backbone, images, corpus, params.pretrain, seed=params.seed, device=device)
            curve = curve_obj.records()
            probe_n = min(2000, len(images))
            feats = extract_features(
                backbone, images[-probe_n:], batch_size=params.runtime.eval_batch_size, device=device
            )
            head_acc = {
                name: float((heads[name].cpu()(feats).argmax(1) == y[-probe_n:]).float().mean())
                for name, y in corpus.items()
            }
    state = backbone_state(backbone.cpu())
    save_state_dict(layout.pretrained, state, backbone_metadata(params.backbone))
    write_json(layout.log("pretrain"), curve)
    metrics = {
        "parameters": sum(v.numel() for v in state.values()),
        "train_head_accuracy": head_acc,  # on the last corpus images, seen in training: a sanity check, not a score
        "final_loss": curve[-1]["loss"] if curve else None,
    }
    write_json(layout.metrics("pretrain"), metrics)
    write_json(layout.timing("pretrain"), timer.record())
    return metrics


def _pretrain_text(params: Params, layout: Layout, device: torch.device):
    """(the text backbone after masked-LM pretraining on the corpus' sentences, its loss curve's records)."""
    from mergeflow.ml.data.text import special_ids
    from mergeflow.ml.text_models import model_config
    from mergeflow.ml.text_training import pretrain_denoising, pretrain_masked_lm

    tokens = load_state_dict(layout.pretrain_corpus, check=False).get("tokens")
    if tokens is None or tokens.ndim != 2 or len(tokens) == 0:
        raise MergeflowError(
            f"{layout.pretrain_corpus}: expected a text corpus, array 'tokens' [N, L] of at least one sentence "
            "(suite.pretrain_images sentences)"
        )
    denoising = getattr(model_config(params.backbone), "is_encoder_decoder", False)
    special = special_ids(text2text=params.suite.source == "text2text")
    state, curve = (pretrain_denoising if denoising else pretrain_masked_lm)(
        params.backbone, tokens, params.pretrain, special=special, seed=params.seed, device=device
    )
    return build_backbone(
        params.backbone, state, source="denoising pretraining" if denoising else "masked-LM pretraining"
    ), curve.records()


# ---------------------------------------------------------------- finetune
def _feature_anchor(
    params: Params, layout: Layout, backbone: Backbone, seed: int, device: torch.device
) -> FeatureAnchor | None:
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


def _frozen_head(
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


def _imported(params: Params, task: str, backbone: Backbone) -> Backbone:
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


def finetune(params: Params, task: str, layout: Layout = Layout()) -> dict:
    """The task's frozen head (a linear probe on theta0's features, or CLIP's zero-shot head), then fine-tune the
    backbone under it, or import a published fine-tune (finetune.checkpoints)."""
    params.check_task(task)
    seed = _task_seed(params.seed, task)
    device = _setup(params, seed)
    data = data_mod.load_task(layout.task_data(task), params.suite.image_size)
    backbone = load_backbone(params.backbone, layout.pretrained)
    bs = params.runtime.eval_batch_size
    with Timer() as timer:
        # the probe fits on train's features; a zero-shot head needs only val's and test's (its accuracy on theta0)
        featured = data_mod.SPLITS if params.finetune.head == "probe" else EVALUATED
        feats = {s: extract_features(backbone, data.split(s).inputs, batch_size=bs, device=device) for s in featured}
        head, head_record = _frozen_head(params, task, data, feats, seed, device)
        probe_acc = {s: head_score(head, feats[s], data.split(s).labels, data.metric) for s in ("val", "test")}
        epoch_states: dict[int, dict] = {}
        if task in params.finetune.checkpoints:
            model, curve = _imported(params, task, backbone), None
        else:
            model = copy.deepcopy(backbone)

            def keep_epoch(epoch: int) -> None:
                if params.finetune.checkpoint_every_epoch:
                    epoch_states[epoch] = backbone_state(model)

            anchor = _feature_anchor(params, layout, backbone, seed, device)
            curve = finetune_loop(
                model,
                head,
                data.train.inputs,
                data.train.labels,
                params.finetune,
                seed=seed,
                device=device,
                desc=f"finetune {task}",
                on_epoch_end=keep_epoch,
                anchor=anchor,
                train_head=params.finetune.train_head,
            )
        model_feats = {
            s: extract_features(model, data.split(s).inputs, batch_size=bs, device=device) for s in ("val", "test")
        }
        individual = {s: head_score(head, model_feats[s], data.split(s).labels, data.metric) for s in ("val", "test")}
        # the test predictions of both, which the leaderboard's bootstrap rescores
        predictions = {
            "labels": data.test.labels,
            "probe": head_predictions(head, feats["test"], data.metric),
            "individual": head_predictions(head, model_feats["test"], data.metric),
        }
    # a path changed in params.yaml: DVC records the new file after the run (written once the inputs proved good)
    imports.sync(params, layout.root, [task])
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
    metrics = {
        "task": task,
        "steps": len(curve.step) if curve else 0,
        "imported": params.finetune.checkpoints.get(task),
        "probe": head_record | probe_acc,  # the head on theta0: the linear probe's or the zero-shot accuracy
        "individual": individual,
        "gain_over_probe": {s: individual[s] - probe_acc[s] for s in ("val", "test")},
    }
    write_json(layout.metrics("finetune", task), metrics)
    write_json(layout.timing("finetune", task), timer.record())
    return metrics


# ---------------------------------------------------------------- vectors
def vectors(params: Params, layout: Layout = Layout()) -> dict:
    """tau_t = theta_t - theta0 for every task, with norms and cosine similarities (whole and per tensor)."""
    with Timer() as timer:
        pretrained = load_state_dict(layout.pretrained)
        tvs = {
            t: task_vector(
                pretrained,
                load_state_dict(layout.finetuned(t)),
                pretrained_name=str(layout.pretrained),
                finetuned_name=str(layout.finetuned(t)),
            )
            for t in params.suite.tasks
        }
        stats = vector_statistics(pretrained, tvs)
        with atomic_path(layout.vectors, directory=True) as tmp:
            for t, tv in tvs.items():
                save_state_dict(tmp / f"{t}.safetensors", tv, {"task": t})
            write_json(tmp / "stats.json", stats)
            plot_cosine_heatmap(stats, tmp / "cosine.png")
    summary = {"norms": stats["norms"], "relative_norms": stats["relative_norms"]}
    write_json(layout.metrics("vectors"), summary)
    write_json(layout.timing("vectors"), timer.record())
    return summary


# ---------------------------------------------------------------- statistics
def statistics(params: Params, layout: Layout = Layout()) -> dict:
    """Per task, what data-aware methods read (mergeflow.ml.statistics): the diagonal Fisher of the fine-tuned model
    with its head (labels sampled from the model, and the true labels) and the Gram of every linear layer's inputs,
    on the first statistics.examples training examples. Once per task here, so that a merge hyperparameter change
    does not recompute them."""
    from mergeflow.ml.metrics import is_regression
    from mergeflow.ml.statistics import fisher_diagonal, input_grams

    device = _setup(params, params.seed)
    tasks = _load_tasks(params, layout, ("train",))  # the statistics are of training examples
    heads = _load_heads(params, layout, build_backbone(params.backbone).num_features, tasks)
    sizes, times = {}, {}
    with Timer() as timer, atomic_path(layout.statistics(params.suite.tasks[0]).parent, directory=True) as tmp:
        for t, data in tasks.items():
            with Timer() as task_timer:
                model = load_backbone(params.backbone, layout.finetuned(t))
                images, labels = (
                    data.train.inputs[: params.statistics.examples],
                    data.train.labels[: params.statistics.examples],
                )
                generator = torch.Generator().manual_seed(_task_seed(params.seed, t))
                out = {}
                for kind, given in (("fisher_sampled", None), ("fisher_empirical", labels)):
                    out |= {
                        f"{kind}/{k}": v
                        for k, v in fisher_diagonal(
                            model,
                            heads[t],
                            images,
                            given,
                            generator=generator,
                            device=device,
                            regression=is_regression(data.metric),
                        ).items()
                    }
                out |= {
                    f"gram/{k}": v
                    for k, v in input_grams(
                        model, images, batch_size=params.runtime.eval_batch_size, device=device
                    ).items()
                }
                save_state_dict(tmp / layout.statistics(t).name, out, {"task": t, "examples": str(len(images))})
            sizes[t], times[t] = len(images), task_timer.seconds
            print(
                f"statistics: {t} ({len(sizes)}/{len(tasks)}): Fishers and Grams of {len(images)} training examples in "
                f"{task_timer.seconds:.1f} s",
                flush=True,
            )
    metrics = {"examples": sizes}
    write_json(layout.metrics("statistics"), metrics)
    write_json(layout.timing("statistics"), timer.record() | {"tasks": times})
    return metrics


# ---------------------------------------------------------------- sources
def sources(params: Params, layout: Layout = Layout()) -> dict:
    """What each merge's, study's and regime's bytes follow from (mergeflow.pipeline.sources):
    sources/merge/<method>.json, sources/study/<name>.json, sources/regime/<name>.json for every registered one, and
    sources/regime_merge/<name>.json for each regime with the methods params.yaml gives it (regimes.methods), each
    {file: md5}: a change to one method re-runs only the merges that use it."""
    from mergeflow.ml.regimes import REGISTRY as REGIMES
    from mergeflow.pipeline.sources import (
        digest,
        merging_dir,
        method_sources,
        regime_sources,
        source_dir,
        study_sources,
    )
    from mergeflow.studies import REGISTRY as STUDIES

    package_dir, src = merging_dir(layout.root), source_dir(layout.root)
    files = {layout.method_sources(m): method_sources(m, package_dir) for m in REGISTRY}
    files |= {layout.study_sources(s): study_sources(s, src) for s in STUDIES}
    runnable = [r for r, spec in REGIMES.items() if spec.settings_model is not None]
    files |= {layout.regime_sources(r): regime_sources(r, src) for r in runnable}
    lora = src / "ml" / "lora.py"  # a regime's LoRA task vectors are read as their factors
    files |= {
        layout.regime_merge_sources(r): sorted(
            {lora, *(f for m in params.regimes.methods_of(r) if m in REGISTRY for f in files[layout.method_sources(m)])}
        )
        for r in runnable
    }
    with atomic_path(layout.sources, directory=True) as tmp:
        for out, found in files.items():
            path = tmp / out.relative_to(layout.sources)
            path.parent.mkdir(exist_ok=True)
            write_json(path, digest(found, src))
    return {"files": len(files)}


# ---------------------------------------------------------------- regime
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
    anchors = LazyAnchors(tasks, lambda t: _feature_anchor(params, layout, backbone, seeds[t], torch.device(device)))
    return finetune_trainer(
        params.backbone,
        heads,
        {t: (d.train.inputs, d.train.labels) for t, d in tasks.items()},
        params.finetune,
        seeds=seeds,
        device=torch.device(device),
        anchors=anchors,
    )


def _variant_record(params: Params, result, kwargs: dict, tasks: dict, heads: dict, device) -> dict:
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


def _save_variant(
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


def regime(params: Params, name: str, layout: Layout = Layout()) -> dict:
    """Stage regime@<name>: every variant of one training-time regime (mergeflow.ml.regimes; MIMA and ATM make one per
    round count), through the pipeline's own fine-tune from theta0 under each task's probe head (the standard
    fine-tune's, frozen). Writes each variant's task vectors and statistics, its own model when it has one, and
    metrics/regime/<name>.json: the task models' accuracies, the regime model's, per-round norms and cosines.

    After every finished round the run is checkpointed (atomically) under checkpoints/; a run killed mid-regime
    starts again from its last finished round, and a finished one removes its checkpoints."""
    from mergeflow.ml.regimes import REGISTRY as REGIMES, save_checkpoint
    from mergeflow.ml.regimes import PoolTrainer

    params.check_regime(name)
    cfg = params.regimes.config(name)
    device = _setup(params, params.seed)
    tasks = _load_tasks(params, layout)
    theta0 = load_state_dict(layout.pretrained)
    heads = _load_heads(params, layout, build_backbone(params.backbone).num_features, tasks)
    variants_out: dict[str, dict] = {}
    variant_times: dict[str, dict] = {}
    # a round's fine-tunes run at once, one process each up to the CPU threads this stage has (one thread each);
    # on a GPU, one after the other in this process
    threads = params.threads() or torch.get_num_threads()
    workers = 1 if device.type == "cuda" else min(len(tasks), threads)
    build = functools.partial(regime_trainer, params, layout, str(device))
    with (
        Timer() as timer,
        PoolTrainer(build, workers, max(1, threads // workers), params.runtime.deterministic)
        if workers > 1
        else contextlib.nullcontext(build()) as train,
    ):
        print(
            f"regime {name}: each round's {len(tasks)} fine-tunes on {workers} "
            f"{'processes' if workers > 1 else 'process'} ({device})",
            flush=True,
        )
        results = {}
        for variant, kwargs in cfg.variants(name, params.finetune.steps).items():
            checkpoint = layout.regime_checkpoint(name, variant)
            identity = regime_identity(params, name, variant, kwargs, layout)
            round_times: list[float] = []
            clock = [time.perf_counter()]

            def on_round_end(ckpt, checkpoint=checkpoint, identity=identity, round_times=round_times, clock=clock):
                save_checkpoint(checkpoint, ckpt, identity=identity)
                now = time.perf_counter()
                round_times.append(now - clock[0])
                clock[0] = now

            resume = resume_from(checkpoint, identity)
            if resume is not None:
                print(f"regime {variant}: resuming after round {resume.round} from {checkpoint}", flush=True)
                round_times.extend([float("nan")] * resume.round)  # those rounds' times were another process's
            with Timer() as variant_timer:
                result = REGIMES[name](theta0, list(tasks), train, on_round_end=on_round_end, resume=resume, **kwargs)

            variants_out[variant] = _variant_record(params, result, kwargs, tasks, heads, device)
            # apart from the metrics, whose bytes must not change with the machine's load (logs/timing)
            variant_times[variant] = {"wall_time_s": variant_timer.seconds, "rounds_wall_time_s": round_times}
            results[variant] = result
    with atomic_path(layout.regime(name), directory=True) as tmp:
        for variant, result in results.items():
            _save_variant(params, layout, tmp / variant, name, variant, result, theta0, variants_out[variant], cfg)
    metrics = {"regime": name, "paper": REGIMES[name].paper, "variants": variants_out}
    write_json(layout.metrics("regime", name), metrics)
    write_json(layout.timing("regime", name), timer.record() | {"variants": variant_times})
    for variant in results:
        layout.regime_checkpoint(name, variant).unlink(missing_ok=True)
    return metrics
