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
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from mergeflow.config import BackboneConfig
from mergeflow.ml.models import build_backbone

# the _gpu_* modules beside this file: importable when it runs as a script and when the tests load it by its path
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gpu_sections import bench_adamerging, bench_finetune, bench_forward, bench_host, bench_merge_stage
from _gpu_sections import bench_statistics, task_vectors

MODELS = {
    "b32": "vit_base_patch32_clip_quickgelu_224",
    "b16": "vit_base_patch16_clip_quickgelu_224",
    "l14": "vit_large_patch14_clip_quickgelu_224",
}
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
def finetune_rows(f: dict) -> list[tuple[str, str]]:
    """The fine-tuning section's rows: its speed, its model FLOP/s and MFU, and the step's products alone."""
    mfu = f"{100 * f['mfu']:.1f}% of {f['peak_tflops']:.0f} TFLOP/s" if f.get("mfu") else f"n/a ({f['peak_source']})"
    rows = [
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
        rows.append(("  products and attention alone", f"{f['matmul_floor_images_per_s']:,.0f} images/s{floor_mfu}"))
    return rows


def merge_stage_rows(r: dict) -> list[tuple[str, str]]:
    """The merge stage's rows: its total, then reading its files, reading them again, the search and the test."""
    return [
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


def table(result: dict) -> str:
    rows = [("device", result["device"]), ("model", f"{result['model']} at {result['image_size']} px")]
    if result.get("finetune"):
        rows += finetune_rows(result["finetune"])
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
        rows += merge_stage_rows(result["merge_stage"])
    if result.get("peak_bytes"):
        rows.append(("peak GPU memory", f"{result['peak_bytes'] / 2**30:.1f} GiB"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def use_the_baseline_path() -> None:
    """Fine-tuning as it was before: batches copied from the host, the unfused optimiser, a loss read every step."""
    import mergeflow.ml.training as training

    training.resident = lambda tensor, device, share=0.5: tensor
    training.LOSS_READ_EVERY = 1
    plain = training._optimizer
    training._optimizer = lambda kind, params, cfg, momentum=0.0, device=None: plain(kind, params, cfg, momentum)


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
        use_the_baseline_path()
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
