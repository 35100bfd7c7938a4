"""The real pipeline, tiny profile, end to end: `mergeflow repro`, `dvc repro` and the Prefect flow, asserting
on the outputs (against routes independent of the merge code) and on what MLflow recorded."""

import json
import re
import sys
from pathlib import Path

import pytest
import torch
import yaml

from mlflow import MlflowClient

from mergeflow.core.io import load_state_dict

from .conftest import copy_project, run as _run
from .profiles import TINY

pytestmark = pytest.mark.e2e
TASKS = ["digits", "house_numbers", "count"]
METHODS = TINY["merge"]["methods"]  # data-free ones, task negation, and fisher, regmean, adamerging_cart
ROWS = [m for m in METHODS if m != "task_negation"]
REGIME_METHODS = ["weight_averaging", "task_arithmetic", "ties"]
VARIANTS = {"one_epoch": "one_epoch", "mima_n2": "mima"}  # the tiny profile's regimes: one_epoch, and mima with N = 2
STUDIES = TINY["studies"]["run"]


@pytest.fixture(scope="module")
def project(tiny_reference, tiny_env, tmp_path_factory):
    """A copy of the session's reference run (one `mergeflow repro` of the tiny profile), with that run's output."""
    root, out = tiny_reference
    return copy_project(root, tmp_path_factory.mktemp("e2e") / "project"), tiny_env, out


def _server_records(url: str, kind: str) -> list[dict]:
    """Flow or task runs ('flow_runs', 'task_runs') a Prefect server holds."""
    import urllib.request

    request = urllib.request.Request(
        f"{url}/{kind}/filter", data=b"{}", headers={"Content-Type": "application/json"}, method="POST"
    )
    return json.loads(urllib.request.urlopen(request, timeout=30).read())


def _flow_runs_of(url: str, root) -> list[dict]:
    """The flow runs a (shared) Prefect server holds for the project at ``root``."""
    return [r for r in _server_records(url, "flow_runs") if r["parameters"].get("root") == str(root)]


def _stages_ran(flow_output: str) -> set[str]:
    match = re.search(r"(\d+) of (\d+) stages to run: (.*)", flow_output)
    assert match, flow_output[-2000:]
    return set() if match.group(3).strip() == "none" else set(match.group(3).strip().split(", "))


def _mlflow(project_dir):
    client = MlflowClient(tracking_uri=f"sqlite:///{project_dir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("mergeflow/embedded")
    runs = client.search_runs([exp.experiment_id], max_results=500)
    return client, runs


def test_pipeline_end_to_end(project, prefect_server, monkeypatch):
    root, env, out = project

    # 1. mergeflow repro ran everything (the session's reference run)
    regime_stages = [f"{stage}@{r}" for r in VARIANTS.values() for stage in ("regime", "regime_merge")]
    for stage in [
        "prepare",
        "pretrain",
        *(f"finetune@{t}" for t in TASKS),
        "vectors",
        "statistics",
        *(f"merge@{m}" for m in METHODS),
        *regime_stages,
        "report",
        *(f"study@{s}" for s in STUDIES),
        "track",
    ]:
        assert f"Running stage '{stage}'" in out
    assert "up to date" in _run("dvc status", root, env)
    # quiet: no third-party warning or notice in any stage's output (MLflow's, scikit-learn's convergence, DVC's empty
    # outputs; MLflow's first-run "Creating initial MLflow database tables")
    assert not [line for line in out.splitlines() if "Warning:" in line or "WARNING" in line or " INFO " in line], out

    summary = json.loads((root / "results/summary.json").read_text())
    rows = {r["method"]: r for r in summary["rows"] if r["regime"] == "standard"}
    assert set(rows) == {"Pretrained (linear probe)", "Individual", *ROWS}
    regime_rows = {(r["regime"], r["method"]) for r in summary["rows"] if r["regime"] != "standard"}
    assert regime_rows == {(v, m) for v in VARIANTS for m in ["Individual", *REGIME_METHODS]}
    for r in rows.values():
        assert all(0.0 <= r[t] <= 1.0 for t in TASKS)
        assert r["average"] == pytest.approx(sum(r[t] for t in TASKS) / len(TASKS))
    summary_md = (root / "results/summary.md").read_text()
    assert (
        summary_md.startswith("# embedded: merging 3 tasks\n\n## Leaderboard\n") and "\n## Every score\n" in summary_md
    )
    assert "Test examples per task: digits 60, house_numbers 60, count 60." in summary_md
    every_score = summary_md.split("\n## Every score\n")[1].split("\n###")[0]
    assert sum(line.startswith("| ") for line in every_score.splitlines()) == 1 + len(rows) + len(VARIANTS) * (
        1 + len(REGIME_METHODS)
    )

    # the leaderboard: ranked, its intervals from the predictions the stages kept, which give back the recorded
    # accuracies (an independent route: the predictions against the labels, here)
    boards = json.loads((root / "results/leaderboard.json").read_text())["boards"]
    assert list(boards) == ["standard", *VARIANTS]
    standard = {e["method"]: e for e in boards["standard"]}
    assert [e["rank"] for e in boards["standard"] if e["rank"]] == list(range(1, len(ROWS) + 1)) and standard[
        "Individual"
    ]["rank"] is None
    assert [e["score"] for e in boards["standard"]] == sorted((e["score"] for e in boards["standard"]), reverse=True)
    kept = {t: load_state_dict(root / f"predictions/finetune/{t}.safetensors") for t in TASKS}
    finetuned = {t: json.loads((root / f"metrics/finetune/{t}.json").read_text()) for t in TASKS}
    for t in TASKS:
        for name, key in (("probe", "probe"), ("individual", "individual")):
            assert float((kept[t][name] == kept[t]["labels"]).double().mean()) == pytest.approx(
                finetuned[t][key]["test"], abs=1e-6
            )
    for m in ROWS:
        predicted = load_state_dict(root / f"predictions/merge/{m}.safetensors")
        assert [float((predicted[t] == kept[t]["labels"]).double().mean()) for t in TASKS] == pytest.approx(
            [rows[m][t] for t in TASKS], abs=1e-6
        )
        e = standard[m]
        assert e["score"] == round(100 * rows[m]["average"], 2) and e["low"] <= e["score"] <= e["high"]
        assert e["vs_reference"]["delta"] == (
            None
            if m == "task_arithmetic"
            else pytest.approx(e["score"] - standard["task_arithmetic"]["score"], abs=0.02)
        )
    assert all(e["low"] is not None for e in boards["mima_n2"] if e["method"] != "Individual")
    # the report prints the leaderboard, each merge one line: what it chose, its validation and test averages (each
    # line after its stage's address, as `mergeflow repro` shows them)
    for line in (
        "[report] Standard fine-tune: best ",
        "[report] mima_n2: best ",
        "[merge@task_negation] task_negation: lam per negated task digits=",
        "] mima_n2/ties: chose lam=",
    ):
        assert line in out, line
    for m in ROWS:
        assert re.search(rf"\[merge@{m}\] {m}: chose .*; validation [0-9.]+%, test [0-9.]+%", out), m
    assert "\n### Environment\n\n- deterministic: torch AVX2, MKL COMPATIBLE, GEMMs on OpenBLAS, " in summary_md
    assert rows["emr"]["storage_models"] > 1.0 and rows["Individual"]["storage_models"] == len(TASKS)
    consensus = json.loads((root / "metrics/merge/consensus_ta.json").read_text())
    assert set(consensus["searched"]["tall_lambda"]) == set(TASKS) and set(
        consensus["searched"]["tall_lambda"].values()
    ) <= {0.2, 0.6}
    negation = json.loads((root / "metrics/evaluate/task_negation.json").read_text())
    for t, r in negation["per_task"].items():
        assert r["lam"] in (0.0, 0.5, 1.0) and 0 <= r["target"] <= 1 and 0 <= r["control"] <= 1
    assert (root / "results/accuracy.png").stat().st_size > 1000 and (root / "vectors/cosine.png").stat().st_size > 1000

    # merged checkpoints, recomputed from the fine-tuned checkpoints directly (not through the task vectors)
    theta0 = load_state_dict(root / "models/pretrained.safetensors")
    thetas = [load_state_dict(root / f"models/finetuned/{t}.safetensors") for t in TASKS]
    wa = load_state_dict(root / "merged/weight_averaging.safetensors")
    ta = load_state_dict(root / "merged/task_arithmetic.safetensors")
    lam = json.loads((root / "metrics/merge/task_arithmetic.json").read_text())["hyperparameters"]["lam"]
    assert lam in (0.1, 0.3, 0.5)
    for k in theta0:
        assert torch.allclose(wa[k], sum(th[k] for th in thetas) / len(thetas), atol=1e-5)
        assert torch.allclose(ta[k], theta0[k] + lam * sum(th[k] - theta0[k] for th in thetas), atol=1e-5)
    ties = json.loads((root / "metrics/merge/ties.json").read_text())
    assert ties["hyperparameters"]["k"] == 0.2 and ties["searched"]["lam"] in (0.8, 1.0) and len(ties["val_curve"]) == 2
    best = max(ties["val_curve"], key=lambda r: r["average"])
    assert ties["val_average"] == best["average"]
    ev = json.loads((root / "metrics/evaluate/ties.json").read_text())
    assert rows["ties"]["average"] == pytest.approx(ev["average"])

    # the regimes: MIMA's own model is the uniform average of its last round's task models, so theta0 plus the mean
    # of its task vectors; its weight-averaging merge is that model; TA of a regime is theta0 + lam * sum of its vectors
    mima = json.loads((root / "metrics/regime/mima.json").read_text())["variants"]["mima_n2"]
    assert [r["round"] for r in mima["rounds"]] == [1, 2] and mima["hyperparameters"] == {
        "rounds": 2,
        "total_steps": 8,
        "schedule": "one_schedule",
        "optimizer_state": "reset",
    }
    taus = [load_state_dict(root / f"regimes/mima/mima_n2/vectors/{t}.safetensors") for t in TASKS]
    ua = load_state_dict(root / "regimes/mima/mima_n2/model.safetensors")
    mima_wa = load_state_dict(root / "merged/regime/mima/mima_n2/weight_averaging.safetensors")
    one_epoch_taus = [load_state_dict(root / f"regimes/one_epoch/one_epoch/vectors/{t}.safetensors") for t in TASKS]
    one_epoch_ta = load_state_dict(root / "merged/regime/one_epoch/one_epoch/task_arithmetic.safetensors")
    one_epoch_lam = json.loads(
        (root / "metrics/regime_merge/one_epoch/one_epoch/merge/task_arithmetic.json").read_text()
    )["hyperparameters"]["lam"]
    standard_taus = [load_state_dict(root / f"vectors/{t}.safetensors") for t in TASKS]
    for k in theta0:
        assert torch.allclose(ua[k], theta0[k] + sum(tau[k] for tau in taus) / len(TASKS), atol=1e-5)
        assert torch.allclose(mima_wa[k], ua[k], atol=1e-5)
        assert torch.allclose(
            one_epoch_ta[k], theta0[k] + one_epoch_lam * sum(tau[k] for tau in one_epoch_taus), atol=1e-5
        )
    # one epoch (200 images in batches of 32: 6 steps) is not the standard fine-tune (8 steps)
    assert not all(torch.equal(a[k], b[k]) for a, b in zip(one_epoch_taus, standard_taus) for k in theta0)
    for variant in VARIANTS:
        for m in REGIME_METHODS:
            ev = json.loads(
                (root / f"metrics/regime_merge/{VARIANTS[variant]}/{variant}/evaluate/{m}.json").read_text()
            )
            headline = json.loads((root / f"metrics/headline/{variant}/{m}.json").read_text())
            assert headline["test_avg"] == pytest.approx(round(100 * sum(ev["accuracy"].values()) / len(TASKS), 2))
    for s in STUDIES:
        verdicts = json.loads((root / f"metrics/studies/{s}.json").read_text())
        assert verdicts["holds"] + verdicts["fails"] + verdicts["not_measured"] == len(verdicts["claims"]) > 0
        assert json.loads((root / f"metrics/verdicts/{s}.json").read_text()) == {
            k: verdicts[k] for k in ("holds", "fails", "not_measured")
        }
        assert "## Verdicts" in (root / f"studies/{s}/report.md").read_text()

    # 2. after dvc repro the Prefect flow has nothing to redo (against the session's Prefect server: a flow on a
    # temporary server of its own is tests/test_prefect_home.py's)
    served = env | {"PREFECT_API_URL": prefect_server}
    assert (
        _stages_ran(_run([sys.executable, "-m", "flows.pipeline", "--workers", "2", "--root", str(root)], root, served))
        == set()
    )

    # 3. one merge hyperparameter changed: the flow re-runs that merge, its evaluation, the report and tracking
    # only; this time against a running Prefect server, which records the flow run and its task runs
    params = yaml.safe_load((root / "params.yaml").read_text())
    # (every regime merges with TIES, on merge.ties's grid), and one MIMA setting: MIMA trains again, its rounds'
    # fine-tunes through the flow
    params["merge"]["ties"]["k"] = 0.1
    params["regimes"]["mima"]["optimizer_state"] = "carry"
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    ran = _stages_ran(
        _run([sys.executable, "-m", "flows.pipeline", "--workers", "2", "--root", str(root)], root, served)
    )
    assert ran == {
        "merge@ties",
        "regime@mima",
        "regime_merge@mima",
        "regime_merge@one_epoch",
        "report",
        *(f"study@{s}" for s in STUDIES),
        "track",
    }
    carried = json.loads((root / "metrics/regime/mima.json").read_text())["variants"]["mima_n2"]
    assert (
        carried["hyperparameters"]["optimizer_state"] == "carry"
        and carried["rounds"][1]["update_norms"] != mima["rounds"][1]["update_norms"]
    )
    assert carried["rounds"][0]["update_norms"] == pytest.approx(
        mima["rounds"][0]["update_norms"], rel=1e-4
    )  # round 1 has no state to carry
    flow_runs = sorted(_flow_runs_of(prefect_server, root), key=lambda r: r["start_time"])
    assert [(r["flow_id"] is not None, r["state_type"]) for r in flow_runs] == [(True, "COMPLETED")] * 2
    task_runs = {
        run["id"]: [r for r in _server_records(prefect_server, "task_runs") if r["flow_run_id"] == run["id"]]
        for run in flow_runs
    }
    assert [{(r["name"], r["state_type"]) for r in task_runs[run["id"]]} for run in flow_runs] == [
        set(),
        {(s, "COMPLETED") for s in ran},
    ]
    assert json.loads((root / "metrics/merge/ties.json").read_text())["hyperparameters"]["k"] == 0.1
    # ... and then DVC agrees that everything is up to date
    assert "up to date" in _run("dvc status", root, env)
    assert "Running stage" not in _run("dvc repro", root, env)

    # (`dvc exp run -S`, which re-runs only what depends on the value it sets, is tests/test_experiments.py's)

    # 4. MLflow: one run per stage item, logged again only when its stage changed, and one pipeline run per
    # pipeline state naming the stage runs it covers
    client, runs = _mlflow(root)
    by_stage = {}
    for r in runs:
        by_stage.setdefault(r.data.tags["mergeflow.stage"], []).append(r)
    pipelines = by_stage["pipeline"]
    assert sorted(r.data.tags["mergeflow.source"] for r in pipelines) == ["dvc", "prefect"]
    first = min(pipelines, key=lambda r: r.info.start_time)
    assert len(first.data.tags["git.commit"]) == 40 and len(first.data.tags["dvc.lock.sha256"]) == 64
    assert {r.info.run_name for r in by_stage["prepare"] + by_stage["pretrain"] + by_stage["vectors"]} == {
        "prepare",
        "pretrain",
        "vectors",
    }
    assert len(by_stage["finetune"]) == len(TASKS) and len(by_stage["merge"]) == len(METHODS) + 1  # ties once more
    monkeypatch.chdir(root)  # MLflow reads the artifacts from the workspace (their locations are relative)
    ft_run = client.get_run(first.data.tags["stage_run.finetune.digits"])
    assert ft_run.data.params["finetune.steps"] == "8" and ft_run.info.run_name == "finetune@digits"
    assert len(client.get_metric_history(ft_run.info.run_id, "train.loss")) == 8
    assert "checkpoints/digits.safetensors" in {
        a.path for a in client.list_artifacts(ft_run.info.run_id, "checkpoints")
    }
    ties_runs = sorted(
        (r for r in by_stage["merge"] if r.data.tags["mergeflow.item"] == "ties"), key=lambda r: r.info.start_time
    )
    assert [r.data.params["k"] for r in ties_runs] == ["0.2", "0.1"]
    assert all(float(r.data.params["lam"]) in (0.8, 1.0) and "test_avg" in r.data.metrics for r in ties_runs)
    assert first.data.tags["stage_run.merge.ties"] == ties_runs[0].info.run_id
    assert ties_runs[0].data.tags["mergeflow.model_uri"].startswith("models:/")
    (ada,) = (r for r in by_stage["merge"] if r.data.tags["mergeflow.item"] == "adamerging_cart")
    assert ada.data.params["data"] == "test inputs (TTA)" and ties_runs[0].data.params["data"] == "none"
    learned = json.loads((root / "metrics/merge/adamerging_cart.json").read_text())["learned"]
    logged = json.loads(
        Path(client.download_artifacts(ada.info.run_id, "learned/coefficients.json", str(root.parent))).read_text()
    )
    assert logged == learned

    # the regimes in MLflow: a run per variant (its task models' accuracy as in metrics/regime), a run per variant and
    # method of each regime merge, logged again only when it changed (MIMA's merges: after optimizer_state=carry;
    # TIES: after k changed), and a run per study holding its verdict counts
    regime_runs = {(r.data.tags["variant"], r.data.params.get("optimizer_state")): r for r in by_stage["regime"]}
    assert set(regime_runs) == {("one_epoch", None), ("mima_n2", "reset"), ("mima_n2", "carry")}
    assert regime_runs[("mima_n2", "reset")].data.metrics["individual_avg"] == pytest.approx(
        round(100 * mima["individual_average"]["test"], 2)
    )
    merges = [(r.data.tags["variant"], r.data.params["method"]) for r in by_stage["regime_merge"]]
    assert sorted(merges) == sorted(
        [("one_epoch", m) for m in REGIME_METHODS]
        + [("one_epoch", "ties")]
        + [("mima_n2", m) for m in REGIME_METHODS] * 2
    )
    assert all(
        r.data.tags["regime"] == VARIANTS[r.data.tags["variant"]] and "test_avg" in r.data.metrics
        for r in by_stage["regime_merge"]
    )
    for s in STUDIES:
        latest = max((r for r in by_stage["study"] if r.data.tags["study"] == s), key=lambda r: r.info.start_time)
        verdicts = json.loads((root / f"metrics/studies/{s}.json").read_text())
        assert {k: latest.data.metrics[k] for k in ("holds", "fails", "not_measured")} == {
            k: verdicts[k] for k in ("holds", "fails", "not_measured")
        }

    # 5. MLFLOW_TRACKING_URI sends the record elsewhere, and mlflow.db is left alone
    other = root.parent / "elsewhere.db"
    before = len(runs)
    _run("mergeflow track", root, env | {"MLFLOW_TRACKING_URI": f"sqlite:///{other}"})
    elsewhere = MlflowClient(tracking_uri=f"sqlite:///{other}")
    moved = elsewhere.search_runs([elsewhere.get_experiment_by_name("mergeflow/embedded").experiment_id])
    assert {r.data.tags["mlflow.runName"] for r in moved} >= {"merge@ties", "finetune@digits", "prepare"}
    assert len(_mlflow(root)[1]) == before
