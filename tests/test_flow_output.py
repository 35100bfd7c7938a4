"""What the Prefect flow tells its user, on the Prefect server: each stage's summary line in the logs, the
Markdown artifact mergeflow-summary (the summary table and the MLflow run's link, also when nothing ran), and a
failure named by stage address with its one-line error, no traceback, no task run UUID."""

import json
import re
import sys
import urllib.request

import pytest
import yaml

from .conftest import copy_project, run as _run

pytestmark = pytest.mark.e2e
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _api(url: str, path: str, body: dict) -> list[dict]:
    request = urllib.request.Request(
        f"{url}/{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    return json.loads(urllib.request.urlopen(request, timeout=30).read())


def _last_flow_run(url: str, root) -> dict:
    runs = [
        r
        for r in _api(url, "flow_runs/filter", {"sort": "START_TIME_DESC"})
        if r["parameters"].get("root") == str(root)
    ]
    assert runs, f"no flow run of {root} on the server"
    return runs[0]


def _logs(url: str, flow_run_id: str) -> list[str]:
    """Every log message of the flow run, its task runs' included, oldest first."""
    return [
        e["message"]
        for e in _api(url, "logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "sort": "TIMESTAMP_ASC"})
    ]


def _summary_artifact(url: str, flow_run_id: str) -> str:
    artifacts = _api(
        url,
        "artifacts/filter",
        {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}, "key": {"any_": ["mergeflow-summary"]}}},
    )
    assert len(artifacts) == 1 and artifacts[0]["type"] == "markdown", artifacts
    return artifacts[0]["data"]


@pytest.fixture(scope="module")
def project(tiny_reference, tmp_path_factory):
    return copy_project(tiny_reference[0], tmp_path_factory.mktemp("flow-output") / "project")


def test_a_run_publishes_the_summary_and_the_mlflow_link(project, tiny_env, prefect_server):
    """merge.ties.k changed, with no regime or study to run (so the standard stages alone): merge@ties, report and
    track run; each stage's summary line reaches the server's
    logs, and the artifact holds the summary table, the MLflow run's link and which stages ran. Then a run with
    nothing to do publishes the same results, saying that nothing ran."""
    env = tiny_env | {"PREFECT_API_URL": prefect_server, "MERGEFLOW_MLFLOW_UI": "http://mlflow.example:8080/"}
    out = _run(
        [
            sys.executable,
            "-m",
            "flows.pipeline",
            "--workers",
            "2",
            "--root",
            str(project),
            "-S",
            "merge.ties.k=0.1",
            "-S",
            "regimes.run=[]",
            "-S",
            "studies.run=[]",
        ],
        project,
        env,
    )
    assert "3 of 19 stages to run: merge@ties, report, track" in out, out[-3000:]
    assert "Traceback" not in out
    flow_run = _last_flow_run(prefect_server, project)
    assert flow_run["state_type"] == "COMPLETED"
    logs = _logs(prefect_server, flow_run["id"])
    for stage in ("merge@ties", "report", "track"):
        assert any(m.startswith(f"{stage} completed in ") for m in logs), (stage, logs)
    ties_line = next(m for m in logs if m.startswith("merge@ties completed in "))
    assert "average=" in ties_line  # the numbers of metrics/evaluate/ties.json

    tracking = json.loads((project / "metrics/tracking.json").read_text())
    summary_rows = [line for line in (project / "results/summary.md").read_text().splitlines() if line.startswith("| ")]
    markdown = _summary_artifact(prefect_server, flow_run["id"])
    assert "**Ran in this flow run** (3 of 19 stages): merge@ties, report, track." in markdown
    assert summary_rows[0] in markdown and summary_rows[2] in markdown  # the header and the first row
    link = f"http://mlflow.example:8080/#/experiments/{tracking['experiment_id']}/runs/{tracking['run_id']}"
    assert f"[{tracking['run_id']}]({link})" in markdown and "`mergeflow ui --port 8080`" in markdown

    out = _run([sys.executable, "-m", "flows.pipeline", "--workers", "2", "--root", str(project)], project, env)
    assert "0 of 19 stages to run: none" in out
    again = _last_flow_run(prefect_server, project)
    assert again["id"] != flow_run["id"]
    markdown = _summary_artifact(prefect_server, again["id"])
    assert "**Nothing ran in this flow run**: all 19 stages were up to date" in markdown
    assert summary_rows[2] in markdown and link in markdown


def test_a_failed_stage_is_named_with_its_error_line_and_no_traceback(project, tmp_path, tiny_env, prefect_server):
    """Bad input in one stage: runtime.device 'cuda' on a machine that shows none (CUDA_VISIBLE_DEVICES empty),
    with merge.ties.k changed so that merge@ties runs and exits with status 2. The flow's output and the server's
    logs name merge@ties with its error line and the stages after it by address, with no traceback and no
    UUID; the artifact says the same."""
    root = copy_project(project, tmp_path / "failing")
    env = tiny_env | {"PREFECT_API_URL": prefect_server, "CUDA_VISIBLE_DEVICES": ""}
    proc = _run(
        [
            sys.executable,
            "-m",
            "flows.pipeline",
            "--workers",
            "2",
            "--root",
            str(root),
            "-S",
            "merge.ties.k=0.3",
            "-S",
            "runtime.device=cuda",
            "-S",
            "regimes.run=[]",
            "-S",
            "studies.run=[]",
        ],
        root,
        env,
        check=False,
    )
    out = proc.stdout + proc.stderr
    error = "error: runtime.device: 'cuda' asked for but no CUDA device is available"
    assert proc.returncode == 1, out[-3000:]
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "error: 3 of 3 stages did not complete; first failure: stage merge@ties exited with status 2: " + error
        )
    ), out[-3000:]
    flow_run = _last_flow_run(prefect_server, root)
    logs = _logs(prefect_server, flow_run["id"])
    assert flow_run["state_type"] == "FAILED"
    for text in (out, "\n".join(logs)):
        assert "Traceback" not in text
        assert f"failed: merge@ties, exit status 2 (bad input): {error}" in text
        assert "not run: report (needs merge@ties, which failed); track (needs merge@ties, which failed)" in text
        assert not UUID.search(
            "\n".join(line for line in text.splitlines() if "merge@ties" in line or "not run" in line)
        )
    assert "merge@ties failed after" in "\n".join(logs) and "NotReady" not in out  # no task run left waiting on a UUID

    markdown = _summary_artifact(prefect_server, flow_run["id"])
    assert f"- **merge@ties**, exit status 2 (bad input): `{error}`" in markdown
    assert (
        "- **report**: needs merge@ties, which failed" in markdown
        and "- **track**: needs merge@ties, which failed" in markdown
    )
    assert yaml.safe_load((root / "dvc.lock").read_text()) == yaml.safe_load((project / "dvc.lock").read_text())


def test_bad_configuration_in_a_deployment_run_is_one_line(project, tmp_path, prefect_server):
    """A deployment's run calls the flow directly, so the check runs inside it: an unknown method fails the run
    with one line (no traceback in its logs), and the artifact gives that line."""
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.pipeline import pipeline

    root = copy_project(project, tmp_path / "unknown-method")
    with temporary_settings({PREFECT_API_URL: prefect_server}):
        state = pipeline(root=str(root), overrides=["merge.methods=[ties,fisher_merging]"], return_state=True)
        APILogWorker.drain_all(timeout=10)
    assert state.is_failed() and "unknown merge method 'fisher_merging'" in state.message
    flow_run = _last_flow_run(prefect_server, root)
    logs = _logs(prefect_server, flow_run["id"])
    assert not any("Traceback" in m for m in logs) and any(
        "unknown merge method 'fisher_merging'" in m for m in logs
    ), logs
    markdown = _summary_artifact(prefect_server, flow_run["id"])
    assert "The run stopped before any stage" in markdown and "fisher_merging" in markdown


def test_a_stages_output_reaches_the_logs_on_success_and_on_failure(tmp_path, prefect_server):
    """The Prefect task on two stand-in stages: one prints 30 lines and a warning, one prints its work and then
    its error line, with exit status 2. The server's logs hold the last lines of each (stdout's summary line
    last, stderr apart), the failure named by address with its error line, and no traceback."""
    from prefect import flow
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.task_runners import ThreadPoolTaskRunner

    from mergeflow.runner.graph import StageNode
    from tasks.stages import run_stage_task

    (tmp_path / "works.py").write_text(
        "import sys\nfor i in range(30):\n    print(f'step {i}')\nprint('summary: 30 steps', flush=True)\n"
        "print('UserWarning: noisy', file=sys.stderr)\n"
    )
    (tmp_path / "fails.py").write_text(
        "import sys\nprint('reading data/tasks/digits.npz')\nprint('error: data/tasks/digits.npz: not a readable task "
        "file', file=sys.stderr)\nsys.exit(2)\n"
    )
    works, fails = (
        StageNode("finetune@digits", (sys.executable, "works.py"), ()),
        StageNode("merge@ties", (sys.executable, "fails.py"), ()),
    )

    @flow(task_runner=ThreadPoolTaskRunner(max_workers=2))
    def two_stages():
        futures = [run_stage_task.submit(node, str(tmp_path), {}) for node in (works, fails)]
        return [f.result(raise_on_failure=False) for f in futures]

    with temporary_settings({PREFECT_API_URL: prefect_server}):
        state = two_stages(return_state=True)
        APILogWorker.drain_all(timeout=10)
    logs = _logs(prefect_server, str(state.state_details.flow_run_id))
    text = "\n".join(logs)
    assert "Traceback" not in text
    assert any(m.startswith("finetune@digits completed in ") for m in logs)
    stdout = next(m for m in logs if m.startswith("finetune@digits output (last lines):"))
    assert stdout.splitlines()[1:] == [f"step {i}" for i in range(11, 30)] + ["summary: 30 steps"]
    assert "finetune@digits stderr (last lines):\nUserWarning: noisy" in logs
    assert any(
        re.fullmatch(
            r"merge@ties failed after [\d.]+ s with exit status 2 \(bad "
            r"input\): error: data/tasks/digits.npz: not a readable task file",
            m,
        )
        for m in logs
    ), logs
    assert (
        "merge@ties output (last lines):\nreading data/tasks/digits.npz\n"
        "error: data/tasks/digits.npz: not a readable task file" in logs
    )
