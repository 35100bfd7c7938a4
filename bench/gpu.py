"""The GPU path's figures in one command: fine-tuning, the evaluator, AdaMerging, the statistics and one whole merge
stage of the 8-task benchmark's size, on CLIP's image tower at its real shapes (random weights: the architecture is
what costs), through the library's own functions. Prints a table and writes JSON that `mergeflow plan --calibration`
reads (mergeflow.runner.plan.calibration).

    python bench/gpu.py --json bench-gpu.json          # ViT-B/32 at 224 px, the benchmark's sizes (~2-3 min on an H100)
    python bench/gpu.py --model b16                    # or l14, or any timm CLIP model name
    python bench/gpu.py --sections finetune --compile  # one section; the backbone under torch.compile
    python bench/gpu.py --tiny                         # a 2-block ViT at 32 px and a few images: seconds, any device

Each figure is timed after a warm-up call (allocator, cuDNN's kernel choice), with the device synchronised around it.
MFU is model FLOPs (6 per parameter and token in the matrix products, 12 L T^2 D for attention: the PaLM paper's
count, fused attention included) over the GPU's dense bf16 peak from its datasheet; the FLOPs torch counts in one
step (FlopCounterMode) are printed beside it as a check. The merge stage writes its task files and task vectors to
--workdir, drops them from the page cache (posix_fadvise), then times reading them back, moving them to the device,
the validation search over task arithmetic's 10-point grid (bf16) and the chosen model's test (float32).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import nn

from mergeflow.config import BackboneConfig, FinetuneConfig
from mergeflow.ml.data import TaskData, load_task, save_task
from mergeflow.ml.evaluation import MultiTaskEvaluator
from mergeflow.core.io import load_state_dict, save_state_dict
from mergeflow.ml.merging import REGISTRY, MergeData
from mergeflow.ml.merging._adaptive import EntropyObjective
from mergeflow.ml.merging._tensors import svd
from mergeflow.ml.merging.search import search
from mergeflow.ml.models import build_backbone, make_head
from mergeflow.ml.statistics import fisher_diagonal, input_grams
from mergeflow.ml.training import finetune

MODELS = {
    "b32": "vit_base_patch32_clip_quickgelu_224",
    "b16": "vit_base_patch16_clip_quickgelu_224",
    "l14": "vit_large_patch14_clip_quickgelu_224",
}
# dense bf16 matrix throughput from the datasheets, FLOP/s (H200: the H100 SXM's chip)
PEAK_BF16 = {"H100 PCIe": 756e12, "H100": 989.4e12, "H200": 989.4e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12}
TA8_LAMBDAS = [0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0]  # profiles/ta8.yaml's task_arithmetic grid
SECTIONS = ("finetune", "forward", "adamerging", "statistics", "host", "merge_stage")


def sizes(tiny: bool) -> dict:
    if tiny:
        return dict(
            tasks=2,
            classes=3,
            batch=8,
            warm_steps=2,
            steps=3,
            pool=16,
            train=16,
            n_val=16,
            n_test=24,
            eval_batch=8,
            ada_batch=4,
            ada_steps=2,
            fisher=4,
            grams=8,
            grid=[0.3, 0.6, 1.0],
        )
    return dict(
        tasks=8,
        classes=10,
        batch=128,
        warm_steps=10,
        steps=50,
        pool=256,
        train=1024,
        n_val=1000,
        n_test=10000,
        eval_batch=512,
        ada_batch=16,
        ada_steps=20,
        fisher=64,
        grams=512,
        grid=TA8_LAMBDAS,
    )


def backbone_config(model: str, tiny: bool) -> BackboneConfig:
    kwargs = {"img_size": 32, "patch_size": 8, "embed_dim": 64, "depth": 2, "num_heads": 2} if tiny else {}
    return BackboneConfig(
        model=MODELS.get(model, model),
        kwargs=kwargs,
        global_pool="token",
        input_norm="pretrained_cfg",
        embedding="clip",
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def peak_memory(device: torch.device, into: dict):
    """The section's peak of allocated device memory (CUDA; nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    yield
    if device.type == "cuda":
        into["peak_bytes"] = int(torch.cuda.max_memory_allocated(device))


def timed(fn, device: torch.device) -> tuple[object, float]:
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def random_images(n: int, size: int, pool: int, seed: int) -> torch.Tensor:
    """n uint8 NHWC images drawn from a pool of distinct random ones (generating gigabytes of noise takes longer
    than the benchmark; what the backbone costs does not depend on the pixels)."""
    g = torch.Generator().manual_seed(seed)
    distinct = torch.randint(0, 256, (min(n, pool), size, size, 3), generator=g, dtype=torch.uint8)
    return distinct[torch.arange(n) % len(distinct)]


def model_flops_per_image(backbone, image_size: int, training: bool) -> float:
    """PaLM's count (Chowdhery et al. 2022, appendix B): 2 FLOPs per matrix parameter and token forward, 3x that for
    training, plus attention's 4 L T^2 D forward (12 for training). The patch embedding is a matrix product too."""
    net = backbone.net
    tokens = (image_size // net.patch_embed.patch_size[0]) ** 2 + getattr(net, "num_prefix_tokens", 1)
    in_blocks = sum(p.numel() for n, p in net.blocks.named_parameters() if p.ndim == 2)
    patch = net.patch_embed.proj.weight.numel()
    head = net.head.weight.numel() if isinstance(getattr(net, "head", None), nn.Linear) else 0
    forward = 2 * (in_blocks * tokens + patch * (tokens - 1) + head) + 4 * len(net.blocks) * tokens**2 * net.embed_dim
    return 3 * forward if training else forward


def matmul_floor_s(backbone, batch: int, image_size: int, device: torch.device) -> float:
    """One training step's matrix products and attention alone, in bf16, each shape timed by itself: the step's
    time if nothing else cost anything (norms, activations, casts, the optimiser), so its MFU is a ceiling for this
    batch. Per linear layer: the forward product and the two of the backward (the input's gradient, the weight's);
    the patch embedding has no input gradient and the frozen head no weight gradient."""
    net = backbone.net
    tokens = (image_size // net.patch_embed.patch_size[0]) ** 2 + getattr(net, "num_prefix_tokens", 1)
    rows = batch * tokens
    shapes: dict[tuple[int, int, int], int] = {}  # (m, k, n) -> how many products of that shape a step makes

    def add(m, k, n, times=1):
        shapes[(m, k, n)] = shapes.get((m, k, n), 0) + times

    for module in net.blocks.modules():
        if isinstance(module, nn.Linear):
            k, n = module.in_features, module.out_features
            add(rows, k, n)  # forward
            add(rows, n, k)  # the input's gradient
            add(k, rows, n)  # the weight's gradient
    patch = net.patch_embed.proj.weight
    add(batch * (tokens - 1), patch[0].numel(), patch.shape[0], 2)  # forward and the weight's gradient
    add(batch, net.head.in_features, net.head.out_features, 2)  # forward and the input's gradient
    seconds = 0.0
    for (m, k, n), count in shapes.items():
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
        seconds += count * event_time(lambda a=a, b=b: a @ b, device)
    heads = net.blocks[0].attn.num_heads
    q, k, v = (
        torch.randn(
            batch, heads, tokens, net.embed_dim // heads, device=device, dtype=torch.bfloat16, requires_grad=True
        )
        for _ in range(3)
    )
    out = nn.functional.scaled_dot_product_attention(q, k, v)
    grad = torch.randn_like(out)
    forward = event_time(lambda: nn.functional.scaled_dot_product_attention(q, k, v), device)
    both = event_time(
        lambda: torch.autograd.grad(nn.functional.scaled_dot_product_attention(q, k, v), (q, k, v), grad), device
    )
    return seconds + len(net.blocks) * max(both, forward)


def event_time(fn, device: torch.device, repeats: int = 20) -> float:
    """Median seconds of ``fn`` after a warm-up: by CUDA events on a GPU, the host's clock elsewhere."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device.type != "cuda":
            times.append(timed(fn, device)[1])
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def counted_flops(fn) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def peak_flops(device: torch.device, given: float | None) -> tuple[float | None, str]:
    if given:
        return given * 1e12, "given"
    if device.type != "cuda":
        return None, "not a GPU"
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16.items():
        if all(word in name for word in key.split()):
            return value, f"{key} datasheet, dense bf16"
    return None, f"unknown for {name} (give --peak-tflops)"


# ---------------------------------------------------------------- sections
def bench_finetune(cfg: BackboneConfig, size: dict, image_size: int, device: torch.device, args) -> dict:
    backbone = build_backbone(cfg)
    if args.compile:
        backbone.net = torch.compile(backbone.net)
    head = make_head(backbone.num_features, size["classes"])
    images = random_images(size["train"], image_size, size["pool"], seed=1)
    labels = torch.randint(0, size["classes"], (size["train"],), generator=torch.Generator().manual_seed(2))
    schedule = dict(batch_size=size["batch"], lr=1e-5, weight_decay=0.1, warmup_steps=0)
    out: dict = {
        "batch_size": size["batch"],
        "steps": size["steps"],
        "compile": bool(args.compile),
        "baseline": bool(args.baseline),
    }
    with peak_memory(device, out):
        _, out["warmup_s"] = timed(
            lambda: finetune(
                backbone,
                head,
                images,
                labels,
                FinetuneConfig(steps=size["warm_steps"], **schedule),
                seed=0,
                device=device,
            ),
            device,
        )
        _, seconds = timed(
            lambda: finetune(
                backbone, head, images, labels, FinetuneConfig(steps=size["steps"], **schedule), seed=1, device=device
            ),
            device,
        )
    out["seconds"] = seconds
    out["images_per_s"] = size["steps"] * size["batch"] / seconds
    per_image = model_flops_per_image(build_backbone(cfg), image_size, training=True)
    out["model_flops_per_image"] = per_image

    def one_step():
        batch = images[: size["batch"]].to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = nn.functional.cross_entropy(head(backbone(batch)).float(), labels[: size["batch"]].to(device))
        loss.backward()

    out["counted_flops_per_image"] = counted_flops(one_step) / size["batch"]
    peak, source = peak_flops(device, args.peak_tflops)
    out["tflops"] = out["images_per_s"] * per_image / 1e12
    out["peak_tflops"], out["peak_source"] = (peak / 1e12 if peak else None), source
    out["mfu"] = out["images_per_s"] * per_image / peak if peak else None
    if not args.no_floor:
        floor = matmul_floor_s(build_backbone(cfg), size["batch"], image_size, device)
        out["matmul_floor_images_per_s"] = size["batch"] / floor
        out["matmul_floor_mfu"] = size["batch"] / floor * per_image / peak if peak else None
    return out


def synthetic_tasks(size: dict, image_size: int, splits: dict[str, int]) -> dict[str, TaskData]:
    from mergeflow.ml.data import Split

    tasks = {}
    for i in range(size["tasks"]):
        parts = {}
        for j, (split, n) in enumerate(splits.items()):
            g = torch.Generator().manual_seed(100 * i + j)
            parts[split] = Split(
                random_images(n, image_size, size["pool"], seed=100 * i + j),
                torch.randint(0, size["classes"], (n,), generator=g),
            )
        tasks[f"task{i}"] = TaskData(
            f"task{i}",
            [str(c) for c in range(size["classes"])],
            train=parts.get("train"),
            val=parts.get("val"),
            test=parts.get("test"),
        )
    return tasks


def random_heads(tasks, features: int, classes: int) -> dict[str, nn.Linear]:
    torch.manual_seed(3)
    return {t: make_head(features, classes) for t in tasks}


def bench_forward(cfg: BackboneConfig, size: dict, image_size: int, device: torch.device, args) -> dict:
    tasks = synthetic_tasks(size, image_size, {"val": size["n_val"]})
    heads = random_heads(tasks, build_backbone(cfg).num_features, size["classes"])
    state = build_backbone(cfg).net.state_dict()
    out: dict = {"images": size["tasks"] * size["n_val"], "batch_size": size["eval_batch"]}
    with peak_memory(device, out):
        for name, bf16, tf32 in (("float32", False, False), ("bf16", True, False), ("tf32", False, True)):
            if name == "tf32" and device.type != "cuda":
                continue
            evaluator = MultiTaskEvaluator(cfg, tasks, heads, "val", device, size["eval_batch"], bf16=bf16)
            previous = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = tf32
            try:
                evaluator(state)  # warm-up
                _, seconds = timed(lambda evaluator=evaluator: evaluator(state), device)
            finally:
                torch.backends.cuda.matmul.allow_tf32 = previous
            out[f"{name}_images_per_s"] = out["images"] / seconds
    return out


def task_vectors(state: dict, tasks: int, scale: float = 1e-3) -> dict[str, dict[str, torch.Tensor]]:
    return {
        f"task{i}": {
            k: scale * torch.randn(v.shape, generator=torch.Generator().manual_seed(i)) for k, v in state.items()
        }
        for i in range(tasks)
    }


def bench_adamerging(cfg: BackboneConfig, size: dict, image_size: int, device: torch.device, args, vectors) -> dict:
    theta0, taus = vectors
    tasks = synthetic_tasks(size, image_size, {"test": max(4 * size["ada_batch"], size["ada_batch"] * 2)})
    heads = random_heads(tasks, build_backbone(cfg).num_features, size["classes"])
    inputs = {"test": {t: d.test.inputs for t, d in tasks.items()}}
    out: dict = {"tasks": size["tasks"], "batch_size": size["ada_batch"], "steps": size["ada_steps"]}
    with peak_memory(device, out):
        data = MergeData(objective=EntropyObjective(build_backbone(cfg), heads, inputs, device))
        method = REGISTRY["adamerging"].with_data(data)
        method(theta0, taus, steps=2, batch_size=size["ada_batch"])  # warm-up
        method(theta0, taus, steps=size["ada_steps"], batch_size=size["ada_batch"])
    out["steps_per_s"] = data.timing[-1]["steps_per_second"]
    return out


def bench_statistics(cfg: BackboneConfig, size: dict, image_size: int, device: torch.device, args) -> dict:
    backbone = build_backbone(cfg)
    head = make_head(backbone.num_features, size["classes"])
    images = random_images(max(size["fisher"], size["grams"]), image_size, size["pool"], seed=5)
    out: dict = {"fisher_examples": size["fisher"], "gram_images": size["grams"]}
    with peak_memory(device, out):
        fisher_diagonal(
            backbone, head, images[:2], None, generator=torch.Generator().manual_seed(0), device=device
        )  # warm-up
        _, seconds = timed(
            lambda: fisher_diagonal(
                backbone,
                head,
                images[: size["fisher"]],
                None,
                generator=torch.Generator().manual_seed(0),
                device=device,
            ),
            device,
        )
        out["fisher_examples_per_s"] = size["fisher"] / seconds
        input_grams(backbone, images[:2], batch_size=size["eval_batch"], device=device)
        _, seconds = timed(
            lambda: input_grams(backbone, images[: size["grams"]], batch_size=size["eval_batch"], device=device), device
        )
        out["gram_images_per_s"] = size["grams"] / seconds
    return out


def bench_host(cfg: BackboneConfig, device: torch.device, args, vectors) -> dict:
    """What the plan's merge estimate reads besides the forward passes: one elementwise pass over every parameter
    (on the host, where the merges' arithmetic runs) and one SVD of the largest matrix (on the SVD device)."""
    theta0, taus = vectors
    tau = next(iter(taus.values()))

    def one_pass():
        return {k: v + tau[k] for k, v in theta0.items()}

    one_pass()
    _, pass_s = timed(one_pass, torch.device("cpu"))
    largest = max((v for v in theta0.values() if v.ndim == 2), key=lambda v: v.shape[0] * v.shape[1] * min(v.shape))
    svd(largest)
    _, svd_s = timed(lambda: svd(largest), device)
    from mergeflow.runner.plan.measure import decode_seconds

    return {
        "param_pass_s": pass_s,
        "svd_s": svd_s,
        "svd_shape": list(largest.shape),
        "threads": torch.get_num_threads(),
        "decode_s": decode_seconds(224),
    }


def drop_from_page_cache(path: Path) -> bool:
    """Ask the kernel to forget the file's cached pages, so that reading it goes to the disk."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return True
    except (OSError, AttributeError):
        return False


class TimedScorer:
    """The evaluator, with the seconds its forward passes take added up."""

    def __init__(self, evaluator: MultiTaskEvaluator, device: torch.device):
        self.evaluator, self.device, self.seconds = evaluator, device, 0.0

    def _timed(self, fn):
        out, seconds = timed(fn, self.device)
        self.seconds += seconds
        return out

    def __call__(self, state):
        return self._timed(lambda: self.evaluator(state))

    def task(self, task, state):
        return self._timed(lambda: self.evaluator.task(task, state))

    def per_task(self, model_of):
        return {t: self.task(t, model_of(t)) for t in self.evaluator.tasks}


def read_stage_inputs(workdir: Path, taus, image_size: int):
    """The task files' val and test splits, the pretrained weights and the task vectors, as a merge stage reads them."""
    tasks = {
        t: load_task(workdir / f"{t}.safetensors", image_size, ("val", "test")) for t in taus
    }  # copies the splits out
    theta = load_state_dict(workdir / "pretrained.safetensors")
    return tasks, theta, {t: load_state_dict(workdir / f"tau-{t}.safetensors") for t in taus}


def bench_merge_stage(cfg: BackboneConfig, size: dict, image_size: int, device: torch.device, args, vectors) -> dict:
    """One merge stage (task arithmetic over its grid) as mergeflow.pipeline.stages.merge_and_evaluate runs it, from
    files."""
    theta0, taus = vectors
    workdir = Path(tempfile.mkdtemp(prefix="mergeflow-bench-", dir=args.workdir))
    files = []
    for t, data in synthetic_tasks(
        size, image_size, {"train": 4, "val": size["n_val"], "test": size["n_test"]}
    ).items():
        arrays = {
            f"{s}_{p}": getattr(data.split(s), "inputs" if p == "x" else "labels").numpy()
            for s in ("train", "val", "test")
            for p in ("x", "y")
        }
        save_task(workdir / f"{t}.safetensors", t, arrays, data.classes, image_size)
        files.append(workdir / f"{t}.safetensors")
    save_state_dict(workdir / "pretrained.safetensors", theta0)
    for t, tau in taus.items():
        save_state_dict(workdir / f"tau-{t}.safetensors", tau)
        files.append(workdir / f"tau-{t}.safetensors")
    files.append(workdir / "pretrained.safetensors")
    cold = all(drop_from_page_cache(f) for f in files)
    out: dict = {
        "method": "task_arithmetic",
        "tasks": size["tasks"],
        "n_val": size["n_val"],
        "n_test": size["n_test"],
        "grid": size["grid"],
        "cold_read": cold,
    }
    out["bytes_read"] = sum(f.stat().st_size for f in files)
    heads = random_heads(taus, build_backbone(cfg).num_features, size["classes"])
    try:
        with peak_memory(device, out):
            start = time.perf_counter()
            tasks, theta, loaded = read_stage_inputs(workdir, taus, image_size)
            out["read_s"] = time.perf_counter() - start
            on_val, out["val_to_device_s"] = timed(
                lambda: MultiTaskEvaluator(cfg, tasks, heads, "val", device, size["eval_batch"], bf16=True), device
            )
            scorer = TimedScorer(on_val, device)
            (best, output, curve, _), search_s = timed(
                lambda: search(REGISTRY["task_arithmetic"], {"lam": size["grid"]}, theta, loaded, scorer), device
            )
            out["search_forward_s"], out["merge_s"] = scorer.seconds, search_s - scorer.seconds
            on_test, out["test_to_device_s"] = timed(
                lambda: MultiTaskEvaluator(cfg, tasks, heads, "test", device, size["eval_batch"]), device
            )
            test, out["test_forward_s"] = timed(lambda: on_test(output), device)
            out["total_s"] = time.perf_counter() - start
        _, out["warm_read_s"] = timed(
            lambda: read_stage_inputs(workdir, taus, image_size), torch.device("cpu")
        )  # now from the page cache
    finally:
        for f in workdir.iterdir():
            f.unlink()
        workdir.rmdir()
    out["chosen_lam"] = best["hyperparameters"]["lam"]
    out["candidates"] = len(curve)
    data_s = out["read_s"] + out["val_to_device_s"] + out["test_to_device_s"]
    out["read_share"] = data_s / out["total_s"]
    out["read_bytes_per_s"] = out["bytes_read"] / out["read_s"]
    out["warm_read_bytes_per_s"] = out["bytes_read"] / out["warm_read_s"]
    out["search_images_per_s"] = len(curve) * size["tasks"] * size["n_val"] / out["search_forward_s"]
    out["test_images_per_s"] = size["tasks"] * size["n_test"] / out["test_forward_s"]
    return out


def stage_import_s() -> float | None:
    """A stage process's start: Python importing what a merge stage imports, the second of two imports (the first
    also writes the bytecode caches); None where the stages cannot be imported (a GPU machine without DVC's or
    MLflow's packages)."""
    times = []
    for _ in range(2):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", "import mergeflow.pipeline.stages"], capture_output=True)
        if done.returncode != 0:
            return None
        times.append(time.perf_counter() - start)
    return times[-1]


# ---------------------------------------------------------------- report
def table(result: dict) -> str:
    rows = [("device", result["device"]), ("model", f"{result['model']} at {result['image_size']} px")]
    f = result.get("finetune")
    if f:
        mfu = (
            f"{100 * f['mfu']:.1f}% of {f['peak_tflops']:.0f} TFLOP/s" if f.get("mfu") else f"n/a ({f['peak_source']})"
        )
        rows += [
            (
                "fine-tuning",
                f"{f['images_per_s']:,.0f} images/s at batch "
                f"{f['batch_size']}{' (compiled)' if f['compile'] else ''}"
                f"{' (baseline path)' if f['baseline'] else ''}",
            ),
            ("  model TFLOP/s, MFU", f"{f['tflops']:.1f}, {mfu}"),
            (
                "  FLOPs per image: model, counted",
                f"{f['model_flops_per_image'] / 1e9:.2f} G, {f['counted_flops_per_image'] / 1e9:.2f} G",
            ),
        ]
        if f.get("matmul_floor_images_per_s"):
            floor_mfu = f", MFU {100 * f['matmul_floor_mfu']:.1f}%" if f.get("matmul_floor_mfu") else ""
            rows.append(
                ("  products and attention alone", f"{f['matmul_floor_images_per_s']:,.0f} images/s{floor_mfu}")
            )
    if "forward" in result:
        r = result["forward"]
        tf32 = f", {r['tf32_images_per_s']:,.0f} float32 with TF32 products" if "tf32_images_per_s" in r else ""
        rows.append(
            (
                "evaluator forward",
                f"{r['float32_images_per_s']:,.0f} images/s float32, "
                f"{r['bf16_images_per_s']:,.0f} bf16{tf32} (batch {r['batch_size']})",
            )
        )
    one_line = {  # section -> (label, its line)
        "adamerging": (
            "AdaMerging",
            lambda r: f"{r['steps_per_s']:.2f} steps/s ({r['tasks']} tasks x {r['batch_size']} inputs a step)",
        ),
        "statistics": (
            "statistics",
            lambda r: (
                f"Fisher {r['fisher_examples_per_s']:,.1f} examples/s, Grams {r['gram_images_per_s']:,.0f} images/s"
            ),
        ),
        "host": (
            "host",
            lambda r: (
                f"one pass over the parameters {1e3 * r['param_pass_s']:.1f} ms, one SVD {r['svd_shape']} "
                f"{1e3 * r['svd_s']:.1f} ms"
            ),
        ),
    }
    rows += [(label, line(result[section])) for section, (label, line) in one_line.items() if section in result]
    if "merge_stage" in result:
        r = result["merge_stage"]
        rows += [
            (
                "merge stage",
                f"{r['total_s']:.1f} s: {r['tasks']} tasks, {r['candidates']} "
                f"candidates x {r['n_val']} val, {r['n_test']} test each",
            ),
            (
                "  reading data",
                f"{r['read_s']:.1f} s ({r['bytes_read'] / 1e9:.1f} GB, {r['read_bytes_per_s'] / 1e9:.2f} "
                f"GB/s{', from disk' if r['cold_read'] else ', page cache'}) + "
                f"{r['val_to_device_s'] + r['test_to_device_s']:.1f} s to the device: {100 * r['read_share']:.0f}%",
            ),
            (
                "  reading again",
                f"{r['warm_read_s']:.1f} s ({r['warm_read_bytes_per_s'] / 1e9:.2f} GB/s, from the page cache)",
            ),
            (
                "  search, test",
                f"merges {r['merge_s']:.1f} s, val forward {r['search_forward_s']:.1f} s (bf16), test forward "
                f"{r['test_forward_s']:.1f} s (float32)",
            ),
        ]
    if result.get("peak_bytes"):
        rows.append(("peak GPU memory", f"{result['peak_bytes'] / 2**30:.1f} GiB"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="b32", help="b32, b16, l14 or a timm CLIP model name (default b32)")
    parser.add_argument("--tiny", action="store_true", help="a 2-block ViT at 32 px and a few images (tests, CPU)")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile", action="store_true", help="fine-tune the backbone under torch.compile")
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="fine-tune on the earlier path: batches copied from the host, unfused optimiser, a loss read every step",
    )
    parser.add_argument("--no-floor", action="store_true", help="skip timing the step's matrix products alone")
    parser.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak, when it is not in the table")
    parser.add_argument(
        "--workdir", help="where the merge stage writes its files (default: the system's temporary folder)"
    )
    parser.add_argument("--json", type=Path, help="write the figures here (mergeflow plan --calibration reads it)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    if args.baseline:
        import mergeflow.ml.training as training

        training.resident = lambda tensor, device, share=0.5: tensor
        training.LOSS_READ_EVERY = 1
        plain = training._optimizer
        training._optimizer = lambda kind, params, cfg, momentum=0.0, device=None: plain(kind, params, cfg, momentum)
    cfg = backbone_config(args.model, args.tiny)
    size = sizes(args.tiny)
    probe = build_backbone(cfg)
    image_size = probe.net.patch_embed.img_size[0]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    result: dict = {
        "bench": "gpu",
        "version": 1,
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": f"{device.type} ({name})",
        "device_memory_bytes": torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0,
        "model": cfg.model,
        "kwargs": cfg.kwargs,
        "image_size": image_size,
        "parameters": sum(p.numel() for p in probe.parameters()),
        "tiny": args.tiny,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "sections": args.sections,
    }
    del probe
    vectors = None
    if {"adamerging", "host", "merge_stage"} & set(args.sections):
        theta0 = {k: v.detach().clone() for k, v in build_backbone(cfg).net.state_dict().items()}
        vectors = (theta0, task_vectors(theta0, size["tasks"]))
    for section in args.sections:
        start = time.perf_counter()
        if section == "finetune":
            result[section] = bench_finetune(cfg, size, image_size, device, args)
        elif section == "forward":
            result[section] = bench_forward(cfg, size, image_size, device, args)
        elif section == "adamerging":
            result[section] = bench_adamerging(cfg, size, image_size, device, args, vectors)
        elif section == "statistics":
            result[section] = bench_statistics(cfg, size, image_size, device, args)
        elif section == "host":
            result[section] = bench_host(cfg, device, args, vectors)
        elif section == "merge_stage":
            result[section] = bench_merge_stage(cfg, size, image_size, device, args, vectors)
        result[section]["section_s"] = time.perf_counter() - start
        print(f"{section}: {result[section]['section_s']:.1f} s", file=sys.stderr, flush=True)
    peaks = [r["peak_bytes"] for r in result.values() if isinstance(r, dict) and "peak_bytes" in r]
    result["peak_bytes"] = max(peaks, default=0)
    # (a tiny run calibrates no plan: its stage import, two processes of seconds each, is not timed)
    result["stage_import_s"] = None if args.tiny else stage_import_s()
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
