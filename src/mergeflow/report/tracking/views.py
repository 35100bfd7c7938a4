"""What the MLflow UI shows: the experiment's saved views (methods ranked by test_avg, regimes, studies), the
pipeline run's description, and the path that opens the methods view (after the UI's address,
config.mlflow_ui_base)."""

from __future__ import annotations

import urllib.parse

from mergeflow.report.summary import percent

VIEW_KEY = "methods"  # the shared view's key: experiment tag mlflow.sharedViewState.methods


VIEW_NAME = "Methods ranked by test_avg"  # its name in the UI's Views menu


ML_EXPERIMENT_KIND = "custom_model_development"  # MLflow 3's value of mlflow.experimentKind for classic ML


def _shown(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


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
