"""Prefect task: run one stage of dvc.yaml, and log what it printed. All logic lives in mergeflow.runner
(running, gpus)."""

import sys
import time

from prefect import get_run_logger, task

from mergeflow.runner.checkouts import Source, run_in_checkout
from mergeflow.core.devices import RUN_GPUS_ENV
from mergeflow.runner.gpus import process_device_pool
from mergeflow.runner.graph import StageNode
from mergeflow.runner.running import (
    StageFailed,
    completed_line,
    last_lines,
    quiet_failure_tracebacks,
    resume_stages,
    run_stage,
    stop_stages,
    stopping,
)
from mergeflow.runner.stage_server import served_env

quiet_failure_tracebacks()  # here too: a Dask worker imports this module, not the flow's


def _retry_if_transient(task, task_run, state) -> bool:
    """Retry a stage killed by a signal or failing with status 75 (StageFailed.transient); never bad input (2) or
    an unexpected error (1), which fail the same way again. Failures outside the stage (launching it) retry."""
    try:
        state.result()
    except StageFailed as err:
        return err.transient
    except Exception:
        return True
    return False


def dask_worker_index() -> int | None:
    """This process's number when it is a worker of a Dask LocalCluster (named 0, 1, ...), else None."""
    if "distributed" not in sys.modules:  # never imported: not a Dask worker
        return None
    from distributed import get_worker

    try:
        name = get_worker().name
    except ValueError:
        return None
    return name if isinstance(name, int) else None


# the flow run whose stop (stop_worker_stages) this process has seen, on a worker of an existing Dask cluster
_stopped_flow_run: str | None = None


def stop_worker_stages(flow_run_id: str) -> int:
    """On a Dask worker (Client.run), when flow run ``flow_run_id`` is stopped: stop the stages this worker runs
    and start no more of that run's. Returns how many were running."""
    global _stopped_flow_run
    _stopped_flow_run = flow_run_id
    return stop_stages()


@task(retries=2, retry_delay_seconds=2, retry_condition_fn=_retry_if_transient, task_run_name="{node.address}")
def run_stage_task(
    node: StageNode,
    root: str,
    env: dict[str, str],
    gpus: list[str] | None = None,
    gpu_workers: int | None = None,
    source: Source | None = None,
    servers: dict[str, str | None] | None = None,
) -> dict:
    """Run one stage. With ``gpus``, the stage gets one of them to itself (CUDA_VISIBLE_DEVICES) from this
    process's pool, waiting while every one is taken; on a Dask LocalCluster of ``gpu_workers`` workers each
    worker hands out its own share of them, and the stage forks from that GPU's stage server where ``servers``
    names one (mergeflow.runner.stage_server.running_servers). With ``source``, it runs in this worker's own checkout of
    it, its inputs and outputs moved by the DVC remote (mergeflow.runner.checkouts)."""
    logger = get_run_logger()
    worker = dask_worker_index()
    if stopping() and _stopped_flow_run not in (None, env.get("PREFECT__FLOW_RUN_ID")):
        resume_stages()  # a long-lived Dask worker: an earlier flow run was stopped, not this one
    started = time.monotonic()
    with process_device_pool(gpus, gpu_workers, worker).lease() as device_env:
        if device_env:
            logger.info("%s runs on GPU %s", node.address, device_env["CUDA_VISIBLE_DEVICES"])
        try:
            # the stage's threads: the cores' share of one GPU (Params.stage_share)
            stage_env = (
                env | served_env(device_env, servers) | ({RUN_GPUS_ENV: str(len(gpus))} if device_env and gpus else {})
            )
            if source is None:
                result = run_stage(node, root, stage_env)
            else:
                result = run_in_checkout(node, source, stage_env)
                root = result["checkout"]
        except StageFailed as err:
            seconds = time.monotonic() - started
            kind = " (bad input)" if err.bad_input else " (transient)" if err.transient else ""
            logger.error(
                "%s failed after %.1f s with exit status %d%s: %s",
                node.address,
                seconds,
                err.returncode,
                kind,
                err.tail,
            )
            if (last := last_lines(err.output)) != err.tail:  # more than its error line
                logger.error("%s output (last lines):\n%s", node.address, last)
            raise
    if source is not None:
        logger.info("%s ran in the checkout %s", node.address, root)
    logger.info("%s", completed_line(node, root, time.monotonic() - started))
    if last := last_lines(result["stdout"]):
        logger.info("%s output (last lines):\n%s", node.address, last)
    if last := last_lines(result["stderr"]):
        logger.info("%s stderr (last lines):\n%s", node.address, last)
    return result
