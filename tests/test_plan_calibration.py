"""mergeflow plan --calibration: bench/gpu.py's figures (the H100 run committed under docs/gpu) as the plan's
throughput, each field from its figure; the estimate of a merge by hand from those rates; a benchmark of another
backbone, a tiny one or a partial one refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mergeflow.runner import plan as P
from mergeflow.cli import main
from mergeflow.params import load_params
from mergeflow.core.errors import MergeflowError
from mergeflow.ml.merging.search import golden_section
from mergeflow.runner.plan.calibration import throughput_from_bench

REPO = Path(__file__).resolve().parents[1]
H100 = REPO / "docs" / "gpu" / "2026-11-27-h100-vit-b32.json"


@pytest.fixture(scope="module")
def ta8():
    return load_params(REPO / "profiles" / "ta8.yaml")


def test_every_rate_comes_from_its_figure(ta8):
    bench = json.loads(H100.read_text())
    tp = throughput_from_bench(H100, ta8)
    assert tp.device == "cuda (NVIDIA H100 80GB HBM3)" and tp.calibration == str(H100)
    assert tp.train_img_s == bench["finetune"]["images_per_s"] and tp.batches["train"] == 128
    assert (
        tp.forward_img_s == bench["forward"]["float32_images_per_s"]
        and tp.search_img_s == bench["forward"]["bf16_images_per_s"]
    )
    assert tp.example_grad_s == pytest.approx(1 / bench["statistics"]["fisher_examples_per_s"])
    assert tp.adaptation_img_s == pytest.approx(
        bench["adamerging"]["steps_per_s"] * 8 * 16
    )  # 8 tasks x 16 inputs a step
    assert tp.load_bytes_per_s == bench["merge_stage"]["read_bytes_per_s"] and tp.svd_s == bench["host"]["svd_s"]
    assert (
        tp.device_memory_bytes == bench["device_memory_bytes"]
        and tp.train_peak_bytes == bench["finetune"]["peak_bytes"]
    )


def test_a_merge_estimate_by_hand_from_the_calibrated_rates(ta8):
    """merge@task_arithmetic on ta8 (8 tasks, 1000 val and 10000 test each, golden search over 10 lambdas): the
    candidates' val passes at the bf16 rate, the choice's test at float32's, the files at the read rate."""
    tp = throughput_from_bench(H100, ta8)
    work = P.stage_work(ta8, "merge@task_arithmetic")
    scored = len(golden_section(10, lambda i: 0.0))
    assert scored < 10 and work.search_images == scored * 8 * 1000
    data = 8 * 11000 * 224 * 224 * 3
    weights = 9 * P.model_shape(ta8).parameters * 4  # the pretrained weights and 8 task vectors
    assert work.load_bytes == data + weights
    passes = 2 * 4 * 8 + 2 * scored  # two merges of 4 passes a task, then one interpolation a candidate
    by_hand = (
        scored * 8000 / tp.search_img_s
        + 80000 / tp.forward_img_s
        + (data + weights) / tp.load_bytes_per_s
        + passes * tp.param_pass_s
        + 1.0
    )
    assert P.compute_seconds(work, tp) == pytest.approx(by_hand)


def test_adamerging_is_its_measured_loop_alone(ta8):
    """A calibrated AdaMerging step already holds the merged model's build: its passes are not added again."""
    tp = throughput_from_bench(H100, ta8)
    work = P.stage_work(ta8, "merge@adamerging")
    steps = 500 * 8 * 16
    assert work.adaptation_images == steps and work.adaptation_passes == 500 * 2 * 8
    uncalibrated = P.compute_seconds(work, tp.__class__(**{**tp.__dict__, "adaptation_img_s": 0.0}))
    calibrated = P.compute_seconds(work, tp)
    assert uncalibrated - calibrated == pytest.approx(
        steps / tp.train_img_s + work.adaptation_passes * tp.param_pass_s - steps / tp.adaptation_img_s
    )


def test_a_benchmark_of_another_backbone_size_or_a_partial_one_is_one_line(ta8, tmp_path):
    bench = json.loads(H100.read_text())
    cases = {
        "b16": (
            {**bench, "model": "vit_base_patch16_clip_quickgelu_224"},
            "run bench/gpu.py --model vit_base_patch32_clip_quickgelu_224",
        ),
        "size": ({**bench, "image_size": 336}, "measured at 336 px, params.yaml's suite.image_size is 224"),
        "tiny": ({**bench, "tiny": True}, "measured with --tiny"),
        "partial": ({k: v for k, v in bench.items() if k != "adamerging"}, "no figures for adamerging"),
        "other": ({"bench": "merge"}, "not bench/gpu.py's output"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(content))
        with pytest.raises(MergeflowError, match=message) as err:
            throughput_from_bench(path, ta8)
        assert str(path) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(MergeflowError, match="calibration file not found"):
        throughput_from_bench(tmp_path / "none.json", ta8)


def test_cli_plan_with_a_calibration_names_it(repo_root, tmp_path, monkeypatch, capsys):
    """The repository's own project, with the H100's figures relabelled for its backbone (a plan reads only rates)."""
    params = load_params(repo_root / "params.yaml")
    bench = json.loads(H100.read_text()) | {
        "model": params.backbone.model,
        "kwargs": params.backbone.kwargs,
        "image_size": params.suite.image_size,
    }
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    monkeypatch.chdir(repo_root)
    assert main(["plan", "--all", "--json", "--calibration", str(path)]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["device"] == "cuda (NVIDIA H100 80GB HBM3)" and plan["throughput"]["calibration"] == str(path)
    assert plan["machine_memory_of"] == "GPU memory" and plan["machine_memory_bytes"] == bench["device_memory_bytes"]
    assert params.merge.search == "grid"  # the default suite scores every grid point; the GPU profiles narrow
