"""What `mergeflow track` records in MLflow, on a copy of the session's tiny reference run (whose `dvc repro`
already ran track once): one metric convention for every merge run (the training-time regimes' too), the regimes'
variants and the studies' verdicts as their files say, nothing logged twice, and the stages' real times (what its
store gives back, the merged models, the registry's best and the UI: tests/test_tracking_models.py)."""

import hashlib
import json
import shutil
import sqlite3
import statistics
from pathlib import Path

import pytest
import torch
import yaml
from mlflow import MlflowClient

from mergeflow.params import apply_overrides
from mergeflow.core.io import load_state_dict
from mergeflow.ml.mlflow_model import load_model
from mergeflow.report.tracking import MERGE_METRICS, stage_times

from .conftest import copy_project, run
from .profiles import TINY

pytestmark = pytest.mark.e2e
TASKS = ["digits", "house_numbers", "count"]


def _tracked_copy(tiny_reference, tiny_env, tmp_path_factory):
    """(root, env, client, experiment id): a copy of the reference run and its MLflow store, tracked (each module
    that reads a store tracks a copy of its own: tests/test_tracking_models.py too)."""
    ref, _ = tiny_reference
    root = copy_project(ref, tmp_path_factory.mktemp("tracking") / "project")
    run(
        "mergeflow track", root, tiny_env
    )  # what ran after the reference's track (a study, when track does not depend on it)
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    return root, tiny_env, client, client.get_experiment_by_name("mergeflow/embedded").experiment_id


@pytest.fixture(scope="module")
def tracked_store(tiny_reference, tiny_env, tmp_path_factory):
    """(root, env, client, experiment id): a copy of the reference run and its MLflow store."""
    return _tracked_copy(tiny_reference, tiny_env, tmp_path_factory)


@pytest.fixture
def tracked(tracked_store, monkeypatch):
    """The tracked copy, read from its workspace: MLflow finds the artifacts there (their locations are relative)."""
    monkeypatch.chdir(tracked_store[0])
    return tracked_store


def _runs(client, exp_id, stage=None):
    runs = client.search_runs(
        [exp_id], filter_string=f"tags.`mergeflow.stage` = '{stage}'" if stage else "", max_results=1000
    )
    return {r.info.run_id: r for r in runs}


def _store_files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in (root / "mlruns").rglob("*") if p.is_file()}


def _read(root: Path, path: str):
    return json.loads((root / path).read_text())


def test_merge_runs_share_one_metric_convention(tracked):
    root, _, client, exp_id = tracked
    merges = {r.data.tags["mergeflow.item"]: r for r in _runs(client, exp_id, "merge").values()}
    assert set(merges) == set(TINY["merge"]["methods"])
    names = set(MERGE_METRICS) | {f"test_acc.{t}" for t in TASKS}
    for method, r in merges.items():
        # every model's test_avg has the leaderboard's interval (negation: its negated tasks')
        extra = (
            {f"control_acc.{t}" for t in TASKS} | {"control_avg"}
            if method == "task_negation"
            else {"test_avg_ci_low", "test_avg_ci_high"}
        )
        assert set(r.data.metrics) == names | extra, method
        ev = _read(root, f"metrics/evaluate/{method}.json")
        average = ev["average"]["target"] if method == "task_negation" else ev["average"]
        assert r.data.metrics["test_avg"] == pytest.approx(100 * average, abs=0.006), method
        assert r.data.params["method"] == method and r.data.params["kind"] == ev["kind"]
        assert r.data.tags["mergeflow.fingerprint"] and (r.data.tags["regime"], r.data.tags["variant"]) == (
            "standard",
            "standard",
        )
    assert merges["ties"].data.params["k"] == "0.2" and merges["ties"].data.params["grid.lam"] == "0.8, 1.0"
    assert merges["consensus_ta"].data.params.keys() >= {f"tall_lambda.{t}" for t in TASKS}
    assert merges["task_negation"].data.params.keys() >= {f"lam.{t}" for t in TASKS}
    summary = {
        r["method"]: r for r in _read(root, "results/summary.json")["rows"] if r["regime"] == "standard"
    }  # the regimes' rows follow
    assert merges["ties"].data.metrics["gap_recovered"] == pytest.approx(
        100 * summary["ties"]["gap_recovered"], abs=0.006
    )
    curve = json.loads(Path(client.download_artifacts(merges["ties"].info.run_id, "curves/val_curve.json")).read_text())
    assert curve["x"] == ["lam"] and sorted(r["lam"] for r in curve["rows"]) == [0.8, 1.0]
    assert "plots/search.png" in {a.path for a in client.list_artifacts(merges["ties"].info.run_id, "plots")}
    # and as the image "search", which the runs page's chart view shows for every selected run side by side
    assert any(
        a.path.startswith("images/search+step+0+") for a in client.list_artifacts(merges["ties"].info.run_id, "images")
    )
    board = {e["method"]: e for e in _read(root, "results/leaderboard.json")["boards"]["standard"]}
    assert (merges["ties"].data.metrics["test_avg_ci_low"], merges["ties"].data.metrics["test_avg_ci_high"]) == (
        board["ties"]["low"],
        board["ties"]["high"],
    )
    experiment = client.get_experiment(exp_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    view = json.loads(json.loads(experiment.tags["mlflow.sharedViewState.methods"])["state"])
    assert view["orderByKey"] == "metrics.`test_avg`" and view["selectedColumns"][:3] == [
        "params.`method`",
        "tags.`variant`",
        "metrics.`test_avg`",
    ]
    # the standard fine-tune's own view: its runs only, and only the hyperparameters they have (none of negation's)
    standard = json.loads(json.loads(experiment.tags["mlflow.sharedViewState.methods.standard"])["state"])
    shown = client.search_runs([exp_id], filter_string=standard["searchFilter"], max_results=1000)
    assert sorted(r.data.tags["mergeflow.item"] for r in shown) == sorted(
        [m for m in merges if m != "task_negation"] + ["individual", "probe"]
    )
    # the baselines' runs: their test averages and intervals are the leaderboard's
    for r in (r for r in shown if r.data.tags["mergeflow.stage"] == "baseline"):
        e = board[r.data.params["method"]]
        assert (r.data.metrics["test_avg"], r.data.metrics["test_avg_ci_low"], r.data.metrics["test_avg_ci_high"]) == (
            e["score"],
            e["low"],
            e["high"],
        )
    hyperparameters = {
        c
        for c in standard["selectedColumns"]
        if c.startswith("params.") and c not in ("params.`method`", "params.`data`")
    }
    assert hyperparameters == {
        f"params.`{k}`"
        for r in shown
        for k in r.data.params
        if k not in ("method", "kind", "paper", "data") and not k.startswith("grid.")
    }
    # the pipeline run's description is the leaderboard, each method linked to its run
    pipeline = client.search_runs([exp_id], filter_string="tags.`mergeflow.stage` = 'pipeline'", max_results=5)[
        0
    ]  # the newest
    note = pipeline.data.tags["mlflow.note.content"]
    individual = next(r for r in _runs(client, exp_id, "baseline").values() if r.data.params["method"] == "Individual")
    assert (
        f"[ties](#/experiments/{exp_id}/runs/{merges['ties'].info.run_id})" in note
        and f"[Individual](#/experiments/{exp_id}/runs/{individual.info.run_id})" in note
        and "95% bootstrap interval" in note
    )
    assert (
        _read(root, "metrics/tracking.json")["ui_path"]
        == f"/#/experiments/{exp_id}/runs?viewStateShareKey=methods&workflowType=machine_learning"
    )


def _params(root: Path):
    from mergeflow.params import load_params

    return load_params(root / "params.yaml")


def _one(runs, **tags):
    found = [r for r in runs if all(r.data.tags.get(k) == v for k, v in tags.items())]
    assert len(found) == 1, (tags, [r.info.run_name for r in found])
    return found[0]


def _pct(fraction: float) -> float:
    return round(100 * fraction, 2)


def test_regime_runs_record_each_variant(tracked):
    root, _, client, exp_id = tracked
    p = _params(root)
    runs = list(_runs(client, exp_id, "regime").values())
    expected = [(r, v) for r in p.regimes.run for v in p.regimes.config(r).variants(r, p.finetune.steps)]
    assert expected and sorted((r.data.tags["regime"], r.data.tags["variant"]) for r in runs) == sorted(expected)
    ft = {t: _read(root, f"metrics/finetune/{t}.json") for t in TASKS}
    probe, individual = (
        sum(ft[t]["probe"]["test"] for t in TASKS) / 3,
        sum(ft[t]["individual"]["test"] for t in TASKS) / 3,
    )
    for regime, variant in expected:
        record = _read(root, f"metrics/regime/{regime}.json")["variants"][variant]
        r = _one(runs, regime=regime, variant=variant)
        assert r.info.run_name == f"regime@{variant}" and r.data.tags["mergeflow.item"] == regime
        assert {k: v for k, v in r.data.params.items() if k not in ("regime", "variant", "paper")} == {
            k: str(v) for k, v in record["hyperparameters"].items()
        }
        assert r.data.params["paper"] == _read(root, f"metrics/regime/{regime}.json")["paper"]
        m = r.data.metrics
        assert m["individual_avg"] == pytest.approx(
            _pct(sum(record["individual"][t]["test"] for t in TASKS) / 3), abs=0.006
        )
        assert m["individual_val_avg"] == pytest.approx(
            _pct(sum(record["individual"][t]["val"] for t in TASKS) / 3), abs=0.006
        )
        assert {t: m[f"individual_acc.{t}"] for t in TASKS} == {t: _pct(record["individual"][t]["test"]) for t in TASKS}
        assert m["wall_time_s"] == pytest.approx(
            _read(root, f"logs/timing/regime/{regime}.json")["variants"][variant]["wall_time_s"], abs=0.001
        )
        if record["model"] is None:
            assert not any(k.startswith("model_") for k in m) and "mergeflow.model_uri" not in r.data.tags
        else:
            own = record["model"]["accuracy"]
            assert m["model_test_avg"] == pytest.approx(_pct(sum(own["test"].values()) / 3), abs=0.006)
            assert m["model_val_avg"] == pytest.approx(_pct(sum(own["val"].values()) / 3), abs=0.006)
            assert m["model_gap_recovered"] == pytest.approx(
                100 * (sum(own["test"].values()) / 3 - probe) / (individual - probe), abs=0.006
            )
            state = load_model(f"runs:/{r.info.run_id}/model", f"sqlite:///{root / 'mlflow.db'}").net.state_dict()
            expected_state = load_state_dict(root / f"regimes/{regime}/{variant}/model.safetensors")
            assert state.keys() == expected_state.keys() and all(
                torch.equal(state[k], t) for k, t in expected_state.items()
            )
        # per round: the median and max over the task pairs, at step = round
        for metric, key, summary in [
            ("task_vector_cosine_median", "task_vector_cosines", statistics.median),
            ("update_cosine_max", "update_cosines", max),
        ]:
            history = sorted((h.step, h.value) for h in client.get_metric_history(r.info.run_id, metric))
            assert history == [
                (rd["round"], pytest.approx(summary(list(rd[key].values())), abs=6e-5)) for rd in record["rounds"]
            ], metric
        assert m["task_vector_cosine_median"] == pytest.approx(
            statistics.median(record["rounds"][-1]["task_vector_cosines"].values()), abs=6e-5
        )  # the table shows the last round
        artifacts = {a.path for a in client.list_artifacts(r.info.run_id)} | {
            a.path for a in client.list_artifacts(r.info.run_id, "vectors")
        }
        assert {"regime", "vectors/stats.json"} <= artifacts


def test_regime_merge_runs_follow_the_merge_convention(tracked):
    root, _, client, exp_id = tracked
    p = _params(root)
    runs = list(_runs(client, exp_id, "regime_merge").values())
    expected = [
        (r, v, m)
        for r in p.regimes.run
        for v in p.regimes.config(r).variants(r, p.finetune.steps)
        for m in p.regimes.methods_of(r)
    ]
    assert expected and sorted(
        (r.data.tags["regime"], r.data.tags["variant"], r.data.params["method"]) for r in runs
    ) == sorted(expected)
    summary = {(row["regime"], row["method"]): row for row in _read(root, "results/summary.json")["rows"]}
    ft = {t: _read(root, f"metrics/finetune/{t}.json") for t in TASKS}
    names = (set(MERGE_METRICS) - {"wall_time_s"}) | {f"test_acc.{t}" for t in TASKS}
    for regime, variant, method in expected:
        r = _one([x for x in runs if x.data.params["method"] == method], regime=regime, variant=variant)
        folder = f"metrics/regime_merge/{regime}/{variant}"
        ev = _read(root, f"{folder}/evaluate/{method}.json")
        assert r.info.run_name == f"{variant}/{method}" and r.data.tags["mergeflow.item"] == regime
        # every model's interval from its test predictions (a regime's own model's too: its stage keeps them)
        assert set(r.data.metrics) == names | {"test_avg_ci_low", "test_avg_ci_high"}, (variant, method)
        m = r.data.metrics
        assert m["test_avg"] == pytest.approx(_pct(sum(ev["accuracy"][t] for t in TASKS) / 3), abs=0.006)
        assert {t: m[f"test_acc.{t}"] for t in TASKS} == {t: _pct(ev["accuracy"][t]) for t in TASKS}
        assert m["normalized_avg"] == pytest.approx(
            100 * sum(ev["accuracy"][t] / ft[t]["individual"]["test"] for t in TASKS) / 3, abs=0.006
        )
        assert m["gap_recovered"] == pytest.approx(
            100 * summary[(variant, method)]["gap_recovered"], abs=0.006
        )  # the standard fine-tune's scale
        assert m["storage_models"] == pytest.approx(ev["storage_models"], abs=0.006)
        assert r.data.params["kind"] == ev["kind"]
        if method == regime:  # the regime's own model: evaluated, not merged
            assert ev["kind"] == "regime_model" and not any(k.startswith("grid.") for k in r.data.params)
            weights = root / f"regimes/{regime}/{variant}/model.safetensors"
        else:
            mm = _read(root, f"{folder}/merge/{method}.json")
            assert m["val_avg"] == pytest.approx(_pct(mm["val_average"]), abs=0.006)
            assert {k: v for k, v in r.data.params.items() if k.startswith("grid.")} == {
                f"grid.{k}": ", ".join(map(str, v)) for k, v in mm["grid"].items()
            }
            assert "plots/search.png" in {a.path for a in client.list_artifacts(r.info.run_id, "plots")}
            weights = root / f"merged/regime/{regime}/{variant}/{method}.safetensors"
        chosen = {k: str(v) for k, v in ev["hyperparameters"].items() if not isinstance(v, dict)}
        assert {k: r.data.params[k] for k in chosen} == chosen
        if ev["kind"] in (
            "model",
            "regime_model",
        ):  # the run's model, or the one already stored with these weights (the regime's own)
            state = load_model(r.data.tags["mergeflow.model_uri"], f"sqlite:///{root / 'mlflow.db'}").net.state_dict()
            assert all(torch.equal(state[k], t) for k, t in load_state_dict(weights).items()), (variant, method)
    # the saved view ranks the merge runs of every regime, negation aside, and shows the regime
    view = json.loads(json.loads(client.get_experiment(exp_id).tags["mlflow.sharedViewState.methods"])["state"])
    assert "tags.`variant`" in view["selectedColumns"]
    ranked = client.search_runs(
        [exp_id], filter_string=view["searchFilter"], order_by=["metrics.test_avg DESC"], max_results=1000
    )
    standard = [r for r in _runs(client, exp_id, "merge").values() if r.data.params["kind"] != "negation"] + list(
        _runs(client, exp_id, "baseline").values()
    )
    assert sorted(r.info.run_id for r in ranked) == sorted(
        [r.info.run_id for r in standard] + [r.info.run_id for r in runs]
    )
    # and each variant has a view of its own, which shows its runs
    for _, variant, _ in expected:
        own = json.loads(
            json.loads(client.get_experiment(exp_id).tags[f"mlflow.sharedViewState.methods.{variant}"])["state"]
        )
        shown = client.search_runs([exp_id], filter_string=own["searchFilter"], max_results=1000)
        assert sorted(r.info.run_id for r in shown) == sorted(
            r.info.run_id for r in runs if r.data.tags["variant"] == variant
        )
    # the registry stays the standard regime's
    latest = max(client.search_model_versions("name = 'mergeflow-embedded'"), key=lambda v: int(v.version))
    assert client.get_run(latest.run_id).data.tags["regime"] == "standard"


def test_study_runs_record_verdicts(tracked):
    root, _, client, exp_id = tracked
    p = _params(root)
    runs = list(_runs(client, exp_id, "study").values())
    assert p.studies.run and sorted(r.data.tags["study"] for r in runs) == sorted(p.studies.run)
    for name in p.studies.run:
        study = _read(root, f"metrics/studies/{name}.json")
        r = _one(runs, study=name)
        verdicts = [c["verdict"] for c in study["claims"]]
        assert (
            r.data.metrics["holds"] == verdicts.count("holds")
            and r.data.metrics["fails"] == verdicts.count("fails")
            and r.data.metrics["not_measured"] == verdicts.count("not measured")
        )
        assert {k: v for k, v in r.data.params.items() if k.startswith("verdict.")} == {
            f"verdict.{c['name']}": c["verdict"] for c in study["claims"]
        }
        files = {f.name for f in (root / "studies" / name).iterdir() if f.is_file()}
        assert "report.md" in files and files <= {a.path for a in client.list_artifacts(r.info.run_id)}
        assert all(c["id"] in r.data.tags["mlflow.note.content"] for c in study["claims"])


def test_runs_start_and_end_at_the_stages_times(tracked):
    root, _, client, exp_id = tracked
    for r in _runs(client, exp_id).values():
        stage, item = r.data.tags["mergeflow.stage"], r.data.tags.get("mergeflow.item")
        if stage == "pipeline":
            continue
        if (
            stage == "baseline"
        ):  # the fine-tunes measured the baselines: from the first one's start to the last one's end
            spans = [stage_times(root / "logs/timing/finetune" / f"{t}.json") for t in TASKS]
            assert (r.info.start_time, r.info.end_time) == (
                int(min(a for a, _ in spans) * 1000),
                int(max(b for _, b in spans) * 1000),
            )
            continue
        timing = root / "logs/timing" / (f"{stage}/{item}.json" if item else f"{stage}.json")
        started, ended = stage_times(timing, ("evaluate_wall_time_s",) if stage == "merge" else ())
        assert (r.info.start_time, r.info.end_time) == (int(started * 1000), int(ended * 1000)), r.info.run_name
        if "started" in _read(root, str(timing.relative_to(root))):
            assert r.info.start_time == int(_read(root, str(timing.relative_to(root)))["started"] * 1000)


def test_runs_logged_before_regimes_get_the_standard_tag(tracked):
    """A store from a track that knew no regimes: its standard runs are tagged when track meets them again, and
    nothing is logged again."""
    root, env, client, exp_id = tracked
    merges = _runs(client, exp_id, "merge")
    ties = next(r for r in merges.values() if r.data.tags["mergeflow.item"] == "ties")
    client.delete_tag(ties.info.run_id, "regime")
    client.delete_tag(ties.info.run_id, "variant")
    before = _runs(client, exp_id).keys()
    assert "0 new runs" in run("mergeflow track", root, env)
    assert _runs(client, exp_id).keys() == before
    tags = client.get_run(ties.info.run_id).data.tags
    assert (tags["regime"], tags["variant"]) == ("standard", "standard")


def test_track_logs_only_what_changed(tracked):
    root, env, client, exp_id = tracked
    before, files = _runs(client, exp_id), _store_files(root)

    out = run("mergeflow track", root, env)  # nothing changed
    assert "0 new runs" in out
    assert _runs(client, exp_id).keys() == before.keys() and _store_files(root) == files

    # one merge hyperparameter changes; its stage re-runs and DVC records it, as dvc repro would
    old_md5 = next(
        o["md5"]
        for o in yaml.safe_load((root / "dvc.lock").read_text())["stages"]["merge@ties"]["outs"]
        if o["path"] == "merged/ties.safetensors"
    )
    apply_overrides(root / "params.yaml", ["merge.ties.k=0.1"])
    run("mergeflow merge", root, env | {"DVC_STAGE": "merge@ties"})
    run("mergeflow report", root, env)
    run("dvc commit -f merge@ties report", root, env)
    run("mergeflow track", root, env)

    after = _runs(client, exp_id)
    new = [after[r] for r in after.keys() - before.keys()]
    assert sorted((r.data.tags["mergeflow.stage"], r.data.tags.get("mergeflow.item")) for r in new) == [
        ("merge", "ties"),
        ("pipeline", None),
    ]
    ties = next(r for r in new if r.data.tags["mergeflow.stage"] == "merge")
    assert ties.data.params["k"] == "0.1"
    added = {f: n for f, n in _store_files(root).items() if f not in files}
    weights = [f for f in added if f.endswith(".safetensors")]
    changed = hashlib.md5((root / "merged/ties.safetensors").read_bytes()).hexdigest() != old_md5
    assert [Path(f).name for f in weights] == (["ties.safetensors"] if changed else []), (
        weights
    )  # the changed model only
    pipeline = next(r for r in new if r.data.tags["mergeflow.stage"] == "pipeline")
    assert pipeline.data.tags["stage_run.merge.ties"] == ties.info.run_id
    assert pipeline.data.tags["stage_run.merge.emr"] == next(
        r.info.run_id for r in before.values() if r.data.tags.get("mergeflow.item") == "emr"
    )
    assert _read(root, "metrics/tracking.json")["run_id"] == pipeline.info.run_id


def test_regimes_and_studies_that_did_not_run_are_left_out(tiny_reference, tiny_env, tmp_path):
    """regimes.run and studies.run list what has not run yet (no metrics, or no timing file): track logs the rest
    and says what it left out."""
    ref, _ = tiny_reference
    root = copy_project(ref, tmp_path / "project")
    for path in ("mlflow.db", "mlruns", "metrics/studies", "logs/timing/regime_merge"):
        shutil.rmtree(root / path) if (root / path).is_dir() else (root / path).unlink()
    apply_overrides(root / "params.yaml", ["tracking.log_checkpoints=false"])
    out = run("mergeflow track", root, tiny_env)
    p = _params(root)
    assert all(f"study {s} not tracked" in out for s in p.studies.run) and all(
        f"regime {r}'s merges not tracked" in out for r in p.regimes.run
    )
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    exp_id = client.get_experiment_by_name("mergeflow/embedded").experiment_id
    stages = [r.data.tags["mergeflow.stage"] for r in _runs(client, exp_id).values()]
    assert stages.count("regime") == sum(len(p.regimes.config(r).variants(r, p.finetune.steps)) for r in p.regimes.run)
    assert "regime_merge" not in stages and "study" not in stages and stages.count("pipeline") == 1


def test_artifact_locations_are_relative_to_the_workspace(tracked):
    """The copy's store was not rewritten by the test: its locations were relative from the start, so the copy reads
    its own artifacts (the other tests here and in test_tracking_models.py read them)."""
    root = tracked[0]
    with sqlite3.connect(root / "mlflow.db") as con:
        locations = [
            row[0]
            for sql in (
                "SELECT artifact_location FROM experiments",
                "SELECT artifact_uri FROM runs",
                "SELECT artifact_location FROM logged_models",
                "SELECT storage_location FROM model_versions",
            )
            for row in con.execute(sql)
        ]
    assert len(locations) > 10
    assert [loc for loc in locations if not loc.startswith("mlruns/")] == []
