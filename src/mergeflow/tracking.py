"""MLflow records of a pipeline run, made by the last stage (``mergeflow track``) from what the stages wrote.

One parent run per pipeline run, nested runs per stage, with runs per task under ``finetune`` and per method
under ``merge``. Parameters are what each stage used (every merge hyperparameter and the chosen value), metrics
include training curves by step, artifacts the checkpoints, merged models, plots and the summary table; tags hold
the git commit and dvc.lock hashes. Because it reads the stages' outputs, ``dvc repro`` and the Prefect flow
record the same thing.

``track`` survives being killed at any point: a new SQLite store is created and migrated under a temporary name
and then renamed into place (an old one is upgraded on a copy), so a kill during MLflow's migrations leaves no
half-migrated ``mlflow.db``; runs a killed ``track`` left RUNNING are marked FAILED when the next one starts, and
that one logs everything again. DVC never restores ``track`` from its run-cache (its output is ``persist``), so it
always logs to the store it is pointed at.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import socket
import sqlite3
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

import yaml

from mergeflow.config import Params
from mergeflow.errors import MergeflowError, TransientError
from mergeflow.io import atomic_path, read_json, write_json
from mergeflow.orchestration import process_alive
from mergeflow.stages import Layout


def tracking_uri(root: Path) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(root / 'mlflow.db').resolve()}"


def _read_one(path: Path, sql: str):
    """The first column of the first row ``sql`` gives on the SQLite file ``path``, opened read-only; None when
    the file, table or row is missing."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            row = db.execute(sql).fetchone()
    except sqlite3.Error:
        return None
    return row[0] if row else None


def _migrate(path: Path) -> None:
    """Create MLflow's tables in the SQLite file ``path`` (empty or partial) and upgrade them to the latest schema."""
    import sqlalchemy
    from mlflow.store.db import utils

    engine = sqlalchemy.create_engine(f"sqlite:///{path}")
    try:
        if utils._all_tables_exist(engine):
            utils._upgrade_db(engine)
        else:
            utils._initialize_tables(engine)
    finally:
        engine.dispose()


def prepare_store(uri: str) -> str | None:
    """Make a local SQLite store ready before MLflow opens it: created or upgraded under a temporary name, then
    renamed into place, so that a kill at any point leaves either the old file or a complete new one. A store that
    an earlier, unprotected kill left half-migrated, with no runs in it, is set aside and made anew. Returns a
    one-line notice when it set one aside. Other stores (a server, another database) are left to MLflow."""
    from mlflow.store.db.utils import _get_latest_schema_revision

    if not uri.startswith("sqlite:///"):
        return None
    path = Path(uri.removeprefix("sqlite:///"))
    head = _get_latest_schema_revision()
    if path.is_file() and _read_one(path, "SELECT version_num FROM alembic_version") == head:
        return None
    notice = None
    with atomic_path(path) as tmp:  # a kill leaves the old file (or none) and a temporary the next stage sweeps
        if path.is_file() and path.stat().st_size:
            shutil.copyfile(path, tmp)
        try:
            _migrate(tmp)
        except Exception as err:  # noqa: BLE001 - any failure of a partial schema: start over if nothing is lost
            if path.is_file() and _read_one(path, "SELECT COUNT(*) FROM runs"):
                raise MergeflowError(f"{path}: MLflow could not upgrade this store ({str(err).splitlines()[0]}); back it up and run 'mlflow db upgrade {uri}'") from None
            tmp.write_bytes(b"")
            _migrate(tmp)
            aside = path.with_name(f"{path.name}.broken-{time.strftime('%Y%m%d-%H%M%S')}")
            shutil.copyfile(path, aside)
            notice = f"{path}: a half-migrated MLflow store with no runs (left by a killed run) was set aside as {aside.name} and made anew"
    return notice


def fail_abandoned_runs(client, experiment_id: str) -> int:
    """Mark FAILED the runs a killed ``track`` on this host left RUNNING (its process is gone); returns how many."""
    host = socket.gethostname()
    abandoned = [
        r
        for r in client.search_runs([experiment_id], filter_string=f"attributes.status = 'RUNNING' and tags.`mergeflow.host` = '{host}'", max_results=5000)
        if not process_alive(int(r.data.tags.get("mergeflow.pid", "0")))
    ]
    for run in abandoned:
        client.set_terminated(run.info.run_id, "FAILED")
    return len(abandoned)


def experiment_name(params: Params) -> str:
    return f"mergeflow/{params.suite.name}"


def _flatten(prefix: str, obj) -> dict[str, str]:
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            out |= _flatten(f"{prefix}.{k}" if prefix else str(k), v)
        return out
    return {prefix: str(obj)}


def _git_commit(root: Path) -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _lock_tags(root: Path) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """(run-wide tags, per-stage tags) from dvc.lock: its sha256 and each stage's output hashes."""
    lock = root / "dvc.lock"
    if not lock.is_file():
        return {"dvc.lock": "absent"}, {}
    text = lock.read_text()
    stages = (yaml.safe_load(text) or {}).get("stages", {})
    per_stage = {name: {f"dvc.out.{o['path']}": o.get("md5", "") for o in entry.get("outs", [])} for name, entry in stages.items()}
    return {"dvc.lock.sha256": hashlib.sha256(text.encode()).hexdigest()}, per_stage


def _log_curve(client, run_id: str, curve: Mapping[str, list], prefix: str) -> None:
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    metrics = [Metric(f"{prefix}{key}", float(v), now, int(step)) for key in curve if key != "step" for step, v in zip(curve["step"], curve[key])]
    for i in range(0, len(metrics), 1000):
        client.log_batch(run_id, metrics=metrics[i : i + 1000], synchronous=True)


def _metrics(prefix: str, values: Mapping[str, float]) -> dict[str, float]:
    return {f"{prefix}{k}": float(v) for k, v in values.items() if isinstance(v, (int, float))}


def track(params: Params, layout: Layout = Layout()) -> dict:
    import mlflow
    from mlflow import MlflowClient

    root = layout.root
    uri = tracking_uri(root)
    if notice := prepare_store(uri):
        print(f"warning: {notice}")
    mlflow.set_tracking_uri(uri)
    try:
        experiment = mlflow.set_experiment(experiment_name(params))
    except Exception as err:  # noqa: BLE001 - SQLite's lock is held by another writer: worth a retry
        if "database is locked" in str(err):
            raise TransientError(f"{uri}: the MLflow store is locked by another process") from None
        raise
    client = MlflowClient()
    if failed := fail_abandoned_runs(client, experiment.experiment_id):
        print(f"marked {failed} runs FAILED that a killed track left RUNNING")
    run_tags, stage_tags = _lock_tags(root)
    # every run carries its host and process, so the next track can tell a run still being logged from an abandoned one
    process_tags = {"mergeflow.host": socket.gethostname(), "mergeflow.pid": str(os.getpid())}
    run_tags |= process_tags | {"git.commit": _git_commit(root), "mergeflow.source": os.environ.get("MERGEFLOW_RUN_SOURCE", "dvc")}
    if os.environ.get("PREFECT__FLOW_RUN_ID"):
        run_tags["prefect.flow_run_id"] = os.environ["PREFECT__FLOW_RUN_ID"]
    summary = read_json(layout.results / "summary.json")
    times = summary["stage_wall_time_s"]
    log_ckpt = params.tracking.log_checkpoints
    tasks, methods = params.suite.tasks, params.merge.methods

    with mlflow.start_run(run_name=f"pipeline {time.strftime('%Y-%m-%d %H:%M:%S')}", tags=run_tags) as parent:
        mlflow.log_params(_flatten("", params.model_dump(mode="json")))
        for row in summary["rows"]:
            name = row["method"].split(" ")[0].lower()
            mlflow.log_metrics({f"{name}.average": row["average"], f"{name}.normalized": row["normalized"]} | _metrics(f"{name}.acc.", {t: row[t] for t in tasks}))
        mlflow.log_metrics(_metrics("wall_time_s.", {k.replace("@", "."): v for k, v in summary["stage_wall_time_s"].items()}))
        mlflow.log_artifacts(str(layout.results), "results")
        if (root / "dvc.lock").is_file():
            mlflow.log_artifact(str(root / "dvc.lock"))

        def child(name: str, parent_id: str, tags: Mapping[str, str] | None = None):
            return mlflow.start_run(run_name=name, nested=True, parent_run_id=parent_id, tags={**process_tags, **stage_tags.get(name, {}), **(tags or {})})

        with child("prepare", parent.info.run_id) as run:
            mlflow.log_params(_flatten("suite", params.suite.model_dump(mode="json")) | {"seed": params.seed})
            prep = read_json(layout.metrics("prepare"))
            mlflow.log_metrics({"wall_time_s": times["prepare"], "pretrain_images": prep["pretrain_images"]} | {f"{t}.{s}": n for t, sizes in prep["tasks"].items() for s, n in sizes.items()})

        with child("pretrain", parent.info.run_id) as run:
            mlflow.log_params(_flatten("backbone", params.backbone.model_dump(mode="json")) | _flatten("pretrain", params.pretrain.model_dump(mode="json")))
            pre = read_json(layout.metrics("pretrain"))
            mlflow.log_metrics(_metrics("", {"wall_time_s": times["pretrain"], "parameters": pre["parameters"]}) | _metrics("head_accuracy.", pre["train_head_accuracy"]))
            _log_curve(client, run.info.run_id, read_json(layout.log("pretrain")), "train.")
            if log_ckpt:
                mlflow.log_artifact(str(layout.pretrained), "checkpoints")

        with child("finetune", parent.info.run_id) as stage_run:
            mlflow.log_params(_flatten("finetune", params.finetune.model_dump(mode="json")) | _flatten("probe", params.probe.model_dump(mode="json")))
            for t in tasks:
                with child(f"finetune@{t}", stage_run.info.run_id, {"task": t}) as run:
                    m = read_json(layout.metrics("finetune", t))
                    mlflow.log_params({"task": t, "probe.C": m["probe"]["C"], "steps": m["steps"]})
                    mlflow.log_metrics({"wall_time_s": times[f"finetune@{t}"]} | _metrics("probe.", m["probe"]) | _metrics("individual.", m["individual"]) | _metrics("gain.", m["gain_over_probe"]))
                    _log_curve(client, run.info.run_id, read_json(layout.log("finetune", t)), "train.")
                    if log_ckpt:
                        mlflow.log_artifact(str(layout.finetuned(t)), "checkpoints")
                        mlflow.log_artifact(str(layout.head(t)), "heads")

        with child("vectors", parent.info.run_id):
            vec = read_json(layout.metrics("vectors"))
            mlflow.log_metrics({"wall_time_s": times["vectors"]} | _metrics("norm.", vec["norms"]) | _metrics("relative_norm.", vec["relative_norms"]))
            mlflow.log_artifact(str(layout.vectors / "stats.json"))
            mlflow.log_artifact(str(layout.vectors / "cosine.png"))

        with child("merge", parent.info.run_id) as stage_run:
            for method in methods:
                with child(f"merge@{method}", stage_run.info.run_id, {"method": method}) as run:
                    mm, ev = read_json(layout.metrics("merge", method)), read_json(layout.metrics("evaluate", method))
                    mlflow.log_params(_flatten("hp", mm["hyperparameters"]) | _flatten("grid", mm["grid"]) | {"paper": mm["paper"], "kind": mm["kind"]} | _flatten("chosen", mm["searched"]))
                    timing = read_json(layout.timing("merge", method))
                    timing = {"merge_wall_time_s": timing["wall_time_s"], "evaluate_wall_time_s": timing["evaluate_wall_time_s"]}
                    if mm["kind"] == "negation":
                        mlflow.log_metrics(timing | _metrics("test.average.", ev["average"]) | {f"test.{t}.{k}": v for t, r in ev["per_task"].items() for k, v in r.items()})
                    else:
                        mlflow.log_metrics(
                            timing
                            | {"val.average": mm["val_average"], "test.average": ev["average"], "test.normalized": ev["normalized_average"], "storage_models": ev["storage_models"]}
                            | _metrics("val.", mm["val_accuracy"])
                            | _metrics("test.", ev["accuracy"])
                        )
                        grid_keys = list(mm["grid"])
                        if len(grid_keys) == 1:  # the validation curve, indexed by grid position
                            curve = mm["val_curve"]
                            _log_curve(client, run.info.run_id, {"step": list(range(len(curve))), "val.curve.average": [r["average"] for r in curve], f"val.curve.{grid_keys[0]}": [r["hyperparameters"][grid_keys[0]] for r in curve]}, "")
                    plot = layout.log("merge", method, ".png")
                    if plot.is_file():
                        mlflow.log_artifact(str(plot))
                    if log_ckpt:
                        mlflow.log_artifact(str(layout.merged(method)), "merged")

    record = {"tracking_uri": mlflow.get_tracking_uri(), "experiment": experiment.name, "experiment_id": experiment.experiment_id, "run_id": parent.info.run_id}
    write_json(layout.metrics("tracking"), record)
    return record
