"""``mergeflow plan``: before a long run, which stages will run and about how long and how much memory each takes.

The estimate is work / measured throughput. The work of each stage is counted from params.yaml in the units the
stage spends its time in (images through the backbone's forward pass, training images, per-example gradients,
elementwise passes over the parameters, SVDs); the throughputs are measured once, on this device, on the real
backbone architecture with random weights (never the hub's weights: the architecture is what costs). Stages that
do not fit those units (prepare, report, track) take a few named constants, each measured on the 2-core machine
the default run was made on; studies are not estimated.

The estimate is for ``dvc repro``: one stage after another, each with the threads params.yaml gives it. The Prefect
flow runs siblings at once on shared cores; its total wall time is lower, each stage's longer.
"""

from __future__ import annotations

import functools
import math
import os
import statistics as stats
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mergeflow.config import Params
from mergeflow.errors import MergeflowError

# ---------------------------------------------------------------- calibration constants (few, each measured)
# dvc repro's own work between two stages (hashing and caching outputs, writing dvc.lock, starting the next
# process) besides the import of mergeflow, which plan measures: the default run in /work/main had a median gap of
# 5.2 s between one stage's end and the next one's start (logs/timing started/ended), ~2 s of it the import.
DVC_BOOKKEEPING_S = 3.2
# prepare: its process pool's start (the tiny profile's prepare took 5.8 s for 960 task and 800 corpus images),
# then the embedded suite's generation per image (tasks' splits and the pretraining corpus) on 2 cores: 30.05 s in
# all for 8 x 3700 task images + 60000 corpus images in /work/main (logs/timing/prepare.json).
PREPARE_POOL_START_S = 5.5
PREPARE_S_PER_IMAGE = (30.05 - PREPARE_POOL_START_S) / (8 * 3700 + 60000)
# the linear probe (scikit-learn L-BFGS, one BLAS thread): per C value, L-BFGS iteration, training example and
# feature; a probe of 3 C values x 150 iterations on 3000 x 128 features took 0.4-0.7 s (training.fit_probe).
PROBE_S_PER_UNIT = 0.55 / (3 * 150 * 3000 * 128)
# reading a task's safetensors file and checking it (data.load_task), bytes per second: 8 task files of 11 MB
# loaded in ~0.9 s in a merge stage (weight_averaging's 2.0 s less its 1.1 s of evaluation) on the 2-core machine.
LOAD_BYTES_PER_S = 100e6
# report: the summary table and its plots; results/summary.md to metrics/summary.json took ~4 s in /work/main.
REPORT_S = 4.0
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
}


@dataclass(frozen=True)
class ModelShape:
    """What the costs scale with: the parameter count and the 2-D weights' shapes (the SVD methods' matrices)."""

    parameters: int
    matrices: tuple[tuple[int, int], ...]

    @property
    def largest_matrix(self) -> tuple[int, int]:
        return max(self.matrices, key=lambda s: s[0] * s[1] * min(s), default=(1, 1))

    def svd_units(self) -> float:
        """One SVD of every 2-D weight, in units of one SVD of the largest (cost ~ m n min(m, n))."""
        m, n = self.largest_matrix
        return sum(a * b * min(a, b) for a, b in self.matrices) / (m * n * min(m, n))


def model_shape(params: Params) -> ModelShape:
    """The backbone's shape, built on the meta device: no memory, no weights, any size."""
    import torch

    from mergeflow.models import Backbone

    with torch.device("meta"):
        net = Backbone(params.backbone, pretrained=False).net
    state = net.state_dict()
    matrices = tuple(tuple(v.shape) for k, v in state.items() if v.ndim == 2 and k.endswith("weight") and min(v.shape) > 1)
    return ModelShape(sum(v.numel() for v in state.values()), matrices)


@dataclass(frozen=True)
class Throughput:
    """The device's measured speeds on the configured backbone (random init, same architecture)."""

    device: str
    threads: int
    forward_img_s: float  # eval, no grad, at runtime.eval_batch_size (or less on a big model on the CPU)
    train_img_s: float  # forward + backward + AdamW step at finetune.batch_size
    example_grad_s: float  # one example's forward + backward at batch 1 (the statistics stage's Fisher)
    param_pass_s: float  # one torch.add over every parameter
    svd_s: float  # one SVD (merging._tensors.svd) of the largest 2-D weight
    train_peak_bytes: int  # a training step's memory: CUDA's peak allocated; CPU: the RSS growth from before the model
    forward_peak_bytes: int  # the same for an evaluation batch
    base_bytes: int  # a stage process's memory before any work (CPU: its RSS after imports, measured; CUDA: 0)
    memory_source: str
    import_s: float  # a stage process's start: `python -m mergeflow.cli --help`
    batches: dict = field(default_factory=dict)  # the batch sizes measured at


def _median_time(fn, budget_s: float, most: int, least: int = 2) -> float:
    """Median seconds of ``fn`` after one warm-up call, over at least ``least`` and at most ``most`` calls or
    ``budget_s`` seconds; the median, because a shared machine's other load shows as outliers."""
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < least or (len(times) < most and time.perf_counter() - start < budget_s):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return stats.median(times)


def _stage_process() -> tuple[float, int]:
    """A stage process's start: seconds and peak resident bytes of `python -m mergeflow.cli --help` (it parses
    params.yaml and imports torch, timm and the method registry, as a stage does). Linux reports kilobytes."""
    import resource

    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "mergeflow.cli", "--help"], capture_output=True, check=False)
    return time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


def measure_throughput(params: Params, *, budget_s: float = 1.0) -> Throughput:
    """Measure the backbone's speeds on runtime.device with the threads the stages use, ``budget_s`` seconds a
    measure at most (a few iterations on a model too big for that). On CUDA the peaks are
    torch.cuda.max_memory_allocated; on the CPU the RSS growth (psutil) from before the model to after the step:
    weights, gradients, AdamW's two states and the activations the allocator keeps."""
    import psutil
    import torch

    from mergeflow.merging._tensors import svd
    from mergeflow.models import build_backbone, select_device
    from mergeflow.training import seed_everything

    seed_everything(params.seed, params.threads())
    device = select_device(params.runtime.device)
    process = psutil.Process()
    model = build_backbone(params.backbone).to(device)
    size = params.suite.image_size
    n_params = sum(p.numel() for p in model.parameters())
    big = n_params > 20e6 and device.type == "cpu"  # e.g. ViT-B/32 on a CPU: a small batch, a couple of iterations
    eval_bs = min(params.runtime.eval_batch_size, 32 if big else params.runtime.eval_batch_size)
    train_bs = min(params.finetune.batch_size, 16 if big else params.finetune.batch_size)
    most = 3 if big else 50

    def images(n):
        return torch.randint(0, 256, (n, size, size, 3), dtype=torch.uint8, device=device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def timed(fn):
        return _median_time(lambda: (fn(), sync()), budget_s, most)

    rss0 = process.memory_info().rss - (n_params * 4 if device.type == "cpu" else 0)  # before the model (built above)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    x = images(eval_bs)
    model.eval()
    with torch.no_grad():
        forward_s = timed(lambda: model(x))
    forward_peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else max(process.memory_info().rss - rss0, n_params * 4)
    del x

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    xb = images(train_bs)
    model.train()

    def step():
        loss = model(xb).float().pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    train_s = timed(step)
    train_peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else max(process.memory_info().rss - rss0, n_params * 16)
    model.eval()
    weights = [p for p in model.parameters() if p.requires_grad]  # CLIP's projection bias is frozen
    x1 = images(1)
    example_s = timed(lambda: torch.autograd.grad(model(x1).sum(), weights))
    detached = [p.detach() for p in weights]
    pass_s = timed(lambda: [torch.add(w, w) for w in detached])
    shape = model_shape(params)
    matrix = torch.randn(*shape.largest_matrix)
    svd_s = timed(lambda: svd(matrix))
    del optimizer, xb
    import_s, import_rss = _stage_process()
    return Throughput(
        device=str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        threads=torch.get_num_threads(),
        forward_img_s=eval_bs / forward_s,
        train_img_s=train_bs / train_s,
        example_grad_s=example_s,
        param_pass_s=pass_s,
        svd_s=svd_s,
        train_peak_bytes=int(train_peak),
        forward_peak_bytes=int(forward_peak),
        base_bytes=0 if device.type == "cuda" else int(import_rss),
        memory_source="CUDA max_memory_allocated of the measured step" if device.type == "cuda" else (
            "RSS: a stage process's after its imports (measured) + the step's RSS growth (at least parameters x 16 B: weights, grads, 2 AdamW states) + the models and data the stage holds"),
        import_s=import_s,
        batches={"forward": eval_bs, "train": train_bs},
    )


# ---------------------------------------------------------------- work per stage
@dataclass
class Work:
    """A stage's work in the units throughput is measured in, and what it holds in memory."""

    forward_images: float = 0  # images through the backbone, eval, no grad
    train_images: float = 0  # images through forward + backward + optimiser step
    example_grads: float = 0  # per-example gradients (batch 1)
    param_passes: float = 0  # elementwise passes over every parameter
    svds: float = 0  # SVDs, in units of one SVD of the largest 2-D weight
    load_bytes: float = 0  # files read (task data)
    fixed_s: float = 0  # named constants (prepare, probe, report, track, plots)
    trains: bool = False  # whether its peak is a training step's
    held_models: float = 0  # full copies of the parameters it holds besides the one it runs (task vectors)
    held_bytes: float = 0  # data it holds (task images)
    notes: list[str] = field(default_factory=list)

    def add(self, other: Work) -> Work:
        for name in ("forward_images", "train_images", "example_grads", "param_passes", "svds", "load_bytes", "fixed_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.trains |= other.trains
        self.held_models = max(self.held_models, other.held_models)
        self.held_bytes = max(self.held_bytes, other.held_bytes)
        self.notes += [n for n in other.notes if n not in self.notes]
        return self


def _task_bytes(params: Params, splits: tuple[str, ...] = ("train", "val", "test")) -> float:
    """The task files' images (uint8, at most n_<split> a task): what a stage reads. Merges read val and test."""
    s = params.suite
    return len(s.tasks) * sum(getattr(s, f"n_{split}") for split in splits) * s.image_size**2 * 3


def _finetune_steps(params: Params) -> tuple[int, int]:
    """(steps, images a step) of one standard fine-tune."""
    from mergeflow.training import total_steps

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
    fit = len(params.probe.c_grid) * params.probe.max_iter * s.n_train * _feature_dim(params) if probe else 0
    return Work(forward_images=features + s.n_val + s.n_test, train_images=steps * per_step, fixed_s=fit * PROBE_S_PER_UNIT, trains=bool(steps),
                held_bytes=_task_bytes(params) / len(s.tasks))


def _feature_dim(params: Params) -> int:
    import torch

    from mergeflow.models import Backbone

    with torch.device("meta"):
        return Backbone(params.backbone, pretrained=False).num_features


def merge_work(params: Params, method: str, overrides: dict | None = None) -> Work:
    """One method's search and test, as merging.evaluation.search runs it: per-task choices first, then every grid
    candidate (a coefficient swept by interpolation: two merges, then one pass a value) scored on every task's
    val split, then the chosen one on every task's test split."""
    from mergeflow.merging import REGISTRY

    spec = REGISTRY[method]
    overrides = params.merge.overrides(method) if overrides is None else overrides
    tasks, s = len(params.suite.tasks), params.suite
    fixed, grid = spec.search_space(overrides)
    per_task = spec.per_task_space(overrides)
    val, test = tasks * s.n_val, tasks * s.n_test
    merge_passes = PASSES_PER_TASK * tasks
    svd_units = SVDS_PER_MATRIX.get(method, lambda t: 0)(tasks) * model_shape(params).svd_units()
    evaluated = _task_bytes(params, ("val", "test"))
    w = Work(load_bytes=evaluated, held_models=tasks + 3, held_bytes=evaluated)
    if spec.kind == "negation":
        candidates = math.prod(len(v) for v in grid.values())
        w.forward_images = val + tasks * candidates * val + tasks * test
        w.param_passes = tasks * candidates * PASSES_PER_TASK + tasks * PASSES_PER_TASK
        return w
    calls = 0
    for values in per_task.values():  # the shared merge once, then each task's model per value, on its own val
        calls = 1
        w.forward_images += len(values) * val
        w.param_passes += len(values) * tasks
    coefficient = spec.coefficient if spec.coefficient in grid else None
    others = math.prod(len(v) for k, v in grid.items() if k != coefficient)
    candidates = others * (len(grid[coefficient]) if coefficient else 1)
    calls += others * (2 if coefficient else 1)
    w.forward_images += candidates * val + test
    w.param_passes += calls * merge_passes + (candidates * 2 if coefficient else 0) + (candidates + 1) * (tasks if spec.kind == "per_task" else 0)
    w.svds = calls * svd_units
    if spec.reads == "test_inputs":  # AdaMerging: Adam steps on the coefficients through the merged model
        hp = fixed
        w.train_images += calls * hp["steps"] * tasks * hp["batch_size"]
        w.param_passes += calls * hp["steps"] * 2 * tasks
        w.trains = True
    if spec.reads == "train_statistics":
        w.load_bytes += 3 * tasks * model_shape(params).parameters * 4  # two Fishers and the Grams per task
    return w


def statistics_work(params: Params) -> Work:
    """Per task: two diagonal Fishers (one example at a time, forward + backward) and the Grams (a forward pass)."""
    tasks, n = len(params.suite.tasks), min(params.statistics.examples, params.suite.n_train)
    return Work(example_grads=2 * tasks * n, forward_images=tasks * n, load_bytes=_task_bytes(params), held_bytes=_task_bytes(params), held_models=3)


def regime_work(params: Params, regime: str) -> Work:
    """Every variant: each task's fine-tune (as finetune_work's steps, or the regime's budget), the accuracies of
    each task model and of the regime's own model."""
    from mergeflow.regimes import REGISTRY as REGIMES  # noqa: F401 - the regimes must be importable
    from mergeflow.training import total_steps

    s, cfg = params.suite, params.finetune
    tasks = len(s.tasks)
    steps, per_step = _finetune_steps(params)
    anchor = cfg.preserve_features.images if cfg.preserve_features.weight > 0 else 0
    w = Work(forward_images=tasks * anchor, load_bytes=_task_bytes(params), held_bytes=_task_bytes(params), held_models=2 * tasks + 1, trains=True)
    threads = params.threads() or os.cpu_count() or 1
    if params.runtime.device != "cuda" and min(tasks, threads) > 1:  # stages.regime: one process a task, up to the threads
        w.fixed_s += REGIME_POOL_START_S
    one_epoch = total_steps(cfg.model_copy(update={"epochs": 1}), s.n_train, cfg.optimizer == "gd")
    for variant, kwargs in params.regimes.config(regime).variants(regime, cfg.steps).items():
        if regime == "one_epoch":
            variant_steps = one_epoch
        elif regime == "atm":
            k = kwargs["steps"] if kwargs["steps"] is not None else one_epoch
            variant_steps = kwargs["rounds"] * k
        else:
            variant_steps = steps
        w.train_images += tasks * variant_steps * per_step
        w.forward_images += tasks * (s.n_val + s.n_test) * (1 if regime == "one_epoch" else 3)  # + the own model's, every task
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


@functools.cache
def decode_seconds(image_size: int) -> float:
    """Seconds to decode one photo-sized JPEG (500 x 375, SUN397's typical size) and resize it to
    ``image_size``, as prepare does for every real image; the median of a few."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    smooth = np.repeat(np.repeat(rng.integers(0, 256, (47, 63, 3), dtype=np.uint8), 8, 0), 8, 1)[:375, :500]
    buffer = io.BytesIO()
    Image.fromarray(smooth).save(buffer, format="JPEG", quality=90)
    data = buffer.getvalue()

    def once():
        with Image.open(io.BytesIO(data)) as im:
            np.asarray(im.convert("RGB").resize((image_size, image_size), Image.BICUBIC))

    return _median_time(once, 0.5, 20)


def stage_work(params: Params, address: str) -> Work | None:
    """The work of one stage of dvc.yaml by its address (finetune@digits, merge@ties); None when not estimated."""
    work = _stage_work(params, address)
    if work is not None and address.partition("@")[0] not in ("prepare", "report", "track"):
        work.fixed_s += STAGE_SETUP_S
    return work


def _stage_work(params: Params, address: str) -> Work | None:
    kind, _, item = address.partition("@")
    s = params.suite
    if kind == "prepare":
        images = len(s.tasks) * (s.n_train + s.n_val + s.n_test)
        if s.source == "embedded":
            corpus = s.pretrain_images if params.backbone.pretrained is None else 0
            return Work(fixed_s=PREPARE_POOL_START_S + PREPARE_S_PER_IMAGE * (images + corpus))
        # real data: every image decoded and resized once, the tasks in parallel processes (at most the caps:
        # a smaller dataset takes less); each process holds its task's arrays
        workers = min(len(s.tasks), params.threads() or os.cpu_count() or 1)
        w = Work(fixed_s=PREPARE_POOL_START_S + images * decode_seconds(s.image_size) / workers, held_bytes=workers * (s.n_train + s.n_val + s.n_test) * s.image_size**2 * 3)
        w.notes.append("real data: decoding measured on a 500x375 JPEG; downloads not estimated")
        return w
    if kind == "pretrain":
        if params.backbone.pretrained is not None:
            return Work(notes=["loads pretrained weights: read time not estimated"])
        cfg = params.pretrain
        steps = cfg.steps if cfg.epochs is None else cfg.epochs * max(1, s.pretrain_images // cfg.batch_size)
        return Work(train_images=steps * cfg.batch_size, forward_images=min(2000, s.pretrain_images), trains=True, held_bytes=s.pretrain_images * s.image_size**2 * 3)
    if kind == "finetune":
        return finetune_work(params, address.partition("@")[2])
    if kind == "vectors":
        return vectors_work(params)
    if kind == "statistics":
        return statistics_work(params)
    if kind == "merge" and item:
        return merge_work(params, item)
    if kind == "regime" and item:
        return regime_work(params, item)
    if kind == "regime_merge" and item:
        return regime_merge_work(params, item)
    if kind == "report":
        return Work(fixed_s=REPORT_S)
    if kind == "track":
        checkpoints = (len(s.tasks) + len(params.merge.methods) + 1) * model_shape(params).parameters * 4 if params.tracking.log_checkpoints else 0
        return Work(fixed_s=TRACK_S, load_bytes=checkpoints, notes=["track: an assumed constant, never timed"])
    return None


def compute_seconds(work: Work, tp: Throughput) -> float:
    """The stage's own time: its work divided by the measured throughputs, plus its constants."""
    return (
        work.forward_images / tp.forward_img_s
        + work.train_images / tp.train_img_s
        + work.example_grads * tp.example_grad_s
        + work.param_passes * tp.param_pass_s
        + work.svds * tp.svd_s
        + work.load_bytes / LOAD_BYTES_PER_S
        + work.fixed_s
    )


def overhead_seconds(tp: Throughput) -> float:
    """A stage's start and bookkeeping: the process and its imports (measured), DVC's (a constant)."""
    return tp.import_s + DVC_BOOKKEEPING_S


def peak_bytes(work: Work, tp: Throughput, n_params: int) -> int:
    """The stage's peak memory: on CUDA the device's (the measured step's peak); on the CPU the process's, its
    RSS after its imports, the step's growth, and the models and data it holds besides."""
    step = tp.train_peak_bytes if work.trains else tp.forward_peak_bytes
    if tp.device.startswith("cuda"):
        return int(step)
    return int(tp.base_bytes + step + work.held_models * n_params * 4 + work.held_bytes)


# ---------------------------------------------------------------- the plan
def make_plan(params: Params, nodes, stale: set[str], tp: Throughput, *, include_all: bool = False) -> dict:
    """Every stage (``nodes``: orchestration.StageNode, in order) with whether it will run, its estimate (those
    that will run, or all with ``include_all``), and the total of those that will run."""
    n_params = model_shape(params).parameters
    rows, total = [], 0.0
    for node in nodes:
        will_run = node.address in stale
        row = {"stage": node.address, "will_run": will_run, "estimated": False, "seconds": None, "compute_seconds": None, "overhead_seconds": None, "peak_memory_bytes": None, "work": None, "notes": []}
        if will_run or include_all:
            work = stage_work(params, node.address)
            if work is None:
                row["notes"] = ["not estimated"]
            else:
                compute, overhead = compute_seconds(work, tp), overhead_seconds(tp)
                row |= {"estimated": True, "seconds": compute + overhead, "compute_seconds": compute, "overhead_seconds": overhead, "peak_memory_bytes": peak_bytes(work, tp, n_params), "notes": work.notes,
                        "work": {k: v for k, v in asdict(work).items() if k not in ("notes", "trains") and v}}
                if will_run:
                    total += row["seconds"]
        rows.append(row)
    unestimated = [r["stage"] for r in rows if r["will_run"] and not r["estimated"]]
    return {"device": tp.device, "throughput": asdict(tp), "parameters": n_params, "stages": rows, "total_seconds": total, "will_run": sum(r["will_run"] for r in rows), "not_estimated": unestimated}


def project_plan(root: str | Path, params: Params, *, include_all: bool = False, throughput: Throughput | None = None) -> dict:
    """The plan of the DVC project at ``root`` (its stages and which are out of date, as ``dvc status`` says)."""
    from mergeflow.orchestration import check_repo, stage_graph, stale_stages

    check_repo(root)
    nodes = stage_graph(root)
    stale = stale_stages(root, nodes)
    return make_plan(params, nodes, stale, throughput or measure_throughput(params), include_all=include_all)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {seconds % 60:02.0f} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def device_line(plan: dict) -> str:
    tp = plan["throughput"]
    return (
        f"device {plan['device']}, {tp['threads']} threads; backbone {plan['parameters'] / 1e6:.2f} M parameters: forward {tp['forward_img_s']:.0f} img/s (batch {tp['batches']['forward']}), "
        f"train {tp['train_img_s']:.0f} img/s (batch {tp['batches']['train']}), per-example gradient {1000 * tp['example_grad_s']:.1f} ms, parameter pass {1000 * tp['param_pass_s']:.2f} ms, "
        f"SVD {1000 * tp['svd_s']:.1f} ms; stage start {tp['import_s']:.1f} s + DVC {DVC_BOOKKEEPING_S:.1f} s; memory: {tp['memory_source']}"
    )


def plan_table(plan: dict):
    """A rich Table of the plan, its total in the caption."""
    from rich.table import Table

    table = Table(title="mergeflow plan (dvc repro, one stage after another)", title_justify="left")
    table.add_column("stage", no_wrap=True)
    table.add_column("will run")
    table.add_column("est. time", justify="right")
    table.add_column("peak memory", justify="right")
    table.add_column("notes", overflow="fold")
    for r in plan["stages"]:
        table.add_row(r["stage"], "yes" if r["will_run"] else "up to date", _duration(r["seconds"]) if r["estimated"] else ("not estimated" if r["notes"] else "-"), _size(r["peak_memory_bytes"]), "; ".join(n for n in r["notes"] if n != "not estimated"))
    missing = f"; not estimated: {', '.join(plan['not_estimated'])}" if plan["not_estimated"] else ""
    table.caption = f"total of the {plan['will_run']} stages that will run: {_duration(plan['total_seconds'])}{missing}"
    table.caption_justify = "left"
    return table


def print_plan(params_path: str, *, include_all: bool = False, as_json: bool = False, root: str = ".") -> int:
    """``mergeflow plan``: the table (or JSON) for the project in ``root``."""
    import json

    from rich.console import Console

    from mergeflow.config import load_params

    params = load_params(params_path)
    if not Path(root, "dvc.yaml").is_file():
        raise MergeflowError(f"{Path(root).resolve()}: no dvc.yaml (run `mergeflow plan` from the repository root)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the architecture only: nothing to fetch
    plan = project_plan(root, params, include_all=include_all)
    if as_json:
        print(json.dumps(plan, indent=2))
        return 0
    console = Console(width=min(Console().width, 140), highlight=False)
    console.print(plan_table(plan))
    console.print(device_line(plan), soft_wrap=False)
    return 0
