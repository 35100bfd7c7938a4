"""Each stage's work, counted from params.yaml, and its estimate: work / the measured throughput.

The estimate is work / measured throughput. The work of each stage is counted from params.yaml in the units the
stage spends its time in (images through the backbone's forward pass, training images, per-example gradients,
elementwise passes over the parameters, SVDs); the throughputs are measured on this device
(mergeflow.runner.plan.measure) and kept per machine (mergeflow.runner.plan.cache). Stages that
do not fit those units (prepare, report, track) take a few named constants, each measured on the 2-core machine
the default run was made on; studies are not estimated.

The estimate is for ``mergeflow repro`` running one stage after another, as it does on one GPU or 2 cores, each
stage with the threads params.yaml gives it and forked from the run's stage server (mergeflow.runner.stage_server): the
stages' imports once, then a short gap between stages. On more cores or GPUs, ``mergeflow repro`` and the Prefect
flow run siblings at once; their total wall time is lower, each stage's longer. Plain ``dvc repro`` starts a
process per stage, which imports torch each time (seconds a stage, not counted here).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from mergeflow.config import NEWTON_MAX_UNKNOWNS, Params
from mergeflow.ml.merging.search import golden_section, swept_key
from mergeflow.runner.plan.measure import Throughput, model_shape
from mergeflow.ml.regimes import REGISTRY as REGIMES
from mergeflow.core.stage_table import STAGES

# ---------------------------------------------------------------- calibration constants (few, each measured)
# `mergeflow repro`'s time between two stages whose processes fork from its stage server (the command's start, the
# fork, the stage's setup before its timer; the commit to dvc.lock runs beside the next stage): 11.7 s between the
# 42 stages of a fresh clone's default run on the 2-core machine (fc6, 2026-11-28, docs/daily-loop.md).
STAGE_GAP_S = 0.28
# prepare: its process pool's start (the tiny profile's prepare took 5.8 s for 960 task and 800 corpus images),
# then the embedded suite's generation per image (tasks' splits and the pretraining corpus) on 2 cores: 30.05 s in
# all for 8 x 3700 task images + 60000 corpus images in /work/main (logs/timing/prepare.json).
PREPARE_POOL_START_S = 5.5
PREPARE_S_PER_IMAGE = (30.05 - PREPARE_POOL_START_S) / (8 * 3700 + 60000)
# the linear probe (scikit-learn, one BLAS thread). L-BFGS: per C value, iteration, training example and feature;
# 3 C values x 150 iterations on 3000 x 128 features took 0.4-0.7 s. Newton (probe.solver's default): per C value,
# training example and feature squared (its Hessian), about ten iterations; 0.3-1.7 s a C value on the default
# suite's 3000 x 128 features, 0.8 s on average (training.fit_probe, 2026-11-28)
PROBE_S_PER_UNIT = 0.55 / (3 * 150 * 3000 * 128)
PROBE_NEWTON_S_PER_UNIT = 0.8 / (3000 * 128**2)
# reading a task's safetensors file and checking it (data.load_task), bytes per second: 8 task files of 11 MB
# loaded in ~0.9 s in a merge stage (weight_averaging's 2.0 s less its 1.1 s of evaluation) on the 2-core machine.
LOAD_BYTES_PER_S = 100e6
# report: the summary table and its plots; results/summary.md to metrics/summary.json took ~4 s in /work/main.
REPORT_S = 4.0
SOURCES_S = 1.0  # the merging modules read and hashed
# track: logging params, metrics and checkpoints into MLflow; not timed by the pipeline: an assumption (~10 s plus
# the checkpoints it copies at LOAD_BYTES_PER_S), stated as such in the output.
TRACK_S = 10.0
# elementwise passes over the parameters per task and method call (read tau_t, combine, write): a merge's
# arithmetic besides its SVDs, and a plot (vectors' cosine heatmap) at a constant.
PASSES_PER_TASK = 4
PLOT_S = 1.0
# a computing stage's setup inside its timer (reading the model, building evaluators, lazy imports such as
# scikit-learn's, writing outputs and plots): the tiny profile's stages with next to no work took 0.6-1.9 s.
STAGE_SETUP_S = 1.0
# a regime stage's pool of fine-tuning processes on the CPU (each imports torch and builds its trainer): the tiny
# profile's regime stages took 9-10 s with ~0.5 s of work and 2 workers.
REGIME_POOL_START_S = 8.0

# a ViT block's MLP holds about 2/3 of its parameters (2 x 4 D^2 of 12 D^2): WEMoE runs every image through T of them
MLP_SHARE = 2 / 3

# SVDs per 2-D weight and method call, as a function of the number of tasks T (merging/<method>.py)
SVDS_PER_MATRIX = {
    "low_rank_ta": lambda t: t,  # SVD_k of every tau_t
    "cart": lambda t: t,  # of every centred tau_t
    "cart_indexing": lambda t: t,
    "adamerging_cart": lambda t: t,
    "tsv_c": lambda t: t,
    "tsv_m": lambda t: t + 2,  # every tau_t, then two polar decompositions
    "iso_c": lambda t: 1,  # the sum's
    "iso_cts": lambda t: t + 3,  # the sum's, each residual's, two polar decompositions
    "regmean": lambda t: 1,  # a linear solve of the Grams, about an SVD's cost
    "smile": lambda t: t,  # every tau_t's top-k SVD
}


# ---------------------------------------------------------------- work per stage
@dataclass
class Work:
    """A stage's work in the units throughput is measured in, and what it holds in memory."""

    forward_images: float = 0  # images through the backbone, eval, no grad
    search_images: float = 0  # of forward_images, the validation search's (bf16 on CUDA)
    train_images: float = 0  # images through forward + backward + optimiser step
    adaptation_images: float = 0  # of train_images, AdaMerging's (through the merge, only the coefficients learn)
    adaptation_passes: float = 0  # AdaMerging's merged model built at every step (in a calibrated rate already)
    example_grads: float = 0  # per-example gradients (batch 1)
    param_passes: float = 0  # elementwise passes over every parameter
    svds: float = 0  # SVDs, in units of one SVD of the largest 2-D weight
    load_bytes: float = 0  # files read (task data)
    decoded_images: float = 0  # real data's JPEGs decoded and resized, one process after another (prepare)
    fixed_s: float = 0  # named constants (prepare, probe, report, track, plots)
    trains: bool = False  # whether its peak is a training step's
    held_models: float = 0  # full copies of the parameters it holds besides the one it runs (task vectors)
    held_bytes: float = 0  # data it holds (task images)
    notes: list[str] = field(default_factory=list)

    def add(self, other: Work) -> Work:
        for name in (
            "forward_images",
            "search_images",
            "train_images",
            "adaptation_images",
            "adaptation_passes",
            "example_grads",
            "param_passes",
            "svds",
            "load_bytes",
            "decoded_images",
            "fixed_s",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.trains |= other.trains
        self.held_models = max(self.held_models, other.held_models)
        self.held_bytes = max(self.held_bytes, other.held_bytes)
        self.notes += [n for n in other.notes if n not in self.notes]
        return self


def _task_bytes(params: Params, splits: tuple[str, ...] = ("train", "val", "test")) -> float:
    """The task files' images (uint8, at most n_<split> a task): what a stage reads. Merges read val and test."""
    s = params.suite
    return len(s.tasks) * sum(getattr(s, f"n_{split}") for split in splits) * example_bytes(s)


def example_bytes(s) -> int:
    """One stored example: an image's uint8 pixels, or a text example's int32 token ids."""
    return s.seq_len * 4 if s.modality == "text" else s.image_size**2 * 3


def total_steps(cfg, n_examples: int, full_batch: bool = False) -> int:
    """training.total_steps's arithmetic, here so that a plan from the cache imports neither the training code nor
    timm with it (seconds); tests/test_plan.py checks that the two agree."""
    if cfg.epochs is None:
        return cfg.steps
    per_epoch = 1 if full_batch else max(1, n_examples // min(cfg.batch_size, n_examples))
    return cfg.epochs * per_epoch


def _finetune_steps(params: Params) -> tuple[int, int]:
    """(steps, images a step) of one standard fine-tune."""
    cfg, n = params.finetune, params.suite.n_train
    full = cfg.optimizer == "gd"
    batch = n if full else cfg.batch_size
    anchor = cfg.preserve_features.batch_size if cfg.preserve_features.weight > 0 else 0
    return total_steps(cfg, n, full), batch + anchor


def finetune_work(params: Params, task: str | None = None) -> Work:
    """One task: the features its head needs (a probe: every split's; a zero-shot head: val's and test's) and the
    anchor images', the probe, the steps (none for a task finetune.checkpoints imports), the accuracies."""
    s, cfg = params.suite, params.finetune
    steps, per_step = (0, 0) if task in cfg.checkpoints else _finetune_steps(params)
    anchor = cfg.preserve_features.images if cfg.preserve_features.weight > 0 and steps else 0
    probe = cfg.head == "probe"
    features = (s.n_train if probe else 0) + s.n_val + s.n_test + anchor
    d = model_shape(params).features
    newton = params.probe.solver == "newton-cholesky" and d * 10 <= NEWTON_MAX_UNKNOWNS  # (taken as 10 classes)
    fit_s = (
        len(params.probe.c_grid)
        * s.n_train
        * (d * d * PROBE_NEWTON_S_PER_UNIT if newton else params.probe.max_iter * d * PROBE_S_PER_UNIT)
        if probe
        else 0
    )
    return Work(
        forward_images=features + s.n_val + s.n_test,
        train_images=steps * per_step,
        fixed_s=fit_s,
        trains=bool(steps),
        held_bytes=_task_bytes(params) / len(s.tasks),
    )


def merge_work(params: Params, method: str, overrides: dict | None = None) -> Work:
    """One method's search and test, as mergeflow.ml.merging.search runs it: per-task choices first, then every grid
    candidate (a coefficient swept by interpolation: two merges, then one pass a value) scored on every task's
    val split, then the chosen one on every task's test split."""
    from mergeflow.ml.merging import REGISTRY

    spec = REGISTRY[method]
    overrides = params.merge.overrides(method) if overrides is None else overrides
    tasks, s = len(params.suite.tasks), params.suite
    fixed, grid = spec.search_space(overrides)
    per_task = spec.per_task_space(overrides)
    val, test = tasks * s.n_val, tasks * s.n_test
    merge_passes = PASSES_PER_TASK * tasks
    svd_units = SVDS_PER_MATRIX.get(method, lambda t: 0)(tasks) * model_shape(params).svd_units()
    evaluated = _task_bytes(params, ("val", "test"))
    vectors = (tasks + 1) * model_shape(params).parameters * 4  # the task vectors and the pretrained weights, float32
    w = Work(load_bytes=evaluated + vectors, held_models=tasks + 3, held_bytes=evaluated)
    if spec.kind == "negation":
        candidates = math.prod(len(v) for v in grid.values())
        w.forward_images = val + tasks * candidates * val + tasks * test
        w.search_images = val + tasks * candidates * val
        w.param_passes = tasks * candidates * PASSES_PER_TASK + tasks * PASSES_PER_TASK
        return w
    calls = 0
    for values in per_task.values():  # the shared merge once, then each task's model per value, on its own val
        calls = 1
        w.forward_images += len(values) * val
        w.search_images += len(values) * val
        w.param_passes += len(values) * tasks
    coefficient = spec.coefficient if spec.coefficient in grid else None
    # merge.search golden: the swept key's points a golden-section
    # search scores (on a flat curve; a real one, a few more or fewer)
    swept = swept_key(spec, grid) if params.merge.search == "golden" else None
    scored = len(golden_section(len(grid[swept]), lambda i: 0.0)) if swept else None
    others = math.prod(len(v) for k, v in grid.items() if k not in (coefficient, swept))
    if swept and swept != coefficient:  # a one-key grid that is not a coefficient: a merge for each point scored
        candidates, calls = scored, calls + scored
    else:
        candidates = others * ((scored or len(grid[coefficient])) if coefficient else 1)
        calls += others * (2 if coefficient else 1)
    w.forward_images += candidates * val + test
    w.search_images += candidates * val
    w.param_passes += (
        calls * merge_passes
        + (candidates * 2 if coefficient else 0)
        + (candidates + 1) * (tasks if spec.kind == "per_task" else 0)
    )
    w.svds = calls * svd_units
    if method == "surgery":  # its base merge at the base's defaults, then features; its own steps are on features
        base = REGISTRY[fixed["base"]]
        w.add(
            _adaptation(base.defaults, tasks, calls)
            if base.reads == "test_inputs"
            else Work(param_passes=calls * merge_passes)
        )
        w.forward_images += calls * 2 * test  # the merged and each task's own model on the task's inputs
    elif method == "wemoe":  # AdaMerging's steps, and every image through the MLPs of all T task vectors: forward and
        # the inputs' gradient (the task vectors learn nothing), two forward passes' worth
        w.add(_adaptation(fixed, tasks, calls))
        w.forward_images += calls * fixed["steps"] * tasks * fixed["batch_size"] * tasks * MLP_SHARE * 2
    elif method == "gossip_adamerging":  # AdaMerging's steps at every node of every round
        w.add(_adaptation({**fixed, "steps": fixed["steps"] * fixed["rounds"] * tasks}, tasks, calls))
    elif spec.reads == "test_inputs":  # AdaMerging: Adam steps on the coefficients through the merged model
        w.add(_adaptation(fixed, tasks, calls))
    elif not spec.merged:  # an ensemble: every image through each of the T models it keeps
        w.forward_images += (tasks - 1) * (candidates * val + test)
        w.search_images += (tasks - 1) * candidates * val
        w.held_models += tasks
    if spec.reads == "train_inputs":  # RegMean++: each task's examples through its own and the merged blocks
        w.forward_images += calls * 2 * tasks * min(params.statistics.examples, params.suite.n_train)
        w.load_bytes += _task_bytes(params, ("train",))
    if spec.reads == "train_examples":  # FW-Merging: forward and backward over each task's examples per step
        hp = fixed
        w.train_images += calls * hp["steps"] * tasks * min(hp["examples"], params.suite.n_train)
        w.load_bytes += _task_bytes(params, ("train",))
        w.trains = True
    if spec.reads == "train_statistics":
        w.load_bytes += 3 * tasks * model_shape(params).parameters * 4  # two Fishers and the Grams per task
    return w


def _adaptation(hp, tasks: int, calls: int) -> Work:
    """AdaMerging's Adam steps (``hp``: steps, batch_size) through the merged model, ``calls`` times."""
    images = calls * hp["steps"] * tasks * hp["batch_size"]
    return Work(
        train_images=images, adaptation_images=images, adaptation_passes=calls * hp["steps"] * 2 * tasks, trains=True
    )


def statistics_work(params: Params) -> Work:
    """Per task: two diagonal Fishers (one example at a time, forward + backward) and the Grams (a forward pass);
    nothing when no method of merge.methods reads them (the stage then writes only a note)."""
    from mergeflow.params import statistics_readers

    if not statistics_readers(params):
        return Work()
    tasks, n = len(params.suite.tasks), min(params.statistics.examples, params.suite.n_train)
    return Work(
        example_grads=2 * tasks * n,
        forward_images=tasks * n,
        load_bytes=_task_bytes(params),
        held_bytes=_task_bytes(params),
        held_models=3,
    )


def regime_work(params: Params, regime: str) -> Work:
    """Every variant: each task's fine-tune (as finetune_work's steps, or the regime's budget), the accuracies of
    each task model and of the regime's own model."""
    s, cfg = params.suite, params.finetune
    tasks = len(s.tasks)
    steps, per_step = _finetune_steps(params)
    anchor = cfg.preserve_features.images if cfg.preserve_features.weight > 0 else 0
    w = Work(
        forward_images=tasks * anchor,
        load_bytes=_task_bytes(params),
        held_bytes=_task_bytes(params),
        held_models=2 * tasks + 1,
        trains=True,
    )
    threads = params.threads() or os.cpu_count() or 1
    if (
        params.runtime.device != "cuda" and min(tasks, threads) > 1
    ):  # stages.regime: one process a task, up to the threads
        w.fixed_s += REGIME_POOL_START_S
    one_epoch = total_steps(cfg.model_copy(update={"epochs": 1}), s.n_train, cfg.optimizer == "gd")
    settings = params.regimes.config(regime)
    for kwargs in settings.variants(regime, cfg.steps).values():
        w.train_images += tasks * settings.training_steps(kwargs, steps, one_epoch) * per_step
        w.forward_images += (
            tasks * (s.n_val + s.n_test) * (3 if REGIMES[regime].own_model else 1)
        )  # + the own model's, every task
    return w


def regime_merge_work(params: Params, regime: str) -> Work:
    """Every variant merged with each of the regime's methods (its own model's evaluation costs nothing here)."""
    w = Work()
    variants = params.regimes.config(regime).variants(regime, params.finetune.steps)
    for _ in variants:
        for method in params.regimes.methods_of(regime):
            if method != regime:
                w.add(merge_work(params, method))
    w.load_bytes = _task_bytes(params, ("val", "test"))  # the tasks are read once for every merge of the stage
    return w


def vectors_work(params: Params) -> Work:
    tasks = len(params.suite.tasks)
    return Work(param_passes=2 * tasks + tasks * tasks, fixed_s=PLOT_S, held_models=tasks + 1)


def stage_work(params: Params, address: str) -> Work | None:
    """The work of one stage of dvc.yaml by its address (finetune@digits, merge@ties); None when not estimated."""
    work = _stage_work(params, address)
    if work is not None and address.partition("@")[0] not in ("prepare", "report", "track"):
        work.fixed_s += STAGE_SETUP_S
    return work


def prepare_work(params: Params) -> Work:
    s = params.suite
    images = len(s.tasks) * (s.n_train + s.n_val + s.n_test)
    if s.source == "embedded":
        corpus = s.pretrain_images if params.backbone.pretrained is None else 0
        return Work(fixed_s=PREPARE_POOL_START_S + PREPARE_S_PER_IMAGE * (images + corpus))
    # real data: every image decoded and resized once, the tasks in parallel processes (at most the caps:
    # a smaller dataset takes less); each process holds its task's arrays
    workers = min(len(s.tasks), params.threads() or os.cpu_count() or 1)
    w = Work(
        fixed_s=PREPARE_POOL_START_S,
        decoded_images=images / workers,
        held_bytes=workers * (s.n_train + s.n_val + s.n_test) * example_bytes(s),
    )
    w.notes.append("real data: decoding measured on a 500x375 JPEG; downloads not estimated")
    return w


def pretrain_work(params: Params) -> Work:
    s = params.suite
    if params.backbone.pretrained is not None:
        return Work(notes=["loads pretrained weights: read time not estimated"])
    cfg = params.pretrain
    steps = cfg.steps if cfg.epochs is None else cfg.epochs * max(1, s.pretrain_images // cfg.batch_size)
    return Work(
        train_images=steps * cfg.batch_size,
        forward_images=min(2000, s.pretrain_images),
        trains=True,
        held_bytes=s.pretrain_images * example_bytes(s),
    )


def track_work(params: Params) -> Work:
    checkpoints = (
        (len(params.suite.tasks) + len(params.merge.methods) + 1) * model_shape(params).parameters * 4
        if params.tracking.log_checkpoints
        else 0
    )
    return Work(fixed_s=TRACK_S, load_bytes=checkpoints, notes=["track: an assumed constant, never timed"])


# every stage of stage_table.STAGES: (params, item) -> its work, or None where it is not estimated (a replicate, a
# study: their time is in the work they repeat, or their own measurements)
COSTS: dict[str, Callable[[Params, str], Work | None]] = {
    "prepare": lambda params, _: prepare_work(params),
    "pretrain": lambda params, _: pretrain_work(params),
    "finetune": finetune_work,
    "vectors": lambda params, _: vectors_work(params),
    "statistics": lambda params, _: statistics_work(params),
    "sources": lambda params, _: Work(fixed_s=SOURCES_S),
    "merge": merge_work,
    "regime": regime_work,
    "regime_merge": regime_merge_work,
    "replicate": lambda params, _: None,
    "study": lambda params, _: None,
    "report": lambda params, _: Work(fixed_s=REPORT_S),
    "track": lambda params, _: track_work(params),
}


def _stage_work(params: Params, address: str) -> Work | None:
    kind, _, item = address.partition("@")
    if kind not in COSTS or (STAGES[kind].item is not None and not item):
        return None
    return COSTS[kind](params, item)


def compute_seconds(work: Work, tp: Throughput) -> float:
    """The stage's own time: its work divided by the measured throughputs, plus its constants. The search's and
    AdaMerging's images go at their own rates where a calibration gives them, else at the forward and training ones."""
    return (
        (work.forward_images - work.search_images) / tp.forward_img_s
        + work.search_images / (tp.search_img_s or tp.forward_img_s)
        + (work.train_images - work.adaptation_images) / tp.train_img_s
        + work.adaptation_images / (tp.adaptation_img_s or tp.train_img_s)
        + work.example_grads * tp.example_grad_s
        + work.param_passes * tp.param_pass_s
        + (0.0 if tp.adaptation_img_s else work.adaptation_passes * tp.param_pass_s)
        + work.svds * tp.svd_s
        + work.load_bytes / (tp.load_bytes_per_s or LOAD_BYTES_PER_S)
        + work.decoded_images * tp.decode_s
        + work.fixed_s
    )


def overhead_seconds(tp: Throughput, first: bool = False) -> float:
    """A stage's start and bookkeeping under `mergeflow repro` (STAGE_GAP_S); the run's ``first`` stage also waits
    for the stage server's imports (measured: ``tp.import_s``)."""
    return STAGE_GAP_S + (tp.import_s if first else 0.0)


def peak_bytes(work: Work, tp: Throughput, n_params: int) -> int:
    """The stage's peak memory: on CUDA the device's (the measured step's peak); on the CPU the process's, its
    RSS after its imports, the step's growth, and the models and data it holds besides."""
    step = tp.train_peak_bytes if work.trains else tp.forward_peak_bytes
    if tp.device.startswith("cuda"):
        return int(step)
    return int(tp.base_bytes + step + work.held_models * n_params * 4 + work.held_bytes)
