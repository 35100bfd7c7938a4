"""MLflow records of the pipeline, made by its last stage (``mergeflow track``) from the files the stages wrote.

Runs. One run per stage item (``prepare``, ``pretrain``, ``finetune@<task>``, ``vectors``, ``merge@<method>``),
tagged ``mergeflow.stage`` (prepare, pretrain, finetune, vectors, merge) and ``mergeflow.item`` (the task or
method), started and ended at the stage's real times (logs/timing). Plus one ``pipeline`` run per pipeline state:
the git commit, dvc.lock, results/, the probe and individual averages, the best method, and one tag
``stage_run.<stage>.<item>`` per stage run it covers. Runs are flat (no nesting): a stage run that did not change
belongs to every later pipeline run. The standard fine-tune's runs (finetune, vectors, merge) are tagged
``regime`` = ``variant`` = ``standard``.

Training-time regimes and studies (each item of their stages is several runs, so each run's key in the pipeline
run, ``stage_run.<stage>.<item>.<variant>[.<method>]``, names it):

    regime@<r>        one run per variant v (run name ``regime@<v>``; tags regime=<r>, variant=<v>): params the
                      variant's hyperparameters, regime, variant, paper; metrics individual_avg,
                      individual_val_avg, individual_acc.<task> (its task models), model_test_avg, model_val_avg,
                      model_gap_recovered, model_test_acc.<task> (its own model, when it has one: MIMA's average,
                      ATM's theta(R)), wall_time_s (the variant's), and per round (step = round)
                      update_cosine_median/_max, task_vector_cosine_median/_max (over the task pairs),
                      update_norm_mean, task_vector_norm_mean, round_wall_time_s; artifacts the variant's record
                      (``regime/<v>.json``: every pair's cosine per round), its vectors' stats.json, and its own
                      model as an MLflow model (``model``) when it has one
    regime_merge@<r>  one run per variant v and method m (run name ``<v>/<m>``; tags regime=<r>, variant=<v>), a
                      merge run under the convention below (gap_recovered and normalized_avg on the standard
                      fine-tune's scale, as in results/summary.json; no wall_time_s: the stage times its
                      variants' merges together); the method named as the regime (kind "regime_model") is its own
                      model, evaluated: its params are the variant's hyperparameters, its model the regime's
    study@<s>         one run (tag study=<s>): metrics holds, fails, not_measured, wall_time_s; params paper and
                      verdict.<claim id> (holds, fails, not measured); artifacts report.md and its figures, and
                      study.json (every claim's numbers); the verdicts as its description

A variant's run (and a regime merge's) starts and ends with its stage, which runs every variant. A regime or
study that has not run (its metrics file, or its timing file, missing) is left out with a notice. The registry
holds the standard regime's best merged model only: its versions compare one pipeline run to the next on the
same fine-tune.

Only what changed is logged. A stage item's fingerprint is the sha256 of its dvc.lock entry's params and output
hashes (timing logs left out: a re-run that gives the same outputs is the same result); a regime variant's or
regime merge's, the sha256 of its own files' md5s (dvc.lock's, from the directory manifests in DVC's cache, when
current) and its record without wall times. A run whose fingerprint
already has a FINISHED run in the experiment is not logged again, and the pipeline run's fingerprint is that of
all its stages and the report; a weights file whose md5 is already in the store is not copied again (the run
points to the copy through ``mergeflow.weights_in``).

Metric convention, the same for every merge run (a new method follows it), accuracies in percent:

    test_avg          mean test accuracy over the tasks
    test_acc.<task>   test accuracy on each task
    val_avg           mean validation accuracy of the chosen setting
    normalized_avg    mean of test accuracy / the individual fine-tuned model's, per task
    gap_recovered     (test_avg - probe_avg) / (individual_avg - probe_avg): the share of the gap between the
                      linear probe on the pretrained backbone and the individual models that the merge closes;
                      not logged when the individual models do not beat the probe (evaluation.MIN_GAP)
    storage_models    what is stored, in models (1 for one merged model; per-task stores more)
    wall_time_s       the merge stage: search on validation plus the test evaluation

Task negation (kind "negation") logs the same names for the models that negate each task t: ``test_acc.<t>`` is
the accuracy on t itself (the target, lower is better), ``test_avg`` their mean, ``gap_recovered`` by the same
formula (negative: it moves away from the individual models), ``storage_models`` one model per task, and adds
``control_acc.<t>`` (mean accuracy on the other tasks) and ``control_avg``.

Parameters of a merge run: ``method``, ``kind``, ``paper``, every hyperparameter under its own name (``lam``,
``k``, ``rank_ratio``; a per-task choice as ``<key>.<task>``) and each searched grid as ``grid.<key>`` (its
values, comma-separated). The validation curve is the artifact ``curves/val_curve.json`` (a table against the
hyperparameter values, per-task choices' curves too) beside the stage's plot ``plots/<method>.png`` (a heatmap for
two-parameter grids); it is no metric history, which the UI plots against the step (the grid index) and which
would add names other methods lack. A merged model of kind "model" is an MLflow model (``model``, see
mergeflow.mlflow_model). Per-task stores are plain artifacts (``merged/<method>.safetensors``: a task's model is
rebuilt from the store and the pretrained weights), and task negation's file of chosen coefficients is not logged
(they are its ``lam.<t>`` parameters). The best merged model (highest test_avg among single models, a tie to the
method listed first) is registered as ``mergeflow-<suite>``.

Views. The experiment carries a saved view, "Methods ranked by test_avg" (experiment tag
``mlflow.sharedViewState.methods``, in the runs page's Views menu): merge runs of every regime (merge and
regime_merge) except negation, whose test_avg ranks the other way, best test_avg first, the regime and variant
tags, headline metrics and hyperparameters as columns (one regime: add ``and tags.variant = 'mima_n4'``, or
``'standard'``, to its search). With regimes or studies, "Regimes: task models and rounds" (key ``regimes``) and
"Studies: verdicts" (key ``studies``) too. ``ui_path`` in
metrics/tracking.json opens it. MLflow 3.17's UI picks the classic (not GenAI) pages from its own
``workflowType`` (the "Model training" switch, or ``?workflowType=machine_learning``, which ``ui_path`` carries);
the experiment tag ``mlflow.experimentKind`` = ``custom_model_development`` is set for the versions that read it.

``track`` survives being killed at any point: a new SQLite store is created and migrated under a temporary name
and then renamed into place (an old one is upgraded on a copy), so a kill during MLflow's migrations leaves no
half-migrated ``mlflow.db``; runs a killed ``track`` left RUNNING are marked FAILED when the next one starts, and
that one logs them again (only FINISHED runs count as logged). DVC never restores ``track`` from its run-cache
(its output is ``persist``), so it always logs to the store it is pointed at.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import socket
import sqlite3
import statistics
import subprocess
import tempfile
import time
import urllib.parse
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import yaml

from mergeflow.config import Params, mlflow_ui_base
from mergeflow.errors import MergeflowError, TransientError
from mergeflow.evaluation import gap_recovered, mean, normalized_average
from mergeflow.io import atomic_path, process_alive, read_json, write_json
from mergeflow.layout import Layout
from mergeflow.summary import percent

MERGE_METRICS = ("test_avg", "val_avg", "normalized_avg", "gap_recovered", "storage_models", "wall_time_s")  # and test_acc.<task>
VIEW_KEY = "methods"  # the shared view's key: experiment tag mlflow.sharedViewState.methods
VIEW_NAME = "Methods ranked by test_avg"  # its name in the UI's Views menu
ML_EXPERIMENT_KIND = "custom_model_development"  # MLflow 3's value of mlflow.experimentKind for classic ML
STANDARD_TAGS = {"regime": "standard", "variant": "standard"}  # the standard fine-tune's runs (finetune, vectors, merge), beside the training-time regimes'


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


def registered_model_name(params: Params) -> str:
    return f"mergeflow-{params.suite.name}"


def _flatten(prefix: str, obj) -> dict[str, str]:
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            out |= _flatten(f"{prefix}.{k}" if prefix else str(k), v)
        return out
    if isinstance(obj, list):
        return {prefix: json.dumps(obj)}
    return {prefix: str(obj)}


def _git_commit(root: Path) -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _sha256(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _md5(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def lock_stages(root: Path) -> dict[str, dict]:
    """dvc.lock's stage entries by name ({} when there is no lock)."""
    lock = root / "dvc.lock"
    if not lock.is_file():
        return {}
    try:
        return (yaml.safe_load(lock.read_text()) or {}).get("stages", {}) or {}
    except yaml.YAMLError as err:
        raise MergeflowError(f"{lock}: not valid YAML ({str(err).splitlines()[0]}); run 'mergeflow check' to restore it") from None


def fingerprint(entry: Mapping | None, files: list[Path], root: Path) -> str:
    """What identifies a stage item's result: its dvc.lock entry's params and output hashes, timing logs left
    out (a re-run that gives the same outputs in another time is the same result). Without an entry that
    matches the stage's metrics files (no dvc.lock, or a stage re-run but not yet committed), the md5 of the
    files ``track`` reads for it."""
    recorded = {o["path"]: o.get("md5") for o in (entry or {}).get("outs", [])}
    current = all(recorded[rel] == _md5(p) for p in files if p.suffix == ".json" and (rel := p.relative_to(root).as_posix()) in recorded)
    if entry and entry.get("outs") and current:
        outs = {o["path"]: o.get("md5") for o in entry["outs"] if not o["path"].startswith("logs/timing/")}
        return _sha256({"params": entry.get("params", {}), "outs": outs})
    return _sha256({p.relative_to(root).as_posix(): _md5(p) for p in files if p.is_file()})


def _out_md5(entry: Mapping | None, path: Path, root: Path) -> str:
    """A file's md5 as dvc.lock records it (no need to read it again), else computed."""
    rel = path.relative_to(root).as_posix()
    for out in (entry or {}).get("outs", []):
        if out["path"] == rel and out.get("md5"):
            return out["md5"]
    return _md5(path)


def stage_times(path: Path, extra_keys: tuple[str, ...] = ()) -> tuple[float, float]:
    """(started, ended) in Unix seconds from a timing file. Files without them (written before stages recorded
    them) give ended = the file's modification time, when the stage wrote it, and started = ended - wall time."""
    timing = read_json(path)
    try:
        wall = float(timing["wall_time_s"]) + sum(float(timing[k]) for k in extra_keys)
    except (KeyError, TypeError, ValueError):
        raise MergeflowError(f"{path}: needs numbers 'wall_time_s'{''.join(f', {k!r}' for k in extra_keys)}") from None
    ended = float(timing.get("ended") or path.stat().st_mtime)
    return float(timing.get("started") or ended - wall), ended


def curve_records(log, source: Path) -> list[dict]:
    """A training log as records [{"step": 0, "loss": ..., "lr": ...}, ...]; the older column form
    {"step": [...], "loss": [...]} is turned into records."""
    if isinstance(log, Mapping) and isinstance(log.get("step"), list):
        keys = list(log)
        return [dict(zip(keys, values)) for values in zip(*(log[k] for k in keys))]
    if isinstance(log, list) and all(isinstance(r, Mapping) and "step" in r for r in log):
        return list(log)
    raise MergeflowError(f"{source}: a training log is records [{{'step': ..., 'loss': ...}}, ...] or columns {{'step': [...], ...}}")


def merge_metrics(mm: Mapping, ev: Mapping, tasks: list[str], individual: Mapping[str, float], probe_avg: float, individual_avg: float) -> dict[str, float]:
    """The convention's metrics (module docstring) of one merge, from metrics/merge/<m>.json and
    metrics/evaluate/<m>.json; fractions become percent."""
    if ev["kind"] == "negation":
        per_task = ev["per_task"]
        target = {t: per_task[t]["target"] for t in tasks}
        extra = {f"control_acc.{t}": percent(per_task[t]["control"]) for t in tasks} | {"control_avg": percent(ev["average"]["control"])}
        test_avg, val_avg = ev["average"]["target"], mean(mm["per_task"][t]["chosen"]["target"] for t in tasks)
        normalized, storage = normalized_average(target, individual), float(len(tasks))
    else:
        target, extra = ev["accuracy"], {}
        test_avg, val_avg, normalized, storage = ev["average"], mm["val_average"], ev["normalized_average"], ev["storage_models"]
    return {
        "test_avg": percent(test_avg),
        "val_avg": percent(val_avg),
        "normalized_avg": percent(normalized),
        "gap_recovered": percent(gap_recovered(test_avg, probe_avg, individual_avg)),
        "storage_models": round(float(storage), 2),
        **{f"test_acc.{t}": percent(target[t]) for t in tasks},
        **extra,
    }


def merge_params(mm: Mapping, ev: Mapping) -> dict[str, str]:
    """method, kind, paper, each hyperparameter under its own name (per-task choices as <key>.<task>), and the
    searched grids as grid.<key>."""
    chosen = dict(mm["hyperparameters"])
    if ev["kind"] == "negation":
        chosen["lam"] = {t: r["lam"] for t, r in ev["per_task"].items()}
    from mergeflow.merging import DATA

    return {"method": mm["method"], "kind": mm["kind"], "paper": mm["paper"], "data": DATA[mm.get("reads")]} | _flatten("", chosen) | {f"grid.{k}": ", ".join(map(str, v)) for k, v in mm["grid"].items()}  # not JSON: the UI spreads a JSON list over lines


def _val_curve(mm: Mapping) -> dict:
    """The validation search as a table against the hyperparameter values (not the grid index), percent."""
    keys = list(mm["grid"])
    if mm["kind"] == "negation":
        rows = [{"task": t, "lam": p["lam"], "target": percent(p["target"]), "control": percent(p["control"])} for t, r in mm["per_task"].items() for p in r["curve"]]
        return {"x": ["lam"], "rows": rows, "chosen": {t: r["chosen"]["lam"] for t, r in mm["per_task"].items()}}
    rows = [{k: r["hyperparameters"].get(k) for k in keys} | {"val_avg": percent(r["average"])} for r in mm.get("val_curve", [])]
    per_task = [{"key": key, "task": t, "value": float(v), "val_acc": percent(acc)} for key, by_task in (mm.get("per_task_curves") or {}).items() for t, curve in by_task.items() for v, acc in curve.items()]
    return {"x": keys, "rows": rows, "per_task": per_task, "chosen": mm["searched"]}


def locked_md5s(lock: Mapping[str, dict], root: Path) -> dict[str, str]:
    """Every output file's md5 as dvc.lock records it, by path from the root: a file output's from its entry, the
    files of a directory output from the directory's manifest in DVC's cache (``.dvc/cache/files/md5/ab/cd….dir``;
    a manifest not there is skipped: its files are hashed when needed)."""
    out: dict[str, str] = {}
    cache = root / ".dvc" / "cache"
    for entry in lock.values():
        for o in (entry or {}).get("outs", []) or []:
            md5 = o.get("md5")
            if not md5:
                continue
            if not md5.endswith(".dir"):
                out[o["path"]] = md5
                continue
            for manifest in (cache / "files" / "md5" / md5[:2] / md5[2:], cache / md5[:2] / md5[2:]):  # DVC 3, DVC 2
                if manifest.is_file():
                    try:
                        out |= {f"{o['path']}/{f['relpath']}": f["md5"] for f in json.loads(manifest.read_text())}
                    except (ValueError, KeyError, TypeError):
                        pass
                    break
    return out


class _Hashes:
    """md5s of output files, from dvc.lock (and DVC's cache) where they are current: a regime's weights are not
    read again on every track."""

    def __init__(self, lock: Mapping[str, dict], root: Path):
        self.root, self.lock, self._locked = root, lock, None

    def __call__(self, files: list[Path]) -> dict[str, str]:
        """{path from the root: md5} of those of ``files`` that exist: dvc.lock's when every one of them is
        recorded there and the JSON files among them match it (the lock is current), else computed."""
        if self._locked is None:
            self._locked = locked_md5s(self.lock, self.root)
        present = {p: p.relative_to(self.root).as_posix() for p in files if p.is_file()}
        current = all(rel in self._locked for rel in present.values()) and all(self._locked[rel] == _md5(p) for p, rel in present.items() if p.suffix == ".json")
        return {rel: self._locked[rel] if current else _md5(p) for p, rel in present.items()}


ROUND_METRICS = (  # (metric, the round record's key, how its values are summarised): one point per round, step = round
    ("update_cosine_median", "update_cosines", statistics.median),
    ("update_cosine_max", "update_cosines", max),
    ("task_vector_cosine_median", "task_vector_cosines", statistics.median),
    ("task_vector_cosine_max", "task_vector_cosines", max),
    ("update_norm_mean", "update_norms", statistics.fmean),
    ("task_vector_norm_mean", "task_vector_norms", statistics.fmean),
)


def regime_metrics(record: Mapping, tasks: list[str], probe_avg: float, individual_avg: float, times: Mapping | None = None) -> tuple[dict[str, float], dict[str, list[tuple[int, float]]]]:
    """One regime variant's metrics (metrics/regime/<regime>.json's record), percent, and its per-round histories
    (step = round; pairwise cosines and norms summarised over the task pairs and tasks); ``times``: the variant's
    entry of logs/timing/regime/<regime>.json (wall_time_s, rounds_wall_time_s)."""
    times = times or {}
    individual = record["individual"]
    metrics = {
        "individual_avg": percent(record["individual_average"]["test"]),
        "individual_val_avg": percent(record["individual_average"]["val"]),
        **{f"individual_acc.{t}": percent(individual[t]["test"]) for t in tasks},
    }
    if "wall_time_s" in times:
        metrics["wall_time_s"] = float(times["wall_time_s"])
    if own := record.get("model"):
        test = own["average"]["test"]
        metrics |= {
            "model_test_avg": percent(test),
            "model_val_avg": percent(own["average"]["val"]),
            "model_gap_recovered": percent(gap_recovered(test, probe_avg, individual_avg)),
            **{f"model_test_acc.{t}": percent(own["accuracy"]["test"][t]) for t in tasks},
        }
    history: dict[str, list[tuple[int, float]]] = {}
    walls = list(times.get("rounds_wall_time_s") or [])
    for i, r in enumerate(record.get("rounds", [])):
        for name, key, summary in ROUND_METRICS:
            if values := [float(v) for v in (r.get(key) or {}).values()]:
                history.setdefault(name, []).append((int(r["round"]), round(summary(values), 4)))
        wall = walls[i] if i < len(walls) else None
        if isinstance(wall, (int, float)) and math.isfinite(wall):  # NaN: a round run by a process that was killed
            history.setdefault("round_wall_time_s", []).append((int(r["round"]), round(float(wall), 3)))
    return metrics, history


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def study_note(study: Mapping) -> str:
    """A study run's description (Markdown): its verdicts, one line per claim."""
    lines = [
        f"**{study['holds']} hold, {study['fails']} fail, {study['not_measured']} not measured.** {study['paper']}",
        "",
        "The report with its figures: artifact `report.md`.",
        "",
        "| claim | verdict | measured |",
        "|---|---|---|",
    ]
    lines += [f"| {_cell(c['id'])} {_cell(c['claim'])} | **{c['verdict']}** | {_cell(c.get('detail', ''))} |" for c in study["claims"]]
    return "\n".join(lines)


class _Recorder:
    """Logs stage runs into one experiment, skipping those already logged."""

    def __init__(self, client, experiment_id: str, base_tags: dict[str, str]):
        self.client, self.experiment_id, self.base_tags = client, experiment_id, base_tags
        self.stage_runs: dict[str, str] = {}  # stage item -> its run id (new or already there)
        self.fingerprints: dict[str, str] = {}
        self.new_runs: list[str] = []

    def _find_run(self, tag: str, value: str):
        runs = self.client.search_runs([self.experiment_id], filter_string=f"tags.`{tag}` = '{value}' and attributes.status = 'FINISHED'", max_results=1, order_by=["attributes.start_time DESC"])
        return runs[0] if runs else None

    def find(self, tag: str, value: str) -> str | None:
        run = self._find_run(tag, value)
        return run.info.run_id if run else None

    @contextlib.contextmanager
    def run(self, name: str, fp: str, times: tuple[float, float], tags: Mapping[str, str], run_name: str | None = None) -> Iterator[str | None]:
        """A run for stage item ``name`` (a key unique in the pipeline; the UI shows ``run_name``, default
        ``name``) at the stage's real start and end; yields None (nothing to log) when a FINISHED run with
        fingerprint ``fp`` is already there. Such a run gets the tags in ``tags`` it lacks (a run logged by an
        older track: regime=standard), none it has is changed."""
        self.fingerprints[name] = fp
        if existing := self._find_run("mergeflow.fingerprint", fp):
            for key, value in tags.items():
                if key not in existing.data.tags:
                    self.client.set_tag(existing.info.run_id, key, value)
            self.stage_runs[name] = existing.info.run_id
            yield None
            return
        started, ended = times
        run = self.client.create_run(self.experiment_id, start_time=int(started * 1000), run_name=run_name or name, tags={**self.base_tags, **tags, "mergeflow.fingerprint": fp})
        run_id = run.info.run_id
        try:
            yield run_id
        except BaseException:
            self.client.set_terminated(run_id, "FAILED")
            raise
        # after everything is logged: a FINISHED run is a complete one (log_model's own end is overwritten here)
        self.client.set_terminated(run_id, "FINISHED", end_time=int(ended * 1000))
        self.stage_runs[name] = run_id
        self.new_runs.append(run_id)

    def log(self, run_id: str, params: Mapping[str, str] = {}, metrics: Mapping[str, float] = {}, at: float | None = None, history: Mapping[str, list[tuple[int, float]]] = {}) -> None:
        """Parameters, metrics at time ``at`` (the stage's end), and metric histories by step."""
        from mlflow.entities import Metric, Param

        ts = int((at or time.time()) * 1000)
        metrics = {k: round(float(v), 3) if k == "wall_time_s" else v for k, v in metrics.items()}  # ms: the UI shows every digit
        # a metric that is not defined (gap_recovered when the fine-tunes do not beat the probe) is not logged
        entries = [Metric(k, float(v), ts, 0) for k, v in metrics.items() if v is not None] + [Metric(k, float(v), ts, int(step)) for k, points in history.items() for step, v in points]
        params = [Param(k, str(v)) for k, v in params.items()]
        for i in range(0, len(params), 100):  # MLflow's limits per batch: 100 params, 1000 metrics
            self.client.log_batch(run_id, params=params[i : i + 100], synchronous=True)
        for i in range(0, len(entries), 1000):
            self.client.log_batch(run_id, metrics=entries[i : i + 1000], synchronous=True)

    def stored(self, md5: str) -> dict[str, str] | None:
        """The tags of a FINISHED run whose logged weights include a file with this md5, if any."""
        runs = self.client.search_runs([self.experiment_id], filter_string=f"tags.`mergeflow.weights_md5` LIKE '%{md5}%' and attributes.status = 'FINISHED'", max_results=1)
        return runs[0].data.tags | {"run_id": runs[0].info.run_id} if runs else None

    def weights(self, run_id: str, files: Mapping[Path, str], artifact_path: Callable[[Path], str]) -> None:
        """Copy weights files (path -> md5) into the run's artifacts, except those the store already holds: the
        run's tag mergeflow.weights_in.<file> names the run that has it."""
        copied = []
        for path, md5 in files.items():
            if holder := self.stored(md5):
                self.client.set_tag(run_id, f"mergeflow.weights_in.{path.stem}", f"runs:/{holder['run_id']}")
                continue
            self.client.log_artifact(run_id, str(path), artifact_path(path))
            copied.append(md5)
        if copied:
            self.client.set_tag(run_id, "mergeflow.weights_md5", " ".join(copied))  # what the next track searches


def _shown(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _log_merged_model(recorder: _Recorder, run_id: str, weights: Path, md5: str, params: Params) -> str:
    """Log a merged model as an MLflow model (mergeflow.mlflow_model) unless one with these weights is stored;
    returns its model URI (also the run's tag mergeflow.model_uri)."""
    import mlflow
    import numpy
    import pydantic
    import safetensors
    import timm
    import torch

    from mergeflow import mlflow_model

    holder = recorder.stored(md5)
    if holder and holder.get("mergeflow.model_uri"):
        uri = holder["mergeflow.model_uri"]
        recorder.client.set_tag(run_id, "mergeflow.weights_in.model", f"runs:/{holder['run_id']}")
    else:
        requirements = [f"{m.__name__}=={m.__version__.split('+')[0]}" for m in (torch, timm, safetensors, numpy, pydantic, mlflow)]
        with contextlib.ExitStack() as stack:
            backbone = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mergeflow-track-"))) / mlflow_model.BACKBONE
            backbone.write_text(json.dumps(params.backbone.model_dump(mode="json"), indent=2))
            stack.enter_context(mlflow.start_run(run_id=run_id))
            stack.enter_context(warnings.catch_warnings())
            # predict takes and gives numpy arrays, which MLflow's type-hint validation does not cover: no hints
            warnings.filterwarnings("ignore", message=".*Add type hints to the `predict` method", category=UserWarning)
            info = mlflow.pyfunc.log_model(
                name="model",
                python_model=mlflow_model.__file__,
                artifacts={"weights": str(weights.resolve()), "backbone": str(backbone)},
                pip_requirements=requirements,  # given, so MLflow does not run the model to infer them
            )
        uri = info.model_uri
        recorder.client.set_tag(run_id, "mergeflow.weights_md5", md5)
    recorder.client.set_tag(run_id, "mergeflow.model_uri", uri)
    return uri


def register_best(client, name: str, merge_runs: Mapping[str, str]) -> dict | None:
    """Register the merged model with the highest test_avg among ``merge_runs`` (method -> run id, single-model
    methods only) as a version of ``name``, tagged with its method and hyperparameters; no new version when the
    latest one already comes from that run. Returns {"name", "version", "run_id", "method"} or None."""
    from mlflow.exceptions import MlflowException

    runs = [client.get_run(r) for r in merge_runs.values()]
    runs = [r for r in runs if "test_avg" in r.data.metrics and r.data.tags.get("mergeflow.model_uri")]
    if not runs:
        return None
    best = max(runs, key=lambda r: r.data.metrics["test_avg"])
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description=f"The best merged model (highest test_avg among single-model methods) of each pipeline run; load one with `mergeflow.mlflow_model.load_model('models:/{name}/1')` (its version number for 1).")
    versions = client.search_model_versions(f"name = '{name}'")
    latest = max(versions, key=lambda v: int(v.version), default=None)
    if latest is not None and latest.run_id == best.info.run_id:
        return {"name": name, "version": latest.version, "run_id": best.info.run_id, "method": best.data.params["method"]}
    hyperparameters = {k: v for k, v in best.data.params.items() if k not in ("method", "kind", "paper") and not k.startswith("grid.")}
    tags = {"method": best.data.params["method"], "test_avg": f"{best.data.metrics['test_avg']:.2f}", "run_id": best.info.run_id} | hyperparameters
    version = client.create_model_version(name, best.data.tags["mergeflow.model_uri"], run_id=best.info.run_id, tags=tags)
    return {"name": name, "version": version.version, "run_id": best.info.run_id, "method": tags["method"]}


def methods_view(tasks: list[str], hyperparameters: list[str]) -> dict:
    """The experiment's shared view of merge runs (MLflow UI state, stored as the experiment tag
    mlflow.sharedViewState.<key> and opened by ?viewStateShareKey=<key>): the merge runs of every regime (stages
    merge and regime_merge; a regime's own model too; negation aside: its test_avg ranks the other way), best
    test_avg first, the regime and variant, the headline metrics and the hyperparameters as columns. One regime's
    runs: add ``and tags.variant = 'mima_n4'`` (``'standard'`` for the standard fine-tune's) to the search."""
    metrics = ["test_avg", "gap_recovered", "normalized_avg", "val_avg", "storage_models", *(f"test_acc.{t}" for t in tasks)]
    # data: what the method reads (test-time adaptation is not comparable with the others), beside the run's name
    columns = ["attributes.`Run Name`", "tags.`regime`", "tags.`variant`", "params.`data`", *(f"metrics.`{m}`" for m in metrics), "params.`method`", *(f"params.`{p}`" for p in hyperparameters), "attributes.`Models`"]
    return {
        "searchFilter": "tags.`mergeflow.stage` LIKE '%merge' and params.kind != 'negation'",  # merge, regime_merge; negation's test_avg: lower is better
        "orderByKey": "metrics.`test_avg`",
        "orderByAsc": False,
        "startTime": "ALL",
        "lifecycleFilter": "Active",
        "modelVersionFilter": "All Runs",
        "datasetsFilter": [],
        "selectedColumns": columns,
        "columnOrder": columns,
    }


def _view(search: str, order_by: str, columns: list[str]) -> dict:
    return {"searchFilter": search, "orderByKey": order_by, "orderByAsc": False, "startTime": "ALL", "lifecycleFilter": "Active", "modelVersionFilter": "All Runs", "datasetsFilter": [], "selectedColumns": columns, "columnOrder": columns}


def regimes_view(tasks: list[str], hyperparameters: list[str]) -> dict:
    """The shared view of the regime runs (one per variant): their task models' and own model's accuracies and
    the last round's cosines and norms (each is a history by round: the run's Model metrics tab plots it)."""
    metrics = ["individual_avg", "model_test_avg", "model_gap_recovered", "task_vector_cosine_median", "update_cosine_median", "task_vector_norm_mean", "wall_time_s", *(f"individual_acc.{t}" for t in tasks)]
    columns = ["attributes.`Run Name`", "tags.`regime`", "tags.`variant`", *(f"metrics.`{m}`" for m in metrics), *(f"params.`{p}`" for p in hyperparameters), "attributes.`Models`"]
    return _view("tags.`mergeflow.stage` = 'regime'", "metrics.`individual_avg`", columns)


def studies_view(verdicts: list[str]) -> dict:
    """The shared view of the study runs: verdict counts and each claim's verdict."""
    columns = ["attributes.`Run Name`", "metrics.`holds`", "metrics.`fails`", "metrics.`not_measured`", *(f"params.`{v}`" for v in verdicts)]
    return _view("tags.`mergeflow.stage` = 'study'", "metrics.`holds`", columns)


def ui_path(experiment_id: str) -> str:
    """The MLflow UI path (after the server's address) of the methods view, in the classic ML view."""
    query = urllib.parse.urlencode({"viewStateShareKey": VIEW_KEY, "workflowType": "machine_learning"})
    return f"/#/experiments/{experiment_id}/runs?{query}"


def headline_markdown(client, experiment_id: str, merge_ids: list[str], probe_avg: float, individual_avg: float, regime_merges: list[tuple[str, str, str]] = (), studies: list[tuple[str, str]] = ()) -> str:
    """The pipeline run's description (the UI renders it as Markdown): every method, best test_avg first, each
    linked to its merge run; then each training-time regime's variants and methods, and the studies' verdicts."""

    def chosen(r) -> str:
        return ", ".join(f"{k}={v}" for k, v in r.data.params.items() if k not in ("method", "kind", "paper") and not k.startswith("grid."))

    def link(text: str, run_id: str) -> str:
        return f"[{text}](#/experiments/{experiment_id}/runs/{run_id})"

    runs = sorted((client.get_run(r) for r in merge_ids), key=lambda r: (r.data.params["kind"] == "negation", -r.data.metrics["test_avg"]))
    lines = [f"Linear probe {percent(probe_avg)}%, individual models {percent(individual_avg)}% (test average).", "", "| method | test_avg | gap_recovered | hyperparameters |", "|---|---|---|---|"]
    for r in runs:
        note = " (negation: target accuracy, lower is better)" if r.data.params["kind"] == "negation" else ""
        lines.append(f"| {link(r.data.params['method'], r.info.run_id)}{note} | {r.data.metrics['test_avg']:.2f} | {_shown(r.data.metrics.get('gap_recovered'))} | {chosen(r)} |")
    if regime_merges:
        lines += ["", "Training-time regimes (gap_recovered on the standard fine-tune's scale), best test_avg first within each variant:", "", "| variant | method | test_avg | gap_recovered | hyperparameters |", "|---|---|---|---|---|"]
        order = list(dict.fromkeys(v for v, _, _ in regime_merges))
        runs = sorted(((v, client.get_run(r)) for v, _, r in regime_merges), key=lambda vr: (order.index(vr[0]), -vr[1].data.metrics["test_avg"]))
        lines += [f"| {v} | {link(r.data.params['method'], r.info.run_id)} | {r.data.metrics['test_avg']:.2f} | {_shown(r.data.metrics.get('gap_recovered'))} | {chosen(r)} |" for v, r in runs]
    if studies:
        lines += ["", "Studies:", ""]
        for name, run_id in studies:
            m = client.get_run(run_id).data.metrics
            lines.append(f"- {link(name, run_id)}: {m['holds']:.0f} hold, {m['fails']:.0f} fail, {m['not_measured']:.0f} not measured")
    return "\n".join(lines)


def _hyperparameter_names(client, run_ids) -> list[str]:
    names: set[str] = set()
    for run_id in run_ids:
        names |= {k for k in client.get_run(run_id).data.params if k not in ("method", "kind", "paper", "data") and not k.startswith("grid.")}
    return sorted(names)


def _notice(text: str) -> None:
    print(f"MLflow: {text}", flush=True)


def _track_regimes(params: Params, layout: Layout, rec: _Recorder, hashes: _Hashes, tasks: list[str], individual: Mapping[str, float], probe_avg: float, individual_avg: float) -> list[tuple[str, str, str]]:
    """The training-time regimes' runs: per variant of regime@<r> one run (its task models' accuracies, its own
    model, per-round cosines and norms), and per variant and method of regime_merge@<r> one merge run under the
    merge convention. A regime whose files are missing (not run yet) is left out with a notice. Returns
    (variant, method, run id) of the merge runs, in order."""
    client, log_ckpt = rec.client, params.tracking.log_checkpoints
    merges: list[tuple[str, str, str]] = []
    for r in params.regimes.run:
        metrics_path, timing = layout.metrics("regime", r), layout.timing("regime", r)
        if not (metrics_path.is_file() and timing.is_file()):
            _notice(f"regime {r} not tracked: {metrics_path if not metrics_path.is_file() else timing} is missing (regime@{r} has not run)")
            continue
        measured, times = read_json(metrics_path), stage_times(timing)
        variants = [v for v in params.regimes.config(r).variants(r, params.finetune.steps) if v in measured["variants"]]
        if missing := [v for v in params.regimes.config(r).variants(r, params.finetune.steps) if v not in measured["variants"]]:
            _notice(f"regime {r}: variants {', '.join(missing)} not tracked: not in {metrics_path} (regime@{r} ran with other settings)")
        for v in variants:
            record, model, stats = measured["variants"][v], layout.regime_model(r, v), layout.regime_vectors(r, v) / "stats.json"
            own_model = record.get("model") is not None and model.is_file()
            name = f"regime@{r}/{v}"
            fp = _sha256({"item": name, "record": record, "files": hashes([stats, model] if own_model else [stats])})
            with rec.run(name, fp, times, {"mergeflow.stage": "regime", "mergeflow.item": r, "regime": r, "variant": v}, run_name=f"regime@{v}") as run_id:
                if run_id:
                    metrics, history = regime_metrics(record, tasks, probe_avg, individual_avg, read_json(timing).get("variants", {}).get(v))
                    rec.log(run_id, {"regime": r, "variant": v, "paper": measured["paper"]} | _flatten("", record["hyperparameters"]), metrics, times[1], history)
                    client.log_dict(run_id, record, f"regime/{v}.json")  # every round's norms and pairwise cosines
                    if stats.is_file():
                        client.log_artifact(run_id, str(stats), "vectors")
                    if log_ckpt and own_model:
                        _log_merged_model(rec, run_id, model, hashes([model])[model.relative_to(layout.root).as_posix()], params)

        merge_timing = layout.timing("regime_merge", r)
        if not merge_timing.is_file():
            _notice(f"regime {r}'s merges not tracked: {merge_timing} is missing (regime_merge@{r} has not run)")
            continue
        times = stage_times(merge_timing)
        for v in variants:
            record = measured["variants"][v]
            for method in params.regimes.methods_of(r):
                run = layout.merge_run(method, r, v)
                own = method == r  # the regime's own model, evaluated (not merged)
                if not run.evaluation.is_file() or not (own or run.choice.is_file()):
                    _notice(f"regime {r}: {v} merged with {method} not tracked: {run.evaluation if not run.evaluation.is_file() else run.choice} is missing")
                    continue
                if own and record.get("model") is None:
                    _notice(f"regime {r}: {v} has no model of its own to track as method {method}")
                    continue
                ev = read_json(run.evaluation)
                if own:
                    weights = layout.regime_model(r, v)
                    mm = {"method": method, "kind": ev["kind"], "paper": measured["paper"], "hyperparameters": ev["hyperparameters"], "grid": {}, "val_average": record["model"]["average"]["val"]}
                    files = [run.evaluation, weights]
                else:
                    weights, mm = run.merged, read_json(run.choice)
                    files = [run.choice, run.evaluation, weights]
                name = f"regime_merge@{r}/{v}/{method}"
                md5s = hashes(files)
                fp = _sha256({"item": name, "files": md5s, "val_average": mm["val_average"]})
                tags = {"mergeflow.stage": "regime_merge", "mergeflow.item": r, "regime": r, "variant": v}
                with rec.run(name, fp, times, tags, run_name=f"{v}/{method}") as run_id:
                    if run_id:
                        rec.log(run_id, merge_params(mm, ev), merge_metrics(mm, ev, tasks, individual, probe_avg, individual_avg), times[1])
                        if not own:
                            client.log_dict(run_id, _val_curve(mm), "curves/val_curve.json")
                            if "learned" in mm:
                                client.log_dict(run_id, mm["learned"], "learned/coefficients.json")
                            if run.search_plot.is_file():
                                client.log_artifact(run_id, str(run.search_plot), "plots")
                        md5 = md5s.get(weights.relative_to(layout.root).as_posix())
                        if log_ckpt and md5 and mm["kind"] in ("model", "regime_model"):
                            _log_merged_model(rec, run_id, weights, md5, params)
                        elif log_ckpt and md5 and mm["kind"] == "per_task":
                            rec.weights(run_id, {weights: md5}, lambda p: "merged")
                merges.append((v, method, rec.stage_runs[name]))
    return merges


def _track_studies(params: Params, layout: Layout, rec: _Recorder, lock: Mapping[str, dict]) -> list[tuple[str, str]]:
    """One run per study@<s>: its verdict counts as metrics, each claim's verdict as parameter verdict.<id>, the
    report and its figures as artifacts, the verdicts as its description. Returns (study, run id) in order."""
    out = []
    for s in params.studies.run:
        path, timing, folder = layout.metrics("studies", s), layout.timing("study", s), layout.study(s)
        if not (path.is_file() and timing.is_file()):
            _notice(f"study {s} not tracked: {path if not path.is_file() else timing} is missing (study@{s} has not run)")
            continue
        name = f"study@{s}"
        files = [path, *sorted(f for f in folder.rglob("*") if f.is_file())]
        times = stage_times(timing)
        with rec.run(name, fingerprint(lock.get(name), files, layout.root), times, {"mergeflow.stage": "study", "mergeflow.item": s, "study": s}) as run_id:
            if run_id:
                study = read_json(path)
                verdicts = {f"verdict.{c['id']}": c["verdict"] for c in study["claims"]}
                rec.log(run_id, {"study": s, "paper": study["paper"]} | verdicts, {k: study[k] for k in ("holds", "fails", "not_measured")} | {"wall_time_s": read_json(timing)["wall_time_s"]}, times[1])
                if folder.is_dir():
                    rec.client.log_artifacts(run_id, str(folder))  # report.md and its figures, side by side as it links them
                rec.client.log_dict(run_id, study, "study.json")  # every claim's numbers
                rec.client.set_tag(run_id, "mlflow.note.content", study_note(study))
        out.append((s, rec.stage_runs[name]))
    return out


def track(params: Params, layout: Layout = Layout()) -> dict:
    import mlflow
    from mlflow import MlflowClient

    track_started = time.time()
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # log_model reads its files back: no bars in the stage's log
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
    exp_id = experiment.experiment_id
    if failed := fail_abandoned_runs(client, exp_id):
        print(f"marked {failed} runs FAILED that a killed track left RUNNING")

    tasks, methods = params.suite.tasks, params.merge.methods
    lock = lock_stages(root)
    # every run carries its host and process, so the next track can tell a run still being logged from an abandoned one
    base = {"mergeflow.host": socket.gethostname(), "mergeflow.pid": str(os.getpid()), "git.commit": _git_commit(root), "mergeflow.source": os.environ.get("MERGEFLOW_RUN_SOURCE", "dvc")}
    if os.environ.get("PREFECT__FLOW_RUN_ID"):
        base["prefect.flow_run_id"] = os.environ["PREFECT__FLOW_RUN_ID"]
    rec = _Recorder(client, exp_id, base)
    log_ckpt = params.tracking.log_checkpoints
    ft = {t: read_json(layout.metrics("finetune", t)) for t in tasks}
    individual = {t: ft[t]["individual"]["test"] for t in tasks}
    probe_avg, individual_avg = mean(ft[t]["probe"]["test"] for t in tasks), mean(individual.values())

    def item(name: str, stage: str, files: list[Path], timing: Path, label: str = "", extra_time: tuple[str, ...] = (), extra_tags: Mapping[str, str] = {}):
        times = stage_times(timing, extra_time)
        tags = {"mergeflow.stage": stage} | ({"mergeflow.item": label} if label else {}) | dict(extra_tags)
        return rec.run(name, fingerprint(lock.get(name), files, root), times, tags), times[1]

    def weights(run_id: str, entry_name: str, files: Mapping[Path, str]) -> None:
        if log_ckpt:
            rec.weights(run_id, {p: _out_md5(lock.get(entry_name), p, root) for p in files}, lambda p: files[p])

    ctx, end = item("prepare", "prepare", [layout.metrics("prepare")], layout.timing("prepare"))
    with ctx as run_id:
        if run_id:
            prep = read_json(layout.metrics("prepare"))
            images = {s: sum(sizes[s] for sizes in prep["tasks"].values()) for s in ("train", "val", "test")}
            rec.log(run_id, {"seed": params.seed} | _flatten("suite", params.suite.model_dump(mode="json")), {"wall_time_s": read_json(layout.timing("prepare"))["wall_time_s"], "pretrain_images": prep["pretrain_images"]} | {f"task_images.{s}": n for s, n in images.items()}, end)

    ctx, end = item("pretrain", "pretrain", [layout.metrics("pretrain"), layout.pretrained], layout.timing("pretrain"))
    with ctx as run_id:
        if run_id:
            pre = read_json(layout.metrics("pretrain"))
            curve = curve_records(read_json(layout.log("pretrain")), layout.log("pretrain"))
            rec.log(
                run_id,
                _flatten("backbone", params.backbone.model_dump(mode="json")) | _flatten("pretrain", params.pretrain.model_dump(mode="json")),
                {"wall_time_s": read_json(layout.timing("pretrain"))["wall_time_s"], "parameters": pre["parameters"], "final_loss": pre["final_loss"]} | {f"head_acc.{k}": percent(v) for k, v in pre["train_head_accuracy"].items()},
                end,
                {f"train.{k}": [(r["step"], r[k]) for r in curve] for k in curve[0] if k != "step"} if curve else {},
            )
            weights(run_id, "pretrain", {layout.pretrained: "checkpoints"})

    for t in tasks:
        name = f"finetune@{t}"
        ctx, end = item(name, "finetune", [layout.metrics("finetune", t), layout.finetuned(t), layout.head(t)], layout.timing("finetune", t), t, extra_tags=STANDARD_TAGS)
        with ctx as run_id:
            if run_id:
                m = ft[t]
                curve = curve_records(read_json(layout.log("finetune", t)), layout.log("finetune", t))
                rec.log(
                    run_id,
                    {"task": t, "steps": m["steps"], "head": m["probe"].get("head", "probe")} | ({"probe.C": m["probe"]["C"]} if m["probe"].get("C") is not None else {}) | ({"imported": m["imported"]} if m.get("imported") else {}) | _flatten("finetune", params.finetune.model_dump(mode="json")),
                    {"wall_time_s": read_json(layout.timing("finetune", t))["wall_time_s"], "probe_acc": percent(m["probe"]["test"]), "individual_acc": percent(m["individual"]["test"]), "individual_val_acc": percent(m["individual"]["val"]), "gain": percent(m["gain_over_probe"]["test"])},
                    end,
                    {f"train.{k}": [(r["step"], r[k]) for r in curve] for k in curve[0] if k != "step"} if curve else {},
                )
                weights(run_id, name, {layout.finetuned(t): "checkpoints", layout.head(t): "heads"})

    ctx, end = item("vectors", "vectors", [layout.metrics("vectors"), layout.vectors / "stats.json"], layout.timing("vectors"), extra_tags=STANDARD_TAGS)
    with ctx as run_id:
        if run_id:
            vec = read_json(layout.metrics("vectors"))
            rec.log(run_id, {"tasks": ",".join(tasks)}, {"wall_time_s": read_json(layout.timing("vectors"))["wall_time_s"]} | {f"norm.{k}": v for k, v in vec["norms"].items()} | {f"relative_norm.{k}": v for k, v in vec["relative_norms"].items()}, end)
            for f in ("stats.json", "cosine.png"):
                if (layout.vectors / f).is_file():
                    client.log_artifact(run_id, str(layout.vectors / f))

    single_models: dict[str, str] = {}
    for method in methods:
        name = f"merge@{method}"
        files = [layout.metrics("merge", method), layout.metrics("evaluate", method), layout.merged(method)]
        ctx, end = item(name, "merge", files, layout.timing("merge", method), method, ("evaluate_wall_time_s",), STANDARD_TAGS)
        with ctx as run_id:
            if run_id:
                mm, ev = read_json(layout.metrics("merge", method)), read_json(layout.metrics("evaluate", method))
                timing = read_json(layout.timing("merge", method))
                metrics = merge_metrics(mm, ev, tasks, individual, probe_avg, individual_avg) | {"wall_time_s": timing["wall_time_s"] + timing.get("evaluate_wall_time_s", 0.0)}
                rec.log(run_id, merge_params(mm, ev), metrics, end)
                client.log_dict(run_id, _val_curve(mm), "curves/val_curve.json")
                if "learned" in mm:  # AdaMerging's coefficients and entropy per step (the plot draws them)
                    client.log_dict(run_id, mm["learned"], "learned/coefficients.json")
                plot = layout.log("merge", method, ".png")
                if plot.is_file():
                    client.log_artifact(run_id, str(plot), "plots")
                if log_ckpt and mm["kind"] == "model":
                    _log_merged_model(rec, run_id, layout.merged(method), _out_md5(lock.get(name), layout.merged(method), root), params)
                elif log_ckpt and mm["kind"] == "per_task":
                    weights(run_id, name, {layout.merged(method): "merged"})
        if read_json(layout.metrics("merge", method))["kind"] == "model":
            single_models[method] = rec.stage_runs[name]

    # the registry stays the standard regime's: its best merged model, comparable from one pipeline run to the next
    registered = register_best(client, registered_model_name(params), single_models) if log_ckpt else None

    hashes = _Hashes(lock, root)
    regime_merges = _track_regimes(params, layout, rec, hashes, tasks, individual, probe_avg, individual_avg)
    studies = _track_studies(params, layout, rec, lock)

    # the pipeline run: one per state of all its stages (and the report); a track with nothing new logs none
    report_fp = fingerprint(lock.get("report"), sorted(layout.results.glob("*.json")), root)
    pipeline_fp = _sha256({"stages": rec.fingerprints, "report": report_fp})
    pipeline_id = rec.find("mergeflow.pipeline_fingerprint", pipeline_fp)
    if pipeline_id is None:
        # from the first stage this pipeline run (re)ran, to now
        started = min((client.get_run(r).info.start_time for r in rec.new_runs), default=int(track_started * 1000))
        tags = base | {"mergeflow.stage": "pipeline", "mergeflow.pipeline_fingerprint": pipeline_fp}
        tags |= {f"stage_run.{n.replace('@', '.').replace('/', '.')}": r for n, r in rec.stage_runs.items()}
        if (root / "dvc.lock").is_file():
            tags["dvc.lock.sha256"] = hashlib.sha256((root / "dvc.lock").read_bytes()).hexdigest()
        best = {}
        if single_models:
            best_run = max((client.get_run(r) for r in single_models.values()), key=lambda r: r.data.metrics["test_avg"])
            best = {"best_test_avg": best_run.data.metrics["test_avg"]}
            tags |= {"mergeflow.best_method": best_run.data.params["method"], "mergeflow.best_run": best_run.info.run_id}
        if registered:
            tags["mergeflow.registered"] = f"models:/{registered['name']}/{registered['version']}"
        tags["mlflow.note.content"] = headline_markdown(client, exp_id, [rec.stage_runs[f"merge@{m}"] for m in methods], probe_avg, individual_avg, regime_merges, studies)
        run = client.create_run(exp_id, start_time=started, run_name=f"pipeline {time.strftime('%Y-%m-%d %H:%M:%S')}", tags=tags)
        pipeline_id = run.info.run_id
        try:
            rec.log(pipeline_id, {"suite": params.suite.name, "tasks": ",".join(tasks), "methods": ",".join(methods), "regimes": ",".join(params.regimes.run) or "none", "studies": ",".join(params.studies.run) or "none", "backbone": params.backbone.model}, {"probe_avg": percent(probe_avg), "individual_avg": percent(individual_avg)} | best)
            client.log_artifacts(pipeline_id, str(layout.results), "results")
            if (root / "dvc.lock").is_file():
                client.log_artifact(pipeline_id, str(root / "dvc.lock"))
        except BaseException:
            client.set_terminated(pipeline_id, "FAILED")
            raise
        client.set_terminated(pipeline_id, "FINISHED", end_time=int(time.time() * 1000))
        rec.new_runs.append(pipeline_id)

    merge_ids = [rec.stage_runs[f"merge@{m}"] for m in methods] + [run_id for _, _, run_id in regime_merges]
    client.set_experiment_tag(exp_id, "mlflow.experimentKind", ML_EXPERIMENT_KIND)
    # the UI's saved-view envelope: listed under Views > Saved views, and opened by ?viewStateShareKey=
    now_ms = int(time.time() * 1000)
    views = {VIEW_KEY: (VIEW_NAME, methods_view(tasks, _hyperparameter_names(client, merge_ids)))}
    regime_ids = [r for n, r in rec.stage_runs.items() if n.startswith("regime@")]
    if regime_ids:
        names = sorted({k for r in regime_ids for k in client.get_run(r).data.params if k not in ("regime", "variant", "paper")})
        views["regimes"] = ("Regimes: task models and rounds", regimes_view(tasks, names))
    if studies:
        views["studies"] = ("Studies: verdicts", studies_view(sorted({k for _, r in studies for k in client.get_run(r).data.params if k.startswith("verdict.")})))
    for key, (name, state) in views.items():
        client.set_experiment_tag(exp_id, f"mlflow.sharedViewState.{key}", json.dumps({"name": name, "createdAt": now_ms, "updatedAt": now_ms, "state": json.dumps(state)}))
    path = ui_path(exp_id)
    server = mlflow_ui_base()  # where `mergeflow ui` serves (config.MLFLOW_UI_ENV)
    print(f"MLflow: {len(rec.new_runs)} new runs ({len(rec.stage_runs) + 1 - len(rec.new_runs)} unchanged) in {experiment.name}; methods ranked by test_avg (every regime): {server}{path}")
    if registered:
        print(f"best merged model: {registered['method']}, models:/{registered['name']}/{registered['version']}")
    record = {"tracking_uri": mlflow.get_tracking_uri(), "experiment": experiment.name, "experiment_id": exp_id, "run_id": pipeline_id, "ui_path": path, "new_runs": len(rec.new_runs), "registered_model": registered}
    write_json(layout.metrics("tracking"), record)
    return record
