"""What the MLflow UI shows: the experiment's saved views (methods ranked by test_avg, regimes, studies), the
pipeline run's description, and the path that opens the methods view (after the UI's address,
config.environment.mlflow_ui_base)."""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping

from mergeflow.report.leaderboard import board_table, column_align, legend, title
from mergeflow.report.tables import render

VIEW_KEY = "methods"  # the shared view's key: experiment tag mlflow.sharedViewState.methods


VIEW_NAME = "Methods ranked by test_avg, every regime"  # its name in the UI's Views menu


ML_EXPERIMENT_KIND = "custom_model_development"  # MLflow 3's value of mlflow.experimentKind for classic ML


def methods_view(tasks: list[str], hyperparameters: list[str], variant: str | None = None) -> dict:
    """A shared view of merge runs (MLflow UI state, stored as the experiment tag mlflow.sharedViewState.<key>
    and opened by ?viewStateShareKey=<key>): one regime variant's merge runs (``variant``; None: every regime's)
    with the baselines' runs (the standard fine-tune's), best test_avg first (negation aside: its test_avg ranks the
    other way), the method first, then its score with
    the leaderboard's interval, its validation average, the gap recovered, the storage, what it reads, each task's
    score and the hyperparameters (``hyperparameters``: only those the shown runs have)."""
    metrics = [
        "test_avg",
        "test_avg_ci_low",
        "test_avg_ci_high",
        "val_avg",
        "gap_recovered",
        "normalized_avg",
        "storage_models",
        *(f"test_acc.{t}" for t in tasks),
    ]
    columns = [
        "params.`method`",
        "tags.`variant`",
        *(f"metrics.`{m}`" for m in metrics),
        "params.`data`",
        *(f"params.`{p}`" for p in hyperparameters),
        "attributes.`Run Name`",
        "attributes.`Models`",
    ]
    search = "tags.`mergeflow.ranked` = 'yes'"  # merges (but negation) of every regime, and the baselines
    return _view(search + (f" and tags.`variant` = '{variant}'" if variant else ""), "metrics.`test_avg`", columns)


def _view(search: str, order_by: str, columns: list[str]) -> dict:
    return {
        "searchFilter": search,
        "orderByKey": order_by,
        "orderByAsc": False,
        "startTime": "ALL",
        "lifecycleFilter": "Active",
        "modelVersionFilter": "All Runs",
        "datasetsFilter": [],
        "selectedColumns": columns,
        "columnOrder": columns,
    }


def regimes_view(tasks: list[str], hyperparameters: list[str]) -> dict:
    """The shared view of the regime runs (one per variant): their task models' and own model's accuracies and
    the last round's cosines and norms (each is a history by round: the run's Model metrics tab plots it)."""
    metrics = [
        "individual_avg",
        "model_test_avg",
        "model_gap_recovered",
        "task_vector_cosine_median",
        "update_cosine_median",
        "task_vector_norm_mean",
        "wall_time_s",
        *(f"individual_acc.{t}" for t in tasks),
    ]
    columns = [
        "attributes.`Run Name`",
        "tags.`regime`",
        "tags.`variant`",
        *(f"metrics.`{m}`" for m in metrics),
        *(f"params.`{p}`" for p in hyperparameters),
        "attributes.`Models`",
    ]
    return _view("tags.`mergeflow.stage` = 'regime'", "metrics.`individual_avg`", columns)


def studies_view(verdicts: list[str]) -> dict:
    """The shared view of the study runs: verdict counts and each claim's verdict."""
    columns = [
        "attributes.`Run Name`",
        "metrics.`holds`",
        "metrics.`fails`",
        "metrics.`not_measured`",
        *(f"params.`{v}`" for v in verdicts),
    ]
    return _view("tags.`mergeflow.stage` = 'study'", "metrics.`holds`", columns)


def ui_path(experiment_id: str) -> str:
    """The MLflow UI path (after the server's address) of the methods view, in the classic ML view."""
    query = urllib.parse.urlencode({"viewStateShareKey": VIEW_KEY, "workflowType": "machine_learning"})
    return f"/#/experiments/{experiment_id}/runs?{query}"


def pipeline_note(
    experiment_id: str,
    leaderboard: Mapping,
    links: Mapping[tuple[str, str], str],
    studies: list[tuple[str, str, Mapping]] = (),
) -> str:
    """The pipeline run's description (the UI renders it as Markdown): the report's leaderboards
    (results/leaderboard.json), each method linked to its merge run (``links``: (variant, method) -> run id), then
    the studies' verdicts (name, run id, its metrics)."""
    boards = leaderboard.get("boards", {})
    if not boards:
        return "No leaderboard: results/leaderboard.json is missing (run the report stage)."
    lines: list[str] = []
    for variant, entries in boards.items():
        table = board_table(entries)
        for row, e in zip(table[1:], entries):
            if (run_id := links.get((variant, e["method"]))) is not None:
                row[1] = f"[{e['method']}](#/experiments/{experiment_id}/runs/{run_id})"
        lines += [f"**{title(variant, entries)}**", "", render(table, markdown=True, align=column_align(table)), ""]
    lines.append(legend(leaderboard["test_examples"], leaderboard.get("measure", "accuracy")))
    if studies:
        lines += ["", "Studies:", ""]
        for name, run_id, m in studies:
            lines.append(
                f"- [{name}](#/experiments/{experiment_id}/runs/{run_id}): {m['holds']:.0f} hold, {m['fails']:.0f} "
                f"fail, {m['not_measured']:.0f} not measured"
            )
    return "\n".join(lines)


def _hyperparameter_names(client, run_ids) -> list[str]:
    """The hyperparameters the runs have (task negation's, which the views leave out, not among them)."""
    names: set[str] = set()
    for run_id in run_ids:
        params = client.get_run(run_id).data.params
        if params.get("kind") != "negation":
            names |= {k for k in params if k not in ("method", "kind", "paper", "data") and not k.startswith("grid.")}
    return sorted(names)
