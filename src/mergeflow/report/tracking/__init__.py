"""MLflow records of the pipeline, made by its last stage (``mergeflow track``) from the files the stages wrote.

Runs. One run per stage item (``prepare``, ``pretrain``, ``finetune@<task>``, ``vectors``, ``merge@<method>``),
tagged ``mergeflow.stage`` (prepare, pretrain, finetune, vectors, merge) and ``mergeflow.item`` (the task or
method), started and ended at the stage's real times (logs/timing). Plus one ``pipeline`` run per pipeline state:
the git commit, dvc.lock, results/, the probe and individual averages, the best method, and one tag
``stage_run.<stage>.<item>`` per stage run it covers. Runs are flat (no nesting): a stage run that did not change
belongs to every later pipeline run. The standard fine-tune's runs (finetune, vectors, merge) are tagged
``regime`` = ``variant`` = ``standard``. The leaderboard's baselines have a run each (``baseline@probe``,
``baseline@individual``, stage tag ``baseline``): the merge runs' metrics of the pretrained model under the tasks'
heads and of the individual fine-tunes, so that the views rank the merges beside them.

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
    test_avg_ci_low/_high  the leaderboard's 95% bootstrap interval of test_avg over the test examples
                      (results/leaderboard.json; not logged where the run kept no predictions)
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
hyperparameter values, per-task choices' curves too) beside the stage's plot ``plots/search.png`` (a heatmap for
two-parameter grids), also logged as the image ``search``: the runs page's chart view sets the selected runs'
searches side by side; it is no metric history, which the UI plots against the step (the grid index) and which
would add names other methods lack. A merged model of kind "model" is an MLflow model (``model``, see
mergeflow.ml.mlflow_model). Per-task stores are plain artifacts (``merged/<method>.safetensors``: a task's model is
rebuilt from the store and the pretrained weights), and task negation's file of chosen coefficients is not logged
(they are its ``lam.<t>`` parameters). The best merged model on validation (highest val_avg among single models,
a tie to the method listed first; never chosen on test) is registered as ``mergeflow-<suite>``.

The pipeline run's description is the report's leaderboard (results/leaderboard.json), each method linked to
its merge run, then the studies' verdicts.

Views. The experiment carries saved views (experiment tags ``mlflow.sharedViewState.<key>``, in the runs page's
Views menu): "Methods ranked by test_avg, every regime" (key ``methods``) and one per regime variant ("Methods
ranked by test_avg: <variant>", key ``methods.<variant>``, ``standard`` for the standard fine-tune): merge runs
except negation, whose test_avg ranks the other way, and the baselines (the runs tagged ``mergeflow.ranked``), best
test_avg first, the method first, then test_avg with
its interval, the other headline metrics, each task's score and the hyperparameters those runs have. With
regimes or studies, "Regimes: task models and rounds" (key ``regimes``) and "Studies: verdicts" (key
``studies``) too. ``ui_path`` in
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

import hashlib
import json
import logging
import os
import socket
import time
from pathlib import Path

from mergeflow.config import Params
from mergeflow.config.environment import mlflow_ui_base
from mergeflow.core.mlflow_store import relative_artifact_paths
from mergeflow.core.errors import TransientError
from mergeflow.core.files import write_json
from mergeflow.core.layout import Layout
from mergeflow.core.reproducibility.machine import recorded
from mergeflow.report.summary import percent
from mergeflow.report.tracking.merges import MERGE_METRICS, merge_metrics, merge_params
from mergeflow.report.tracking.regimes import ROUND_METRICS, regime_metrics
from mergeflow.report.tracking.registry import register_best
from mergeflow.report.tracking.runs import (
    _git_commit,
    _md5,
    _Recorder,
    _sha256,
    curve_records,
    fingerprint,
    lock_stages,
    locked_md5s,
    stage_times,
)
from mergeflow.report.tracking.standard import NOT_RECORDED, RECORDERS, STANDARD_TAGS, Tracked, baseline_run
from mergeflow.report.tracking.store import (
    experiment_name,
    fail_abandoned_runs,
    prepare_store,
    registered_model_name,
    tracking_uri,
)
from mergeflow.report.tracking.studies import study_note
from mergeflow.report.tracking.views import (
    ML_EXPERIMENT_KIND,
    VIEW_KEY,
    VIEW_NAME,
    _hyperparameter_names,
    methods_view,
    pipeline_note,
    regimes_view,
    studies_view,
    ui_path,
)


def _open_experiment(params: Params, root: Path):
    """The experiment track logs to, on the project's store; runs a killed track left RUNNING marked FAILED."""
    import mlflow
    from mlflow import MlflowClient

    os.environ.setdefault(
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false"
    )  # log_model reads its files back: no bars in the stage's log
    logging.getLogger("mlflow").setLevel(
        logging.WARNING
    )  # its notices (tables and experiment created) are not the stage's news
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
    relative_artifact_paths(root)  # a new experiment's location, or a store from before, moved or copied
    client = MlflowClient()
    if failed := fail_abandoned_runs(client, experiment.experiment_id):
        print(f"marked {failed} runs FAILED that a killed track left RUNNING")
    return experiment, client


def _base_tags(root: Path) -> dict[str, str]:
    # every run carries its host and process, so the next track can tell a run still being logged from an abandoned one
    base = {
        "mergeflow.host": socket.gethostname(),
        "mergeflow.pid": str(os.getpid()),
        "git.commit": _git_commit(root),
        "mergeflow.source": os.environ.get("MERGEFLOW_RUN_SOURCE", "dvc"),
        "dvc.lock_md5": _md5(root / "dvc.lock") if (root / "dvc.lock").is_file() else "",
    }
    if os.environ.get("PREFECT__FLOW_RUN_ID"):
        base["prefect.flow_run_id"] = os.environ["PREFECT__FLOW_RUN_ID"]
    return base


def _pipeline_run(t: Tracked, exp_id: str, base: dict[str, str], registered: dict | None, track_started: float) -> str:
    """The pipeline run: one per state of all its stages (and the report); a track with nothing new logs none."""
    params, layout, root, client, rec = t.params, t.layout, t.root, t.client, t.rec
    report_fp = fingerprint(t.lock.get("report"), sorted(layout.results.glob("*.json")), root)
    pipeline_fp = _sha256({"stages": rec.fingerprints, "report": report_fp})
    pipeline_id = rec.find("mergeflow.pipeline_fingerprint", pipeline_fp)
    if pipeline_id is not None:
        return pipeline_id
    # from the first stage this pipeline run (re)ran, to now
    started = min((client.get_run(r).info.start_time for r in rec.new_runs), default=int(track_started * 1000))
    tags = base | {"mergeflow.stage": "pipeline", "mergeflow.pipeline_fingerprint": pipeline_fp}
    tags |= {f"stage_run.{n.replace('@', '.').replace('/', '.')}": r for n, r in rec.stage_runs.items()}
    if (root / "dvc.lock").is_file():
        tags["dvc.lock.sha256"] = hashlib.sha256((root / "dvc.lock").read_bytes()).hexdigest()
    best = {}
    if t.single_models:
        best_run = max((client.get_run(r) for r in t.single_models.values()), key=lambda r: r.data.metrics["test_avg"])
        best = {"best_test_avg": best_run.data.metrics["test_avg"]}
        tags |= {"mergeflow.best_method": best_run.data.params["method"], "mergeflow.best_run": best_run.info.run_id}
    if registered:
        tags["mergeflow.registered"] = f"models:/{registered['name']}/{registered['version']}"
    links = {("standard", m): rec.stage_runs[f"merge@{m}"] for m in params.merge.methods} | {
        (v, m): r for v, m, r in t.regime_merges
    }
    baselines = [e["method"] for e in t.leaderboard["boards"].get("standard", []) if e["baseline"]]
    links |= {("standard", m): rec.stage_runs[baseline_run(m)] for m in baselines if baseline_run(m) in rec.stage_runs}
    studies = [(name, run_id, client.get_run(run_id).data.metrics) for name, run_id in t.studies]
    tags["mlflow.note.content"] = pipeline_note(exp_id, t.leaderboard, links, studies)
    run = client.create_run(
        exp_id, start_time=started, run_name=f"pipeline {time.strftime('%Y-%m-%d %H:%M:%S')}", tags=tags
    )
    pipeline_id = run.info.run_id
    try:
        logged = {
            "suite": params.suite.name,
            "tasks": ",".join(params.suite.tasks),
            "methods": ",".join(params.merge.methods),
            "regimes": ",".join(params.regimes.run) or "none",
            "studies": ",".join(params.studies.run) or "none",
            "backbone": params.backbone.model,
        }
        rec.log(
            pipeline_id, logged, {"probe_avg": percent(t.probe_avg), "individual_avg": percent(t.individual_avg)} | best
        )
        client.log_artifacts(pipeline_id, str(layout.results), "results")
        if (root / "dvc.lock").is_file():
            client.log_artifact(pipeline_id, str(root / "dvc.lock"))
    except BaseException:
        client.set_terminated(pipeline_id, "FAILED")
        raise
    client.set_terminated(pipeline_id, "FINISHED", end_time=int(time.time() * 1000))
    rec.new_runs.append(pipeline_id)
    return pipeline_id


def _saved_views(t: Tracked, exp_id: str) -> None:
    """The UI's saved views (Views > Saved views, opened by ?viewStateShareKey=): the methods ranked, the regimes'
    task models and rounds, the studies' verdicts."""
    client, rec, tasks = t.client, t.rec, t.params.suite.tasks
    merge_ids = [rec.stage_runs[f"merge@{m}"] for m in t.params.merge.methods] + [
        run_id for _, _, run_id in t.regime_merges
    ]
    client.set_experiment_tag(exp_id, "mlflow.experimentKind", ML_EXPERIMENT_KIND)
    now_ms = int(time.time() * 1000)
    views = {VIEW_KEY: (VIEW_NAME, methods_view(tasks, _hyperparameter_names(client, merge_ids)))}
    by_variant = {"standard": [rec.stage_runs[f"merge@{m}"] for m in t.params.merge.methods]}
    for variant, _, run_id in t.regime_merges:
        by_variant.setdefault(variant, []).append(run_id)
    for variant, run_ids in by_variant.items():  # one view per regime variant, its own hyperparameters only
        views[f"methods.{variant}"] = (
            f"Methods ranked by test_avg: {variant}",
            methods_view(tasks, _hyperparameter_names(client, run_ids), variant),
        )
    regime_ids = [r for n, r in rec.stage_runs.items() if n.startswith("regime@")]
    if regime_ids:
        names = sorted(
            {k for r in regime_ids for k in client.get_run(r).data.params if k not in ("regime", "variant", "paper")}
        )
        views["regimes"] = ("Regimes: task models and rounds", regimes_view(tasks, names))
    if t.studies:
        views["studies"] = (
            "Studies: verdicts",
            studies_view(
                sorted({k for _, r in t.studies for k in client.get_run(r).data.params if k.startswith("verdict.")})
            ),
        )
    for key, (name, state) in views.items():
        client.set_experiment_tag(
            exp_id,
            f"mlflow.sharedViewState.{key}",
            json.dumps({"name": name, "createdAt": now_ms, "updatedAt": now_ms, "state": json.dumps(state)}),
        )


def track(params: Params, layout: Layout = Layout()) -> dict:
    import mlflow

    track_started = time.time()
    root = layout.root
    experiment, client = _open_experiment(params, root)
    exp_id = experiment.experiment_id
    base = _base_tags(root)
    rec = _Recorder(client, exp_id, base)
    tracked = Tracked(params, layout, rec, client, lock_stages(root), recorded(root))
    for _, record in RECORDERS:
        record(tracked)
    # the registry stays the standard regime's: its best merged model, comparable from one pipeline run to the next
    registered = (
        register_best(client, registered_model_name(params), tracked.single_models)
        if params.tracking.log_checkpoints
        else None
    )
    pipeline_id = _pipeline_run(tracked, exp_id, base, registered, track_started)
    _saved_views(tracked, exp_id)
    path = ui_path(exp_id)
    server = mlflow_ui_base()  # where `mergeflow ui` serves (config.MLFLOW_UI_ENV)
    print(
        f"MLflow: {len(rec.new_runs)} new runs ({len(rec.stage_runs) + 1 - len(rec.new_runs)} unchanged) in "
        f"{experiment.name}; methods ranked by test_avg (every regime): {server}{path}"
    )
    if registered:
        print(f"best merged model: {registered['method']}, models:/{registered['name']}/{registered['version']}")
    record = {
        "tracking_uri": mlflow.get_tracking_uri(),
        "experiment": experiment.name,
        "experiment_id": exp_id,
        "run_id": pipeline_id,
        "ui_path": path,
        "new_runs": len(rec.new_runs),
        "registered_model": registered,
    }
    write_json(layout.metrics("tracking"), record)
    return record


__all__ = [
    "MERGE_METRICS",
    "NOT_RECORDED",
    "RECORDERS",
    "ML_EXPERIMENT_KIND",
    "ROUND_METRICS",
    "STANDARD_TAGS",
    "VIEW_KEY",
    "VIEW_NAME",
    "curve_records",
    "experiment_name",
    "fail_abandoned_runs",
    "fingerprint",
    "lock_stages",
    "locked_md5s",
    "merge_metrics",
    "merge_params",
    "methods_view",
    "pipeline_note",
    "prepare_store",
    "register_best",
    "registered_model_name",
    "regime_metrics",
    "regimes_view",
    "stage_times",
    "studies_view",
    "study_note",
    "track",
    "tracking_uri",
    "ui_path",
]
