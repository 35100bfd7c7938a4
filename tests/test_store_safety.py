"""The MLflow store is never set aside or replaced while it may hold runs: a corrupt one, one that is not a
database, or one this user cannot read is one line naming it (exit status 2) and stays byte for byte; only a
store that reads whole, has no runs and was left half-migrated is set aside and made anew."""

import hashlib
import os
import sqlite3
from pathlib import Path

import pytest

from mergeflow.core.errors import BAD_INPUT_STATUS, MergeflowError
from mergeflow.report.tracking.store import prepare_store, store_problem


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def store_with_runs(tmp_path_factory) -> Path:
    from mlflow import MlflowClient

    path = tmp_path_factory.mktemp("store") / "mlflow.db"
    assert prepare_store(f"sqlite:///{path}") is None
    client = MlflowClient(tracking_uri=f"sqlite:///{path}")
    experiment = client.create_experiment("e")
    for i in range(21):
        run = client.create_run(experiment)
        client.log_metric(run.info.run_id, "acc", i / 21)
        client.set_terminated(run.info.run_id)
    client._tracking_client.store.engine.dispose()
    assert store_problem(path) == (None, 21)
    return path


def _copy(src: Path, dst: Path) -> Path:
    dst.write_bytes(src.read_bytes())
    return dst


def _refused(path: Path, match: str) -> None:
    before, siblings = _digest(path), sorted(p.name for p in path.parent.iterdir())
    with pytest.raises(MergeflowError, match=match) as err:
        prepare_store(f"sqlite:///{path}")
    assert err.value.exit_status == BAD_INPUT_STATUS and "\n" not in str(err.value) and str(path) in str(err.value)
    assert _digest(path) == before, "the store was changed"
    assert sorted(p.name for p in path.parent.iterdir()) == siblings, "something was set aside or added"


def test_a_store_with_runs_is_ready_as_it_is(store_with_runs, tmp_path):
    path = _copy(store_with_runs, tmp_path / "mlflow.db")
    assert prepare_store(f"sqlite:///{path}") is None and _digest(path) == _digest(store_with_runs)


def test_a_corrupt_store_holding_runs_is_one_line_and_left_alone(store_with_runs, tmp_path):
    path = _copy(store_with_runs, tmp_path / "mlflow.db")
    data = bytearray(path.read_bytes())
    page = 4096
    for start in range(2 * page, len(data) - page, 3 * page):  # a page in three overwritten, the header kept
        data[start : start + page] = b"\xab" * page
    path.write_bytes(bytes(data))
    _refused(path, r"mlflow.db: the MLflow store cannot be read whole \(.*\); it is left as it is")


def test_a_file_that_is_not_a_database_is_one_line_and_left_alone(tmp_path):
    path = tmp_path / "mlflow.db"
    path.write_bytes(b"not a database, but perhaps someone's runs " * 100)
    _refused(path, r"mlflow.db: the MLflow store cannot be read whole \(file is not a database\)")


def test_a_store_cut_in_half_is_one_line_and_left_alone(store_with_runs, tmp_path):
    path = tmp_path / "mlflow.db"
    path.write_bytes(store_with_runs.read_bytes()[: store_with_runs.stat().st_size // 2])
    _refused(path, r"mlflow.db: the MLflow store cannot be read whole")


def test_an_unreadable_store_is_one_line_and_left_alone(store_with_runs, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads any file")
    path = _copy(store_with_runs, tmp_path / "mlflow.db")
    path.chmod(0)
    try:
        with pytest.raises(MergeflowError, match=r"mlflow.db: the MLflow store cannot be read and written"):
            prepare_store(f"sqlite:///{path}")
    finally:
        path.chmod(0o644)


def _half_migrated(path: Path, runs: int) -> Path:
    """A store an unprotected kill left mid-migration: an alembic revision MLflow does not know."""
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
        db.execute("INSERT INTO alembic_version VALUES ('0000deadbeef')")
        db.execute("CREATE TABLE runs (run_uuid VARCHAR(32))")
        db.executemany("INSERT INTO runs VALUES (?)", [(f"{i:032x}",) for i in range(runs)])
    return path


def test_only_a_half_migrated_store_with_no_runs_is_set_aside(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "held").mkdir()
    empty = _half_migrated(tmp_path / "empty" / "mlflow.db", 0)
    notice = prepare_store(f"sqlite:///{empty}")
    assert "set aside as mlflow.db.broken-" in notice and store_problem(empty) == (None, 0)
    held = _half_migrated(tmp_path / "held" / "mlflow.db", 3)
    _refused(held, r"mlflow.db: MLflow could not upgrade this store of 3 runs")
