"""bench/gpu.py, the GPU path's benchmark, run tiny on the CPU: every section runs through the library, and its
figures agree with what they are made of (tests/test_cuda.py runs it on a GPU, where there is one)."""

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_bench(tmp_path: Path, *args: str) -> dict:
    spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "bench" / "gpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    bench.main(["--tiny", "--workdir", str(tmp_path), "--json", str(out), *args])
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    return run_bench(tmp_path_factory.mktemp("bench"), "--device", "cpu")


def test_every_section_reports_its_figures(tiny):
    for section in ("finetune", "forward", "adamerging", "statistics", "host", "merge_stage"):
        assert tiny[section]["section_s"] > 0, section
    f = tiny["finetune"]
    assert f["images_per_s"] == pytest.approx(f["steps"] * f["batch_size"] / f["seconds"])
    assert f["mfu"] is None and f["peak_source"] == "not a GPU"  # no datasheet peak for a CPU
    assert f["matmul_floor_images_per_s"] > 0  # the step's products alone
    assert tiny["forward"]["float32_images_per_s"] > 0 and tiny["forward"]["bf16_images_per_s"] > 0
    assert tiny["adamerging"]["steps_per_s"] > 0 and tiny["statistics"]["fisher_examples_per_s"] > 0


def test_model_flops_agree_with_the_flops_torch_counts(tiny):
    """PaLM's 6 x matrix parameters x tokens (+ attention) against FlopCounterMode's count of one real step: they
    differ only by what a fine-tune skips (the frozen head's weight gradient, the images' gradient), a few %."""
    f = tiny["finetune"]
    assert f["counted_flops_per_image"] == pytest.approx(f["model_flops_per_image"], rel=0.1)


def test_the_merge_stage_reads_what_it_wrote_and_searches_the_whole_grid(tiny):
    m = tiny["merge_stage"]
    assert m["candidates"] == len(m["grid"]) and m["chosen_lam"] in m["grid"]
    images = m["tasks"] * (4 + m["n_val"] + m["n_test"]) * tiny["image_size"] ** 2 * 3
    assert images < m["bytes_read"] < images + 40 * tiny["parameters"] * 4 + 10**6  # the images, 3 models' weights
    assert 0 < m["read_share"] < 1
    parts = (
        m["read_s"]
        + m["val_to_device_s"]
        + m["search_forward_s"]
        + m["merge_s"]
        + m["test_to_device_s"]
        + m["test_forward_s"]
    )
    assert parts == pytest.approx(m["total_s"], rel=0.05)


@pytest.mark.deploy
def test_the_session_script_keeps_the_benchmark_and_the_cuda_tests_output(tmp_path):
    """bench/gpu_session.sh, the one call a short GPU lease makes, dry-run on the CPU: the benchmark's JSON (what
    `mergeflow plan --calibration` reads), its table, and the CUDA tests' log (all skipped here), each in OUT."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OUT": str(tmp_path / "out"), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    # one section: the benchmark's sections themselves are the tests above
    proc = subprocess.run(
        ["bash", "bench/gpu_session.sh", "--tiny", "--device", "cpu", "--sections", "host", "--workdir", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = tmp_path / "out"
    result = json.loads((out / "gpu-bench.json").read_text())
    assert result["bench"] == "gpu" and result["tiny"] and result["device"].startswith("cpu")
    assert (
        "one pass over the parameters" in (out / "bench.log").read_text()
        and " skipped" in (out / "cuda-tests.log").read_text()
    )
    assert (
        "cuda False" in (out / "gpu.txt").read_text()
        and "bench/gpu.py: exit 0; tests/test_cuda.py: exit 0" in proc.stdout
    )
