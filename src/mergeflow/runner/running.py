"""Running one stage's command as DVC would, in a process group of its own; stopping every running stage with
the run (``stop_stages``); a failed stage as one line (``StageFailed``, ``OneLineFailures``) and a finished one
as its summary line."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from mergeflow.core.errors import BAD_INPUT_STATUS, TRANSIENT_STATUS, MergeflowError
from mergeflow.runner.graph import StageNode

# set to the flow's pid in a stage's environment: the stage asks the kernel to send it SIGTERM when the flow dies
DIE_WITH_PARENT_ENV = "MERGEFLOW_DIE_WITH_PARENT"


class StageFailed(Exception):
    """A stage that exited with a non-zero status: ``tail`` is the last line it printed (its ``error: ...`` line
    for bad input), ``output`` the end of what it printed (stdout and stderr)."""

    def __init__(self, address: str, returncode: int, tail: str, output: str = ""):
        self.address, self.returncode, self.tail, self.output = address, returncode, tail, output
        super().__init__(f"stage {address} exited with status {returncode}: {tail}")

    def __reduce__(self):  # pickled whole: a Dask worker sends the failure back to the flow
        return type(self), (self.address, self.returncode, self.tail, self.output)

    @property
    def transient(self) -> bool:
        """Worth a retry: killed by a signal (the OOM killer, a preempted node) or a transient error (status 75).
        Bad input (2) and unexpected errors (1, a traceback) fail the same way again."""
        return (self.returncode < 0 or self.returncode == TRANSIENT_STATUS) and not _stopping.is_set()

    @property
    def bad_input(self) -> bool:
        return self.returncode == BAD_INPUT_STATUS


class StageNotStarted(StageFailed):
    """A stage the run was stopped before (one that waited for a GPU, say): recorded as not run, not as failed."""

    def __init__(
        self,
        address: str,
        returncode: int = -signal.SIGTERM,
        tail: str = "not started: the run is stopping",
        output: str = "",
    ):
        super().__init__(address, returncode, tail, output)


class PipelineFailed(MergeflowError):
    """Stages of a flow run failed (each is reported with its own status and last line)."""

    exit_status = 1


class OneLineFailures(logging.Filter):
    """Drops the traceback Prefect logs with a failed stage (StageFailed) or bad input (MergeflowError): the
    message already names the stage and holds its own error line, and a traceback through the flow's machinery
    reads as a crash of mergeflow. A stage's own traceback (an unexpected error) is in its logged output."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], (StageFailed, MergeflowError)):
            record.exc_info, record.exc_text = None, None
        return True


def quiet_failure_tracebacks() -> None:
    """Install OneLineFailures on Prefect's flow- and task-run loggers (in each process that runs either)."""
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, OneLineFailures) for f in logger.filters):
            logger.addFilter(OneLineFailures())


_stopping = threading.Event()


_running: dict[int, subprocess.Popen] = {}


_running_lock = threading.Lock()


def stopping() -> bool:
    """Whether stop_stages was called: the run is being stopped on purpose."""
    return _stopping.is_set()


def stop_stages(grace_s: float = 10.0) -> int:
    """Stop every running stage (SIGTERM to its process group, SIGKILL after ``grace_s``) and start no more.
    Returns how many were running."""
    _stopping.set()
    with _running_lock:
        procs = list(_running.values())
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    return len(procs)


def _read_lines(stream, into: list[str], echo, target) -> None:
    for line in stream:
        into.append(line)
        echo(line.rstrip("\n"), target)


def run_stage(
    node: StageNode,
    root: str | Path = ".",
    env: dict[str, str] | None = None,
    echo: Callable[[str, object], None] | None = None,
) -> dict:
    """Run one stage's command in the repository root, in a process group of its own, as DVC would (DVC_STAGE and
    DVC_ROOT set). ``echo(line, sys.stdout or sys.stderr)`` is given each line the stage prints as it comes.
    Raises StageFailed with the last line the command printed when it fails."""
    if _stopping.is_set():
        raise StageNotStarted(node.address)
    root = Path(root).resolve()
    stage_env = {
        **os.environ,
        **(env or {}),
        "DVC_STAGE": node.address,
        "DVC_ROOT": str(root),
        DIE_WITH_PARENT_ENV: str(os.getpid()),
    }
    with _running_lock:
        proc = subprocess.Popen(
            list(node.argv),
            cwd=root,
            env=stage_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        _running[proc.pid] = proc
    try:
        if echo is None:
            stdout, stderr = proc.communicate()
        else:
            out, err = [], []
            readers = [
                threading.Thread(target=_read_lines, args=(proc.stdout, out, echo, sys.stdout), daemon=True),
                threading.Thread(target=_read_lines, args=(proc.stderr, err, echo, sys.stderr), daemon=True),
            ]
            for reader in readers:
                reader.start()
            for reader in readers:
                reader.join()
            proc.wait()
            stdout, stderr = "".join(out), "".join(err)
    finally:
        with _running_lock:
            _running.pop(proc.pid, None)
    if proc.returncode != 0:
        lines = (stderr or stdout).strip().splitlines()
        raise StageFailed(
            node.address, proc.returncode, lines[-1] if lines else "(no output)", (stdout + stderr)[-4000:]
        )
    # stdout and stderr apart too: a stage's summary is the end of its stdout, and warnings on stderr must not
    # push it out of the lines the flow logs
    return {
        "stage": node.address,
        "argv": list(node.argv),
        "output": (stdout + stderr)[-4000:],
        "stdout": stdout[-4000:],
        "stderr": stderr[-4000:],
    }


def resume_stages() -> None:
    """Accept stages again after stop_stages: in a long-lived process that runs the stages of flow after flow (a
    worker of an existing Dask cluster), one flow's stop must not refuse the next flow's stages."""
    _stopping.clear()


OUTPUT_LINES = 20  # the last lines of a stage's output that reach the Prefect logs


def last_lines(output: str, n: int = OUTPUT_LINES) -> str:
    return "\n".join(output.strip().splitlines()[-n:])


def completed_line(node: StageNode, root: str, seconds: float, most: int = 6) -> str:
    """The stage's summary line: its address, time and the numbers at the top level of the metrics files it
    wrote (metrics/*.json), e.g. "merge@ties completed in 3.1 s: average=0.322, val_average=0.233"."""
    numbers = []
    for out in node.outs:
        if not (out.startswith("metrics/") and out.endswith(".json")):
            continue
        try:
            record = json.loads((Path(root) / out).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict):
            numbers += [
                f"{k}={v:.4g}" for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            ]
    shown = ", ".join(numbers[:most]) + (", ..." if len(numbers) > most else "")
    return f"{node.address} completed in {seconds:.1f} s" + (f": {shown}" if shown else "")
