"""Prefect flow: the whole pipeline, stage by stage as dvc.yaml defines it (``python -m flows.pipeline``).

Independent stages (the per-task fine-tunes, the per-method merges) run concurrently; up-to-date stages are
skipped; stages that fail transiently retry. Each finished stage is committed to dvc.lock by the flow itself, one
at a time, under DVC's repository lock. Without PREFECT_API_URL it runs on an ephemeral Prefect server.
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import sys
import threading
from collections.abc import Iterator

# the ephemeral server's telemetry write can collide with the flow's first writes to its SQLite database
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# a first start (fresh PREFECT_HOME: migrations; fresh venv: bytecode) can outlast Prefect's 20 s default
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner

from mergeflow.checks import check_project
from mergeflow.config import apply_overrides
from mergeflow.errors import MergeflowError
from mergeflow.orchestration import PipelineFailed, check_repo, commit_stage, locked_repo, stage_graph, stage_threads, stale_stages, stop_stages, stopping
from tasks.stages import run_stage_task


def default_workers() -> int:
    import torch

    return 1 if torch.cuda.is_available() else max(1, os.cpu_count() or 1)


def _as_completed(futures: list) -> Iterator:
    """The futures as they finish. The main thread waits in short spells: Python runs signal handlers only there,
    and a SIGTERM delivered to a worker thread would otherwise wait for the next stage to end."""
    finished: queue.Queue = queue.Queue()
    for future in futures:
        future.add_done_callback(finished.put)
    for _ in futures:
        while True:
            try:
                yield finished.get(timeout=0.5)
                break
            except queue.Empty:
                continue


@flow(name="mergeflow-pipeline", task_runner=ThreadPoolTaskRunner(max_workers=default_workers()))
def pipeline(root: str = ".", workers: int | None = None, overrides: list[str] | None = None) -> list[str]:
    """Run every stale stage. ``overrides`` are ``key.path=value`` settings written into params.yaml first, as
    ``dvc exp run -S`` takes them; every name is checked (mergeflow check) before any stage runs."""
    logger = get_run_logger()
    check_repo(root)
    if overrides:
        apply_overrides(os.path.join(root, "params.yaml"), list(overrides))
    _, notices = check_project(root)
    for notice in notices:
        logger.warning(notice)
    with locked_repo(root) as repo:
        nodes = stage_graph(repo)
        stale = stale_stages(repo, nodes)
        workers = workers or default_workers()
        threads = stage_threads(nodes, stale, workers, os.cpu_count() or 1)  # concurrent stages share the cores
        env = {"MERGEFLOW_RUN_SOURCE": "prefect", "PREFECT__FLOW_RUN_ID": str(flow_run.get_id() or "")}
        futures = {}
        for node in nodes:
            if node.address not in stale:
                continue
            waits = [futures[u] for u in node.upstream if u in futures]
            futures[node.address] = run_stage_task.submit(node, root, env | {"MERGEFLOW_THREADS": str(threads[node.address])}, wait_for=waits)
        logger.info("%d of %d stages to run: %s", len(futures), len(nodes), ", ".join(futures) or "none")
        if not futures:
            logger.info("nothing to do: every stage is up to date")
        done, failed = [], []
        for future in _as_completed(list(futures.values())):
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the mergeflow pipeline with Prefect.")
    parser.add_argument("--root", default=".", help="repository root holding dvc.yaml (default: .)")
    parser.add_argument("--workers", type=int, default=None, help="stages at once (default: CPU cores; 1 on a GPU)")
    parser.add_argument("-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="set a parameter in params.yaml first, as dvc exp run -S does (repeatable)")
    args = parser.parse_args(argv)
    workers = args.workers or default_workers()
    try:  # bad input gets its one line here, before Prefect starts (the flow checks again: deployments start there)
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
            pipeline.with_options(task_runner=ThreadPoolTaskRunner(max_workers=workers))(root=args.root, workers=workers, overrides=args.overrides)
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
