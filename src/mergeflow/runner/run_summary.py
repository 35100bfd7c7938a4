"""The Markdown of a Prefect flow run's summary artifact (flows.pipeline publishes it): the stages that ran and
results/summary.md, the MLflow run's link and where the outputs went; or what failed, did not run and completed.

The outputs go to the default DVC remote here (``push_section``): the push's outcome is the summary's section."""

from __future__ import annotations

import json
from pathlib import Path

from mergeflow.config.environment import MLFLOW_UI_ENV, mlflow_ui_base, mlflow_ui_port
from mergeflow.core.errors import MergeflowError
from mergeflow.runner.remote import default_remote, push_outputs
from mergeflow.runner.scheduler import RunOutcome


def mlflow_run_url(tracking: dict, base: str | None = None) -> str:
    """The MLflow UI's page of the run that ``tracking`` (metrics/tracking.json) names."""
    return f"{base or mlflow_ui_base()}/#/experiments/{tracking['experiment_id']}/runs/{tracking['run_id']}"


def _mlflow_section(root: Path) -> str:
    try:
        tracking = json.loads((root / "metrics" / "tracking.json").read_text())
        url = mlflow_run_url(tracking)
    except (OSError, ValueError, KeyError, TypeError) as err:
        return (
            "No MLflow run to link: metrics/tracking.json is missing or "
            f"incomplete ({type(err).__name__}); the track stage writes it."
        )
    base = mlflow_ui_base()
    port = mlflow_ui_port()
    return (
        f"MLflow run [{tracking['run_id']}]({url}) in experiment "
        f"{tracking.get('experiment', tracking['experiment_id'])}, "
        f"store `{tracking.get('tracking_uri', '?')}`.\n\n"
        f"The link opens while the MLflow UI serves that store at {base}: run `mergeflow ui --port {port}` in `{root}` "
        f"(set {MLFLOW_UI_ENV} when your MLflow UI runs elsewhere)."
    )


def push_section(root: Path) -> tuple[str, str | None]:
    """Where the results are: pushed to the default DVC remote (`dvc push`: only what the remote lacks goes), or
    this machine's cache when no remote is set. Returns the artifact's section and the push's error, if any."""
    try:
        remote = default_remote(root)
        if remote is None:
            return (
                f"In this machine's DVC cache only (`{root}/.dvc/cache`): no DVC remote is set. `mergeflow remote add "
                "URL` sets one, and each run then pushes its outputs there.",
                None,
            )
        sent = push_outputs(root, remote=remote)
    except MergeflowError as err:
        return (
            f"**Not pushed**: {err}. The outputs are in this machine's "
            "DVC cache; `dvc push` sends them once the remote answers.",
            str(err),
        )
    return (
        f"Pushed to the DVC remote **{remote.name}** (`{remote.url}`): {sent} files sent, the rest were there already. "
        f"With this dvc.lock (commit it), `dvc pull` on any clone restores every output of this run."
    ), None


def success_markdown(root: Path, ran: list[str], stages: int, stored: str | None = None) -> str:
    """The artifact of a completed run: which stages ran, results/summary.md, the MLflow run's link, and where
    the outputs are stored (``stored``, push_section's)."""
    if ran:
        head = (
            f"**Ran in this flow run** ({len(ran)} of {stages} stages): "
            f"{', '.join(ran)}. The other stages were up to date."
        )
    else:
        head = (
            f"**Nothing ran in this flow run**: all {stages} stages were up to date. The results below are the current "
            "ones, from an earlier run."
        )
    try:
        table = (root / "results" / "summary.md").read_text().strip()
    except OSError:
        table = "results/summary.md is missing (the report stage writes it)."
    stored = f"\n## Outputs\n\n{stored}\n" if stored else ""
    return (
        f"# mergeflow pipeline: completed\n\n{head}\n\n## Results (results/summary.md)\n\n{table}\n\n## MLflow\n\n"
        f"{_mlflow_section(root)}\n{stored}"
    )


def failure_markdown(outcome: RunOutcome | None, error: str | None = None, stages: int | None = None) -> str:
    """The artifact of a failed run: each failed stage with its one-line error, the stages that never started and
    those that completed; or ``error`` when the run stopped before any stage (bad configuration)."""
    lines = ["# mergeflow pipeline: failed", ""]
    if outcome is None:
        return (
            "\n".join(
                lines
                + [
                    "The run stopped before any stage, on:",
                    "",
                    f"    {error}",
                    "",
                    "`mergeflow check` checks the configuration.",
                ]
            )
            + "\n"
        )
    lines += ["## Failed", ""] + [f"- **{a}**, {outcome.status(a)}: `{outcome.error_line(a)}`" for a in outcome.failed]
    if outcome.not_run:
        lines += ["", "## Not run", ""] + [f"- **{a}**: {why}" for a, why in outcome.not_run.items()]
    lines += ["", "## Completed", ""]
    if outcome.done:
        lines += [
            f"{', '.join(outcome.done)} ({len(outcome.done)} of the {len(outcome.planned)} stages to run, of {stages} "
            "in all): recorded in dvc.lock, so the next run starts from there."
        ]
    else:
        lines += [f"None of the {len(outcome.planned)} stages to run (of {stages} in all)."]
    return "\n".join(lines) + "\n"
