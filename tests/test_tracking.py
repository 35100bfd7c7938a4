"""What `mergeflow track` records in MLflow, on a copy of the session's tiny reference run (whose `dvc repro`
already ran track once): one metric convention for every merge run, nothing logged twice, merged models that load
back in one call, the registry's best model, and the stages' real times."""

import hashlib
import json
import sqlite3
from pathlib import Path

import pytest
import torch
import yaml
from mlflow import MlflowClient

from mergeflow.config import apply_overrides
from mergeflow.io import load_state_dict
from mergeflow.mlflow_model import load_model
from mergeflow.tracking import MERGE_METRICS, stage_times

from .conftest import copy_project, run

pytestmark = pytest.mark.e2e
TASKS = ["digits", "house_numbers", "count"]


def _rebase_store(db: Path, old: Path, new: Path) -> None:
    """Point a copied store's artifact locations at the copy's mlruns (they are absolute paths to the original)."""
    with sqlite3.connect(db) as con:
        for (table,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall():
            for _, column, kind, *_ in con.execute(f"PRAGMA table_info('{table}')").fetchall():
                if kind.upper() in ("TEXT", "VARCHAR") or kind.upper().startswith("VARCHAR"):
                    con.execute(f"UPDATE '{table}' SET \"{column}\" = replace(\"{column}\", ?, ?) WHERE \"{column}\" LIKE ?", (str(old), str(new), f"%{old}%"))


@pytest.fixture(scope="module")
def tracked(tiny_reference, tiny_env, tmp_path_factory):
    """(root, env, client, experiment id): a copy of the reference run and its MLflow store."""
    ref, _ = tiny_reference
    root = copy_project(ref, tmp_path_factory.mktemp("tracking") / "project")
    _rebase_store(root / "mlflow.db", ref.resolve(), root.resolve())
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    return root, tiny_env, client, client.get_experiment_by_name("mergeflow/embedded").experiment_id


def _runs(client, exp_id, stage=None):
    runs = client.search_runs([exp_id], filter_string=f"tags.`mergeflow.stage` = '{stage}'" if stage else "", max_results=1000)
    return {r.info.run_id: r for r in runs}


def _store_files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in (root / "mlruns").rglob("*") if p.is_file()}


def _read(root: Path, path: str):
    return json.loads((root / path).read_text())


def test_merge_runs_share_one_metric_convention(tracked):
    root, _, client, exp_id = tracked
    merges = {r.data.tags["mergeflow.item"]: r for r in _runs(client, exp_id, "merge").values()}
    assert set(merges) == {"weight_averaging", "task_arithmetic", "ties", "consensus_ta", "emr", "task_negation"}
    names = set(MERGE_METRICS) | {f"test_acc.{t}" for t in TASKS}
    for method, r in merges.items():
        extra = {f"control_acc.{t}" for t in TASKS} | {"control_avg"} if method == "task_negation" else set()
        assert set(r.data.metrics) == names | extra, method
        ev = _read(root, f"metrics/evaluate/{method}.json")
        average = ev["average"]["target"] if method == "task_negation" else ev["average"]
        assert r.data.metrics["test_avg"] == pytest.approx(100 * average, abs=0.006), method
        assert r.data.params["method"] == method and r.data.params["kind"] == ev["kind"]
        assert r.data.tags["mergeflow.fingerprint"]
    assert merges["ties"].data.params["k"] == "0.2" and merges["ties"].data.params["grid.lam"] == "0.8, 1.0"
    assert merges["consensus_ta"].data.params.keys() >= {f"tall_lambda.{t}" for t in TASKS}
    assert merges["task_negation"].data.params.keys() >= {f"lam.{t}" for t in TASKS}
    summary = {r["method"]: r for r in _read(root, "results/summary.json")["rows"]}
    assert merges["ties"].data.metrics["gap_recovered"] == pytest.approx(100 * summary["ties"]["gap_recovered"], abs=0.006)
    curve = json.loads(Path(client.download_artifacts(merges["ties"].info.run_id, "curves/val_curve.json")).read_text())
    assert curve["x"] == ["lam"] and sorted(r["lam"] for r in curve["rows"]) == [0.8, 1.0]
    assert "plots/ties.png" in {a.path for a in client.list_artifacts(merges["ties"].info.run_id, "plots")}
    experiment = client.get_experiment(exp_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    view = json.loads(json.loads(experiment.tags["mlflow.sharedViewState.methods"])["state"])
    assert view["orderByKey"] == "metrics.`test_avg`" and "metrics.`test_avg`" in view["selectedColumns"]
    assert _read(root, "metrics/tracking.json")["ui_path"] == f"/#/experiments/{exp_id}/runs?viewStateShareKey=methods&workflowType=machine_learning"


def test_runs_start_and_end_at_the_stages_times(tracked):
    root, _, client, exp_id = tracked
    for r in _runs(client, exp_id).values():
        stage, item = r.data.tags["mergeflow.stage"], r.data.tags.get("mergeflow.item")
        if stage == "pipeline":
            continue
        timing = root / "logs/timing" / (f"{stage}/{item}.json" if item else f"{stage}.json")
        started, ended = stage_times(timing, ("evaluate_wall_time_s",) if stage == "merge" else ())
        assert (r.info.start_time, r.info.end_time) == (int(started * 1000), int(ended * 1000)), r.info.run_name
        if "started" in _read(root, str(timing.relative_to(root))):
            assert r.info.start_time == int(_read(root, str(timing.relative_to(root)))["started"] * 1000)


def test_merged_model_loads_back_in_one_call(tracked):
    root, _, client, exp_id = tracked
    for r in _runs(client, exp_id, "merge").values():
        method = r.data.tags["mergeflow.item"]
        if r.data.params["kind"] != "model":
            assert "mergeflow.model_uri" not in r.data.tags, method  # per-task stores and negation are not one model
            continue
        state = load_model(f"runs:/{r.info.run_id}/model", f"sqlite:///{root / 'mlflow.db'}").net.state_dict()
        expected = load_state_dict(root / f"merged/{method}.safetensors")
        assert state.keys() == expected.keys(), method
        for key, tensor in expected.items():
            assert torch.equal(state[key], tensor), (method, key)


def test_registry_holds_the_best_merged_model(tracked):
    _, _, client, exp_id = tracked
    singles = [r for r in _runs(client, exp_id, "merge").values() if r.data.params["kind"] == "model"]
    top = max(r.data.metrics["test_avg"] for r in singles)
    versions = client.search_model_versions("name = 'mergeflow-embedded'")
    latest = max(versions, key=lambda v: int(v.version))
    best = next(r for r in singles if r.info.run_id == latest.run_id)  # a tie goes to the method listed first
    assert best.data.metrics["test_avg"] == top and latest.tags["method"] == best.data.params["method"]
    assert {k: latest.tags[k] for k in best.data.params if k not in ("method", "kind", "paper") and not k.startswith("grid.")} == {
        k: v for k, v in best.data.params.items() if k not in ("method", "kind", "paper") and not k.startswith("grid.")
    }


def test_track_logs_only_what_changed(tracked):
    root, env, client, exp_id = tracked
    before, files = _runs(client, exp_id), _store_files(root)

    out = run("mergeflow track", root, env)  # nothing changed
    assert "0 new runs" in out
    assert _runs(client, exp_id).keys() == before.keys() and _store_files(root) == files

    # one merge hyperparameter changes; its stage re-runs and DVC records it, as dvc repro would
    old_md5 = next(o["md5"] for o in yaml.safe_load((root / "dvc.lock").read_text())["stages"]["merge@ties"]["outs"] if o["path"] == "merged/ties.safetensors")
    apply_overrides(root / "params.yaml", ["merge.ties.k=0.1"])
    run("mergeflow merge", root, env | {"DVC_STAGE": "merge@ties"})
    run("mergeflow report", root, env)
    run("dvc commit -f merge@ties report", root, env)
    run("mergeflow track", root, env)

    after = _runs(client, exp_id)
    new = [after[r] for r in after.keys() - before.keys()]
    assert sorted((r.data.tags["mergeflow.stage"], r.data.tags.get("mergeflow.item")) for r in new) == [("merge", "ties"), ("pipeline", None)]
    ties = next(r for r in new if r.data.tags["mergeflow.stage"] == "merge")
    assert ties.data.params["k"] == "0.1"
    added = {f: n for f, n in _store_files(root).items() if f not in files}
    weights = [f for f in added if f.endswith(".safetensors")]
    changed = hashlib.md5((root / "merged/ties.safetensors").read_bytes()).hexdigest() != old_md5
    assert [Path(f).name for f in weights] == (["ties.safetensors"] if changed else []), weights  # the changed model only
    pipeline = next(r for r in new if r.data.tags["mergeflow.stage"] == "pipeline")
    assert pipeline.data.tags["stage_run.merge.ties"] == ties.info.run_id
    assert pipeline.data.tags["stage_run.merge.emr"] == next(r.info.run_id for r in before.values() if r.data.tags.get("mergeflow.item") == "emr")
    assert _read(root, "metrics/tracking.json")["run_id"] == pipeline.info.run_id
