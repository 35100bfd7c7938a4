"""Prefect flow: the whole pipeline, stage by stage as dvc.yaml defines it (``python -m flows.pipeline``).

Independent stages (the per-task fine-tunes, the per-method merges) run concurrently; up-to-date stages are
skipped; stages that fail transiently retry. Each finished stage is committed to dvc.lock by the flow itself, one
at a time, under DVC's repository lock. Without PREFECT_API_URL it runs on an ephemeral Prefect server.

Stages run on a thread pool in this process (``--runner thread``, the default) or on a Dask cluster
(``--runner dask``: a LocalCluster of ``--workers`` processes, or an existing cluster at ``--dask-address``).
The runner is chosen per run, inside the flow, so a deployment's ``runner`` and ``workers`` parameters take
effect. On a machine with several GPUs each running stage gets one of them (CUDA_VISIBLE_DEVICES).
See docs/scaling.md; ``python -m flows.serve`` (``mergeflow serve``) schedules this flow.
"""

# no `from __future__ import annotations`: a served run gets the flow pickled by value, and Prefect builds its
# parameter model from the signature; string annotations (Runner) would not resolve there

import argparse
import contextlib
import os
import queue
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

# the ephemeral server's telemetry write can collide with the flow's first writes to its SQLite database
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# a first start (fresh PREFECT_HOME: migrations; fresh venv: bytecode) can outlast Prefect's 20 s default
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from mergeflow.checks import check_project
from mergeflow.config import apply_overrides
from mergeflow.errors import MergeflowError
from mergeflow.orchestration import PipelineFailed, check_repo, commit_stage, locked_repo, stage_graph, stage_threads, stale_stages, stop_stages, stopping, visible_gpus
from tasks.stages import run_stage_task, stop_worker_stages

Runner = Literal["thread", "dask"]
RUNNERS: tuple[str, ...] = ("thread", "dask")


def default_workers() -> int:
    """Stages at once: one per GPU where there are GPUs, else one per CPU core."""
    return len(visible_gpus()) or max(1, os.cpu_count() or 1)


def check_runner(runner: str, dask_address: str | None = None) -> None:
    """Refuse an unknown runner, or a Dask address without the Dask runner or prefect-dask (one line each)."""
    if runner not in RUNNERS:
        raise MergeflowError(f"unknown runner {runner!r}: choose one of {', '.join(RUNNERS)}")
    if dask_address and runner != "dask":
        raise MergeflowError(f"a Dask scheduler address ({dask_address}) needs --runner dask")
    if runner == "dask":
        try:
            import prefect_dask  # noqa: F401
        except ImportError:
            raise MergeflowError("--runner dask needs prefect-dask (pip install prefect-dask)") from None


def make_task_runner(runner: str, workers: int, dask_address: str | None = None) -> TaskRunner:
    """The task runner for one flow run: a thread pool of ``workers`` threads, or a DaskTaskRunner on an existing
    cluster (``dask_address``) or on a LocalCluster of ``workers`` processes of one thread each (a stage runs
    as a subprocess of its worker: the worker only waits on it)."""
    check_runner(runner, dask_address)
    if runner == "thread":
        return ThreadPoolTaskRunner(max_workers=workers)
    from prefect_dask import DaskTaskRunner

    if dask_address:
        return DaskTaskRunner(address=dask_address)
    # memory_limit 0: a worker's own memory is small (its stage is a child process Dask does not count), and a
    # limit would only pause or restart workers; the dashboard on a free port (two flows at once)
    cluster = {"n_workers": workers, "threads_per_worker": 1, "processes": True, "memory_limit": 0, "dashboard_address": ":0"}
    if api_url := _ephemeral_api_url():
        cluster["env"] = {"PREFECT_API_URL": api_url}
    return DaskTaskRunner(cluster_kwargs=cluster)


def _ephemeral_api_url() -> str | None:
    """The API of the ephemeral Prefect server this process runs on (no PREFECT_API_URL), for the Dask workers:
    they report their task runs there instead of each starting an ephemeral server of its own."""
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        return None
    try:
        from prefect.server.api.server import SubprocessASGIServer

        servers = [s for s in SubprocessASGIServer._instances.values() if getattr(s, "running", False)]
    except (ImportError, AttributeError):
        return None
    return servers[0].api_url if servers else None


def _as_completed(futures: list, on_stop: Callable[[], None] | None = None) -> Iterator:
    """The futures as they finish. The main thread waits in short spells: Python runs signal handlers only there,
    and a SIGTERM delivered to a worker thread would otherwise wait for the next stage to end. ``on_stop`` is
    called once, from this thread, when the run is being stopped (stopping())."""
    finished: queue.Queue = queue.Queue()
    for future in futures:
        future.add_done_callback(finished.put)
    for _ in futures:
        while True:
            try:
                yield finished.get(timeout=0.5)
                break
            except queue.Empty:
                if on_stop is not None and stopping():
                    on_stop()
                    on_stop = None
                continue


def _stop_on_dask(task_runner, futures: list) -> Callable[[], None]:
    """Stopping a run on Dask: cancel the stages not started yet, and stop those running on every worker (their
    processes are the workers' children, out of this process's reach)."""
    run_id = str(flow_run.get_id() or "")

    def stop() -> None:
        task_runner.client.cancel([f.wrapped_future for f in futures])
        stopped = task_runner.client.run(stop_worker_stages, run_id)  # {worker: stages it stopped}
        get_run_logger().warning("stopping: %d running stages stopped on the Dask workers, the rest cancelled", sum(stopped.values()))

    return stop


@flow(name="mergeflow-pipeline")
def pipeline(root: str = ".", workers: int | None = None, overrides: list[str] | None = None, runner: Runner = "thread", dask_address: str | None = None) -> list[str]:
    """Run every stale stage. ``overrides`` are ``key.path=value`` settings written into params.yaml first, as
    ``dvc exp run -S`` takes them; every name is checked (mergeflow check) before any stage runs. ``runner``:
    "thread" (a thread pool here) or "dask" (a LocalCluster of ``workers`` processes, or the cluster at
    ``dask_address``); ``workers``: stages at once (default: one per GPU, else one per CPU core)."""
    logger = get_run_logger()
    check_repo(root)
    check_runner(runner, dask_address)
    if overrides:
        apply_overrides(os.path.join(root, "params.yaml"), list(overrides))
    _, notices = check_project(root)
    for notice in notices:
        logger.warning(notice)
    # DVC names a stage relative to the working directory ("../repo/dvc.yaml:merge@ties" from elsewhere), and a
    # stage learns its task or method from that name (DVC_STAGE): the run works from the repository root, whatever
    # directory a deployment's runner or worker started it in
    root = str(Path(root).resolve())
    with contextlib.chdir(root), locked_repo(root) as repo:
        nodes = stage_graph(repo)
        stale = stale_stages(repo, nodes)
        workers = workers or default_workers()
        threads = stage_threads(nodes, stale, workers, os.cpu_count() or 1)  # concurrent stages share the cores
        env = {"MERGEFLOW_RUN_SOURCE": "prefect", "PREFECT__FLOW_RUN_ID": str(flow_run.get_id() or "")}
        # one stage per GPU: the GPUs this machine shows, handed out by the thread pool's process or, on a
        # LocalCluster of one worker per GPU, each worker its own; an existing cluster's workers bring their own
        gpus = [] if dask_address else visible_gpus()
        if gpus and runner == "dask" and not dask_address:
            workers = min(workers, len(gpus))
        gpu_workers = workers if gpus and runner == "dask" else None
        to_run = [n for n in nodes if n.address in stale]
        logger.info("%d of %d stages to run: %s", len(to_run), len(nodes), ", ".join(n.address for n in to_run) or "none")
        done, failed, futures = [], [], {}
        if not to_run:
            logger.info("nothing to do: every stage is up to date")
        else:
            logger.info("runner: %s, %d stages at once%s", runner if not dask_address else f"dask at {dask_address}", workers, f", GPUs {', '.join(gpus)}" if gpus else "")
        with make_task_runner(runner, workers, dask_address) if to_run else contextlib.nullcontext() as task_runner:
            for node in to_run:
                waits = [futures[u] for u in node.upstream if u in futures]
                parameters = {"node": node, "root": root, "env": env | {"MERGEFLOW_THREADS": str(threads[node.address])}, "gpus": gpus, "gpu_workers": gpu_workers}
                futures[node.address] = task_runner.submit(run_stage_task, parameters, wait_for=waits)
            on_stop = _stop_on_dask(task_runner, list(futures.values())) if runner == "dask" and futures else None
            for future in _as_completed(list(futures.values()), on_stop):
                try:
                    result = future.result()
                except Exception as err:  # noqa: BLE001 - reported below; stages that do not depend on it go on
                    failed.append(err)
                    continue
                commit_stage(repo, result["stage"])  # one at a time, from this thread: dvc.lock has one writer
                done.append(result["stage"])
    if failed and stopping():
        raise PipelineFailed(f"stopped by a signal: {len(done)} of {len(futures)} stages completed and were recorded in dvc.lock; the rest run next time")
    if failed:
        first = next((e for e in failed if not type(e).__name__.startswith("Upstream")), failed[0])
        raise PipelineFailed(f"{len(failed)} of {len(futures)} stages did not complete; first failure: {first}")
    return done


def _stop(signum, frame):
    """SIGTERM or SIGINT: stop the running stages; the flow then fails on them and ends (a second signal kills)."""
    signal.signal(signum, signal.SIG_DFL)
    stopped = stop_stages()
    print(f"mergeflow: {signal.Signals(signum).name}: stopped {stopped} running stages", file=sys.stderr)


def add_runner_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runner", choices=RUNNERS, default="thread", help="where stages run: a thread pool here (default) or a Dask cluster")
    parser.add_argument("--dask-address", default=None, metavar="tcp://HOST:PORT", help="with --runner dask: an existing cluster's scheduler (default: a LocalCluster of --workers processes)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the mergeflow pipeline with Prefect.")
    parser.add_argument("--root", default=".", help="repository root holding dvc.yaml (default: .)")
    parser.add_argument("--workers", type=int, default=None, help="stages at once (default: one per GPU, else one per CPU core)")
    parser.add_argument("-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="set a parameter in params.yaml first, as dvc exp run -S does (repeatable)")
    add_runner_arguments(parser)
    args = parser.parse_args(argv)
    try:  # bad input gets its one line here, before Prefect starts (the flow checks again: deployments start there)
        check_runner(args.runner, args.dask_address)
        check_repo(args.root)
        check_project(args.root)
        if args.overrides:
            apply_overrides(os.path.join(args.root, "params.yaml"), args.overrides, write=False)
    except MergeflowError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_status
    # The flow runs on a thread of its own and this (main) thread only waits: Python runs signal handlers on the
    # main thread alone, and a flow blocked there waiting on a stage would hear a SIGTERM only when the stage ends.
    outcome: dict[str, BaseException] = {}

    def run() -> None:
        try:
            pipeline(root=args.root, workers=args.workers, overrides=args.overrides, runner=args.runner, dask_address=args.dask_address)
        except BaseException as err:  # noqa: BLE001 - handed to the main thread
            outcome["error"] = err

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    runner = threading.Thread(target=run, name="mergeflow-flow")
    runner.start()
    while runner.is_alive():
        runner.join(0.5)
    if stopping():
        return 130
    err = outcome.get("error")
    if isinstance(err, MergeflowError):
        print(f"error: {err}", file=sys.stderr)
        return err.exit_status
    if err is not None:
        raise err
    return 0


if __name__ == "__main__":
    sys.exit(main())
