"""A plan from a GPU benchmark's figures: ``mergeflow plan --calibration <bench/gpu.py's JSON>``.

bench/gpu.py times, on the GPU machine, the work a plan counts (fine-tuning, the evaluator in float32 and in the
search's bf16, AdaMerging's loop, the per-example gradients of the statistics, a pass over the parameters, an SVD,
a merge stage reading its files, a stage's imports). Here those figures become the plan's Throughput, so that a plan
made anywhere, on a laptop too, estimates the run on that GPU from measured figures rather than assumed ones.
The benchmark must have measured the configured backbone at the configured image size.
"""

from __future__ import annotations

import json
from pathlib import Path

from mergeflow.config import Params
from mergeflow.core.errors import MergeflowError
from mergeflow.runner.plan.measure import Throughput

SECTIONS = ("finetune", "forward", "adamerging", "statistics", "host", "merge_stage")
# a stage's start where the benchmark could not import the stages (a GPU machine without DVC's and MLflow's
# packages): the median import of a merge stage on the 2-core machine with warm bytecode caches
DEFAULT_IMPORT_S = 2.0


def architecture(model: str) -> str:
    """timm's architecture name without its pretrained tag: vit_base_patch32_clip_quickgelu_224.openai -> ..._224."""
    return model.split(".")[0]


def read_bench(path: str | Path) -> dict:
    path = Path(path)
    try:
        result = json.loads(path.read_text())
    except FileNotFoundError:
        raise MergeflowError(f"{path}: calibration file not found (bench/gpu.py --json writes it)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise MergeflowError(f"{path}: not a readable JSON file ({err})") from None
    if not isinstance(result, dict) or result.get("bench") != "gpu":
        raise MergeflowError(f'{path}: not bench/gpu.py\'s output (no "bench": "gpu")')
    missing = [s for s in SECTIONS if not isinstance(result.get(s), dict)]
    if missing:
        raise MergeflowError(f"{path}: no figures for {', '.join(missing)} (run bench/gpu.py with every section)")
    return result


def check_matches(result: dict, params: Params, path: str | Path) -> None:
    """The figures are for params.yaml's backbone and image size, or one line says which differs."""
    if result.get("tiny"):
        raise MergeflowError(
            f"{path}: measured with --tiny (a 2-block ViT), not params.yaml's backbone; run bench/gpu.py without --tiny"
        )
    if (
        architecture(result["model"]) != architecture(params.backbone.model)
        or result.get("kwargs", {}) != params.backbone.kwargs
    ):
        raise MergeflowError(
            f"{path}: measured on '{result['model']}' {result.get('kwargs') or ''}, params.yaml's backbone.model is "
            f"'{params.backbone.model}' {params.backbone.kwargs or ''}; "
            f"run bench/gpu.py --model {architecture(params.backbone.model)}"
        )
    if result["image_size"] != params.suite.image_size:
        raise MergeflowError(
            f"{path}: measured at {result['image_size']} px, "
            f"params.yaml's suite.image_size is {params.suite.image_size}"
        )


def throughput_from_bench(path: str | Path, params: Params) -> Throughput:
    """The plan's Throughput from bench/gpu.py's figures (per-image rates: the fine-tune's at the benchmark's batch of
    128, the papers' and profiles/ta8.yaml's)."""
    result = read_bench(path)
    check_matches(result, params, path)
    f, fw, ada, st, host, merge = (result[s] for s in SECTIONS)
    cuda = result["device"].startswith("cuda")
    return Throughput(
        device=result["device"],
        threads=int(result["threads"]),
        forward_img_s=float(fw["float32_images_per_s"]),
        train_img_s=float(f["images_per_s"]),
        example_grad_s=1.0 / float(st["fisher_examples_per_s"]),
        param_pass_s=float(host["param_pass_s"]),
        svd_s=float(host["svd_s"]),
        train_peak_bytes=int(f.get("peak_bytes", 0)),
        forward_peak_bytes=int(fw.get("peak_bytes", 0)),
        base_bytes=0,
        memory_source="CUDA's peak allocated, from the benchmark"
        if cuda
        else "not measured (the benchmark ran on a CPU)",
        import_s=float(result.get("stage_import_s") or DEFAULT_IMPORT_S),
        batches={"forward": fw["batch_size"], "train": f["batch_size"]},
        timed_at={"forward": [fw["batch_size"]], "train": [f["batch_size"]]},
        decode_s=float(host.get("decode_s", 0.0)),
        device_memory_bytes=int(result.get("device_memory_bytes", 0)),
        measured_at=str(result.get("measured_at", "")),
        search_img_s=float(fw["bf16_images_per_s"]) if cuda else float(fw["float32_images_per_s"]),
        adaptation_img_s=float(ada["steps_per_s"]) * ada["tasks"] * ada["batch_size"],
        load_bytes_per_s=float(merge["read_bytes_per_s"]),
        calibration=str(path),
    )
