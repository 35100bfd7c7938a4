"""The device's speeds and memory on the configured backbone, measured in seconds (random weights in the real
architecture: the architecture is what costs, never the hub's weights).

Measured so that other load on a shared machine moves the figures little: each figure is the fastest of a few
short repetitions (load only ever slows a call down, so the minimum is the call's own time), a call on the CPU
counts the CPU time its threads ran rather than the time they waited for cores (Stopwatch), and a call that would
take long (ViT-B/32 on a CPU at batch 128) is timed at small batches and extrapolated. mergeflow.runner.plan.cache keeps
the result per machine, so a plan measures once.
"""

from __future__ import annotations

import io
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mergeflow.config import GENERATED, Params

# The smaller of the two batches a long call is timed at (the other is twice it): ViT-B/32 on 2 cores runs 4
# images in ~1 s, within 10% of batch 8's time per image.
SMALL_BATCH = 4
# A call at the configured batch that takes at most this long is timed there, not extrapolated.
DIRECT_CALL_S = 1.0
# A call on the CPU that takes at most this long is also timed on one thread (Stopwatch): cheap, and such calls
# (the tiny default ViT's: milliseconds) suffer most from other load.
ONE_THREAD_BELOW_S = 0.2


@dataclass(frozen=True)
class ModelShape:
    """What the costs scale with: the parameter count and the 2-D weights' shapes (the SVD methods' matrices),
    and the width of the features (a linear probe's input)."""

    parameters: int
    matrices: tuple[tuple[int, int], ...]
    features: int = 0

    @property
    def largest_matrix(self) -> tuple[int, int]:
        return max(self.matrices, key=lambda s: s[0] * s[1] * min(s), default=(1, 1))

    def svd_units(self) -> float:
        """One SVD of every 2-D weight, in units of one SVD of the largest (cost ~ m n min(m, n))."""
        m, n = self.largest_matrix
        return sum(a * b * min(a, b) for a, b in self.matrices) / (m * n * min(m, n))


def architecture_key(params: Params) -> dict:
    """What the backbone's shape depends on (not its weights)."""
    b = params.backbone
    return {"model": b.model, "kwargs": b.kwargs, "global_pool": b.global_pool, "embedding": b.embedding}


# shapes by architecture: building one (timm's import, a model on the meta device) takes seconds, and a plan asks
# for it in every merge stage's estimate; mergeflow.runner.plan.cache fills it from disk
_SHAPES: dict[str, ModelShape] = {}


def remember_shape(params: Params, shape: ModelShape) -> None:
    _SHAPES[json.dumps(architecture_key(params), sort_keys=True)] = shape


def model_shape(params: Params) -> ModelShape:
    """The backbone's shape, built on the meta device: no memory, no weights, any size."""
    key = json.dumps(architecture_key(params), sort_keys=True)
    if key not in _SHAPES:
        import torch

        from mergeflow.ml.models import new_backbone

        with torch.device("meta"):
            backbone = new_backbone(params.backbone)
        state = backbone.net.state_dict()
        matrices = tuple(
            tuple(v.shape) for k, v in state.items() if v.ndim == 2 and k.endswith("weight") and min(v.shape) > 1
        )
        _SHAPES[key] = ModelShape(sum(v.numel() for v in state.values()), matrices, backbone.num_features)
    return _SHAPES[key]


@dataclass(frozen=True)
class Throughput:
    """The device's measured speeds on the configured backbone (random init, same architecture)."""

    device: str
    threads: int
    forward_img_s: float  # eval, no grad, at runtime.eval_batch_size
    train_img_s: float  # forward + backward + AdamW step at finetune.batch_size
    example_grad_s: float  # one example's forward + backward at batch 1 (the statistics stage's Fisher)
    param_pass_s: float  # one torch.add over every parameter
    svd_s: float  # one SVD (merging._tensors.svd) of the largest 2-D weight
    train_peak_bytes: (
        int  # a training step's memory: CUDA's peak allocated; CPU: the peak RSS growth from before the model
    )
    forward_peak_bytes: int  # the same for an evaluation batch
    base_bytes: int  # a stage process's memory before any work (CPU: its RSS after imports, measured; CUDA: 0)
    memory_source: str
    # a stage process's imports, `python -m mergeflow.cli --help` (under mergeflow repro: once, the stage server's)
    import_s: float
    batches: dict = field(default_factory=dict)  # the configured batch sizes the speeds are for
    timed_at: dict = field(default_factory=dict)  # the batch sizes actually timed (two: extrapolated to `batches`)
    decode_s: float = 0.0  # one photo-sized JPEG decoded and resized (real data's prepare); 0 when not measured
    device_memory_bytes: int = 0  # CUDA: the device's total memory (the CPU's RAM is read when planning)
    measured_at: str = ""  # when (UTC), and the 1-minute load average then: how busy the machine was
    load_average: float = 0.0
    busy: bool = False  # the load average was half the cores or more when measured (the figures: bounds)
    # from a GPU benchmark's figures (mergeflow.runner.plan.calibration);
    # 0: as forward_img_s, train_img_s, LOAD_BYTES_PER_S
    search_img_s: float = 0.0  # the validation search's forward passes (bf16 on CUDA)
    adaptation_img_s: float = 0.0  # images a second through AdaMerging's loop (forward and backward through the merge)
    load_bytes_per_s: float = 0.0  # a merge stage reading its task files and task vectors
    calibration: str = ""  # the benchmark file the figures come from, when they do


def wall_seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def fastest_time(
    fn: Callable[[], object],
    budget_s: float,
    most: int = 5,
    least: int = 2,
    elapsed: Callable[[Callable[[], object]], float] = wall_seconds,
) -> float:
    """The fastest of at least ``least`` and at most ``most`` calls of ``fn`` (each timed by ``elapsed``), calling
    again while ``budget_s`` has not passed. The fastest, not the mean or median: other work on a shared machine
    only slows a call, and a first call's warm-up (allocations, kernel selection) is slower too."""
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < least or (len(times) < most and time.perf_counter() - start < budget_s):
        times.append(elapsed(fn))
    return min(times)


def machine_busy() -> bool:
    """Whether other work keeps the cores busy: the 1-minute load average at half the usable cores or more."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return os.getloadavg()[0] >= 0.5 * cores


class Stopwatch:
    """Times calls on the device: the fastest of a few within ``budget_s``. On the CPU a busy machine stretches
    a multi-threaded call's wall time many times over, each operator waiting for a thread that another process
    holds, so there a call counts the lesser of its wall time and the CPU time its threads ran, over the threads
    (ViT-B/32's forward pass at batch 4 here, at load 5 on 2 cores: 2.7 s of wall time, 0.3-0.9 s so counted).
    Waiting threads spin, which that CPU time still counts: a short call (many small operators) is also timed on
    one thread by that thread's CPU time, which no other load changes and which is at most `threads` times the
    idle multi-threaded time (the tiny default ViT's pass over its parameters: 175 ms of wall time, 45 ms of CPU
    time over 2 threads, 0.2 ms on one thread)."""

    def __init__(self, device, budget_s: float):
        import torch

        self.threads = torch.get_num_threads()
        self.budget_s = budget_s
        self.on_cpu = device.type == "cpu"

    def elapsed(self, fn: Callable[[], object]) -> float:
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        return min(wall, cpu / self.threads) if self.on_cpu and cpu > 0 else wall

    def time(self, fn: Callable[[], object]) -> float:
        seconds = fastest_time(fn, self.budget_s, elapsed=self.elapsed)
        if not self.on_cpu or self.threads == 1 or seconds > ONE_THREAD_BELOW_S:
            return seconds
        import torch

        torch.set_num_threads(1)
        try:
            return min(seconds, fastest_time(fn, self.budget_s, elapsed=_thread_seconds))
        finally:
            torch.set_num_threads(self.threads)


def _thread_seconds(fn: Callable[[], object]) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


class PeakMemory:
    """Peak memory of a stretch of work: on CUDA the allocator's peak; on the CPU the process's peak resident set
    (Linux's VmHWM, reset through /proc/self/clear_refs; without it, the resident set after the work)."""

    def __init__(self, device):
        import psutil

        self.device = device
        self.process = psutil.Process()

    def _cuda(self) -> bool:
        return self.device.type == "cuda"

    def reset(self) -> None:
        if self._cuda():
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass

    def now(self) -> int:
        if self._cuda():
            import torch

            return torch.cuda.memory_allocated(self.device)
        return self.process.memory_info().rss

    def peak(self) -> int:
        if self._cuda():
            import torch

            return torch.cuda.max_memory_allocated(self.device)
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return self.now()


def _call_cost(call: Callable[[], object], stopwatch: Stopwatch, meter: PeakMemory) -> tuple[float, int]:
    """(seconds, peak bytes) of ``call``."""
    meter.reset()
    seconds = stopwatch.time(call)
    return seconds, meter.peak()


def batch_cost(
    make_call: Callable[[int], Callable[[], object]],
    batch: int,
    stopwatch: Stopwatch,
    meter: PeakMemory,
    *,
    fixed_call: Callable[[], object] | None = None,
) -> tuple[float, int, list[int]]:
    """(seconds, peak bytes, batches timed) of one call at ``batch``; ``make_call(n)`` prepares a call on n
    images. Timed at SMALL_BATCH first, then either at twice it (time: proportional to the batch; memory: the line
    through the two) or, given ``fixed_call``, that part of the call which does not grow with the batch, timed
    alone (a training step's optimiser step; the memory is then the small batch's, for the caller, who knows what
    grows, to extrapolate). Where that puts ``batch`` within DIRECT_CALL_S the call is timed at ``batch`` itself;
    else the extrapolation stands: seconds where the full batch takes minutes."""
    small = min(batch, SMALL_BATCH)
    seconds, peak = _call_cost(make_call(small), stopwatch, meter)
    if small == batch:
        return seconds, peak, [batch]
    if seconds / small * batch <= DIRECT_CALL_S:  # a small model: the whole batch is quick to time (an upper bound)
        seconds, peak = _call_cost(make_call(batch), stopwatch, meter)
        return seconds, peak, [batch]
    if fixed_call is not None:
        fixed_s = min(stopwatch.time(fixed_call), seconds)
        per_image, at_batch, timed = (seconds - fixed_s) / small, peak, [small]
    else:
        # per image, the lesser of the two batches' times: the fixed part, spread over a few images, makes each
        # an upper bound, and one call slowed by other load does not tilt a line through two noisy points
        double = min(batch, 2 * small)
        seconds2, peak2 = _call_cost(make_call(double), stopwatch, meter)
        if double == batch:
            return seconds2, peak2, [batch]
        fixed_s, per_image, timed = 0.0, min(seconds / small, seconds2 / double), [small, double]
        at_batch = max(peak, peak2) + max(0.0, (peak2 - peak) / (double - small)) * (batch - double)
    if fixed_s + per_image * batch <= DIRECT_CALL_S:
        seconds, peak = _call_cost(make_call(batch), stopwatch, meter)
        return seconds, peak, [batch]
    return fixed_s + per_image * batch, int(at_batch), timed


def stage_process_start() -> tuple[float, int]:
    """A stage process's start: seconds and peak resident bytes of `python -m mergeflow.cli --help` (it parses
    params.yaml and imports torch and the method registry, as a stage does). The seconds are its CPU time when
    that is less than its wall time: importing is one thread's work, and other load only adds waiting."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "mergeflow.cli", "--help"], capture_output=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return min(wall, cpu) if cpu > 0 else wall, after.ru_maxrss * 1024  # Linux reports kilobytes


def this_process_start() -> tuple[float, int]:
    """The same figures for this process up to now, when it is the `mergeflow` command before any work of its
    own (it has imported and parsed what a stage does): no second process to start."""
    import psutil

    usage = resource.getrusage(resource.RUSAGE_SELF)
    process = psutil.Process()
    wall = time.time() - process.create_time()
    return min(wall, usage.ru_utime + usage.ru_stime), process.memory_info().rss


def decode_seconds(image_size: int, budget_s: float = 0.3) -> float:
    """Seconds to decode one photo-sized JPEG (500 x 375, SUN397's typical size) and resize it to
    ``image_size``, as prepare does for every real image; the fastest of a few."""
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

    return fastest_time(once, budget_s, most=20, least=3)


def _train_cost(
    model, images, synced, batch_size: int, stopwatch: Stopwatch, meter: PeakMemory
) -> tuple[float, int, list[int]]:
    """A training step's seconds and peak memory at ``batch_size`` (batch_cost), AdamW's step timed apart; the peak
    extrapolated where a smaller batch was timed. The optimiser's states are freed on return."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    backward_peaks: list[int] = []  # each step's peak before the optimiser's step: what grows with the batch is in it

    def train_call(n):
        x = images(n)

        def step():
            meter.reset()
            loss = model(x).float().pow(2).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            backward_peaks.append(meter.peak())
            optimizer.step()

        return synced(step)

    model.train()
    # what stays whatever the batch: the weights (in memory now) and, float32 each, their gradients and AdamW's
    # two states; the optimiser's step is the same at any batch too: timed alone, it leaves one batch size to time
    stays = meter.now() + 12 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    train_s, train_peak, train_at = batch_cost(
        train_call, batch_size, stopwatch, meter, fixed_call=synced(optimizer.step)
    )
    if train_at != [batch_size]:  # extrapolated: the activations (and their gradients) grow
        activations_per_image = max(0, backward_peaks[-1] - stays) / train_at[0]
        train_peak = int(max(train_peak, stays + activations_per_image * batch_size))
    return train_s, train_peak, train_at


def _forward_cost(
    model, images, synced, batch_size: int, stopwatch: Stopwatch, meter: PeakMemory
) -> tuple[float, int, list[int]]:
    """An evaluation batch's seconds and peak memory at ``batch_size`` (batch_cost): the model in eval mode, no
    gradients."""
    import torch

    def forward_call(n):
        x = images(n)

        def call():
            with torch.no_grad():
                model(x)

        return synced(call)

    model.eval()
    return batch_cost(forward_call, batch_size, stopwatch, meter)


def _parameter_costs(params: Params, model, images, synced, stopwatch: Stopwatch) -> tuple[float, float, float]:
    """The seconds of what scales with the parameters: one example's gradient at batch 1, one torch.add over every
    parameter, one SVD (merging._tensors.svd) of the largest 2-D weight."""
    import torch

    from mergeflow.ml.merging import svd

    model.eval()
    weights = [p for p in model.parameters() if p.requires_grad]  # CLIP's projection bias is frozen
    x1 = images(1)
    example_s = stopwatch.time(synced(lambda: torch.autograd.grad(model(x1).sum(), weights)))
    detached = [p.detach() for p in weights]
    pass_s = stopwatch.time(synced(lambda: [torch.add(w, w) for w in detached]))
    shape = model_shape(params)
    matrix = torch.randn(*shape.largest_matrix)
    svd_s = stopwatch.time(synced(lambda: svd(matrix)))
    return example_s, pass_s, svd_s


def _inputs(params: Params, model, n: int, device):
    """``n`` random inputs of the suite's kind: uint8 images, or token ids with words in the first half of each row
    and padding after (a pair's typical length)."""
    import torch

    if params.suite.modality == "text":
        ids = torch.randint(5, model.net.config.vocab_size, (n, params.suite.seq_len), device=device)
        ids[:, params.suite.seq_len // 2 :] = model.net.config.pad_token_id
        return ids
    size = params.suite.image_size
    return torch.randint(0, 256, (n, size, size, 3), dtype=torch.uint8, device=device)


def measure_throughput(
    params: Params, *, budget_s: float = 0.25, process_start: tuple[float, int] | None = None
) -> Throughput:
    """Measure the backbone's speeds on runtime.device with the threads the stages use, each figure the fastest
    of a few calls within ``budget_s`` seconds (at least two calls: a big model's take longer). A stage process's
    start (seconds, bytes) is ``process_start`` when the caller has it (this_process_start), else measured."""
    from datetime import datetime, timezone

    import torch

    from mergeflow.ml.models import build_backbone, select_device
    from mergeflow.ml.training import seed_everything

    seed_everything(params.seed, params.threads())
    device = select_device(params.runtime.device)
    meter = PeakMemory(device)
    load, busy = os.getloadavg()[0], machine_busy()  # before this measuring adds to the load
    stopwatch = Stopwatch(device, budget_s)
    before_model = meter.now()
    model = build_backbone(params.backbone).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    size = params.suite.image_size

    def images(n):
        return _inputs(params, model, n, device)

    def synced(fn):
        if device.type != "cuda":
            return fn
        return lambda: (fn(), torch.cuda.synchronize())

    forward_s, forward_peak, forward_at = _forward_cost(
        model, images, synced, params.runtime.eval_batch_size, stopwatch, meter
    )
    train_s, train_peak, train_at = _train_cost(model, images, synced, params.finetune.batch_size, stopwatch, meter)
    example_s, pass_s, svd_s = _parameter_costs(params, model, images, synced, stopwatch)
    cuda = device.type == "cuda"
    base = 0 if cuda else before_model  # CPU: the growth over the process before the model
    import_s, import_rss = process_start or stage_process_start()
    return Throughput(
        device=str(device) + (f" ({torch.cuda.get_device_name(device)})" if cuda else ""),
        threads=torch.get_num_threads(),
        forward_img_s=params.runtime.eval_batch_size / forward_s,
        train_img_s=params.finetune.batch_size / train_s,
        example_grad_s=example_s,
        param_pass_s=pass_s,
        svd_s=svd_s,
        train_peak_bytes=int(max(train_peak - base, n_params * (4 if cuda else 16))),
        forward_peak_bytes=int(max(forward_peak - base, n_params * 4)),
        base_bytes=0 if cuda else int(import_rss),
        memory_source="CUDA max_memory_allocated of the measured step"
        if cuda
        else (
            "RSS: a stage process's after its imports (measured) + the step's peak RSS growth (at least parameters x "
            "16 B: weights, grads, 2 AdamW states) + the models and data the stage holds"
        ),
        import_s=import_s,
        batches={"forward": params.runtime.eval_batch_size, "train": params.finetune.batch_size},
        timed_at={"forward": forward_at, "train": train_at},
        decode_s=decode_seconds(size) if params.suite.source not in GENERATED else 0.0,
        device_memory_bytes=torch.cuda.get_device_properties(device).total_memory if cuda else 0,
        measured_at=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        load_average=round(load, 2),
        busy=busy,
    )
