"""An unwritable HOME: Prefect's home (~/.prefect) cannot be made, which without help ends a flow in a traceback
("Timed out while attempting to connect to ephemeral Prefect API server"). The flows then use the repository's
.prefect/ with a one-line notice; a PREFECT_HOME set to an unwritable folder is one line, exit status 2.

Runs as root cannot be kept out of a folder by its mode, so HOME is put under a regular file: no one can create
anything there."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLOW = """
import flows
from prefect import flow
from prefect.settings import PREFECT_HOME

@flow
def answer():
    return 41 + 1

print(PREFECT_HOME.value())
print("result", answer())
"""


def _env(tmp_path: Path, **extra) -> dict[str, str]:
    (tmp_path / "not-a-folder").write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MERGEFLOW_"))}
    return (
        env
        | {
            "HOME": str(tmp_path / "not-a-folder" / "home"),
            "PYTHONPATH": f"{REPO / 'src'}:{REPO}",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        }
        | extra
    )


def test_a_flow_runs_with_an_unwritable_home(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "dvc.yaml").write_text("stages: {}\n")
    proc = subprocess.run(
        [sys.executable, "-c", FLOW], cwd=project, env=_env(tmp_path), capture_output=True, text=True, timeout=600
    )  # a hang's limit
    assert proc.returncode == 0, proc.stderr[-2000:]
    home, result = proc.stdout.splitlines()[:2]
    assert Path(home) == project / ".prefect" and result == "result 42"
    assert (project / ".prefect" / "prefect.db").is_file()  # the temporary server's database, in the repository
    notices = [line for line in proc.stderr.splitlines() if line.startswith("warning: ")]
    assert len(notices) == 1 and "cannot be written" in notices[0] and str(project / ".prefect") in notices[0]


def test_an_unwritable_prefect_home_that_was_set_is_one_line(tmp_path):
    env = _env(tmp_path, PREFECT_HOME=str(tmp_path / "not-a-folder" / "prefect"))
    proc = subprocess.run(
        [sys.executable, "-m", "flows.pipeline", "--help"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"error: PREFECT_HOME={tmp_path / 'not-a-folder' / 'prefect'}: Prefect's home is not a folder this user can "
        "write; set PREFECT_HOME to one that is"
    ]


def test_a_writable_home_is_left_to_prefect(tmp_path):
    env = _env(tmp_path, HOME=str(tmp_path / "home"))
    code = "import flows, os; print(os.environ.get('PREFECT_HOME'))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip() == "None" and proc.stderr == ""
