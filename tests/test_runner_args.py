"""The Prefect flow's and the scheduler's arguments (python -m flows.pipeline, mergeflow serve): a bad --workers,
--interval, --cron or --runner is one line, `error: ...` naming the option, exit status 2, before Prefect starts;
an unreachable Dask scheduler is one line within 15 s. Parse-level: no Prefect server is started."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import threading
import time

import pytest

from flows import pipeline, serve
from mergeflow.core.errors import MergeflowError
from mergeflow.runner.arguments import check_dask_imports, check_schedule, check_workers, probe_dask_scheduler


def _one_line(capsys, call) -> tuple[int, str]:
    """Run ``call`` (a main); its exit status (SystemExit's or the return value) and its only stderr line."""
    try:
        status = call()
    except SystemExit as exit_:
        status = exit_.code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return status, err[0]


@pytest.mark.parametrize(
    "value, says",
    [
        ("abc", "'abc' is not a whole number of stages at once (1 to 1,024)"),
        ("1.5", "'1.5' is not a whole number of stages at once (1 to 1,024)"),
        ("0", "0 stages at once: give 1 to 1,024"),
        ("-1", "-1 stages at once: give 1 to 1,024"),
        ("1025", "1025 stages at once: give 1 to 1,024"),
    ],
)
@pytest.mark.parametrize("main", [pipeline.main, serve.main], ids=["pipeline", "serve"])
def test_workers_must_be_a_whole_number_from_1(capsys, main, value, says):
    for runner in ("thread", "dask"):  # dask with -1 used to start a cluster of no workers and wait for ever
        status, line = _one_line(capsys, lambda: main(["--runner", runner, "--workers", value]))
        assert (status, line) == (2, f"error: argument --workers: {says} (--help lists the options)")


def test_workers_as_a_flow_parameter(capsys):
    """A deployment's run takes workers from its parameters (the UI, the API): the flow checks them itself."""
    check_workers(None)
    check_workers(1024, "workers")
    for value, says in (
        (0, "0 stages at once: give 1 to 1,024"),
        (-1, "-1 stages at once: give 1 to 1,024"),
        (2.0, "2.0 is not a whole number of stages at once (1 to 1,024)"),
    ):
        with pytest.raises(MergeflowError) as err:
            check_workers(value, "workers")
        assert str(err.value) == f"workers: {says}"


def test_a_bad_runner_is_one_line(capsys):
    status, line = _one_line(capsys, lambda: pipeline.main(["--runner", "ray"]))
    assert (status, line) == (
        2,
        "error: argument --runner: invalid choice: 'ray' (choose from 'thread', 'dask') (--help lists the options)",
    )


@pytest.mark.parametrize(
    "args, says",
    [
        (
            ["--interval", "inf"],
            "--interval inf: give a finite number of seconds above 0, at most 31,622,400 (366 days)",
        ),
        (
            ["--interval", "nan"],
            "--interval nan: give a finite number of seconds above 0, at most 31,622,400 (366 days)",
        ),
        (["--interval", "0"], "--interval 0: give a finite number of seconds above 0, at most 31,622,400 (366 days)"),
        (
            ["--interval", "-60"],
            "--interval -60: give a finite number of seconds above 0, at most 31,622,400 (366 days)",
        ),
        (
            ["--interval", "1e10"],
            "--interval 1e+10: give a finite number of seconds above 0, at most 31,622,400 (366 days)",
        ),
        (["--cron", ""], "--cron '': give a cron expression, e.g. \"0 3 * * *\" (every day at 03:00)"),
        (["--cron", "   "], "--cron '   ': give a cron expression, e.g. \"0 3 * * *\" (every day at 03:00)"),
    ],
)
def test_a_schedule_that_cannot_work_is_one_line_before_registering(capsys, repo_root, args, says):
    status, line = _one_line(capsys, lambda: serve.main([*args, "--root", str(repo_root)]))
    assert (status, line) == (2, f"error: {says}")


def test_good_schedules_pass():
    check_schedule("0 3 * * *", None)
    check_schedule(None, 3600.0)
    check_schedule(None, 366 * 24 * 3600)
    check_schedule(None, None)


def test_an_interval_that_is_not_a_number_is_one_line(capsys):
    status, line = _one_line(capsys, lambda: serve.main(["--interval", "hourly"]))
    assert (status, line) == (2, "error: argument --interval: invalid float value: 'hourly' (--help lists the options)")


def test_workers_abc_through_the_command_line_is_one_line(repo_root):
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "flows.pipeline", "--workers", "abc"],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "error: argument --workers: 'abc' is not a whole number "
        "of stages at once (1 to 1,024) (--help lists the options)"
    ]
    assert time.monotonic() - started < 120


# ---------------------------------------------------------------- the Dask scheduler's address
def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed when this returns: nothing listens there


def test_an_unreachable_dask_scheduler_through_the_command_line(repo_root):
    port = _closed_port()
    proc = subprocess.run(
        [sys.executable, "-m", "flows.pipeline", "--runner", "dask", "--dask-address", f"tcp://127.0.0.1:{port}"],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"error: --dask-address tcp://127.0.0.1:{port}: no Dask scheduler there (Connection refused)"
    ]


def test_a_dask_scheduler_started_outside_the_project_is_one_line(repo_root, tmp_path):
    """A scheduler that cannot import the project's tasks.stages would fail every stage with Dask's "Error during
    deserialization of the task graph" (ten lines each): the flow says so first, in one line."""
    port = _closed_port()
    scheduler = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "distributed.cli.dask_scheduler",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-dashboard",
        ],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        address = f"tcp://127.0.0.1:{port}"
        while True:  # no deadline: pytest-timeout ends a hang
            with contextlib.suppress(MergeflowError):
                probe_dask_scheduler(address)
                break
            assert scheduler.poll() is None, "the Dask scheduler did not start"
            time.sleep(0.3)
        with pytest.raises(MergeflowError) as err:
            check_dask_imports(address)
        assert (
            str(err.value)
            == f"--dask-address {address}: the scheduler cannot import tasks.stages (ModuleNotFoundError) (1 of 1 "
            "processes): start the scheduler and workers with the project's root on PYTHONPATH"
        )
    finally:
        scheduler.terminate()
        scheduler.wait()


@contextlib.contextmanager
def _silent_listener():
    """A port that accepts connections and never says a word (a scheduler that hangs, or another service)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    accepted = []
    stop = threading.Event()

    def accept():
        server.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                accepted.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        for conn in accepted:
            conn.close()
        server.close()


def test_a_scheduler_that_never_answers_is_one_line_after_the_timeout():
    # the probe's timeout (10 s by default) at 2 s; only a lower bound on the wait: a busy machine may take longer
    with _silent_listener() as port:
        started = time.monotonic()
        with pytest.raises(MergeflowError) as err:
            probe_dask_scheduler(f"tcp://127.0.0.1:{port}", timeout=2.0)
        took = time.monotonic() - started
    assert (
        str(err.value)
        == f"--dask-address tcp://127.0.0.1:{port}: no Dask scheduler answers there (TimeoutError after 2 s)"
    )
    assert took > 1.5, took  # it waited for the handshake, not failed at once


@pytest.mark.parametrize(
    "address, says",
    [
        ("tcp://:8786", "not a scheduler address (tcp://HOST:PORT)"),
        ("tcp://127.0.0.1:port", "not a scheduler address (tcp://HOST:PORT)"),
        ("no-such-host.invalid:8786", None),  # the resolver's own words
    ],
)
def test_addresses_that_are_not_one(address, says):
    with pytest.raises(MergeflowError) as err:
        probe_dask_scheduler(address)
    if says:
        assert str(err.value) == f"--dask-address {address}: {says}"
    else:
        assert str(err.value).startswith(f"--dask-address {address}: no Dask scheduler there (") and "\n" not in str(
            err.value
        )


def test_a_real_scheduler_passes_and_the_runner_bounds_its_connect_timeout(monkeypatch):
    from distributed import Scheduler

    ready, stop = threading.Event(), None
    address = {}

    def serve_scheduler():
        async def main():
            nonlocal stop
            stop = asyncio.Event()
            async with Scheduler(host="127.0.0.1", port=0, dashboard=False) as scheduler:
                address["tcp"] = scheduler.address
                ready.set()
                await stop.wait()

        loop = asyncio.new_event_loop()
        address["loop"] = loop
        loop.run_until_complete(main())

    thread = threading.Thread(target=serve_scheduler, daemon=True)
    thread.start()
    assert ready.wait(60)
    try:
        probe_dask_scheduler(address["tcp"])
        pipeline.check_runner("dask", address["tcp"])
        runner = pipeline.make_task_runner("dask", 2, address["tcp"])
        assert runner.client_kwargs["timeout"] == 10.0
    finally:
        address["loop"].call_soon_threadsafe(stop.set)
        thread.join(30)


def test_a_scheduler_gone_since_the_check_is_one_line_when_the_runner_starts(monkeypatch):
    class Unreachable:
        def __enter__(self):
            raise OSError("Timed out trying to connect to tcp://10.0.0.9:8786 after 10 s")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(pipeline, "make_task_runner", lambda *args: Unreachable())
    with contextlib.ExitStack() as stack, pytest.raises(MergeflowError) as err:
        pipeline._enter_task_runner(stack, "dask", 2, "tcp://10.0.0.9:8786")
    assert (
        str(err.value)
        == "--dask-address tcp://10.0.0.9:8786: the Dask scheduler did not answer (Timed out trying to connect to "
        "tcp://10.0.0.9:8786 after 10 s)"
    )
    with contextlib.ExitStack() as stack, pytest.raises(OSError):  # not a scheduler's: as it was
        pipeline._enter_task_runner(stack, "thread", 2, None)
