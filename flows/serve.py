"""Schedule the pipeline: register it as a Prefect deployment with a schedule and serve it from this process
(``mergeflow serve --cron "0 3 * * *"``, or ``python -m flows.serve``), built on ``Flow.serve``.

Every scheduled (or manual) run is a run of flows.pipeline's flow on the repository at ``--root``: stale stages
run, the rest are skipped, and a run that finds nothing stale ends in seconds with "nothing to do". The
deployment has a concurrency limit of 1: a run that comes due while another runs waits for it (both would write
dvc.lock; the second would also be refused DVC's repository lock). Stop serving with Ctrl-C or SIGTERM: the
schedule is paused. The production way, a work pool and a worker, is prefect.yaml (docs/scaling.md).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

DEPLOYMENT = "scheduled"


def _parser() -> argparse.ArgumentParser:
    from mergeflow.runner.flow_options import OneLineParser, add_run_arguments

    parser = OneLineParser(
        prog="mergeflow serve",
        description="Register the pipeline as a Prefect deployment with a "
        "schedule and serve it (runs come due while this runs).",
    )
    when = parser.add_mutually_exclusive_group()
    when.add_argument("--cron", metavar="EXPR", help='a cron schedule, e.g. "0 3 * * *" (every day at 03:00)')
    when.add_argument("--interval", type=float, metavar="SECONDS", help="a run every SECONDS seconds")
    parser.add_argument(
        "--timezone", default=None, help="the cron schedule's time zone, e.g. Europe/Berlin (default: UTC)"
    )
    parser.add_argument(
        "--name",
        default=DEPLOYMENT,
        help=f"the deployment's name (default: {DEPLOYMENT}; runs as mergeflow-pipeline/NAME)",
    )
    add_run_arguments(parser, "a parameter every run sets in params.yaml first, as dvc exp run -S does (repeatable)")
    return parser


def deployment_parameters(
    root: str,
    workers: int | None,
    runner: str,
    overrides: list[str],
    dask_address: str | None,
    worker_checkouts: bool = False,
) -> dict:
    """The deployment's default parameters (a run started from the UI or API may change any of them)."""
    return {
        "root": str(Path(root).resolve()),
        "workers": workers,
        "runner": runner,
        "overrides": list(overrides),
        "dask_address": dask_address,
        "worker_checkouts": worker_checkouts,
    }


def _sigterm_like_ctrl_c() -> None:
    """SIGTERM (kill, systemd, docker stop) stops serving as Ctrl-C does. Prefect 3.8's own SIGTERM handler exits
    before its deployment is paused (Runner.handle_sigterm: the shutdown coroutine is never awaited), so the
    schedule would go on making runs that no one serves; Ctrl-C's way pauses it, then ends the runs in progress."""
    from prefect.runner import Runner

    def handle_sigterm(self, *args) -> None:
        self._logger.info("SIGTERM received: stopping as on Ctrl-C")
        signal.raise_signal(signal.SIGINT)  # asyncio's SIGINT handler cancels the runner, which then pauses

    Runner.handle_sigterm = handle_sigterm
    # asyncio.run handles SIGINT only where it is not ignored, as a shell ignores it for a background job
    signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
    from prefect.client.schemas.schedules import construct_schedule

    from mergeflow.runner.checks import check_project
    from mergeflow.params import apply_overrides
    from mergeflow.core.errors import MergeflowError
    from mergeflow.runner.arguments import check_schedule
    from mergeflow.runner.graph import check_repo
    from flows.pipeline import pipeline
    from mergeflow.runner.flow_options import check_runner

    try:  # the same checks as a run's, once now: a deployment that would fail every night is refused here
        check_runner(args.runner, args.dask_address)
        check_repo(args.root)
        check_project(args.root)
        if args.overrides:
            apply_overrides(os.path.join(args.root, "params.yaml"), args.overrides, write=False)
        check_schedule(args.cron, args.interval)
        schedule = None
        if args.cron is not None or args.interval is not None:
            schedule = construct_schedule(cron=args.cron, interval=args.interval, timezone=args.timezone)
    except MergeflowError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_status
    except ValueError as err:  # a cron expression or time zone the schedule refuses (pydantic's ValidationError)
        reasons = (
            [e["msg"].removeprefix("Value error, ") for e in err.errors()] if hasattr(err, "errors") else [str(err)]
        )
        print(f"error: {'; '.join(reasons)}", file=sys.stderr)
        return 2
    _sigterm_like_ctrl_c()
    pipeline.serve(
        name=args.name,
        schedules=[schedule] if schedule else None,
        parameters=deployment_parameters(
            args.root, args.workers, args.runner, args.overrides, args.dask_address, args.worker_checkouts
        ),
        # one run at a time; a run that comes due while another runs waits for it
        global_limit=ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE),
        tags=["mergeflow"],
        description="The mergeflow pipeline: every stale stage of dvc.yaml, each committed to dvc.lock as it finishes.",
        pause_on_shutdown=True,
    )
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # flows and tasks, whatever the working directory
    sys.exit(main())
