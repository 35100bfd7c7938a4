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
