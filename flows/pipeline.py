"""Prefect flow: the whole pipeline, stage by stage as dvc.yaml defines it (``python -m flows.pipeline``).

Independent stages (the per-task fine-tunes, the per-method merges) run concurrently; up-to-date stages are
skipped; failed stages retry. Without PREFECT_API_URL it runs on an ephemeral Prefect server.
"""

from __future__ import annotations

import argparse
import os

# the ephemeral server's telemetry write can collide with the flow's first writes to its SQLite database
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# a first start (fresh PREFECT_HOME: migrations; fresh venv: bytecode) can outlast Prefect's 20 s default
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner

from mergeflow.orchestration import check_repo, stage_graph, stage_threads, stale_stages
from tasks.stages import run_stage_task


def default_workers() -> int:
    import torch

    return 1 if torch.cuda.is_available() else max(1, os.cpu_count() or 1)


@flow(name="mergeflow-pipeline", task_runner=ThreadPoolTaskRunner(max_workers=default_workers()))
def pipeline(root: str = ".", workers: int | None = None) -> list[str]:
    logger = get_run_logger()
    check_repo(root)
    nodes = stage_graph(root)
    stale = stale_stages(root, nodes)
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
    return [f.result()["stage"] for f in futures.values()]


def main() -> None:
    parser = argparse.ArgumentParser(description="Run the mergeflow pipeline with Prefect.")
    parser.add_argument("--root", default=".", help="repository root holding dvc.yaml (default: .)")
    parser.add_argument("--workers", type=int, default=None, help="stages at once (default: CPU cores; 1 on a GPU)")
    args = parser.parse_args()
    workers = args.workers or default_workers()
    pipeline.with_options(task_runner=ThreadPoolTaskRunner(max_workers=workers))(root=args.root, workers=workers)


if __name__ == "__main__":
    main()
