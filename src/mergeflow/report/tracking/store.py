"""The MLflow store ``track`` logs to: its URI, made ready (created or upgraded atomically), the runs a killed
``track`` left RUNNING, and the names of the experiment and of the registered model."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sqlite3
import time
from pathlib import Path

from mergeflow.config import Params
from mergeflow.core.errors import MergeflowError
from mergeflow.core.files import atomic_path, process_alive
from mergeflow.core.mlflow_store import read_one, tracked_runs_lost, tracking_uri  # noqa: F401 - the store's API


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


def store_problem(path: Path) -> tuple[str | None, int | None]:
    """Whether the SQLite file ``path`` can be read whole, and how many runs it holds: (why not, None) for a file
    that cannot be opened, is not a database or fails SQLite's quick check; (None, runs) otherwise, 0 when it has
    no runs table yet."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            checked = [row[0] for row in db.execute("PRAGMA quick_check").fetchall()]
            if checked != ["ok"]:
                return f"SQLite's check: {'; '.join(map(str, checked[:2]))}", None
            if db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'runs'").fetchone() is None:
                return None, 0
            return None, db.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
    except sqlite3.Error as err:
        return str(err).splitlines()[0] if str(err) else type(err).__name__, None


def prepare_store(uri: str) -> str | None:
    """Make a local SQLite store ready before MLflow opens it: created or upgraded under a temporary name, then
    renamed into place, so that a kill at any point leaves either the old file or a complete new one. A store that
    cannot be read whole (corrupt, not a database, unreadable) is one line naming it, and is left as it is: it may
    hold runs, and only its owner can tell. Only a store that reads whole, holds no runs and that an earlier,
    unprotected kill left half-migrated is set aside and made anew. Returns a one-line notice when it set one
    aside. Other stores (a server, another database) are left to MLflow."""
    from mlflow.store.db.utils import _get_latest_schema_revision

    if not uri.startswith("sqlite:///"):
        return None
    path = Path(uri.removeprefix("sqlite:///"))
    runs = 0
    if path.is_file() and path.stat().st_size:
        if not os.access(path, os.R_OK | os.W_OK):
            raise MergeflowError(
                f"{path}: the MLflow store cannot be read and written by this "
                "user; give it back its permissions (it is left as it is)"
            )
        why, runs = store_problem(path)
        if why is not None:
            raise MergeflowError(
                f"{path}: the MLflow store cannot be read whole ({why}); it is left as it is: restore it from a "
                "backup, or move it away and run `mergeflow repro` to log every stage anew"
            )
    head = _get_latest_schema_revision()
    if path.is_file() and read_one(path, "SELECT version_num FROM alembic_version") == head:
        return None
    notice = None
    with atomic_path(path) as tmp:  # a kill leaves the old file (or none) and a temporary the next stage sweeps
        if path.is_file() and path.stat().st_size:
            shutil.copyfile(path, tmp)
        try:
            _migrate(tmp)
        except Exception as err:  # noqa: BLE001 - any failure of a partial schema: start over if nothing is lost
            if runs:
                raise MergeflowError(
                    f"{path}: MLflow could not upgrade this store of {runs} runs ({str(err).splitlines()[0]}); back it "
                    f"up and run 'mlflow db upgrade {uri}'"
                ) from None
            tmp.write_bytes(b"")
            _migrate(tmp)
            aside = path.with_name(f"{path.name}.broken-{time.strftime('%Y%m%d-%H%M%S')}")
            shutil.copyfile(path, aside)
            notice = (
                f"{path}: a half-migrated MLflow store with no runs (left by a killed run) was set aside as "
                f"{aside.name} and made anew"
            )
    return notice


def fail_abandoned_runs(client, experiment_id: str) -> int:
    """Mark FAILED the runs a killed ``track`` on this host left RUNNING (its process is gone); returns how many."""
    host = socket.gethostname()
    abandoned = [
        r
        for r in client.search_runs(
            [experiment_id],
            filter_string=f"attributes.status = 'RUNNING' and tags.`mergeflow.host` = '{host}'",
            max_results=5000,
        )
        if not process_alive(int(r.data.tags.get("mergeflow.pid", "0")))
    ]
    for run in abandoned:
        client.set_terminated(run.info.run_id, "FAILED")
    return len(abandoned)


def experiment_name(params: Params) -> str:
    return f"mergeflow/{params.suite.name}"


def registered_model_name(params: Params) -> str:
    return f"mergeflow-{params.suite.name}"
