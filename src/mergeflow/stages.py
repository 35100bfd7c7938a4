"""The pipeline's stages as plain functions: ``mergeflow <stage>`` calls them, DVC runs those commands, and the
Prefect flow runs the same commands read from dvc.yaml. Each stage reads and writes only the paths in ``Layout``
(dvc.yaml declares the same paths; a test checks that they agree) and validates its inputs before writing."""

from __future__ import annotations

import copy
import json
import math
import multiprocessing
import os
import time
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from mergeflow import data as data_mod
from mergeflow.config import Params
from mergeflow.errors import MergeflowError
from mergeflow.evaluation import MultiTaskEvaluator, mean, negation_search, negation_markdown, search, summary_csv, summary_markdown, summary_rows
from mergeflow.io import LazyStateDict, atomic_path, check_compatible, load_state_dict, read_json, save_state_dict, tensor_specs, write_json
from mergeflow.merging import REGISTRY
from mergeflow.merging._tensors import BASE_PREFIX, store_bytes
from mergeflow.models import Backbone, backbone_metadata, backbone_state, build_backbone, load_backbone, load_head, select_device
from mergeflow.plots import plot_accuracy_heatmap, plot_averages, plot_cosine_heatmap, plot_merge_search
from mergeflow.summary import headline_metrics, validation_records
from mergeflow.task_vectors import statistics, task_vector
from mergeflow.training import FeatureAnchor, Timer, accuracy, extract_features, finetune as finetune_loop, fit_probe, pretrain as pretrain_loop, seed_everything


@dataclass(frozen=True)
class Layout:
    """Where every stage reads and writes, relative to the repository root."""

    root: Path = Path(".")

    def _p(self, *parts: str) -> Path:
        return self.root.joinpath(*parts)

    @property
    def output_roots(self) -> list[Path]:
        """Every folder a stage writes under (each stage sweeps their leftover temporaries when it starts)."""
        return [self._p(d) for d in ("data", "models", "vectors", "merged", "metrics", "results", "logs")]

    @property
    def pretrain_corpus(self) -> Path:
        return self._p("data", "pretrain.safetensors")

    def task_data(self, task: str) -> Path:
        return self._p("data", "tasks", f"{task}.safetensors")

    @property
    def pretrained(self) -> Path:
        return self._p("models", "pretrained.safetensors")

    def finetuned(self, task: str) -> Path:
        return self._p("models", "finetuned", f"{task}.safetensors")

    def epochs(self, task: str) -> Path:
        return self._p("models", "epochs", task)

    def head(self, task: str) -> Path:
        return self._p("models", "heads", f"{task}.safetensors")

    @property
    def vectors(self) -> Path:
        return self._p("vectors")

    def merged(self, method: str) -> Path:
        return self._p("merged", f"{method}.safetensors")

    def metrics(self, stage: str, name: str | None = None) -> Path:
        return self._p("metrics", f"{stage}.json") if name is None else self._p("metrics", stage, f"{name}.json")

    def log(self, stage: str, name: str | None = None, suffix: str = ".json") -> Path:
        return self._p("logs", f"{stage}{suffix}") if name is None else self._p("logs", stage, f"{name}{suffix}")

    def timing(self, stage: str, name: str | None = None) -> Path:
        """A stage's wall time: apart from its metrics, which later stages depend on, so that re-running a stage
        that gives the same outputs in another time leaves everything downstream up to date."""
        return self.log("timing", stage) if name is None else self._p("logs", "timing", stage, f"{name}.json")

    @property
    def results(self) -> Path:
        return self._p("results")


def _task_seed(seed: int, task: str) -> int:
    return seed * 1_000_003 + zlib.crc32(task.encode())


def _setup(params: Params, seed: int) -> torch.device:
    seed_everything(seed, params.threads())
    return select_device(params.runtime.device)


def _load_tasks(params: Params, layout: Layout) -> dict[str, data_mod.TaskData]:
    return {t: data_mod.load_task(layout.task_data(t), params.suite.image_size) for t in params.suite.tasks}


def _load_heads(params: Params, layout: Layout, num_features: int, tasks: dict[str, data_mod.TaskData]):
    """Each task's head, checked against the backbone's features and the task file's declared classes."""
    return {t: load_head(layout.head(t), num_features, num_classes=len(tasks[t].classes), classes_source=str(layout.task_data(t))) for t in params.suite.tasks}


# Inputs up to this size are read (and checked) once and held in memory: a search reads every tensor once per
# candidate, and re-reading a small model costs more than holding it. Larger inputs are read tensor by tensor.
IN_MEMORY_INPUT_BYTES = 1 << 30


def _load_task_vectors(params: Params, layout: Layout):
    """Lazy (io.LazyStateDict): a merge reads one tensor of each at a time. Keys and shapes are checked from the headers."""
    pretrained = LazyStateDict(layout.pretrained)
    vectors = {t: LazyStateDict(layout.vectors / f"{t}.safetensors") for t in params.suite.tasks}
    for tv in vectors.values():
        # task vectors are float32 whatever the checkpoint's dtype: keys and shapes must agree
        check_compatible(pretrained, tv, reference_name=str(pretrained.path), other_name=str(tv.path), dtypes=False)
    if _bytes(pretrained) + sum(_bytes(tv) for tv in vectors.values()) <= IN_MEMORY_INPUT_BYTES:
        return _materialise(pretrained), {t: _materialise(tv) for t, tv in vectors.items()}
    return pretrained, vectors


# ---------------------------------------------------------------- prepare
def prepare(params: Params, layout: Layout = Layout()) -> dict:
    """Generate (embedded) or convert (imagefolder, torchvision) every task, and the pretraining corpus."""
    with Timer() as timer:
        # generation is single-threaded numpy: the corpus and the tasks are built in parallel processes (each
        # from its own seed, so the result does not depend on the number of workers)
        workers = min(len(params.suite.tasks) + 1, params.threads() or os.cpu_count() or 1)
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            corpus_job = pool.submit(data_mod.build_pretraining_corpus, params.suite, params.seed) if params.backbone.pretrained is None else None
            jobs = {t: pool.submit(data_mod.build_task, params.suite, t, _task_seed(params.seed, t)) for t in params.suite.tasks}
            built = {t: job.result() for t, job in jobs.items()}
            corpus = corpus_job.result() if corpus_job else None
        for t, (arrays, classes) in built.items():
            data_mod.save_task(layout.task_data(t), t, arrays, classes, params.suite.image_size)
        tensors = {k: torch.from_numpy(v) for k, v in (corpus or {}).items()}
        save_state_dict(layout.pretrain_corpus, tensors or {"images": torch.zeros(0, params.suite.image_size, params.suite.image_size, 3, dtype=torch.uint8)}, {"heads": json.dumps(sorted(k for k in tensors if k != "images"))})
    sizes = {t: {s: int(len(arrays[f"{s}_y"])) for s in data_mod.SPLITS} for t, (arrays, _) in built.items()}
    metrics = {"tasks": sizes, "pretrain_images": int(len(tensors.get("images", [])))}
    write_json(layout.metrics("prepare"), metrics)
    write_json(layout.timing("prepare"), timer.record())
    return metrics


# ---------------------------------------------------------------- pretrain
def pretrain(params: Params, layout: Layout = Layout()) -> dict:
    """Train the backbone on the formula-driven corpus, or load real pretrained weights (a file or the hub)."""
    device = _setup(params, params.seed)
    with Timer() as timer:
        if params.backbone.pretrained is not None:
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


def finetune(params: Params, task: str, layout: Layout = Layout()) -> dict:
    """Linear probe on frozen pretrained features, then fine-tune the backbone with that head frozen."""
    params.check_task(task)
    seed = _task_seed(params.seed, task)
    device = _setup(params, seed)
    data = data_mod.load_task(layout.task_data(task), params.suite.image_size)
    backbone = load_backbone(params.backbone, layout.pretrained)
    bs = params.runtime.eval_batch_size
    with Timer() as timer:
        feats = {s: extract_features(backbone, data.split(s).images, batch_size=bs, device=device) for s in data_mod.SPLITS}
        probe = fit_probe(feats["train"], data.train.labels, feats["val"], data.val.labels, params.probe, seed=seed, num_classes=len(data.classes))
        probe_acc = {s: float((probe.head(feats[s]).argmax(1) == data.split(s).labels).float().mean()) for s in ("val", "test")}
        model = copy.deepcopy(backbone)
        epoch_states: dict[int, dict] = {}

        def keep_epoch(epoch: int) -> None:
            if params.finetune.checkpoint_every_epoch:
                epoch_states[epoch] = backbone_state(model)

        anchor = _feature_anchor(params, layout, backbone, seed, device)
        curve = finetune_loop(model, probe.head, data.train.images, data.train.labels, params.finetune, seed=seed, device=device, desc=f"finetune {task}", on_epoch_end=keep_epoch, anchor=anchor)
        individual = {s: accuracy(model, probe.head, data.split(s).images, data.split(s).labels, batch_size=bs, device=device) for s in ("val", "test")}
    meta = backbone_metadata(params.backbone) | {"task": task}
    save_state_dict(layout.finetuned(task), backbone_state(model.cpu()), meta)
    save_state_dict(layout.head(task), {"weight": probe.head.weight.cpu(), "bias": probe.head.bias.cpu()}, {"task": task, "classes": json.dumps(data.classes)})
    with atomic_path(layout.epochs(task), directory=True) as tmp:
        for epoch, state in epoch_states.items():
            save_state_dict(tmp / f"epoch{epoch:03d}.safetensors", state, meta | {"epoch": str(epoch)})
    write_json(layout.log("finetune", task), curve.records())
    metrics = {
        "task": task,
        "steps": len(curve.step),
        "probe": {"C": probe.c, **probe_acc},
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
        stats = statistics(pretrained, tvs)
        with atomic_path(layout.vectors, directory=True) as tmp:
            for t, tv in tvs.items():
                save_state_dict(tmp / f"{t}.safetensors", tv, {"task": t})
            write_json(tmp / "stats.json", stats)
            plot_cosine_heatmap(stats, tmp / "cosine.png")
    summary = {"norms": stats["norms"], "relative_norms": stats["relative_norms"]}
    write_json(layout.metrics("vectors"), summary)
    write_json(layout.timing("vectors"), timer.record())
    return summary


# ---------------------------------------------------------------- merge
def _materialise(state) -> dict:
    return {k: state[k] for k in state}


def _bytes(state) -> int:
    """Size from shapes and dtypes (a lazy file's header): no tensor is read."""
    return sum(math.prod(shape) * torch.empty(0, dtype=dtype).element_size() for shape, dtype in tensor_specs(state).values())


def merge(params: Params, method: str, layout: Layout = Layout()) -> dict:
    """Merge with one method; every grid point is scored on the validation split and the best is kept, then
    evaluated on test (``evaluate``), in the same process: a stage's start costs more than a small model's merge.

    A per-task method's output is its store (each task's model is rebuilt from it); task negation's output is the
    coefficient chosen for each task.
    """
    params.check_method(method)
    spec = REGISTRY[method]
    device = _setup(params, params.seed)
    overrides = params.merge.overrides(method)
    with Timer() as timer:
        pretrained, tvs = _load_task_vectors(params, layout)
        tasks = _load_tasks(params, layout)
        heads = _load_heads(params, layout, build_backbone(params.backbone).num_features, tasks)
        on_val = MultiTaskEvaluator(params.backbone, tasks, heads, "val", device, params.runtime.eval_batch_size)
        try:
            if spec.kind == "negation":
                pretrained_acc = on_val(_materialise(pretrained))  # a dict of the tensors already read, when held in memory
                negation = negation_search(spec, overrides, pretrained, tvs, on_val, pretrained_acc)
            else:
                best, output, curve, per_task = search(spec, overrides, pretrained, tvs, on_val)
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
        if spec.kind == "per_task":
            uses_theta0 = not any(k.startswith(BASE_PREFIX) for k in output)
            model_bytes = _bytes(pretrained)
            metrics |= {"storage_bytes": store_bytes(output) + (model_bytes if uses_theta0 else 0), "model_bytes": model_bytes}
    save_state_dict(layout.merged(method), output, {"method": method, "kind": spec.kind, "hyperparameters": json.dumps(metrics["hyperparameters"])})
    with atomic_path(layout.log("merge", method, ".png")) as tmp:
        plot_merge_search(metrics, tmp)
    write_json(layout.metrics("merge", method), metrics)
    write_json(layout.log("merge", method), validation_records(metrics, spec.coefficient))
    evaluated = evaluate(params, method, layout, tasks=tasks, heads=heads)
    write_json(layout.timing("merge", method), timer.record() | {"evaluate_wall_time_s": evaluated["wall_time_s"], "ended": time.time()})
    return metrics


# ---------------------------------------------------------------- evaluate
def evaluate(params: Params, method: str, layout: Layout = Layout(), *, tasks=None, heads=None) -> dict:
    """Test accuracy on every task, absolute and normalized by the individual model (per-task methods: each task
    with its own rebuilt model; task negation: the negated task's accuracy against the others')."""
    params.check_method(method)
    spec = REGISTRY[method]
    device = _setup(params, params.seed)
    chosen = read_json(layout.metrics("merge", method))
    ft = {t: read_json(layout.metrics("finetune", t)) for t in params.suite.tasks}
    with Timer() as timer:
        output = load_state_dict(layout.merged(method))
        tasks = tasks or _load_tasks(params, layout)
        heads = heads or _load_heads(params, layout, build_backbone(params.backbone).num_features, tasks)
        evaluator = MultiTaskEvaluator(params.backbone, tasks, heads, "test", device, params.runtime.eval_batch_size)
        if spec.kind == "negation":
            pretrained, tvs = _load_task_vectors(params, layout)
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
            acc = evaluator.per_task(lambda t: spec.reconstruct(output, pretrained, t))
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
            "normalized": {t: acc[t] / individual[t] for t in acc},
            "normalized_average": mean(acc[t] / individual[t] for t in acc),
            "storage_models": chosen["storage_bytes"] / chosen["model_bytes"] if spec.kind == "per_task" else 1.0,
        }
    write_json(layout.metrics("evaluate", method), metrics)
    return metrics | {"wall_time_s": timer.seconds}


# ---------------------------------------------------------------- report
def report(params: Params, layout: Layout = Layout()) -> dict:
    """Summary table (Markdown, CSV, JSON), the accuracy heatmap and the sorted averages; the headline metrics
    (metrics/summary.json) that `dvc exp show` and `dvc metrics diff` compare."""
    tasks = params.suite.tasks
    ft = {t: read_json(layout.metrics("finetune", t)) for t in tasks}
    ev = {m: read_json(layout.metrics("evaluate", m)) for m in params.merge.methods}
    negations = {m: e for m, e in ev.items() if e["kind"] == "negation"}
    rows = summary_rows(tasks, ft, {m: e for m, e in ev.items() if m not in negations})
    headline = headline_metrics(rows, ev)
    with atomic_path(layout.results, directory=True) as tmp:
        (tmp / "summary.md").write_text(summary_markdown(rows, tasks) + "".join(negation_markdown(m, e, tasks) for m, e in negations.items()))
        (tmp / "summary.csv").write_text(summary_csv(rows, tasks))
        write_json(tmp / "summary.json", {"rows": rows, "negation": negations})
        write_json(tmp / "averages.json", [{"method": r["method"], "test_avg": round(100 * r["average"], 2)} for r in rows])
        plot_accuracy_heatmap(rows, tasks, tmp / "accuracy.png")
        plot_averages(rows, tmp / "averages.png")
    write_json(layout.metrics("summary"), headline)
    return {"rows": rows, "negation": negations, "headline": headline}
