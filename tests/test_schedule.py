"""Scheduling and scale-out: the served deployment (a schedule, one run at a time, "nothing to do" on an
up-to-date project), prefect.yaml's deployment, the Dask runner on a LocalCluster, and one stage per GPU (the
device pool, on the CPU: CUDA_VISIBLE_DEVICES is only handed out)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from mergeflow.runner.gpus import DevicePool, parse_visible_devices, process_device_pool, worker_devices

from mergeflow.runner.graph import StageNode, stage_graph

from mergeflow.runner.running import StageFailed, run_stage

from .conftest import copy_project, run as _run


# ---------------------------------------------------------------- one stage per GPU (no GPU needed)
@pytest.mark.parametrize(
    ("value", "devices"),
    [
        ("0,1,2", ["0", "1", "2"]),
        (" 3, 1 ", ["3", "1"]),
        ("", []),
        ("0,-1,2", ["0"]),
        ("GPU-5f1c,GPU-77aa", ["GPU-5f1c", "GPU-77aa"]),
    ],
)
def test_visible_devices_are_read_as_cuda_reads_them(value, devices):
    assert parse_visible_devices(value) == devices


def test_the_pool_hands_out_each_device_once_and_takes_it_back():
    pool = DevicePool(["0", "1", "2"])
    assert [pool.acquire(), pool.acquire()] == ["0", "1"]
    pool.release("0")
    assert pool.acquire() == "0" and pool.acquire() == "2"  # lowest free first
    with pytest.raises(TimeoutError):
        pool.acquire(timeout=0.1)  # every device taken: a stage waits
    with pytest.raises(ValueError):
        pool.release("7")
    for device in ("0", "1", "2"):
        pool.release(device)
    with pytest.raises(ValueError):
        pool.release("1")  # returned twice
    assert pool.free() == ["0", "1", "2"]


def test_no_gpu_means_no_assignment():
    pool = DevicePool([])
    assert pool.acquire(timeout=0) is None
    with pool.lease() as env:
        assert env == {}


def test_concurrent_stages_never_share_a_device():
    """Twelve stages on six threads and three GPUs: at most three at once, each alone on its device, and every
    device back in the pool at the end."""
    pool = DevicePool(["0", "1", "2"])
    lock, busy, peak, seen = threading.Lock(), set(), [0], []

    def stage(i):
        with pool.lease() as env:
            device = env["CUDA_VISIBLE_DEVICES"]
            with lock:
                assert device not in busy
                busy.add(device)
                peak[0] = max(peak[0], len(busy))
                seen.append(device)
            time.sleep(0.02 + 0.01 * (i % 3))
            with lock:
                busy.remove(device)

    threads = [threading.Thread(target=lambda i=i: [stage(j) for j in range(i, 12, 6)]) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(seen) == 12 and peak[0] == 3 and set(seen) == {"0", "1", "2"} and pool.free() == ["0", "1", "2"]


def test_a_failed_stage_returns_its_device(tmp_path):
    (tmp_path / "fail.py").write_text(
        "import os, sys\nprint('error: on', os.environ['CUDA_VISIBLE_DEVICES'], file=sys.stderr)\nsys.exit(2)\n"
    )
    pool = DevicePool(["4"])
    with pytest.raises(StageFailed, match="error: on 4"):
        with pool.lease() as env:
            run_stage(StageNode("merge@ties", (sys.executable, "fail.py"), ()), tmp_path, env)
    assert pool.free() == ["4"]


def test_local_cluster_workers_split_the_devices():
    """A Dask LocalCluster's workers are processes with a pool each: worker i of n hands out devices i, i+n, ..."""
    assert worker_devices(["0", "1", "2", "3"], 0, 2) == ["0", "2"] and worker_devices(["0", "1", "2", "3"], 1, 2) == [
        "1",
        "3",
    ]
    assert worker_devices(["0", "1"], 1, 2) == ["1"] and worker_devices(["0"], 1, 2) == []
    assert process_device_pool(["0", "1", "2", "3"], workers=2, worker=1).devices == ("1", "3")
    assert process_device_pool(["0", "1"]) is process_device_pool(("0", "1"))  # the thread runner: one pool per process


def test_local_cluster_workers_keep_the_thread_settings(monkeypatch):
    """Dask's nannies set OMP_NUM_THREADS (and MKL's, OpenBLAS's) to 1 in their workers: the flow's LocalCluster
    leaves this process's values, so that a stage on a worker gets every core as under `mergeflow repro`, and its
    import-time environment is the stage server's (the stage forks from it instead of importing torch again)."""
    from distributed import Client

    from mergeflow.runner.arguments import local_cluster
    from mergeflow.runner.stage_server import _import_time_env, _same_imports

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.setenv("MKL_NUM_THREADS", "2")
    with (
        local_cluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        (worker,) = client.run(lambda: dict(__import__("os").environ)).values()  # by value: the worker imports no test
    assert "OMP_NUM_THREADS" not in worker and "OPENBLAS_NUM_THREADS" not in worker and worker["MKL_NUM_THREADS"] == "2"
    assert worker["PYTHONHASHSEED"] == "6640"  # Dask's own, which the server does not compare
    assert _same_imports(_import_time_env(worker), _import_time_env(dict(os.environ)), {})


def test_stage_tasks_on_a_thread_pool_get_a_gpu_each(tmp_path, prefect_server):
    """The Prefect task as the flow submits it, four at once on two (pretend) GPUs: each stage sees its own
    CUDA_VISIBLE_DEVICES, never one another stage is using, and no more than two run at once."""
    from prefect import flow
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.task_runners import ThreadPoolTaskRunner

    from tasks.stages import run_stage_task

    (tmp_path / "stage.py").write_text(
        "import json, os, sys, time\nstart = time.time(); time.sleep(0.5)\n"
        "json.dump([os.environ['DVC_STAGE'], os.environ['CUDA_VISIBLE_DEVICES'], start, time.time()], "
        "open(os.environ['DVC_STAGE'] + '.json', 'w'))\n"
    )
    nodes = [StageNode(f"merge@m{i}", (sys.executable, "stage.py"), ()) for i in range(4)]

    @flow(task_runner=ThreadPoolTaskRunner(max_workers=4))
    def stages():
        futures = [run_stage_task.submit(node, str(tmp_path), {}, gpus=["6", "9"]) for node in nodes]
        return [f.result() for f in futures]

    with temporary_settings({PREFECT_API_URL: prefect_server}):
        stages()
        APILogWorker.drain_all(
            timeout=10
        )  # now, while the server is up (not at exit, after the session server is gone)
    runs = [json.loads((tmp_path / f"{n.address}.json").read_text()) for n in nodes]
    assert {device for _, device, _, _ in runs} == {"6", "9"}
    for a in runs:
        assert all(not (b[2] < a[3] and a[2] < b[3]) for b in runs if b is not a and b[1] == a[1]), (
            runs
        )  # one at a time per device
        assert sum(b[2] <= a[2] < b[3] for b in runs) <= 2, runs  # two at once at most, on four threads


# ---------------------------------------------------------------- the Prefect server's records
def _api(url: str, path: str, body: dict | None = None):
    request = urllib.request.Request(
        f"{url}/{path}",
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="GET" if body is None else "POST",
    )
    return json.loads(urllib.request.urlopen(request, timeout=30).read())


def _deployment(url: str, name: str) -> dict | None:
    found = _api(url, "deployments/filter", {"deployments": {"name": {"any_": [name]}}})
    return found[0] if found else None


def _flow_runs(url: str, deployment_id: str) -> list[dict]:
    return _api(
        url, "flow_runs/filter", {"flow_runs": {"deployment_id": {"any_": [deployment_id]}}, "sort": "START_TIME_ASC"}
    )


def _wait_for(what, timeout: float, message: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while not (value := what()):
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"{message}: the process ended ({proc.returncode}):\n{log.read_text()[-3000:] if log else ''}")
        if time.monotonic() > deadline:
            pytest.fail(f"{message} after {timeout} s" + (f":\n{log.read_text()[-3000:]}" if log else ""))
        time.sleep(1)
    return value


def _stop_serving(proc: subprocess.Popen) -> int | None:
    """SIGTERM to `mergeflow serve` (started in a session of its own), as systemd or kill sends it: its status
    (None if it had to be killed); then SIGKILL to whatever of its session is left."""
    status = proc.poll()
    if status is None:
        proc.send_signal(signal.SIGTERM)
        try:
            status = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            status = None
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)
    return status


def _delete_deployment(url: str, deployment_id: str) -> None:
    """Leave the session's shared server without this deployment and its scheduled runs."""
    urllib.request.urlopen(urllib.request.Request(f"{url}/deployments/{deployment_id}", method="DELETE"), timeout=30)


def _check_limit_of_one(deployment: dict) -> None:
    """One run at a time: the deployment's concurrency limit is 1, and a run that comes due while another runs
    waits (ENQUEUE) rather than being dropped."""
    assert deployment["global_concurrency_limit"]["limit"] == 1, deployment
    assert deployment["concurrency_options"]["collision_strategy"] == "ENQUEUE", deployment


# ---------------------------------------------------------------- scheduled runs
@pytest.mark.e2e
@pytest.mark.deploy
def test_served_deployment_runs_on_its_schedule(tmp_path, tiny_reference, tiny_env, prefect_server):
    """`mergeflow serve --interval 5` on an up-to-date project: the deployment has the parameters given and a
    concurrency limit of 1; its scheduled runs complete, each in seconds, recording no stage ("nothing to do"),
    and no two of them ran at once, though runs came due every 5 s."""
    root = copy_project(tiny_reference[0], tmp_path / "served")
    env = tiny_env | {"PREFECT_API_URL": prefect_server}
    name = f"served-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mergeflow.cli", "serve", "--interval", "5", "--name", name, "--workers", "2"],
            cwd=root,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deployment = None
    try:
        deployment = _wait_for(lambda: _deployment(prefect_server, name), 120, "no deployment registered", proc, log)
        _check_limit_of_one(deployment)
        assert deployment["parameters"] == {
            "root": str(root),
            "workers": 2,
            "runner": "thread",
            "overrides": [],
            "dask_address": None,
            "worker_checkouts": False,
        }
        assert deployment["schedules"][0]["schedule"]["interval"] == 5.0 and deployment["schedules"][0]["active"]

        def completed():
            runs = [
                r
                for r in _flow_runs(prefect_server, deployment["id"])
                if r["state_type"] in ("COMPLETED", "FAILED", "CRASHED")
            ]
            return runs if len(runs) >= 2 else None

        runs = _wait_for(completed, 150, "fewer than two scheduled runs ended", proc, log)
        # stopped with SIGTERM, serve pauses the deployment: the shared server schedules nothing more for it
        assert _stop_serving(proc) == 0, log.read_text()[-3000:]
        assert _deployment(prefect_server, name)["paused"], log.read_text()[-3000:]
    finally:
        _stop_serving(proc)
        if deployment:
            spans = sorted(
                (r["start_time"], r["end_time"])
                for r in _flow_runs(prefect_server, deployment["id"])
                if r["start_time"] and r["end_time"]
            )
            _delete_deployment(prefect_server, deployment["id"])
    assert all(r["state_type"] == "COMPLETED" for r in runs), [(r["name"], r["state"]["message"]) for r in runs]
    for r in runs:
        assert r["auto_scheduled"] and r["total_run_time"] < 30, r
        assert _api(prefect_server, "task_runs/filter", {"flow_runs": {"id": {"any_": [r["id"]]}}}) == []  # no stage
        messages = [
            entry["message"]
            for entry in _api(prefect_server, "logs/filter", {"logs": {"flow_run_id": {"any_": [r["id"]]}}})
        ]
        assert (
            any(m.startswith("nothing to do") for m in messages)
            and f"0 of {len(stage_graph(root))} stages to run: none" in messages
        ), messages
    # one at a time: every run of the deployment that ran started after the one before it had ended, though
    # runs came due every 5 s and the runner picks up every run that is due
    assert len(spans) >= 2 and all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:])), spans
    assert subprocess.run(["dvc", "status", "--quiet"], cwd=root, env=env).returncode == 0


@pytest.mark.e2e
def test_prefect_yaml_registers_the_nightly_deployment(tmp_path, tiny_reference, tiny_env, prefect_server):
    """The production way: `prefect deploy` from the repository with prefect.yaml, to a process work pool."""
    root = copy_project(tiny_reference[0], tmp_path / "deployed")
    env = tiny_env | {"PREFECT_API_URL": prefect_server}
    _run(["prefect", "work-pool", "create", "mergeflow", "--type", "process", "--overwrite"], root, env, timeout=120)
    _run(["prefect", "--no-prompt", "deploy", "--name", "nightly"], root, env, timeout=120)
    deployment = _deployment(prefect_server, "nightly")
    _delete_deployment(prefect_server, deployment["id"])  # its nightly schedule stays off the shared server
    _check_limit_of_one(deployment)
    assert deployment["entrypoint"] == "flows/pipeline.py:pipeline" and deployment["work_pool_name"] == "mergeflow"
    assert deployment["pull_steps"] == [{"prefect.deployments.steps.set_working_directory": {"directory": str(root)}}]
    assert deployment["parameters"] == {
        "root": ".",
        "workers": None,
        "runner": "thread",
        "dask_address": None,
        "overrides": [],
    }
    assert [s["schedule"] for s in deployment["schedules"]] == [
        {"cron": "0 3 * * *", "timezone": "UTC", "day_or": True}
    ]


@pytest.mark.e2e
def test_a_failed_run_is_failed_with_the_stage_line(tmp_path, tiny_reference, prefect_server, monkeypatch):
    """The flow as a deployment's run calls it, from another working directory (this one) as a runner may: a
    stage that fails (here a stand-in `mergeflow` that exits with status 2) makes the run Failed, with the
    failing stage's status and last line as its message, and dvc.lock keeps what it had."""
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.pipeline import pipeline

    root = copy_project(tiny_reference[0], tmp_path / "failing")
    fake = tmp_path / "bin" / "mergeflow"
    fake.parent.mkdir()
    fake.write_text(
        '#!/bin/sh\necho "working on $DVC_STAGE"\necho "error: $DVC_STAGE: simulated failure" >&2\nexit 2\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    before = (root / "dvc.lock").read_text()
    with temporary_settings({PREFECT_API_URL: prefect_server}):
        state = pipeline(
            root=str(root),
            workers=2,
            overrides=["merge.ties.k=0.1", "regimes.run=[]", "studies.run=[]"],
            return_state=True,
        )
        APILogWorker.drain_all(timeout=10)
    assert state.is_failed(), state
    assert state.message.endswith(
        "3 of 3 stages did not complete; first failure: stage merge@ties "
        "exited with status 2: error: merge@ties: simulated failure"
    ), state.message
    assert (root / "dvc.lock").read_text() == before


def test_serve_refuses_bad_input_before_registering(tmp_path, repo_root):
    """A schedule that cannot work, or a directory that is no DVC project, is one line and status 2, before
    anything reaches Prefect."""
    for args, says in [
        (["--cron", "0 3 * *"], 'error: Invalid cron string: "0 3 * *"'),
        (["--interval", "0", "--root", str(tmp_path)], "error: " + str(tmp_path)),
    ]:
        proc = subprocess.run(
            [sys.executable, "-m", "flows.serve", *args], cwd=repo_root, capture_output=True, text=True, timeout=120
        )
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(says), (args, proc.stderr)


# ---------------------------------------------------------------- the Dask runner
@pytest.mark.e2e
# the Dask runner on a reference run (merge@ties, report and track on a LocalCluster's workers, each with a pretend
# GPU of its own, recorded by the Prefect server) is tests/test_remote.py's worker-checkouts flow run


def test_a_dask_address_needs_the_dask_runner(tmp_path, repo_root):
    proc = subprocess.run(
        [sys.executable, "-m", "flows.pipeline", "--dask-address", "tcp://127.0.0.1:1"],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        proc.returncode == 2
        and proc.stderr.strip() == "error: a Dask scheduler address (tcp://127.0.0.1:1) needs --runner dask"
    )


def test_stage_failures_cross_process_boundaries():
    """A stage's failure comes back from a Dask worker pickled: it must keep its status and line."""
    import pickle

    err = pickle.loads(pickle.dumps(StageFailed("merge@ties", 2, "error: merge.ties.k: must be in (0, 1]")))
    assert (err.address, err.returncode, err.tail, err.bad_input) == (
        "merge@ties",
        2,
        "error: merge.ties.k: must be in (0, 1]",
        True,
    )
    assert str(err) == "stage merge@ties exited with status 2: error: merge.ties.k: must be in (0, 1]"
