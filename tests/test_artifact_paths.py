"""The MLflow store keeps its artifact locations relative to the workspace, so that a moved or copied workspace
keeps its artifacts: a store MLflow wrote with absolute paths (as it does for every new experiment) is rewritten
in place, and its artifacts read back from the moved folder, through MLflow's own client."""

import contextlib
import shutil
import sqlite3
from pathlib import Path

import pytest

from mergeflow.core.mlflow_store import _workspace_relative, relative_artifact_paths


def _locations(db: Path) -> list[str]:
    with contextlib.closing(sqlite3.connect(db)) as con:
        return [
            row[0]
            for sql in ("SELECT artifact_location FROM experiments", "SELECT artifact_uri FROM runs")
            for row in con.execute(sql)
        ]


def _absolute_store(root: Path, monkeypatch) -> str:
    """A store as MLflow writes it in ``root`` (absolute artifact paths), with one run holding one artifact."""
    from mlflow import MlflowClient

    monkeypatch.chdir(root)
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    experiment = client.create_experiment("e", artifact_location=str(root / "mlruns" / "1"))
    run = client.create_run(experiment)
    (root / "note.txt").write_text("kept")
    client.log_artifact(run.info.run_id, str(root / "note.txt"), "sub")
    client._tracking_client.store.engine.dispose()
    return run.info.run_id


def test_a_moved_workspace_keeps_its_artifacts(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    old = tmp_path / "old"
    old.mkdir()
    run_id = _absolute_store(old, monkeypatch)
    assert all(loc.startswith(str(old)) for loc in _locations(old / "mlflow.db"))  # MLflow's own absolute paths
    new = tmp_path / "new"
    shutil.move(old, new)
    monkeypatch.chdir(new)
    assert relative_artifact_paths(new) == 3  # the default experiment's location, ours and the run's
    assert _locations(new / "mlflow.db") == ["mlruns/0", "mlruns/1", f"mlruns/1/{run_id}/artifacts"]
    client = MlflowClient(tracking_uri=f"sqlite:///{new / 'mlflow.db'}")
    got = Path(client.download_artifacts(run_id, "sub/note.txt", str(tmp_path)))
    assert got.read_text() == "kept"
    # a new run in the rewritten experiment is relative from the start
    later = client.create_run(client.get_experiment_by_name("e").experiment_id)
    assert later.info.artifact_uri == f"mlruns/1/{later.info.run_id}/artifacts"
    assert relative_artifact_paths(new) == 0  # nothing left to rewrite


@pytest.mark.parametrize(
    ("location", "expected"),
    [
        ("/ws/mlruns/1/abc/artifacts", "mlruns/1/abc/artifacts"),  # under the workspace itself
        ("file:///ws/mlruns/1", "mlruns/1"),
        ("mlruns/1", None),  # relative already
        ("/elsewhere/store/1", None),  # not a workspace's mlruns/
        ("models:/m-123", None),
    ],
)
def test_which_locations_are_rewritten(location, expected):
    assert _workspace_relative(location, Path("/ws")) == expected


def test_another_workspaces_live_artifacts_are_left_alone(tmp_path):
    other = tmp_path / "other" / "mlruns" / "1"
    other.mkdir(parents=True)
    # the other workspace still exists: its artifacts are its own, not a moved copy of ours
    assert _workspace_relative(str(other), tmp_path / "ws") is None
    shutil.rmtree(tmp_path / "other")
    assert _workspace_relative(str(other), tmp_path / "ws") == "mlruns/1"  # gone: ours is its moved copy
