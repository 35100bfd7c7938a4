"""Where MLflow's store is, and whether it still holds what `track` logged: read by `mergeflow repro` before any
stage runs, so without mergeflow.report.tracking's imports (torch and timm, through the evaluation it records:
seconds)."""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
from pathlib import Path


def tracking_uri(root: Path) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(root / 'mlflow.db').resolve()}"


def read_one(path: Path, sql: str):
    """The first column of the first row ``sql`` gives on the SQLite file ``path``, opened read-only; None when
    the file, table or row is missing."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            row = db.execute(sql).fetchone()
    except sqlite3.Error:
        return None
    return row[0] if row else None


def tracked_runs_lost(root: Path) -> str | None:
    """Why the MLflow store no longer holds what ``track`` logged, or None: the local SQLite store deleted (or
    replaced) after a run, which DVC cannot see (track has no DVC output, so that dvc.lock does not carry run ids).
    ``mergeflow repro`` then runs track again, which logs everything anew. Only once the pipeline has results."""
    import json

    uri = tracking_uri(root)
    if not uri.startswith("sqlite:///") or not (root / "results").is_dir():
        return None
    store = Path(uri.removeprefix("sqlite:///"))
    if not store.is_file():
        return f"{store} is missing"
    try:
        run_id = json.loads((root / "metrics" / "tracking.json").read_text())["run_id"]
    except (OSError, ValueError, KeyError, TypeError):
        return "metrics/tracking.json names no run"
    if (
        not re.fullmatch(r"[0-9a-f]{32}", str(run_id))
        or read_one(store, f"SELECT 1 FROM runs WHERE run_uuid = '{run_id}'") is None
    ):
        return f"{store} does not hold run {run_id} (metrics/tracking.json)"
    return None


# the columns where MLflow keeps a local artifact location: relative ones are read from the workspace (MLflow's
# local artifact repository resolves them against the working directory, which stages and `mergeflow ui` share)
ARTIFACT_COLUMNS = (
    ("experiments", "artifact_location"),
    ("runs", "artifact_uri"),
    ("logged_models", "artifact_location"),
    ("model_versions", "storage_location"),
    ("model_versions", "source"),
)
ARTIFACT_FOLDER = "mlruns"


def _workspace_relative(location: str, root: Path) -> str | None:
    """``location`` (an absolute path or file:// URI into some workspace's mlruns/) as a path relative to ``root``,
    or None to leave it: a location under ``root`` itself, or under a workspace that no longer exists (this store's
    workspace before it was moved); a workspace that still exists keeps its own."""
    path = location.removeprefix("file://")
    marker = f"/{ARTIFACT_FOLDER}/"
    if not path.startswith("/") or marker not in path:
        return None
    workspace, tail = path[: path.index(marker)], path[path.index(marker) + 1 :]
    if Path(workspace) == root or not Path(workspace).exists():
        return tail
    return None


def relative_artifact_paths(root: Path) -> int:
    """Rewrite the default store's absolute artifact locations (MLflow resolves every local one to an absolute path
    when it creates an experiment) as paths relative to the workspace ``root``, so that a moved or copied workspace
    keeps its artifacts; returns how many were rewritten. Other stores (MLFLOW_TRACKING_URI) are left alone."""
    root = root.resolve()
    store = root / "mlflow.db"
    if tracking_uri(root) != f"sqlite:///{store}" or not store.is_file():
        return 0
    changed = 0
    with contextlib.closing(sqlite3.connect(store)) as db, db:
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        for table, column in ARTIFACT_COLUMNS:
            if table not in tables:
                continue
            rows = db.execute(f'SELECT rowid, "{column}" FROM "{table}" WHERE "{column}" LIKE ?', ("%/mlruns/%",))
            for rowid, location in rows.fetchall():
                if (relative := _workspace_relative(location, root)) is not None:
                    db.execute(f'UPDATE "{table}" SET "{column}" = ? WHERE rowid = ?', (relative, rowid))
                    changed += 1
    return changed
