"""The runners' and the schedule's arguments checked before anything starts: stages at once (--workers), a cron
expression or interval, a Dask scheduler's address (one line unless a scheduler answers there), and a local Dask
cluster whose workers keep this process's thread settings."""

from __future__ import annotations

import math

from mergeflow.core.errors import MergeflowError

MAX_WORKERS = 1024  # stages at once: more than any machine or cluster here runs; -1 or 1e9 is a slip


MAX_INTERVAL_S = 366 * 24 * 3600  # a scheduled run at least once a year


DASK_CONNECT_TIMEOUT_S = 10.0  # an unreachable scheduler is one line after this, not a traceback minutes later


DASK_DEFAULT_PORT = 8786


def workers_problem(value: object) -> str | None:
    """Why ``value`` cannot be the number of stages at once (--workers, the flow's ``workers``), or None."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{value!r} is not a whole number of stages at once (1 to {MAX_WORKERS:,})"
    if not 1 <= value <= MAX_WORKERS:
        return f"{value} stages at once: give 1 to {MAX_WORKERS:,}"
    return None


def workers_argument(text: str) -> int:
    """--workers (argparse's type): a whole number of stages at once, 1 to MAX_WORKERS."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = text
    if problem := workers_problem(value):
        raise argparse.ArgumentTypeError(problem)
    return value


def check_workers(workers: int | None, key: str = "--workers") -> None:
    if workers is not None and (problem := workers_problem(workers)):
        raise MergeflowError(f"{key}: {problem}")


def check_schedule(cron: str | None, interval: float | None) -> None:
    """A cron expression that is not blank, an interval that is a finite number of seconds in (0, a year]; the
    schedule's own parser checks the expression's syntax."""
    if cron is not None and not cron.strip():
        raise MergeflowError(f'--cron {cron!r}: give a cron expression, e.g. "0 3 * * *" (every day at 03:00)')
    if interval is not None and (
        isinstance(interval, bool)
        or not isinstance(interval, (int, float))
        or not math.isfinite(interval)
        or not 0 < interval <= MAX_INTERVAL_S
    ):
        shown = f"{interval:g}" if isinstance(interval, (int, float)) else repr(interval)
        raise MergeflowError(
            f"--interval {shown}: give a finite number of seconds above 0, at most {MAX_INTERVAL_S:,} (366 days)"
        )


def probe_dask_scheduler(address: str, timeout: float = DASK_CONNECT_TIMEOUT_S, key: str = "--dask-address") -> None:
    """One line unless a Dask scheduler answers at ``address`` (tcp://HOST:PORT, tls://, ws://, wss://, or
    HOST[:PORT]) within about ``timeout`` seconds in all: a TCP connection first (a refused port or an unknown host
    fails at once), then Dask's own handshake (``distributed.comm.connect``: something else listening there, or
    nothing answering, fails within the time left). Other transports (inproc, ucx) are left to Dask."""
    import socket
    import time
    import urllib.parse

    deadline = time.monotonic() + timeout
    parts = urllib.parse.urlsplit(address if "://" in address else f"tcp://{address}")
    if parts.scheme not in ("tcp", "tls", "ws", "wss"):
        return
    try:
        host, port = parts.hostname, parts.port or DASK_DEFAULT_PORT
    except ValueError:
        host = None
    if not host:
        raise MergeflowError(f"{key} {address}: not a scheduler address (tcp://HOST:PORT)")
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except TimeoutError:
        raise MergeflowError(f"{key} {address}: no Dask scheduler answered within {timeout:g} s") from None
    except OSError as err:
        raise MergeflowError(
            f"{key} {address}: no Dask scheduler there ({err.strerror or type(err).__name__})"
        ) from None
    try:
        import asyncio
        from concurrent.futures import ThreadPoolExecutor

        from distributed.comm import connect
    except ImportError:
        return  # no Dask here: the runner's own check says so

    left = max(1.0, deadline - time.monotonic())

    async def handshake() -> None:
        # distributed's own timeout covers connecting, not a peer that accepts and then says nothing
        comm = await asyncio.wait_for(connect(address, timeout=left), left)
        comm.abort()

    pool = ThreadPoolExecutor(1)  # a loop of its own, whatever loop the caller's thread runs
    try:
        pool.submit(asyncio.run, handshake()).result(left + 2)
    except Exception as err:  # noqa: BLE001 - any failure to shake hands (a timeout, garbage read as a frame)
        why = (str(err).strip().splitlines() or [""])[0][:120]
        raise MergeflowError(
            f"{key} {address}: no Dask scheduler answers there "
            f"({type(err).__name__}{': ' + why if why else f' after {timeout:g} s'})"
        ) from None
    finally:
        pool.shutdown(wait=False)


def check_dask_imports(address: str, timeout: float = DASK_CONNECT_TIMEOUT_S, key: str = "--dask-address") -> None:
    """One line unless the scheduler and every worker at ``address`` can import mergeflow and the project's
    ``tasks.stages``: the scheduler unpickles each stage's task (Prefect's, by reference), and one started outside
    the project fails every stage with Dask's "Error during deserialization of the task graph"."""
    from distributed import Client

    def missing_imports() -> list[str]:  # nested: cloudpickle sends it by value, importable or not there
        import importlib

        missing = []
        for name in ("mergeflow", "tasks.stages"):
            try:
                importlib.import_module(name)
            except Exception as err:  # noqa: BLE001 - any reason it cannot be imported there
                missing.append(f"{name} ({type(err).__name__})")
        return missing

    with Client(address, timeout=timeout) as client:
        found = {"the scheduler": client.run_on_scheduler(missing_imports)} | {
            f"worker {w}": m for w, m in client.run(missing_imports).items()
        }
    bad = [(who, names) for who, names in found.items() if names]
    if bad:
        who, names = bad[0]
        raise MergeflowError(
            f"{key} {address}: {who} cannot import {names[0]} ({len(bad)} of {len(found)} processes): start the "
            "scheduler and workers with the project's root on PYTHONPATH"
        )


def local_cluster(**kwargs):
    """A Dask LocalCluster whose workers keep this process's thread settings: Dask's nannies otherwise set
    OMP_NUM_THREADS, MKL_NUM_THREADS and OPENBLAS_NUM_THREADS to 1 in every worker, and a stage (a worker's child)
    would run on one thread where `mergeflow repro` uses every core (slower, other bytes), and never fork from the
    stage server, whose imports read those variables."""
    import dask
    from distributed import LocalCluster

    keep = {
        k: v
        for k, v in dask.config.get("distributed.nanny.pre-spawn-environ", {}).items()
        if not k.endswith("_NUM_THREADS")
    }
    with dask.config.set({"distributed.nanny.pre-spawn-environ": keep}):
        return LocalCluster(**kwargs)
