"""mergeflow plan: the work counted per stage (by hand here), estimates = work / throughput, the will-run marking,
the JSON shape, the CLI's one-line error. Fast: a fake throughput, a fake stage graph; one real measurement of a
tiny backbone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mergeflow import plan as P
from mergeflow.cli import main
from mergeflow.config import parse_params
from mergeflow.orchestration import StageNode

REPO = Path(__file__).resolve().parents[1]
TASKS = ["a", "b", "c"]


def small_params(**merge):
    return parse_params({
        "suite": {"tasks": TASKS, "n_train": 100, "n_val": 10, "n_test": 20, "pretrain_images": 500},
        "backbone": {"kwargs": {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 1, "num_heads": 2}},
        "pretrain": {"steps": 7, "batch_size": 16},
        "probe": {"c_grid": [1.0], "max_iter": 10},
        "finetune": {"steps": 5, "batch_size": 8, "preserve_features": {"weight": 1.0, "images": 40, "batch_size": 4}},
        "statistics": {"examples": 6},
        "merge": {"methods": ["task_arithmetic", "task_negation", "cart", "adamerging", "weight_averaging"],
                  "task_arithmetic": {"lam": [0.1, 0.2, 0.3, 0.4]}, "task_negation": {"lam": [0.5, 1.0]},
                  "cart": {"rank_ratio": [0.1, 0.2], "lam": [0.5, 1.0, 1.5]}, "adamerging": {"steps": 3, "batch_size": 2}, **merge},
        "regimes": {"run": ["mima"], "mima": {"rounds": [5]}},
    })


FAKE = P.Throughput(device="cpu", threads=1, forward_img_s=100.0, train_img_s=10.0, example_grad_s=0.5, param_pass_s=0.01, svd_s=0.2,
                    train_peak_bytes=1000, forward_peak_bytes=500, base_bytes=100, memory_source="fake", import_s=1.0, batches={"forward": 4, "train": 2})


def test_merge_work_counts_grid_candidates_times_tasks_times_val():
    p = small_params()
    val, test = 3 * 10, 3 * 20
    ta = P.stage_work(p, "merge@task_arithmetic")
    assert ta.forward_images == 4 * val + test  # 4 lambdas on every task's val, the choice on every test
    assert ta.svds == 0
    assert P.stage_work(p, "merge@weight_averaging").forward_images == val + test
    neg = P.stage_work(p, "merge@task_negation")  # theta0 on val, per task 2 lambdas on every val, per task every test
    assert neg.forward_images == val + 3 * 2 * val + 3 * test
    cart = P.stage_work(p, "merge@cart")  # 2 x 3 candidates; lam swept by interpolation: 2 merges per rank_ratio
    assert cart.forward_images == 6 * val + test
    assert cart.svds == pytest.approx(2 * 2 * 3 * P.model_shape(p).svd_units())  # calls x tasks x the matrices
    ada = P.stage_work(p, "merge@adamerging")
    assert ada.train_images == 3 * 3 * 2 and ada.trains  # steps x tasks x batch


def test_training_stage_work_by_hand():
    p = small_params()
    ft = P.stage_work(p, "finetune@a")
    assert ft.train_images == 5 * (8 + 4)  # steps x (batch + anchor batch)
    assert ft.forward_images == (100 + 10 + 20 + 40) + (10 + 20)  # features of the splits and anchors, then accuracies
    assert P.stage_work(p, "pretrain").train_images == 7 * 16
    st = P.stage_work(p, "statistics")
    assert st.example_grads == 2 * 3 * 6 and st.forward_images == 3 * 6  # two Fishers per example, one Gram pass
    assert P.stage_work(p, "regime@mima").train_images == 3 * 5 * (8 + 4)  # every task's whole schedule
    assert P.stage_work(p, "study@mima") is None  # studies: not estimated


def test_estimate_is_work_over_throughput():
    work = P.Work(forward_images=200, train_images=30, example_grads=4, param_passes=10, svds=5, load_bytes=P.LOAD_BYTES_PER_S, fixed_s=0.25)
    assert P.compute_seconds(work, FAKE) == pytest.approx(200 / 100 + 30 / 10 + 4 * 0.5 + 10 * 0.01 + 5 * 0.2 + 1 + 0.25)
    assert P.overhead_seconds(FAKE) == pytest.approx(1.0 + P.DVC_BOOKKEEPING_S)
    assert P.peak_bytes(P.Work(trains=True), FAKE, 10) == 100 + 1000
    assert P.peak_bytes(P.Work(held_models=2, held_bytes=7), FAKE, 10) == 100 + 500 + 2 * 10 * 4 + 7  # base + step + held


def _nodes():
    return [StageNode("prepare", ("mergeflow", "prepare"), ()), StageNode("finetune@a", ("mergeflow", "finetune"), ("prepare",)),
            StageNode("merge@task_arithmetic", ("mergeflow", "merge"), ("finetune@a",)), StageNode("study@mima", ("mergeflow", "study"), ("merge@task_arithmetic",))]


def test_will_run_marking_total_and_json_shape():
    p = small_params()
    plan = P.make_plan(p, _nodes(), {"merge@task_arithmetic", "study@mima"}, FAKE)
    rows = {r["stage"]: r for r in plan["stages"]}
    assert [r["stage"] for r in plan["stages"]] == ["prepare", "finetune@a", "merge@task_arithmetic", "study@mima"]
    assert not rows["prepare"]["will_run"] and rows["prepare"]["seconds"] is None  # up to date: not estimated without --all
    merge = rows["merge@task_arithmetic"]
    assert merge["will_run"] and merge["seconds"] == pytest.approx(P.compute_seconds(P.stage_work(p, "merge@task_arithmetic"), FAKE) + P.overhead_seconds(FAKE))
    assert rows["study@mima"]["will_run"] and not rows["study@mima"]["estimated"]
    assert plan["total_seconds"] == pytest.approx(merge["seconds"]) and plan["will_run"] == 2 and plan["not_estimated"] == ["study@mima"]
    everything = P.make_plan(p, _nodes(), {"merge@task_arithmetic"}, FAKE, include_all=True)
    assert all(r["estimated"] for r in everything["stages"][:3])
    assert everything["total_seconds"] == pytest.approx(merge["seconds"])  # --all estimates, the total is still what runs
    shape = json.loads(json.dumps(plan))
    assert set(shape) == {"device", "throughput", "parameters", "stages", "total_seconds", "will_run", "not_estimated"}
    assert set(shape["stages"][0]) == {"stage", "will_run", "estimated", "seconds", "compute_seconds", "overhead_seconds", "peak_memory_bytes", "work", "notes"}
    P.plan_table(plan)  # renders


def test_measured_throughput_on_a_tiny_backbone():
    tp = P.measure_throughput(small_params(), budget_s=0.02)
    assert tp.device == "cpu" and min(tp.forward_img_s, tp.train_img_s, 1 / tp.example_grad_s, 1 / tp.param_pass_s, 1 / tp.svd_s) > 0
    assert tp.train_peak_bytes >= tp.forward_peak_bytes > 0 and tp.import_s > 0


def test_cli_outside_a_project_is_one_line(tmp_path, monkeypatch, capsys):
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    monkeypatch.chdir(tmp_path)
    assert main(["plan"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "dvc.yaml" in err[0]


def test_an_imported_fine_tune_is_not_trained_and_a_zero_shot_head_fits_no_probe(repo_root):
    from mergeflow.config import load_params
    from mergeflow.plan import finetune_work

    published = load_params(repo_root / "profiles" / "ta8_fusionbench.yaml")
    trained = load_params(repo_root / "profiles" / "ta8.yaml")
    s = trained.suite
    # zero-shot heads: features of val and test (the head on theta0), then val and test again after training
    assert finetune_work(trained, "SUN397").forward_images == 2 * (s.n_val + s.n_test)
    assert finetune_work(trained, "SUN397").train_images == 2000 * 128 and finetune_work(trained, "SUN397").fixed_s == 0
    assert finetune_work(published, "SUN397").train_images == 0
