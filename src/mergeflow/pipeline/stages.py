"""The pipeline's stages as plain functions: ``mergeflow <stage>`` calls them, DVC runs those commands, and the
Prefect flow runs the same commands read from dvc.yaml. Each stage reads and writes only the paths in ``Layout``
(dvc.yaml declares the same paths; a test checks that they agree) and validates its inputs before writing."""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import time

import torch

from mergeflow.ml import data as data_mod

from mergeflow.pipeline import imports
from mergeflow.config import Params, task_seed as _task_seed
from mergeflow.ml.data import load_tasks as _load_tasks
from mergeflow.core.errors import MergeflowError
from mergeflow.ml.evaluation import MultiTaskEvaluator, mean, normalized, normalized_average
from mergeflow.core.io import LazyStateDict, atomic_path, load_state_dict, read_json, save_state_dict, tensor_specs, write_json
from mergeflow.core.layout import Layout, MergeRun
from mergeflow.ml.merging import DATA, REGISTRY
from mergeflow.ml.merging import BASE_PREFIX, store_bytes
from mergeflow.pipeline.binding import bind_data
from mergeflow.ml.merging.search import negation_search, search
from mergeflow.core.parent_death import process_pool
from mergeflow.ml.models import Backbone, backbone_metadata, backbone_state, build_backbone, hub_access, load_backbone, load_heads as _load_heads, select_device
from mergeflow.ml.lora import split_factors
from mergeflow.ml.regimes import regime_identity, resume_from
from mergeflow.core.reproducibility.machine import environment_markdown, recorded
from mergeflow.report.plots import plot_accuracy_heatmap, plot_averages, plot_cosine_heatmap, plot_learned_coefficients, plot_merge_search
from mergeflow.report.summary import SPREAD_SDS, headline_metrics, negation_markdown, over_seeds, pooled_sd, regime_headline, seeds_markdown, summary_csv, summary_markdown, summary_rows, validation_records
from mergeflow.ml.task_vectors import load_task_vectors as _load_task_vectors, materialise as _materialise, save_task_vectors, state_bytes as _bytes, statistics as vector_statistics, task_vector
from mergeflow.ml.training import FeatureAnchor, Timer, accuracy, extract_features, finetune as finetune_loop, fit_probe, pretrain as pretrain_loop, seed_everything


def _setup(params: Params, seed: int) -> torch.device:
    seed_everything(seed, params.threads())
    return select_device(params.runtime.device)


EVALUATED = ("val", "test")  # what merges read: hyperparameters chosen on val, tested on test


# ---------------------------------------------------------------- prepare
def prepare(params: Params, layout: Layout = Layout()) -> dict:
    """Generate (embedded) or convert (imagefolder, torchvision) every task, and the pretraining corpus."""
    suite = params.suite
    for task in suite.tasks:  # a missing dataset or folder, found before any worker starts (as mergeflow check finds it)
        data_mod.check_layout(suite, task, params.downloads())
    imports.sync(params, layout.root)  # each fine-tune's dependency on its imported checkpoint (a new task's too)
    with Timer() as timer:
        # generation is single-threaded numpy: the corpus and the tasks are built in parallel processes (each
        # from its own seed, so the result does not depend on the number of workers). Each worker saves its own
        # file and returns only the sizes: this process never holds a task's arrays. At 224 pixels a task is
        # gigabytes: no more workers than half the memory holds.
        workers = min(len(suite.tasks) + 1, params.threads() or os.cpu_count() or 1)
        with contextlib.suppress(ValueError, OSError, AttributeError):
            memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            workers = max(1, min(workers, memory // 2 // max(1, data_mod.task_bytes(suite))))
        build_corpus = params.backbone.pretrained is None
        with process_pool(workers) as pool:  # its workers die with the stage, killed or not
            try:
                corpus_job = pool.submit(data_mod.write_pretraining_corpus, layout.pretrain_corpus, suite, params.seed) if build_corpus else None
                jobs = {t: pool.submit(data_mod.write_task, layout.task_data(t), suite, t, _task_seed(params.seed, t), download=params.downloads()) for t in suite.tasks}
                sizes = {t: job.result() for t, job in jobs.items()}
                pretrain_images = corpus_job.result() if corpus_job else 0
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)  # one task failed: start no other
                raise
        if not build_corpus:  # a pretrained backbone: an empty corpus
            data_mod.write_pretraining_corpus(layout.pretrain_corpus, suite, params.seed, build=False)
    metrics = {"tasks": sizes, "pretrain_images": pretrain_images}
    write_json(layout.metrics("prepare"), metrics)
    write_json(layout.timing("prepare"), timer.record())
    return metrics


# ---------------------------------------------------------------- pretrain
def pretrain(params: Params, layout: Layout = Layout()) -> dict:
    """Train the backbone on the formula-driven corpus, or load real pretrained weights (a file or the hub)."""
    device = _setup(params, params.seed)
    with Timer() as timer:
        if params.backbone.pretrained is not None:
            with hub_access(params.downloads()):
                backbone = Backbone(params.backbone, pretrained=True)
            curve, head_acc = [], {}
        else:
            corpus = load_state_dict(layout.pretrain_corpus, check=False)
            data_mod.check_corpus(tensor_specs(corpus), str(layout.pretrain_corpus), params.suite.image_size, labels=corpus)
            images = corpus.pop("images")
            if len(images) == 0:
                raise MergeflowError(f"{layout.pretrain_corpus}: the pretraining corpus is empty (suite.pretrain_images = 0)")
            backbone = build_backbone(params.backbone)
            heads, curve_obj = pretrain_loop(backbone, images, corpus, params.pretrain, seed=params.seed, device=device)
            curve = curve_obj.records()
            probe_n = min(2000, len(images))
            feats = extract_features(backbone, images[-probe_n:], batch_size=params.runtime.eval_batch_size, device=device)
            head_acc = {name: float((heads[name].cpu()(feats).argmax(1) == y[-probe_n:]).float().mean()) for name, y in corpus.items()}
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


# ---------------------------------------------------------------- finetune
def _feature_anchor(params: Params, layout: Layout, backbone: Backbone, seed: int, device: torch.device) -> FeatureAnchor | None:
    cfg = params.finetune.preserve_features
    if cfg.weight == 0:
        return None
    lazy_corpus = LazyStateDict(layout.pretrain_corpus)
    data_mod.check_corpus(lazy_corpus.specs(), str(layout.pretrain_corpus), params.suite.image_size)
    corpus = lazy_corpus["images"]
    if len(corpus) == 0:
        raise MergeflowError(f"{layout.pretrain_corpus}: finetune.preserve_features needs pretraining-corpus images and this corpus is empty (a pretrained backbone has none); set finetune.preserve_features.weight to 0")
    return FeatureAnchor.build(backbone, corpus, cfg, seed=seed, device=device, eval_batch_size=params.runtime.eval_batch_size)


def _frozen_head(params: Params, task: str, data: data_mod.TaskData, feats: dict[str, torch.Tensor], seed: int, device: torch.device):
    """The task's frozen head and its record: a linear probe fitted on theta0's features (C chosen on val), or
    CLIP's zero-shot head from the task's class names and prompt templates."""
    if params.finetune.head == "zeroshot":
        from mergeflow.ml import zeroshot
        from mergeflow.ml.data import benchmark

        # the papers' templates for a benchmark dataset; your own data: CLIP's generic one
        templates = benchmark.templates(task) if params.suite.source == "torchvision" else list(benchmark.GENERIC_TEMPLATES)
        with hub_access(params.downloads()):
            text = zeroshot.text_model(params.backbone, seed=seed)
        head = zeroshot.zeroshot_head(text, zeroshot.open_clip_architecture(params.backbone.model), data.classes, templates, device=device)
        return head, {"head": "zeroshot", "templates": len(templates)}
    probe = fit_probe(feats["train"], data.train.labels, feats["val"], data.val.labels, params.probe, seed=seed, num_classes=len(data.classes))
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
    state = checkpoints.read_checkpoint(path, reference=theta0, projection_from=theta0 if params.backbone.embedding == "clip" else None, source=f"finetune.checkpoints.{task}: {spec}")
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
        feats = {s: extract_features(backbone, data.split(s).images, batch_size=bs, device=device) for s in featured}
        head, head_record = _frozen_head(params, task, data, feats, seed, device)
        probe_acc = {s: float((head(feats[s]).argmax(1) == data.split(s).labels).float().mean()) for s in ("val", "test")}
        epoch_states: dict[int, dict] = {}
        if task in params.finetune.checkpoints:
            model, curve = _imported(params, task, backbone), None
        else:
            model = copy.deepcopy(backbone)

            def keep_epoch(epoch: int) -> None:
                if params.finetune.checkpoint_every_epoch:
                    epoch_states[epoch] = backbone_state(model)

            anchor = _feature_anchor(params, layout, backbone, seed, device)
            curve = finetune_loop(model, head, data.train.images, data.train.labels, params.finetune, seed=seed, device=device, desc=f"finetune {task}", on_epoch_end=keep_epoch, anchor=anchor)
        individual = {s: accuracy(model, head, data.split(s).images, data.split(s).labels, batch_size=bs, device=device) for s in ("val", "test")}
    # a path changed in params.yaml: DVC records the new file after the run (written once the inputs proved good)
    imports.sync(params, layout.root, [task])
    meta = backbone_metadata(params.backbone) | {"task": task}
    save_state_dict(layout.finetuned(task), backbone_state(model.cpu()), meta)
    save_state_dict(layout.head(task), {"weight": head.weight.detach().cpu(), "bias": head.bias.detach().cpu()}, {"task": task, "classes": json.dumps(data.classes)})
    with atomic_path(layout.epochs(task), directory=True) as tmp:
        for epoch, state in epoch_states.items():
            save_state_dict(tmp / f"epoch{epoch:03d}.safetensors", state, meta | {"epoch": str(epoch)})
        # what the folder holds, also when finetune.checkpoint_every_epoch is off (DVC warns on an empty output)
        write_json(tmp / "epochs.json", {"task": task, "checkpoint_every_epoch": params.finetune.checkpoint_every_epoch, "epochs": sorted(epoch_states)})
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
        tvs = {t: task_vector(pretrained, load_state_dict(layout.finetuned(t)), pretrained_name=str(layout.pretrained), finetuned_name=str(layout.finetuned(t))) for t in params.suite.tasks}
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
    from mergeflow.ml.statistics import fisher_diagonal, input_grams

    device = _setup(params, params.seed)
    tasks = _load_tasks(params, layout, ("train",))  # the statistics are of training examples
    heads = _load_heads(params, layout, build_backbone(params.backbone).num_features, tasks)
    sizes, times = {}, {}
    with Timer() as timer, atomic_path(layout.statistics(params.suite.tasks[0]).parent, directory=True) as tmp:
        for t, data in tasks.items():
            with Timer() as task_timer:
                model = load_backbone(params.backbone, layout.finetuned(t))
                images, labels = data.train.images[: params.statistics.examples], data.train.labels[: params.statistics.examples]
                generator = torch.Generator().manual_seed(_task_seed(params.seed, t))
                out = {}
                for kind, given in (("fisher_sampled", None), ("fisher_empirical", labels)):
                    out |= {f"{kind}/{k}": v for k, v in fisher_diagonal(model, heads[t], images, given, generator=generator, device=device).items()}
                out |= {f"gram/{k}": v for k, v in input_grams(model, images, batch_size=params.runtime.eval_batch_size, device=device).items()}
                save_state_dict(tmp / layout.statistics(t).name, out, {"task": t, "examples": str(len(images))})
            sizes[t], times[t] = len(images), task_timer.seconds
    metrics = {"examples": sizes}
    write_json(layout.metrics("statistics"), metrics)
    write_json(layout.timing("statistics"), timer.record() | {"tasks": times})
    return metrics


# ---------------------------------------------------------------- sources
def sources(params: Params, layout: Layout = Layout()) -> dict:
    """What each merge's bytes follow from (mergeflow.pipeline.sources): sources/merge/<method>.json, {file: md5}, for every
    registered method (params aside: the stage re-runs on code changes only)."""
    from mergeflow.pipeline.sources import digest, merging_dir, method_sources

    package_dir = merging_dir(layout.root)
    with atomic_path(layout.sources, directory=True) as tmp:
        for method in REGISTRY:
            path = tmp / layout.method_sources(method).relative_to(layout.sources)
            path.parent.mkdir(exist_ok=True)
            write_json(path, digest(method_sources(method, package_dir), package_dir))
    return {"files": len(REGISTRY)}


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
    return finetune_trainer(params.backbone, heads, {t: (d.train.images, d.train.labels) for t, d in tasks.items()}, params.finetune, seeds=seeds, device=torch.device(device), anchors=anchors)


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
    bs = params.runtime.eval_batch_size
    variants_out: dict[str, dict] = {}
    variant_times: dict[str, dict] = {}
    # a round's fine-tunes run at once, one process each up to the CPU threads this stage has (one thread each);
    # on a GPU, one after the other in this process
    threads = params.threads() or torch.get_num_threads()
    workers = 1 if device.type == "cuda" else min(len(tasks), threads)
    build = functools.partial(regime_trainer, params, layout, str(device))
    with Timer() as timer, PoolTrainer(build, workers, max(1, threads // workers), params.runtime.deterministic) if workers > 1 else contextlib.nullcontext(build()) as train:
        print(f"regime {name}: each round's {len(tasks)} fine-tunes on {workers} {'processes' if workers > 1 else 'process'} ({device})", flush=True)
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

            def accuracies(state, task):
                model = build_backbone(params.backbone, split_factors(state)[0])
                return {s: accuracy(model, heads[task], tasks[task].split(s).images, tasks[task].split(s).labels, batch_size=bs, device=device) for s in ("val", "test")}

            individual = {t: accuracies(result.task_states[t], t) for t in tasks}
            own = None
            if result.model is not None:
                own_acc = {s: {t: accuracies(result.model, t)[s] for t in tasks} for s in ("val", "test")}
                own = {"accuracy": own_acc, "average": {s: mean(own_acc[s].values()) for s in own_acc}}
            variants_out[variant] = {
                "hyperparameters": kwargs,
                "individual": individual,
                "individual_average": {s: mean(individual[t][s] for t in tasks) for s in ("val", "test")},
                "model": own,
                "rounds": [
                    {"round": r.round, "update_norms": r.update_norms, "update_cosines": _pairs(r.update_cosines), "task_vector_norms": r.task_vector_norms, "task_vector_cosines": _pairs(r.task_vector_cosines)}
                    for r in result.rounds
                ],
            }
            # apart from the metrics, whose bytes must not change with the machine's load (logs/timing)
            variant_times[variant] = {"wall_time_s": variant_timer.seconds, "rounds_wall_time_s": round_times}
            results[variant] = result
    with atomic_path(layout.regime(name), directory=True) as tmp:
        for variant, result in results.items():
            meta = {"regime": name, "variant": variant}
            adapter = cfg.adapter(variants_out[variant]["hyperparameters"])
            tvs, storage = save_task_vectors(tmp / variant / "vectors", theta0, result.task_states, adapter=adapter, meta=meta, pretrained_name=str(layout.pretrained))
            variants_out[variant]["storage_bytes"] = storage
            write_json(tmp / variant / "vectors" / "stats.json", vector_statistics(theta0, tvs))
            if result.model is not None:
                save_state_dict(tmp / variant / "model.safetensors", result.model, backbone_metadata(params.backbone) | meta)
            for record in result.rounds:
                for t, update in (record.updates or {}).items():
                    save_state_dict(tmp / variant / "updates" / f"round{record.round}" / f"{t}.safetensors", update, meta | {"task": t, "round": str(record.round)})
    metrics = {"regime": name, "paper": REGIMES[name].paper, "variants": variants_out}
    write_json(layout.metrics("regime", name), metrics)
    write_json(layout.timing("regime", name), timer.record() | {"variants": variant_times})
    for variant in results:
        layout.regime_checkpoint(name, variant).unlink(missing_ok=True)
    return metrics


def regime_merge(params: Params, name: str, layout: Layout = Layout()) -> dict:
    """Stage regime_merge@<name>: each variant of regime <name> merged with each of its methods, the
    hyperparameters chosen on validation as for the standard regime (merge.<method> sets the grids), then tested;
    the regime's own name in its methods evaluates its own model (ATM's theta(R), MIMA's uniform average)."""
    params.check_regime(name)
    cfg = params.regimes.config(name)
    device = _setup(params, params.seed)
    regime_metrics = read_json(layout.metrics("regime", name))
    out: dict[str, dict] = {}
    with Timer() as timer:
        tasks = _load_tasks(params, layout, EVALUATED)
        heads = _load_heads(params, layout, build_backbone(params.backbone).num_features, tasks)
        ft = {t: read_json(layout.metrics("finetune", t)) for t in params.suite.tasks}
        for variant in cfg.variants(name, params.finetune.steps):
            if variant not in regime_metrics["variants"]:
                raise MergeflowError(f"{layout.metrics('regime', name)}: no variant '{variant}' (run regime@{name} again)")
            for method in params.regimes.methods_of(name):
                run = layout.merge_run(method, name, variant)
                if method == name:
                    own = regime_metrics["variants"][variant]["model"]
                    if own is None:
                        raise MergeflowError(f"regimes.{name}.methods: regime {name} has no model of its own to evaluate")
                    acc = own["accuracy"]["test"]
                    individual = {t: ft[t]["individual"]["test"] for t in params.suite.tasks}
                    evaluation = {
                        "method": method, "kind": "regime_model", "hyperparameters": regime_metrics["variants"][variant]["hyperparameters"], "searched": {},
                        "accuracy": acc, "average": mean(acc.values()), "normalized": normalized(acc, individual),
                        "normalized_average": normalized_average(acc, individual), "storage_models": 1.0,
                    }
                    write_json(run.evaluation, evaluation)
                else:
                    _, evaluation = merge_and_evaluate(params, run, layout, tasks, heads, device)
                out[f"{variant}/{method}"] = evaluation
    write_json(layout.timing("regime_merge", name), timer.record())
    return out


# ---------------------------------------------------------------- merge
def merge(params: Params, method: str, layout: Layout = Layout()) -> dict:
    """Stage merge@<method>: merge the standard regime's task vectors with one method (``merge_and_evaluate``)."""
    params.check_method(method)
    device = _setup(params, params.seed)
    with Timer() as timer:
        tasks = _load_tasks(params, layout, EVALUATED)
        heads = _load_heads(params, layout, build_backbone(params.backbone).num_features, tasks)
        metrics, evaluated = merge_and_evaluate(params, layout.merge_run(method), layout, tasks, heads, device)
    learning = {"learning": evaluated["learning"]} if "learning" in evaluated else {}
    write_json(layout.timing("merge", method), timer.record() | {"evaluate_wall_time_s": evaluated["wall_time_s"], "ended": time.time()} | learning)
    return metrics


def merge_and_evaluate(params: Params, run: MergeRun, layout: Layout, tasks, heads, device) -> tuple[dict, dict]:
    """Merge ``run.vectors`` with ``run.method``; every grid point is scored on the validation split and the best
    is kept, then evaluated on test (``evaluate``), in the same process: a stage's start costs more than a small
    model's merge. Returns the choice's metrics and the evaluation's.

    A per-task method's output is its store (each task's model is rebuilt from it); task negation's output is the
    coefficient chosen for each task.
    """
    method = run.method
    spec = REGISTRY[method]
    overrides = params.merge.overrides(method)
    pretrained, tvs = _load_task_vectors(params, layout, run.vectors)
    data = None
    if spec.reads:
        data = bind_data(params, spec, layout, tasks, heads, device)
        spec = spec.with_data(data)
    # the candidates are compared under bf16 autocast on CUDA (float32 on the CPU); the chosen one's test is float32
    on_val = MultiTaskEvaluator(params.backbone, tasks, heads, "val", device, params.runtime.eval_batch_size, bf16=True)
    try:
        if spec.kind == "negation":
            pretrained_acc = on_val(_materialise(pretrained))  # a dict of the tensors already read, when held in memory
            negation = negation_search(spec, overrides, pretrained, tvs, on_val, pretrained_acc)
        else:
            best, output, curve, per_task = search(spec, overrides, pretrained, tvs, on_val, params.merge.search)
    except ValueError as err:
        raise MergeflowError(str(err)) from None
    fixed, grid = spec.search_space(overrides)
    metrics = {"method": method, "kind": spec.kind, "paper": spec.paper, "grid": grid}
    if spec.kind == "negation":
        output = {f"lam/{t}": torch.tensor(float(r["chosen"]["lam"])) for t, r in negation.items()}
        metrics |= {"hyperparameters": fixed, "searched": {}, "pretrained_val_accuracy": pretrained_acc, "per_task": negation}
    else:
        metrics |= {
            "hyperparameters": best["hyperparameters"] | per_task["chosen"],
            "searched": {k: best["hyperparameters"][k] for k in grid} | per_task["chosen"],
            "val_accuracy": best["accuracy"],
            "val_average": best["average"],
            "val_curve": curve,
            "per_task_curves": per_task["curves"],
        }
        if spec.kind in ("per_task", "routed"):
            uses_theta0 = not any(k.startswith(BASE_PREFIX) for k in output)
            model_bytes = _bytes(pretrained)
            metrics |= {"storage_bytes": store_bytes(output) + (model_bytes if uses_theta0 else 0), "model_bytes": model_bytes}
    if data is not None:
        metrics["reads"] = spec.reads
    if data is not None and data.learned:  # the chosen candidate's coefficients (one record per candidate, in order)
        metrics["learned"] = data.learned[curve.index(best)]
    save_state_dict(run.merged, output, {"method": method, "kind": spec.kind, "hyperparameters": json.dumps(metrics["hyperparameters"])})
    with atomic_path(run.search_plot) as tmp:
        (plot_learned_coefficients if "learned" in metrics else plot_merge_search)(metrics, tmp)
    write_json(run.choice, metrics)
    write_json(run.search_log, validation_records(metrics, spec.coefficient))
    evaluation = evaluate(params, method, layout, tasks=tasks, heads=heads, run=run)
    if data is not None and data.timing:
        evaluation["learning"] = data.timing
    return metrics, evaluation


# ---------------------------------------------------------------- evaluate
def evaluate(params: Params, method: str, layout: Layout = Layout(), *, tasks=None, heads=None, run: MergeRun | None = None) -> dict:
    """Test accuracy on every task, absolute and normalized by the (standard regime's) individual model
    (per-task methods: each task with its own rebuilt model; task negation: the negated task's accuracy against
    the others'). ``run``: a regime's merge (default: the standard regime's, merge@<method>)."""
    run = run or layout.merge_run(method)
    spec = REGISTRY[method]
    device = _setup(params, params.seed)
    chosen = read_json(run.choice)
    ft = {t: read_json(layout.metrics("finetune", t)) for t in params.suite.tasks}
    with Timer() as timer:
        output = load_state_dict(run.merged)
        tasks = tasks or _load_tasks(params, layout, EVALUATED)
        heads = heads or _load_heads(params, layout, build_backbone(params.backbone).num_features, tasks)
        evaluator = MultiTaskEvaluator(params.backbone, tasks, heads, "test", device, params.runtime.eval_batch_size)
        if spec.kind == "negation":
            pretrained, tvs = _load_task_vectors(params, layout, run.vectors)
            per_task = {}
            for t in params.suite.tasks:
                lam = round(float(output[f"lam/{t}"]), 6)  # stored as a float32 tensor
                acc = evaluator(spec(pretrained, {t: tvs[t]}, **{**chosen["hyperparameters"], "lam": lam}))
                others = [o for o in params.suite.tasks if o != t]
                per_task[t] = {
                    "lam": lam,
                    "target": acc[t],
                    "control": mean(acc[o] for o in others),
                    "pretrained_target": ft[t]["probe"]["test"],
                    "pretrained_control": mean(ft[o]["probe"]["test"] for o in others),
                }
        elif spec.kind == "per_task":
            pretrained = load_state_dict(layout.pretrained)
            acc = evaluator.per_task(lambda t: spec.reconstruct(output, pretrained, t), spec.feature_maps(output))
        elif spec.kind == "routed":
            acc = evaluator.network(lambda backbone: spec.network(output, backbone))
        else:
            acc = evaluator(output)
    metrics = {"method": method, "kind": spec.kind, "hyperparameters": chosen["hyperparameters"], "searched": chosen["searched"]}
    if spec.kind == "negation":
        metrics |= {"per_task": per_task, "average": {k: mean(r[k] for r in per_task.values()) for k in ("target", "control", "pretrained_target", "pretrained_control")}}
    else:
        individual = {t: ft[t]["individual"]["test"] for t in params.suite.tasks}
        metrics |= {
            "accuracy": acc,
            "average": mean(acc.values()),
            "normalized": normalized(acc, individual),
            "normalized_average": normalized_average(acc, individual),
            "storage_models": chosen["storage_bytes"] / chosen["model_bytes"] if "storage_bytes" in chosen else 1.0,
        }
    write_json(run.evaluation, metrics)
    return metrics | {"wall_time_s": timer.seconds}


# ---------------------------------------------------------------- report
def regime_evaluations(params: Params, layout: Layout) -> dict[str, dict]:
    """Each regime variant's own task models' test accuracies and its methods' evaluations:
    {variant: {"regime": name, "individual": {task: acc}, "evaluations": {method: metrics/.../evaluate/<m>.json},
    "val_averages": {method: its choice's validation average}}}."""
    out = {}
    for name in params.regimes.run:
        cfg = params.regimes.config(name)
        measured = read_json(layout.metrics("regime", name))["variants"]
        for variant in cfg.variants(name, params.finetune.steps):
            out[variant] = {
                "regime": name,
                "individual": {t: measured[variant]["individual"][t]["test"] for t in params.suite.tasks},
                "evaluations": {m: read_json(layout.merge_run(m, name, variant).evaluation) for m in params.regimes.methods_of(name)},
                "val_averages": {m: read_json(layout.merge_run(m, name, variant).choice).get("val_average") for m in params.regimes.methods_of(name)},
            }
    return out


def data_labels() -> dict[str, str]:
    """Per method, the summary's "data" column: what it reads besides the weights (merging.DATA)."""
    return {name: DATA[spec.reads] for name, spec in REGISTRY.items()}


def report(params: Params, layout: Layout = Layout()) -> dict:
    """Summary table (Markdown, CSV, JSON), the accuracy heatmap and the sorted averages; the headline metrics
    (metrics/headline/, a small file per method) that `dvc metrics show`, `dvc exp show` and `dvc metrics diff`
    compare. The standard regime's rows come first; each training-time regime's variant adds its individual models
    and its methods (the regime column)."""
    tasks = params.suite.tasks
    ft = {t: read_json(layout.metrics("finetune", t)) for t in tasks}
    ev = {m: read_json(layout.metrics("evaluate", m)) for m in params.merge.methods}
    negations = {m: e for m, e in ev.items() if e["kind"] == "negation"}
    rows = summary_rows(tasks, ft, {m: e for m, e in ev.items() if m not in negations}, data=data_labels())
    headline = headline_metrics(rows, ev, {m: read_json(layout.metrics("merge", m)).get("val_average") for m in ev})
    for variant, r in regime_evaluations(params, layout).items():
        variant_rows = summary_rows(tasks, ft, r["evaluations"], regime=variant, individual_models=r["individual"], data=data_labels())
        rows += variant_rows
        headline |= regime_headline(variant, variant_rows, r["evaluations"], r["val_averages"])
    labelled = [r if r["regime"] == "standard" else r | {"method": f"{r['method']} ({r['regime']})"} for r in rows]
    spread = seed_spread(params, layout)
    for name, entry in spread.items():  # with more seeds: each name's mean and spread beside the run's own
        headline[name] |= {"seeds": entry["seeds"], "test_avg_mean": entry["mean"], "test_avg_sd": entry["sd"]}
    with atomic_path(layout.results, directory=True) as tmp:
        seeds_section = seeds_markdown(spread, [params.seed, *params.seeds]) if spread else ""
        # the environments of the stages so far (provenance.json, not a declared dependency: each stage's end,
        # this one's included, rewrites it)
        environments = environment_markdown({a: r for a, r in recorded(layout.root).items() if a not in ("report", "track")})
        (tmp / "summary.md").write_text(summary_markdown(rows, tasks) + seeds_section + "".join(negation_markdown(m, e, tasks) for m, e in negations.items()) + environments)
        (tmp / "summary.csv").write_text(summary_csv(rows, tasks))
        write_json(tmp / "summary.json", {"rows": rows, "negation": negations} | ({"seeds": spread, "pooled_sd": pooled_sd(spread)} if spread else {}))
        write_json(tmp / "averages.json", [{"method": r["method"], "regime": r["regime"], "test_avg": round(100 * r["average"], 2)} for r in labelled])
        plot_accuracy_heatmap(labelled, tasks, tmp / "accuracy.png")
        plot_averages(labelled, tmp / "averages.png")
    with atomic_path(layout.headline, directory=True) as tmp:
        for name, entry in headline.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            write_json(tmp / f"{name}.json", entry)
    return {"rows": rows, "negation": negations, "headline": headline}


# ---------------------------------------------------------------- replicate
def replicate(params: Params, seed: int, layout: Layout = Layout()) -> dict:
    """Stage replicate@<seed>: the fine-tunes and merges again with another seed (params.seeds), on the run's data
    and pretrained backbone: every task's probe and fine-tune, the task vectors (and statistics, for the data-aware
    methods), every method of merge.methods, under replicates/<seed>/ (Layout.replicate); then the seed's headline
    (individual, probe, each method's test average) in metrics/replicates/<seed>.json, which the report sets beside
    the run's own."""
    from mergeflow.ml.merging import REGISTRY as METHODS

    params.check_replicate(seed)
    seeded = params.model_copy(update={"seed": seed})
    at = layout.replicate(seed)
    with Timer() as timer:
        for task in params.suite.tasks:
            finetune(seeded, task, at)
        vectors(seeded, at)
        if any(METHODS[m].reads for m in params.merge.methods):
            statistics(seeded, at)
        for method in params.merge.methods:
            merge(seeded, method, at)
    headline = _headline(params, at)
    write_json(layout.replicate_summary(seed), {"seed": seed, "headline": headline})
    write_json(layout.timing("replicate", str(seed)), timer.record())
    return headline


def _headline(params: Params, layout: Layout) -> dict[str, dict]:
    """The standard regime's headline (probe, individual, each method) from the fine-tunes' and merges' metrics."""
    tasks = params.suite.tasks
    ft = {t: read_json(layout.metrics("finetune", t)) for t in tasks}
    ev = {m: read_json(layout.metrics("evaluate", m)) for m in params.merge.methods}
    rows = summary_rows(tasks, ft, {m: e for m, e in ev.items() if e["kind"] != "negation"}, data=data_labels())
    return headline_metrics(rows, ev, {m: read_json(layout.metrics("merge", m)).get("val_average") for m in ev})


def seed_spread(params: Params, layout: Layout) -> dict[str, dict]:
    """Each headline name's test average over seed and params.seeds (summary.over_seeds); {} with one seed."""
    if not params.seeds:
        return {}
    per_seed = {params.seed: _headline(params, layout)} | {s: read_json(layout.replicate_summary(s))["headline"] for s in params.seeds}
    return over_seeds(per_seed)


# ---------------------------------------------------------------- study
def study(params: Params, name: str, layout: Layout = Layout()) -> dict:
    """Stage study@<name>: one of the papers' analyses (mergeflow.studies) on the pipeline's outputs. Writes
    studies/<name>/report.md (its verdict per claim, tables, figures), metrics/studies/<name>.json (the claims)
    and metrics/verdicts/<name>.json (their counts, in git)."""
    from mergeflow.studies import REGISTRY as STUDIES, StudyContext, against_spread, verdict_table

    params.check_study(name)
    spec = STUDIES[name]
    device = _setup(params, params.seed)
    spread = seed_spread(params, layout)
    with Timer() as timer, atomic_path(layout.study(name), directory=True) as tmp:
        result = spec.fn(StudyContext(params, layout, params.studies.settings(name), tmp, device))
        result.claims = [against_spread(c, pooled_sd(spread), 1 + len(params.seeds), SPREAD_SDS) for c in result.claims]
        (tmp / "report.md").write_text(f"# {spec.title}\n\n{spec.paper}\n\n## Verdicts\n\n{verdict_table(result.claims)}\n{result.body}")
    verdicts = [c.verdict for c in result.claims]
    counts = {"holds": verdicts.count("holds"), "fails": verdicts.count("fails"), "not_measured": verdicts.count("not measured")}
    metrics = {"study": name, "paper": spec.paper} | counts | {"claims": [c.record() for c in result.claims]}
    write_json(layout.metrics("studies", name), metrics)
    write_json(layout.verdicts(name), counts)
    write_json(layout.timing("study", name), timer.record())
    return metrics
