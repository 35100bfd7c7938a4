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

import concurrent.futures
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from mergeflow.runner.checkouts import check_source, pull_dependencies, pull_outputs, record_stage, source
from mergeflow.runner.checks import check_project
from mergeflow.params import apply_overrides
from mergeflow.core.errors import MergeflowError, first_line
from mergeflow.runner.arguments import DASK_CONNECT_TIMEOUT_S, check_workers, local_cluster
from mergeflow.runner.flow_options import OneLineParser, Runner, add_run_arguments, check_runner
from mergeflow.runner.graph import (
    StageNode,
    changed_stages,
    check_repo,
    commit_stage,
    locked_repo,
    stage_graph,
    stale_stages,
    still_changed,
)
from mergeflow.runner.running import PipelineFailed, quiet_failure_tracebacks, stop_stages, stopping
from mergeflow.runner.lifetime import watch_children
from mergeflow.runner.run_summary import failure_markdown, push_section, success_markdown
from mergeflow.runner.scheduler import RunOutcome, run_graph, stage_cores, stage_gpus
from mergeflow.runner.stage_server import SERVER_ENV, running_server, running_servers
from mergeflow.runner.verify import check_outputs
from tasks.stages import run_stage_task, stop_worker_stages

quiet_failure_tracebacks()  # a failed stage or bad input is its one line in the logs, not a traceback


def make_task_runner(runner: str, workers: int, dask_address: str | None = None) -> TaskRunner:
    """The task runner for one flow run: a thread pool of ``workers`` threads, or a DaskTaskRunner on an existing
    cluster (``dask_address``) or on a LocalCluster of ``workers`` processes of one thread each (a stage runs
    as a subprocess of its worker: the worker only waits on it)."""
    check_runner(runner, dask_address)
    if runner == "thread":
        return ThreadPoolTaskRunner(max_workers=workers)
    from prefect_dask import DaskTaskRunner

    if dask_address:  # a scheduler that accepts the connection but never answers: Dask's own timeout, bounded too
        return DaskTaskRunner(address=dask_address, client_kwargs={"timeout": DASK_CONNECT_TIMEOUT_S})
    # memory_limit 0: a worker's own memory is small (its stage is a child process Dask does not count), and a
    # limit would only pause or restart workers; the dashboard on a free port (two flows at once)
    cluster = {
        "n_workers": workers,
        "threads_per_worker": 1,
        "processes": True,
        "memory_limit": 0,
        "dashboard_address": ":0",
    }
    if api_url := _ephemeral_api_url():
        cluster["env"] = {"PREFECT_API_URL": api_url}
    return DaskTaskRunner(cluster_class=local_cluster, cluster_kwargs=cluster)


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


def _stop_on_dask(task_runner, futures: dict) -> Callable[[], None]:
    """Stopping a run on Dask: cancel the stages not started yet, and stop those running on every worker (their
    processes are the workers' children, out of this process's reach). ``futures``: the stages submitted so far."""
    run_id = str(flow_run.get_id() or "")

    def stop() -> None:
        task_runner.client.cancel([f.wrapped_future for f in futures.values()])
        stopped = task_runner.client.run(stop_worker_stages, run_id)  # {worker: stages it stopped}
        get_run_logger().warning(
            "stopping: %d running stages stopped on the Dask workers, the rest cancelled", sum(stopped.values())
        )

    return stop


def _enter_task_runner(stack: contextlib.ExitStack, runner: str, workers: int, dask_address: str | None):
    """The started task runner (entered on ``stack``); a Dask scheduler that stopped answering since the check is
    one line naming the address."""
    try:
        return stack.enter_context(make_task_runner(runner, workers, dask_address))
    except (OSError, TimeoutError) as err:
        if not dask_address:
            raise
        why = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise MergeflowError(f"--dask-address {dask_address}: the Dask scheduler did not answer ({why})") from None


@flow(name="mergeflow-pipeline")
def pipeline(
    root: str = ".",
    workers: int | None = None,
    overrides: list[str] | None = None,
    runner: Runner = "thread",
    dask_address: str | None = None,
    worker_checkouts: bool = False,
) -> list[str]:
    """Run every stale stage. ``overrides`` are ``key.path=value`` settings written into params.yaml first, as
    ``dvc exp run -S`` takes them; every name is checked (mergeflow check) before any stage runs. ``runner``:
    "thread" (a thread pool here) or "dask" (a LocalCluster of ``workers`` processes, or the cluster at
    ``dask_address``); ``workers``: stages at once (default: one per GPU, else one per CPU core).
    ``worker_checkouts`` (Dask only): each worker runs its stages in a checkout of its own, their inputs and
    outputs moved by the DVC remote, for a cluster without a shared file system (mergeflow.runner.checkouts). The run
    ends by publishing the Markdown artifact mergeflow-summary: the summary table and the MLflow run, or what failed."""
    logger = get_run_logger()
    commit = _checked(root, workers, runner, dask_address, worker_checkouts, overrides)
    # DVC names a stage relative to the working directory ("../repo/dvc.yaml:merge@ties" from elsewhere), and a
    # stage learns its task or method from that name (DVC_STAGE): the run works from the repository root, whatever
    # directory a deployment's runner or worker started it in
    root = str(Path(root).resolve())
    with contextlib.chdir(root), locked_repo(root) as repo:
        nodes = stage_graph(repo)
        changed, stale = _stale(repo, nodes, root)
        env = {"MERGEFLOW_RUN_SOURCE": "prefect", "PREFECT__FLOW_RUN_ID": str(flow_run.get_id() or "")}
        gpus, workers, gpu_workers = _stage_slots(root, workers, runner, dask_address)
        to_run = [n for n in nodes if n.address in stale]
        logger.info(
            "%d of %d stages to run: %s", len(to_run), len(nodes), ", ".join(n.address for n in to_run) or "none"
        )
        outcome = RunOutcome([])
        if not to_run:
            logger.info("nothing to do: every stage is up to date")
        else:
            logger.info(
                "runner: %s, %d stages at once%s",
                runner if not dask_address else f"dask at {dask_address}",
                workers,
                f", GPUs {', '.join(gpus)}" if gpus else "",
            )
            outcome = _run_stages(
                repo, to_run, changed, root, commit, env, gpus, workers, gpu_workers, runner, dask_address
            )
    return _finish(outcome, len(nodes), len(to_run), root)


def _stage_slots(
    root: str, workers: int | None, runner: Runner, dask_address: str | None
) -> tuple[list[str], int, int | None]:
    """(the GPUs the stages share, the stages at once, the LocalCluster's workers when each takes a GPU of its own)."""
    # one stage per GPU: the GPUs this machine shows, handed out by the thread pool's process or, on a
    # LocalCluster of one worker per GPU, each worker its own; an existing cluster's workers bring their own
    gpus = [] if dask_address else stage_gpus(root)
    workers = workers or len(gpus) or max(1, os.cpu_count() or 1)  # stages at once: one per GPU, else per core
    if gpus and runner == "dask" and not dask_address:
        workers = min(workers, len(gpus))
    return gpus, workers, workers if gpus and runner == "dask" else None


def _run_here(repo, node: StageNode, parameters: Callable[[StageNode], dict]) -> concurrent.futures.Future:
    """A stage run in this process on its inputs pulled from the DVC remote (with worker checkouts, a stage without
    outputs), as a done future: its result, or its error as a worker's failure would be."""
    future = concurrent.futures.Future()
    try:
        pull_dependencies(repo, node.address)
        future.set_result(run_stage_task(**(parameters(node) | {"source": None})))
    except Exception as err:  # noqa: BLE001 - the outcome names it, as a worker's failure
        future.set_exception(err)
    return future


def _run_stages(
    repo,
    to_run: list[StageNode],
    changed: set[str],
    root: str,
    commit: str | None,
    env: dict,
    gpus: list[str],
    workers: int,
    gpu_workers: int | None,
    runner: Runner,
    dask_address: str | None,
) -> RunOutcome:
    """Run ``to_run`` on the task runner, each stage once those before it complete, each recorded in dvc.lock as it
    completes (scheduler.run_graph); with worker checkouts (``commit``), the outputs pulled into this tree after."""

    def parameters(node: StageNode) -> dict:
        checkout = {"source": source(root, commit)} if commit else {}  # dvc.lock as it is now, upstream recorded
        return {
            "node": node,
            "root": root,
            "env": env | served,
            "gpus": gpus,
            "gpu_workers": gpu_workers,
            "servers": servers,
        } | checkout

    def record(address: str) -> None:
        if commit and address not in here:
            record_stage(root, address, futures[address].result())
            repo._reset()  # dvc.lock changed behind DVC's back: its index is read again
        else:
            commit_stage(repo, address)

    # with worker checkouts, a stage with no outputs (track) runs here, where MLflow's store is, on its
    # inputs pulled from the remote
    here = {n.address for n in to_run if commit and not n.outs}

    with contextlib.ExitStack() as stack:
        # on this machine (a thread pool, or a LocalCluster's workers) the stages fork from one process that
        # has imported torch and timm (mergeflow.runner.stage_server); where there are GPUs, from one per GPU
        servers = stack.enter_context(running_servers(gpus))
        address = stack.enter_context(running_server()) if not dask_address and not gpus else None
        served = {SERVER_ENV: address} if address else {}
        task_runner = _enter_task_runner(stack, runner, workers, dask_address)
        futures: dict = {}

        def submit(node: StageNode, upstream: list):
            # wait_for on finished futures: no waiting, but the UI draws the graph's edges
            futures[node.address] = (
                _run_here(repo, node, parameters)
                if node.address in here
                else task_runner.submit(run_stage_task, parameters(node), wait_for=upstream)
            )
            return futures[node.address]

        on_stop = _stop_on_dask(task_runner, futures) if runner == "dask" else None
        # on this machine's CPU, as many stages as their threads leave cores for; on GPUs, one a GPU
        cores, capacity = stage_cores(root) if runner == "thread" and not gpus else (None, None)
        outcome = run_graph(
            to_run,
            submit,
            record,
            None if dask_address else workers,
            on_stop,
            cores,
            capacity,
            still_changed(repo, changed),
        )
    if commit:  # the outputs the workers pushed, into this working tree
        pull_outputs(repo, [a for a in outcome.done if a not in here])
    return outcome


def _checked(
    root: str,
    workers: int | None,
    runner: Runner,
    dask_address: str | None,
    worker_checkouts: bool,
    overrides: list[str] | None,
) -> str | None:
    """Every argument and the project checked (mergeflow check) before any stage runs, the overrides written into
    params.yaml; a refusal is published as the run's summary. Returns the commit worker checkouts start from."""
    try:
        check_repo(root)
        check_workers(workers, "workers")
        check_runner(runner, dask_address, worker_checkouts)
        commit = check_source(root) if worker_checkouts else None  # before params.yaml is written: a refusal leaves it
        if overrides:
            apply_overrides(os.path.join(root, "params.yaml"), list(overrides))
        _, notices = check_project(root)
    except MergeflowError as err:
        publish_summary(failure_markdown(None, f"error: {err}"))
        raise
    for notice in notices:
        get_run_logger().warning(notice)
    return commit


def _stale(repo, nodes: list[StageNode], root: str) -> tuple[set[str], set[str]]:
    """(the changed stages, the stages that may run): DVC's changed ones and those whose outputs' bytes changed with
    their size and mtime kept (which pass DVC's status: hashed again, mergeflow verify, seconds), and everything
    downstream of them, each run when the stages before it leave its inputs changed (scheduler.run_graph)."""
    changed = changed_stages(repo)
    stale = stale_stages(repo, nodes, changed=changed)
    if (Path(root) / "dvc.lock").exists() and (rotted := check_outputs(root, skip=stale)[0]):  # a new project: none yet
        named = "; ".join(f"{c.path} ({c.why}, stage {c.stage})" for c in rotted[:5]) + (
            f"; and {len(rotted) - 5} more" if len(rotted) > 5 else ""
        )
        get_run_logger().warning("%d outputs differ from dvc.lock, their stages run again: %s", len(rotted), named)
        changed |= {c.stage for c in rotted}
        stale = stale_stages(repo, nodes, changed=changed)
    return changed, stale


def _finish(outcome: RunOutcome, stages: int, to_run: int, root: str) -> list[str]:
    """The run's end: each failed or unrun stage logged and the failure summary published (PipelineFailed), or the
    outputs pushed to the DVC remote and the success summary published."""
    logger = get_run_logger()
    if outcome.failed or outcome.not_run:
        for address in outcome.failed:
            logger.error("failed: %s, %s: %s", address, outcome.status(address), outcome.error_line(address))
        if outcome.not_run:
            logger.error("not run: %s", "; ".join(f"{a} ({why})" for a, why in outcome.not_run.items()))
        publish_summary(failure_markdown(outcome, stages=stages))
        if stopping():
            raise PipelineFailed(
                f"stopped by a signal: {len(outcome.done)} of {to_run} stages "
                "completed and were recorded in dvc.lock; the rest run next time"
            )
        # the first failure's first line (a runner's own, Dask's, may run to ten)
        first = (
            first_line(next(iter(outcome.failed.values())), "failed")
            if outcome.failed
            else next(iter(outcome.not_run.values()))
        )
        missing = len(outcome.failed) + len(outcome.not_run)
        raise PipelineFailed(f"{missing} of {to_run} stages did not complete; first failure: {first}")
    pushed, push_error = push_section(Path(root))
    logger.info("outputs: %s", pushed)
    publish_summary(success_markdown(Path(root), outcome.done, stages, pushed))
    if push_error:
        raise PipelineFailed(f"every stage completed, but {push_error}")
    return outcome.done


# ---------------------------------------------------------------- the flow run's Markdown artifact
# (its Markdown: mergeflow.runner.run_summary)
SUMMARY_ARTIFACT_KEY = "mergeflow-summary"


def publish_summary(markdown: str) -> None:
    """Publish the flow run's Markdown artifact (key mergeflow-summary). Failing to publish is a warning: the
    stages' work is done and recorded either way."""
    from prefect.artifacts import create_markdown_artifact

    try:
        create_markdown_artifact(
            markdown=markdown,
            key=SUMMARY_ARTIFACT_KEY,
            description="mergeflow: what this flow run did, its results and MLflow run",
        )
    except Exception as err:  # noqa: BLE001 - see above
        get_run_logger().warning("could not publish the %s artifact: %s", SUMMARY_ARTIFACT_KEY, err)


def _stop(signum, frame):
    """SIGTERM or SIGINT: stop the running stages; the flow then fails on them and ends (a second signal kills)."""
    signal.signal(signum, signal.SIG_DFL)
    stopped = stop_stages()
    print(f"mergeflow: {signal.Signals(signum).name}: stopped {stopped} running stages", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description="Run the mergeflow pipeline with Prefect.")
    add_run_arguments(parser, "set a parameter in params.yaml first, as dvc exp run -S does (repeatable)")
    args = parser.parse_args(argv)
    try:  # bad input gets its one line here, before Prefect starts (the flow checks again: deployments start there)
        check_runner(args.runner, args.dask_address, args.worker_checkouts)
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
            pipeline(
                root=args.root,
                workers=args.workers,
                overrides=args.overrides,
                runner=args.runner,
                dask_address=args.dask_address,
                worker_checkouts=args.worker_checkouts,
            )
        except BaseException as err:  # noqa: BLE001 - handed to the main thread
            outcome["error"] = err

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    watch_children()  # Prefect's ephemeral server (and the stage server) end with this process, even SIGKILLed
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
