"""The stages that make the task models and what the merges read: the data (prepare), the backbone (pretrain),
each fine-tune, the task vectors, the statistics, each merge's sources and the training-time regimes. Each reads
and writes only the paths in ``Layout`` and validates its inputs before writing."""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import shutil
import time

import torch

from mergeflow.ml import data as data_mod

from mergeflow.pipeline import imports
from mergeflow.config import Params, task_seed as _task_seed
from mergeflow.ml.data import load_tasks as _load_tasks
from mergeflow.core.errors import MergeflowError
from mergeflow.core.io import load_state_dict, save_state_dict, tensor_specs
from mergeflow.core.files import atomic_path, write_json
from mergeflow.core.layout import Layout
from mergeflow.ml.merging import REGISTRY
from mergeflow.core.parent_death import process_pool
from mergeflow.core.hub import hub_access
from mergeflow.ml.models import (
    backbone_metadata,
    backbone_state,
    build_backbone,
    new_backbone,
    load_backbone,
    load_heads as _load_heads,
    select_device,
)
from mergeflow.ml.regimes import regime_identity, resume_from
from mergeflow.report.plots import plot_cosine_heatmap
from mergeflow.ml.task_vectors import statistics as vector_statistics, task_vector
from mergeflow.ml.training import (
    Timer,
    extract_features,
    finetune as finetune_loop,
    head_predictions,
    head_score,
    pretrain as pretrain_loop,
    seed_everything,
)
from mergeflow.pipeline._finetune import feature_anchor as _feature_anchor, frozen_head, imported_model, save_finetune
from mergeflow.pipeline._regime import regime_trainer, save_variant, variant_record
from mergeflow.params import statistics_readers


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
        head, head_record = frozen_head(params, task, data, feats, seed, device)
        probe_acc = {s: head_score(head, feats[s], data.split(s).labels, data.metric) for s in ("val", "test")}
        epoch_states: dict[int, dict] = {}
        if task in params.finetune.checkpoints:
            model, curve = imported_model(params, task, backbone), None
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
    save_finetune(params, task, layout, data, model, head, predictions, epoch_states, curve)
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
# what the statistics folder holds when nothing reads it (a note, not an empty folder DVC warns about)
NO_STATISTICS = (
    "No method of merge.methods reads per-task statistics (Fisher merging, RegMean), so the stage computed none.\n"
    "Add one to merge.methods and `dvc repro` computes them here.\n"
)


def statistics(params: Params, layout: Layout = Layout()) -> dict:
    """Per task, what data-aware methods read (mergeflow.ml.statistics): the diagonal Fisher of the fine-tuned model
    with its head (labels sampled from the model, and the true labels) and the Gram of every linear layer's inputs,
    on the first statistics.examples training examples. Once per task here, so that a merge hyperparameter change
    does not recompute them. When no method of merge.methods reads them, nothing is computed: the folder holds a
    note saying so (the stage follows sources/statistics.json, which says whether any does)."""
    from mergeflow.ml.metrics import is_regression
    from mergeflow.ml.statistics import fisher_diagonal, input_grams

    if not statistics_readers(params):
        with Timer() as timer, atomic_path(layout.statistics(params.suite.tasks[0]).parent, directory=True) as tmp:
            (tmp / "README.md").write_text(NO_STATISTICS)
        metrics = {"examples": {}, "read_by": []}
        write_json(layout.metrics("statistics"), metrics)
        write_json(layout.timing("statistics"), timer.record() | {"tasks": {}})
        print("statistics: no method of merge.methods reads them; nothing computed", flush=True)
        return metrics
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
    metrics = {"examples": sizes, "read_by": statistics_readers(params)}
    write_json(layout.metrics("statistics"), metrics)
    write_json(layout.timing("statistics"), timer.record() | {"tasks": times})
    return metrics


# ---------------------------------------------------------------- sources
def sources(params: Params, layout: Layout = Layout()) -> dict:
    """What each merge's, study's and regime's bytes follow from (mergeflow.pipeline.sources):
    sources/merge/<method>.json, sources/study/<name>.json, sources/regime/<name>.json for every registered one, and
    sources/regime_merge/<name>.json for each regime with the methods params.yaml gives it (regimes.methods), and
    sources/replicate.json for merge.methods (what every replicate@<seed> merges with), each {file: md5}: a change to
    one method re-runs only the merges that use it; and sources/statistics.json, whether any method of merge.methods
    reads the statistics stage's outputs."""
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
    merged = {f for m in params.merge.methods if m in REGISTRY for f in files[layout.method_sources(m)]}
    files[layout.replicate_sources] = sorted(merged)
    with atomic_path(layout.sources, directory=True) as tmp:
        # whether the statistics stage has work: a yes or no, so that swapping one reader for another re-runs nothing
        write_json(tmp / layout.statistics_needed.name, {"needed": bool(statistics_readers(params))})
        for out, found in files.items():
            path = tmp / out.relative_to(layout.sources)
            path.parent.mkdir(exist_ok=True)
            write_json(path, digest(found, src))
    return {"files": len(files)}


# ---------------------------------------------------------------- regime
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

            variants_out[variant] = variant_record(params, result, kwargs, tasks, heads, device)
            # apart from the metrics, whose bytes must not change with the machine's load (logs/timing)
            variant_times[variant] = {"wall_time_s": variant_timer.seconds, "rounds_wall_time_s": round_times}
            results[variant] = result
    with atomic_path(layout.regime(name), directory=True) as tmp:
        for variant, result in results.items():
            save_variant(params, layout, tmp / variant, name, variant, result, theta0, variants_out[variant], cfg)
    metrics = {"regime": name, "paper": REGIMES[name].paper, "variants": variants_out}
    write_json(layout.metrics("regime", name), metrics)
    write_json(layout.timing("regime", name), timer.record() | {"variants": variant_times})
    for variant in results:
        layout.regime_checkpoint(name, variant).unlink(missing_ok=True)
    return metrics
