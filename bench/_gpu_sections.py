"""bench/gpu.py's sections: each times one part of the GPU path through the library's own functions (fine-tuning,
the evaluator, AdaMerging, the statistics, the host's share of a merge, one whole merge stage from files) on
synthetic images and random weights, and returns its figures."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from _gpu_measure import counted_flops, matmul_floor_s, model_flops_per_image, peak_flops, peak_memory, timed
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


def random_images(n: int, size: int, pool: int, seed: int) -> torch.Tensor:
    """n uint8 NHWC images drawn from a pool of distinct random ones (generating gigabytes of noise takes longer
    than the benchmark; what the backbone costs does not depend on the pixels)."""
    g = torch.Generator().manual_seed(seed)
    distinct = torch.randint(0, 256, (min(n, pool), size, size, 3), generator=g, dtype=torch.uint8)
    return distinct[torch.arange(n) % len(distinct)]


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
