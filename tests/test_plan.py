"""mergeflow plan: the work counted per stage (by hand here), estimates = work / throughput, the will-run marking,
the JSON shape, the memory flag, the per-machine cache, the CLI's one-line error. Fast: a fake throughput, a fake
stage graph; one real measurement of a tiny backbone. No test times anything (bench/plan.py prints the speed)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mergeflow.runner import plan as P
from mergeflow.runner.plan.work import STAGE_SETUP_S
from mergeflow.cli import main
from mergeflow.params import parse_params
from mergeflow.runner.graph import StageNode

REPO = Path(__file__).resolve().parents[1]
TASKS = ["a", "b", "c"]


def small_params(**merge):
    return parse_params(
        {
            "suite": {"tasks": TASKS, "n_train": 100, "n_val": 10, "n_test": 20, "pretrain_images": 500},
            "backbone": {"kwargs": {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 1, "num_heads": 2}},
            "pretrain": {"steps": 7, "batch_size": 16},
            "probe": {"c_grid": [1.0], "max_iter": 10},
            "finetune": {
                "steps": 5,
                "batch_size": 8,
                "preserve_features": {"weight": 1.0, "images": 40, "batch_size": 4},
            },
            "statistics": {"examples": 6},
            "merge": {
                "methods": ["task_arithmetic", "task_negation", "cart", "adamerging", "weight_averaging"],
                "task_arithmetic": {"lam": [0.1, 0.2, 0.3, 0.4]},
                "task_negation": {"lam": [0.5, 1.0]},
                "cart": {"rank_ratio": [0.1, 0.2], "lam": [0.5, 1.0, 1.5]},
                "adamerging": {"steps": 3, "batch_size": 2},
                **merge,
            },
            "regimes": {"run": ["mima"], "mima": {"rounds": [5]}},
        }
    )


FAKE = P.Throughput(
    device="cpu",
    threads=1,
    forward_img_s=100.0,
    train_img_s=10.0,
    example_grad_s=0.5,
    param_pass_s=0.01,
    svd_s=0.2,
    train_peak_bytes=1000,
    forward_peak_bytes=500,
    base_bytes=100,
    memory_source="fake",
    import_s=1.0,
    batches={"forward": 4, "train": 2},
)


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


def test_surgery_wemoe_and_fw_merging_work_by_hand():
    p = small_params(
        methods=["surgery", "wemoe", "fw_merging"],
        surgery={"base": "task_arithmetic"},
        wemoe={"steps": 4, "batch_size": 2},
        fw_merging={"steps": 2, "examples": 1000},
    )
    test = 3 * 20
    surgery = P.stage_work(p, "merge@surgery")  # TA at its defaults (no adaptation), then two feature passes
    assert surgery.train_images == 0 and surgery.forward_images == 10 * 3 + test + 2 * test
    wemoe = P.stage_work(p, "merge@wemoe")  # AdaMerging's steps x tasks x batch, and each image through T MLPs
    assert wemoe.train_images == 4 * 3 * 2 and wemoe.trains
    assert wemoe.forward_images == pytest.approx(
        10 * 3 + test + 4 * 3 * 2 * 3 * P.work.MLP_SHARE * 2
    )  # x T MLPs, fwd + input grad
    assert P.stage_work(p, "merge@fw_merging").train_images == 2 * 3 * 100  # every train example (100 < 1000) a step


def test_training_stage_work_by_hand():
    p = small_params()
    ft = P.stage_work(p, "finetune@a")
    assert ft.train_images == 5 * (8 + 4)  # steps x (batch + anchor batch)
    assert ft.forward_images == (100 + 10 + 20 + 40) + (10 + 20)  # features of the splits and anchors, then accuracies
    assert P.stage_work(p, "pretrain").train_images == 7 * 16
    # no method of merge.methods reads them: only the stage's setup (it writes a note)
    assert P.stage_work(p, "statistics") == P.Work(fixed_s=STAGE_SETUP_S)
    st = P.stage_work(small_params(methods=["fisher", "task_arithmetic"]), "statistics")
    assert st.example_grads == 2 * 3 * 6 and st.forward_images == 3 * 6  # two Fishers per example, one Gram pass
    assert P.stage_work(p, "regime@mima").train_images == 3 * 5 * (8 + 4)  # every task's whole schedule
    assert P.stage_work(p, "study@mima") is None  # studies: not estimated


def test_estimate_is_work_over_throughput():
    work = P.Work(
        forward_images=200,
        train_images=30,
        example_grads=4,
        param_passes=10,
        svds=5,
        load_bytes=P.LOAD_BYTES_PER_S,
        fixed_s=0.25,
    )
    assert P.compute_seconds(work, FAKE) == pytest.approx(
        200 / 100 + 30 / 10 + 4 * 0.5 + 10 * 0.01 + 5 * 0.2 + 1 + 0.25
    )
    assert P.overhead_seconds(FAKE) == pytest.approx(P.STAGE_GAP_S) and P.overhead_seconds(
        FAKE, first=True
    ) == pytest.approx(1.0 + P.STAGE_GAP_S)
    assert P.peak_bytes(P.Work(trains=True), FAKE, 10) == 100 + 1000
    assert (
        P.peak_bytes(P.Work(held_models=2, held_bytes=7), FAKE, 10) == 100 + 500 + 2 * 10 * 4 + 7
    )  # base + step + held


def _nodes():
    return [
        StageNode("prepare", ("mergeflow", "prepare"), ()),
        StageNode("finetune@a", ("mergeflow", "finetune"), ("prepare",)),
        StageNode("merge@task_arithmetic", ("mergeflow", "merge"), ("finetune@a",)),
        StageNode("study@mima", ("mergeflow", "study"), ("merge@task_arithmetic",)),
    ]


def test_will_run_marking_total_and_json_shape():
    p = small_params()
    plan = P.make_plan(p, _nodes(), {"merge@task_arithmetic", "study@mima"}, FAKE)
    rows = {r["stage"]: r for r in plan["stages"]}
    assert [r["stage"] for r in plan["stages"]] == ["prepare", "finetune@a", "merge@task_arithmetic", "study@mima"]
    assert (
        not rows["prepare"]["will_run"] and rows["prepare"]["seconds"] is None
    )  # up to date: not estimated without --all
    merge = rows["merge@task_arithmetic"]
    assert merge["will_run"] and merge["seconds"] == pytest.approx(
        P.compute_seconds(P.stage_work(p, "merge@task_arithmetic"), FAKE) + P.overhead_seconds(FAKE, first=True)
    )
    assert rows["study@mima"]["will_run"] and not rows["study@mima"]["estimated"]
    assert (
        plan["total_seconds"] == pytest.approx(merge["seconds"])
        and plan["will_run"] == 2
        and plan["not_estimated"] == ["study@mima"]
    )
    everything = P.make_plan(p, _nodes(), {"merge@task_arithmetic"}, FAKE, include_all=True)
    assert all(r["estimated"] for r in everything["stages"][:3])
    assert everything["total_seconds"] == pytest.approx(
        merge["seconds"]
    )  # --all estimates, the total is still what runs
    shape = json.loads(json.dumps(plan))
    assert set(shape) == {
        "device",
        "throughput",
        "parameters",
        "stages",
        "total_seconds",
        "will_run",
        "not_estimated",
        "machine_memory_bytes",
        "machine_memory_of",
        "exceeds_memory",
    }
    assert set(shape["stages"][0]) == {
        "stage",
        "will_run",
        "estimated",
        "seconds",
        "compute_seconds",
        "overhead_seconds",
        "peak_memory_bytes",
        "exceeds_memory",
        "work",
        "notes",
    }
    P.plan_table(plan)  # renders


def test_measured_throughput_on_a_tiny_backbone():
    tp = P.measure_throughput(small_params(), budget_s=0.02)
    assert (
        tp.device == "cpu"
        and min(tp.forward_img_s, tp.train_img_s, 1 / tp.example_grad_s, 1 / tp.param_pass_s, 1 / tp.svd_s) > 0
    )
    assert tp.train_peak_bytes > 0 and tp.forward_peak_bytes > 0 and tp.import_s > 0
    assert tp.batches == {"forward": 512, "train": 8} and tp.measured_at


def test_cli_outside_a_project_is_one_line(tmp_path, monkeypatch, capsys):
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    monkeypatch.chdir(tmp_path)
    assert main(["plan"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "dvc.yaml" in err[0]


def test_an_imported_fine_tune_is_not_trained_and_a_zero_shot_head_fits_no_probe(repo_root):
    from mergeflow.params import load_params
    from mergeflow.runner.plan import finetune_work

    published = load_params(repo_root / "profiles" / "ta8_fusionbench.yaml")
    trained = load_params(repo_root / "profiles" / "ta8.yaml")
    s = trained.suite
    # zero-shot heads: features of val and test (the head on theta0), then val and test again after training
    assert finetune_work(trained, "SUN397").forward_images == 2 * (s.n_val + s.n_test)
    assert finetune_work(trained, "SUN397").train_images == 2000 * 128 and finetune_work(trained, "SUN397").fixed_s == 0
    assert finetune_work(published, "SUN397").train_images == 0


# ---------------------------------------------------------------- the estimate by hand, the memory flag
def test_a_fine_tune_estimate_by_hand():
    """finetune@a of small_params on FAKE: every term written out."""
    p = small_params()
    features = P.model_shape(p).features
    assert features == 32  # embed_dim: the probe's input width
    forward = (100 + 10 + 20 + 40) + (10 + 20)  # the splits' and anchors' features, then val and test accuracies
    train = 5 * (8 + 4)  # steps x (batch + anchor batch)
    probe = 1 * 100 * 32 * 32 * 0.8 / (3000 * 128**2)  # Newton: C values x examples x features^2 x s/unit
    compute = forward / 100.0 + train / 10.0 + probe + 1.0  # + the stage's setup (STAGE_SETUP_S)
    plan = P.make_plan(p, _nodes(), {"finetune@a"}, FAKE)
    row = next(r for r in plan["stages"] if r["stage"] == "finetune@a")
    assert row["compute_seconds"] == pytest.approx(compute)
    assert row["seconds"] == pytest.approx(
        compute + 1.0 + P.STAGE_GAP_S
    )  # + the stage server's imports (import_s: the run's first stage) + the gap
    assert plan["total_seconds"] == pytest.approx(row["seconds"])
    n = P.model_shape(p).parameters
    held = (100 + 10 + 20) * 32 * 32 * 3  # one task's images, uint8
    assert (
        row["peak_memory_bytes"] == 100 + 1000 + held
    )  # base + a training step's peak (FAKE) + its task's images; no models held
    assert P.stage_work(p, "merge@task_arithmetic").held_models == 3 + 3 and n > 0


def test_a_stage_over_the_machines_memory_is_flagged(capsys):
    p = small_params()
    nodes = _nodes()
    peaks = {
        r["stage"]: r["peak_memory_bytes"]
        for r in P.make_plan(p, nodes, {"prepare", "finetune@a", "merge@task_arithmetic"}, FAKE)["stages"]
    }
    assert peaks["merge@task_arithmetic"] > peaks["finetune@a"]  # six models' worth of task vectors held
    memory = (peaks["merge@task_arithmetic"] + peaks["finetune@a"]) // 2  # a machine between the two
    plan = P.make_plan(
        p, nodes, {"prepare", "finetune@a", "merge@task_arithmetic"}, FAKE, memory_bytes=memory, memory_of="RAM"
    )
    rows = {r["stage"]: r for r in plan["stages"]}
    assert rows["merge@task_arithmetic"]["exceeds_memory"] is True and rows["finetune@a"]["exceeds_memory"] is False
    assert rows["study@mima"]["exceeds_memory"] is None  # not estimated: no verdict
    assert plan["exceeds_memory"] == ["merge@task_arithmetic"] and plan["machine_memory_bytes"] == memory
    warning = P.memory_warning(plan)
    assert (
        warning.startswith("warning: 1 stage needs more than")
        and "merge@task_arithmetic" in warning
        and "finetune@a" not in warning
        and "RAM" in warning
    )
    from rich.console import Console

    console = Console(width=140, record=True)
    console.print(P.plan_table(plan))
    marked = [line for line in console.export_text().splitlines() if "!" in line]
    assert len(marked) == 1 and "merge@task_arithmetic" in marked[0]
    assert P.memory_warning(P.make_plan(p, nodes, {"merge@task_arithmetic"}, FAKE, memory_bytes=10**15)) is None


def test_machine_memory_is_the_gpus_on_cuda_else_the_ram():
    import dataclasses

    assert P.machine_memory(dataclasses.replace(FAKE, device="cuda (H100)", device_memory_bytes=80 * 2**30)) == (
        80 * 2**30,
        "GPU memory",
    )
    ram, what = P.machine_memory(FAKE)
    assert what == "RAM" and ram > 2**28


# ---------------------------------------------------------------- measuring: arithmetic, the cache
class _ScriptedMeter:
    """A PeakMemory whose peak the scripted call sets."""

    def __init__(self):
        self.value = 0

    def reset(self):
        self.value = 0

    def peak(self):
        return self.value


class _ScriptedStopwatch:
    """A Stopwatch that returns what the call returns as its seconds: no timing."""

    def time(self, fn):
        return fn()


def test_a_long_call_is_timed_at_two_small_batches_and_extrapolated():
    from mergeflow.runner.plan.measure import batch_cost

    meter, timed = _ScriptedMeter(), []

    def make_call(fixed_s, per_image_s):
        def at(n):
            timed.append(n)

            def call():
                meter.value = 1000 + 10 * n  # weights and optimiser states, then activations per image
                return fixed_s + per_image_s * n

            return call

        return at

    # about 32.5 s at 128: extrapolated from batch 8's time per image (the lesser), the memory along its line
    seconds, peak, at = batch_cost(make_call(0.5, 0.25), 128, _ScriptedStopwatch(), meter)
    assert (seconds, peak, at) == (pytest.approx(128 * (0.5 + 0.25 * 8) / 8), 1000 + 10 * 128, [4, 8]) and timed == [
        4,
        8,
    ]
    timed.clear()
    seconds, peak, at = batch_cost(make_call(0.001, 0.001), 64, _ScriptedStopwatch(), meter)  # 65 ms at 64: timed there
    assert (seconds, peak, at) == (pytest.approx(0.065), 1000 + 640, [64]) and timed == [4, 64]
    timed.clear()  # 0.23 s at 64: batch 4's time per image says 1.7 s, batch 8's 0.93 s, so timed there
    assert batch_cost(make_call(0.1, 0.002), 64, _ScriptedStopwatch(), meter)[2] == [64] and timed == [4, 8, 64]
    assert batch_cost(make_call(0.5, 0.25), 2, _ScriptedStopwatch(), meter)[2] == [2]
    timed.clear()  # a training step: one batch, and its optimiser step (0.5 s) timed alone; the memory the batch's
    seconds, peak, at = batch_cost(make_call(0.5, 0.25), 128, _ScriptedStopwatch(), meter, fixed_call=lambda: 0.5)
    assert (seconds, peak, at) == (pytest.approx(0.5 + 0.25 * 128), 1000 + 10 * 4, [4]) and timed == [4]


def test_fastest_time_is_the_minimum_of_the_calls():
    times = iter([5.0, 2.0, 3.0])
    assert P.fastest_time(lambda: None, budget_s=0, least=3, elapsed=lambda fn: next(times)) == 2.0


def test_total_steps_agrees_with_trainings():
    from mergeflow.runner.plan.work import total_steps
    from mergeflow.ml.training import total_steps as trainings

    cfg = small_params().finetune
    for update in ({}, {"epochs": 1}, {"epochs": 3, "batch_size": 7}, {"epochs": 2, "batch_size": 500}):
        c = cfg.model_copy(update=update)
        for full in (False, True):
            assert total_steps(c, 100, full) == trainings(c, 100, full)


def test_the_cache_serves_the_second_call_without_measuring(tmp_path, monkeypatch):
    from mergeflow.runner.plan import cache, measure

    p = small_params()
    calls = []
    monkeypatch.setattr(measure, "machine_busy", lambda: False)
    monkeypatch.setattr(measure, "measure_throughput", lambda params, **_: calls.append(1) or FAKE)
    first, source = cache.cached_throughput(p, directory=tmp_path)
    assert first == FAKE and not source["cached"] and len(calls) == 1
    [path] = tmp_path.glob("throughput-*.json")
    assert source["path"] == str(path) and not list(tmp_path.glob(".*"))  # written whole, no temporary left

    def fail(params, **_):
        raise AssertionError("measured again")

    monkeypatch.setattr(measure, "measure_throughput", fail)
    measure._SHAPES.clear()  # the shape comes from the file too
    second, source = cache.cached_throughput(p, directory=tmp_path)
    assert second == FAKE and source == {"cached": True, "path": str(path)}
    assert P.model_shape(p).parameters == json.loads(path.read_text())["shape"]["parameters"]
    other = small_params(task_arithmetic={"lam": [0.5]})  # the grids do not change what is measured: the same file
    assert cache.cached_throughput(other, directory=tmp_path)[1]["cached"]
    wider = parse_params(small_params().model_dump() | {"runtime": {"eval_batch_size": 64}})  # a batch size does
    with pytest.raises(AssertionError, match="measured again"):
        cache.cached_throughput(wider, directory=tmp_path)
    with pytest.raises(AssertionError, match="measured again"):  # --remeasure
        cache.cached_throughput(p, directory=tmp_path, remeasure=True)


def test_a_broken_or_busy_cache_file_is_measured_again(tmp_path, monkeypatch):
    import dataclasses

    from mergeflow.runner.plan import cache, measure

    p = small_params()
    monkeypatch.setattr(measure, "measure_throughput", lambda params, **_: dataclasses.replace(FAKE, busy=True))
    monkeypatch.setattr(measure, "machine_busy", lambda: True)
    _, source = cache.cached_throughput(p, directory=tmp_path)
    assert cache.cached_throughput(p, directory=tmp_path)[1]["cached"]  # busy then, busy now: served
    monkeypatch.setattr(measure, "machine_busy", lambda: False)
    monkeypatch.setattr(measure, "measure_throughput", lambda params, **_: FAKE)
    tp, again = cache.cached_throughput(p, directory=tmp_path)  # idle now: measured again, the file replaced
    assert not again["cached"] and tp == FAKE and cache.cached_throughput(p, directory=tmp_path)[0] == FAKE
    Path(source["path"]).write_text("{not json")
    assert not cache.cached_throughput(p, directory=tmp_path)[1]["cached"]


def test_an_unwritable_cache_is_a_warning_not_a_failure(tmp_path, monkeypatch, capsys):
    from mergeflow.runner.plan import cache, measure

    monkeypatch.setattr(measure, "measure_throughput", lambda params, **_: FAKE)
    blocker = tmp_path / "file"
    blocker.write_text("")
    tp, source = cache.cached_throughput(small_params(), directory=blocker / "plan")  # a file where the folder goes
    assert tp == FAKE and source == {"cached": False, "path": None}
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: ") and "not cached" in err[0]


def test_cli_plan_remeasure_reaches_the_cache_and_json_has_the_memory_fields(monkeypatch, capsys, repo_root):
    from mergeflow.runner.plan import cache

    asked = []

    def cached(params, *, remeasure=False, process_start=None, **_):
        asked.append(remeasure)
        return FAKE, {"cached": not remeasure, "path": "/x/throughput.json"}

    monkeypatch.setattr(cache, "cached_throughput", cached)
    monkeypatch.chdir(repo_root)
    assert main(["plan", "--json", "--remeasure"]) == 0 and asked == [True]
    plan = json.loads(capsys.readouterr().out)
    assert plan["throughput_source"] == {"cached": False, "path": "/x/throughput.json"}
    assert (
        plan["machine_memory_of"] == "RAM"
        and plan["machine_memory_bytes"] > 0
        and isinstance(plan["exceeds_memory"], list)
    )


def test_nothing_to_run_measures_nothing(monkeypatch, capsys, repo_root):
    """With every stage up to date, `mergeflow plan` says so without measuring this machine (seconds it would
    spend for no estimate); --all still measures, to estimate every stage."""
    from mergeflow.runner import graph
    from mergeflow.runner.plan import cache

    asked = []

    def cached(params, **_):
        asked.append(True)
        return FAKE, {"cached": True, "path": "/x/throughput.json"}

    monkeypatch.setattr(cache, "cached_throughput", cached)
    monkeypatch.setattr(graph, "stale_stages", lambda repo, nodes: set())
    monkeypatch.chdir(repo_root)
    assert main(["plan"]) == 0 and asked == []
    out = capsys.readouterr().out
    assert "total of the 0 stages that will run: 0.0 s" in out and "nothing to run, nothing measured" in out
    assert main(["plan", "--json"]) == 0 and asked == []
    plan = json.loads(capsys.readouterr().out)
    assert plan["will_run"] == 0 and plan["throughput"] is None and plan["device"] is None
    assert main(["plan", "--all", "--json"]) == 0 and asked == [True]
    assert json.loads(capsys.readouterr().out)["throughput"]["device"] == FAKE.device
