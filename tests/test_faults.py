"""Fault injection on the tiny profile: the flow, `dvc repro` and `track` killed at several points, then the
project recovers with nothing lost: dvc.lock stays readable, `dvc status` works, and one `mergeflow repro` brings
every stage back to the results of an uninterrupted run (the session's reference run)."""

import contextlib
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from mergeflow.core import lockfile

from .conftest import copy_project, make_tiny_project, run

pytestmark = pytest.mark.e2e
# outputs whose bytes carry a wall time or a run id: everything else must come back byte-identical
VARYING = ("logs/timing", "results", "metrics/tracking.json")


def _outs(root: Path) -> dict[str, str]:
    lock = yaml.safe_load((root / "dvc.lock").read_text())
    return {
        o["path"]: o["md5"]
        for s in lock["stages"].values()
        for o in s.get("outs", [])
        if not o["path"].startswith(VARYING)
    }


def _project_processes(root: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cwd", "cmdline"]):
        try:
            if proc.info["cwd"] == str(root) and proc.pid != os.getpid():
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _wait_gone(root: Path, timeout: float = 120) -> list:  # a limit for a hang, not a measurement
    deadline = time.monotonic() + timeout
    while (left := _project_processes(root)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def _start(cmd, root, env):
    return subprocess.Popen(
        cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


def _assert_recoverable(root, env):
    if (root / "dvc.lock").exists():
        assert lockfile.readable((root / "dvc.lock").read_text()), "dvc.lock left unreadable"
    assert run(["dvc", "status"], root, env, check=False).returncode == 0


def _flow_with_a_stage_running(root, env):
    """The flow started on an ephemeral Prefect server, once a stage has run for a second (not about to end): (its
    process, the pids of all its descendants then). No deadline: the temporary server may start slowly."""
    flow = subprocess.Popen(
        [sys.executable, "-m", "flows.pipeline", "--workers", "1"],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    stage_seen = False
    while flow.poll() is None and not stage_seen:
        time.sleep(0.2)
        with contextlib.suppress(psutil.Error):
            family = psutil.Process(flow.pid).children()
            stage_seen = any(
                p.cmdline()[1:2] and p.cmdline()[1].endswith("/mergeflow") and time.time() - p.create_time() > 1.0
                for p in family
            )
    assert stage_seen, f"the flow ended before a stage had run for a second: {flow.communicate()[0][-2000:]}"
    return flow, [p.pid for p in psutil.Process(flow.pid).children(recursive=True)]


def _still_running(pids, wait: float) -> list[int]:
    """The processes of ``pids`` still running (not zombies) after up to ``wait`` seconds."""

    def running():
        return [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]

    deadline = time.monotonic() + wait
    while (left := running()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.faults
def test_killed_flow_and_dvc_repro_recover_to_the_reference(tmp_path, tiny_env, prefect_server, request):
    root = make_tiny_project(tmp_path, tiny_env)
    env = tiny_env | {"PREFECT_API_URL": prefect_server}
    rng = random.Random(16)
    faults = []
    # 1. the flow, SIGKILLed at random points: its stages die with it (parent-death signal), dvc.lock stays whole
    for _ in range(3):
        flow = _start([sys.executable, "-m", "flows.pipeline", "--workers", "1"], root, env)
        delay = rng.uniform(5, 35)
        time.sleep(delay)
        flow.kill()
        flow.wait()
        assert not _wait_gone(root), f"stages outlived the flow killed at {delay:.1f} s"
        _assert_recoverable(root, env)
        faults.append(f"flow SIGKILL at {delay:.1f} s")
    # 2. the flow on its own ephemeral Prefect server while a stage runs, SIGKILLed, then SIGTERMed. The tiny
    # run may have ended between the kills above (all but track, which takes less than a second): then prepare (the
    # longest of its stages, seconds) is made to run again by removing one of its outputs (it gives the same bytes)
    if set(json.loads(run(["dvc", "status", "--json"], root, env, check=False).stdout or "{}")) <= {"track"}:
        (root / "metrics/prepare.json").unlink()
        faults.append("(the run ended between kills: prepare made to run again)")
    # SIGKILL: the Prefect server (which Prefect starts without a parent-death signal), the stage server and the
    # stage end with the flow (runner.lifetime.watch_children)
    flow, family = _flow_with_a_stage_running(root, tiny_env)
    flow.kill()
    flow.communicate()
    assert not _still_running(family, wait=30), (
        "a stage, the stage server or the flow's Prefect server outlived the SIGKILLed flow"
    )
    faults.append("flow on its ephemeral server, SIGKILL while a stage ran")
    # SIGTERM: the flow stops its stages and its own ephemeral Prefect server
    flow, family = _flow_with_a_stage_running(root, tiny_env)
    flow.send_signal(signal.SIGTERM)
    out, _ = flow.communicate()
    assert flow.returncode == 130, out[-2000:]
    assert "SIGTERM: stopped 1 running stages" in out
    assert not _still_running(family, wait=10), "a stage or the flow's Prefect server outlived it"
    _assert_recoverable(root, env)
    faults.append("flow SIGTERM during a stage")
    # 3. `dvc repro`, its process group SIGKILLed (as a scheduler or Ctrl-C would stop it) at random points, on a
    # changed fine-tune (every stage from the fine-tunes on to run again); params.yaml is put back afterwards, so
    # that part 5 brings the stages recorded with it back to the reference
    params = (root / "params.yaml").read_text()
    (root / "params.yaml").write_text(params.replace("  steps: 8\n", "  steps: 9\n", 1))
    assert (root / "params.yaml").read_text() != params
    for _ in range(2):
        repro = _start(["dvc", "repro"], root, env)
        delay = rng.uniform(3, 20)
        time.sleep(delay)
        os.killpg(repro.pid, signal.SIGKILL)
        repro.wait()
        assert not _wait_gone(root)
        # plain DVC rewrites dvc.lock in place: a kill during that write (rare) leaves it empty or cut short, and
        # `mergeflow check` restores the last good copy (the documented recovery; part 5 covers it again)
        if (root / "dvc.lock").exists() and not lockfile.readable((root / "dvc.lock").read_text()):
            assert "restored from" in run(["mergeflow", "check"], root, env)
            faults.append("dvc.lock left cut short by DVC, restored by mergeflow check")
        _assert_recoverable(root, env)
        faults.append(f"dvc repro SIGKILL at {delay:.1f} s")
    (root / "params.yaml").write_text(params)
    # 4. dvc.lock cut short, as a kill during DVC's own (non-atomic) write leaves it; a leftover temporary file
    lock = (root / "dvc.lock").read_text()
    cut = next(
        i for i in range(len(lock) // 2, len(lock)) if not lockfile.readable(lock[:i])
    )  # a prefix DVC cannot load
    (root / "dvc.lock").write_text(lock[:cut])
    (root / "data" / ".pretrain.safetensors.tmp-999999-x").write_bytes(b"half a file")
    faults.append("dvc.lock cut in half")
    # 5. one `mergeflow repro` brings every stage back to the uninterrupted run's results (asked for only now: under
    # xdist another worker makes the reference run while this one kills)
    reference, _ = request.getfixturevalue("tiny_reference")
    out = run(["mergeflow", "repro"], root, env)
    assert "restored from" in out
    assert "up to date" in run(["dvc", "status"], root, env)
    assert _outs(root) == _outs(reference)
    assert (
        json.loads((root / "results/summary.json").read_text())["rows"]
        == json.loads((reference / "results/summary.json").read_text())["rows"]
    )
    print("faults survived:", "; ".join(faults))


def test_leftover_temporaries_change_no_hash(tmp_path, tiny_reference, tiny_env):
    root = copy_project(tiny_reference[0], tmp_path / "p")
    for folder in ("data", "vectors", "results", "models/epochs/digits"):
        (root / folder / ".x.safetensors.tmp-999999-abc").write_bytes(b"partial")
        (root / folder / ".x.old-999999").mkdir()
    assert "up to date" in run(["dvc", "status"], root, tiny_env)


def _revision(path: Path):
    """The store's schema revision as the next writer sees it: read-write (never created), so that SQLite rolls back
    the hot journal a kill during a write leaves, as MLflow's next connection does (read-only, that fails)."""
    try:
        with sqlite3.connect(f"file:{path}?mode=rw", uri=True) as db:
            return db.execute("SELECT version_num FROM alembic_version").fetchone()[0]
    except sqlite3.Error:
        return None


@pytest.mark.faults
def test_killed_track_recovers(tmp_path, tiny_reference, tiny_env):
    from mlflow import MlflowClient
    from mlflow.store.db.utils import _get_latest_schema_revision

    root = copy_project(tiny_reference[0], tmp_path / "p")
    store = tmp_path / "store.db"
    env = tiny_env | {"MLFLOW_TRACKING_URI": f"sqlite:///{store}"}
    head = _get_latest_schema_revision()
    for delay in (1.0, 2.5, 4.0, 6.0, 9.0):  # imports, MLflow's first migration, logging runs and artifacts
        track = _start(["mergeflow", "track"], root, env)
        time.sleep(delay)
        track.kill()
        track.wait()
        assert not store.exists() or _revision(store) == head, f"store left half-migrated by a kill at {delay} s"
    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    experiment = client.get_experiment_by_name("mergeflow/embedded")
    abandoned = (
        len(client.search_runs([experiment.experiment_id], filter_string="attributes.status = 'RUNNING'"))
        if experiment
        else 0
    )
    out = run(["mergeflow", "track"], root, env)
    if abandoned:  # the last kill left runs RUNNING (earlier ones were marked by the tracks after them)
        assert f"marked {abandoned} runs FAILED that a killed track left RUNNING" in out
    runs = client.search_runs([client.get_experiment_by_name("mergeflow/embedded").experiment_id], max_results=1000)
    assert not [r for r in runs if r.info.status == "RUNNING"]
    last = client.get_run(json.loads((root / "metrics/tracking.json").read_text())["run_id"])
    covered = {k: v for k, v in last.data.tags.items() if k.startswith("stage_run.")}
    # prepare, pretrain, the fine-tunes, vectors, the merges, a run per regime variant, per variant and method of its
    # merges, and per study: each a finished run, whichever track logged it
    from mergeflow.params import load_params

    p = load_params(root / "params.yaml")
    variants = [(r, v) for r in p.regimes.run for v in p.regimes.config(r).variants(r, p.finetune.steps)]
    # prepare, pretrain, the fine-tunes, vectors, the merges, the
    # two baselines, the regimes' variants and merges, the studies
    assert last.info.status == "FINISHED" and len(covered) == 2 + len(p.suite.tasks) + 1 + len(
        p.merge.methods
    ) + 2 + len(variants) + sum(len(p.regimes.methods_of(r)) for r, _ in variants) + len(p.studies.run)
    assert all(client.get_run(r).info.status == "FINISHED" for r in covered.values())


@pytest.mark.parametrize("lost", ["store", "store and record"])
def test_a_deleted_store_is_logged_again_by_the_next_repro(tmp_path, tiny_reference, tiny_env, lost):
    """The MLflow store deleted after a run (and metrics/tracking.json with it): track has no DVC output that DVC
    could restore in its place, and `mergeflow repro` runs it again, which logs every stage anew."""
    from mlflow import MlflowClient

    root = copy_project(tiny_reference[0], tmp_path / "p")
    (root / "mlflow.db").unlink()
    if lost == "store and record":
        (root / "metrics/tracking.json").unlink()
    assert "Running stage" not in run(["dvc", "repro"], root, tiny_env)  # what DVC sees: nothing changed
    out = run(["mergeflow", "repro"], root, tiny_env)
    assert (
        "logging every stage to MLflow again" in out
        and "Running stage 'track'" in out
        and "restored from run-cache" not in out
    )
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("mergeflow/embedded").experiment_id])
    assert json.loads((root / "metrics/tracking.json").read_text())["run_id"] in {r.info.run_id for r in runs}
    assert "logging every stage" not in run(["mergeflow", "repro"], root, tiny_env)  # the store holds it now
