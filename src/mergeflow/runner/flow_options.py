"""The Prefect flows' runner options (flows.pipeline and flows.serve take them): where stages run (--runner), an
existing Dask cluster (--dask-address), worker checkouts, each refused in one line; and the flows' parser, whose bad
argument is one line too."""

from __future__ import annotations

import argparse
from typing import Literal

from mergeflow.core.errors import MergeflowError
from mergeflow.runner.arguments import check_dask_imports, probe_dask_scheduler, workers_argument

Runner = Literal["thread", "dask"]
RUNNERS: tuple[str, ...] = ("thread", "dask")


def check_runner(runner: str, dask_address: str | None = None, worker_checkouts: bool = False) -> None:
    """Refuse an unknown runner, or a Dask address or worker checkouts without the Dask runner or prefect-dask
    (one line each)."""
    if runner not in RUNNERS:
        raise MergeflowError(f"unknown runner {runner!r}: choose one of {', '.join(RUNNERS)}")
    if dask_address and runner != "dask":
        raise MergeflowError(f"a Dask scheduler address ({dask_address}) needs --runner dask")
    if worker_checkouts and runner != "dask":
        raise MergeflowError("worker checkouts need --runner dask")
    if runner == "dask":
        try:
            import prefect_dask  # noqa: F401
        except ImportError:
            raise MergeflowError("--runner dask needs prefect-dask (pip install prefect-dask)") from None
        if dask_address:  # an unreachable scheduler: one line now, not Dask's traceback after its retries
            probe_dask_scheduler(dask_address)
            check_dask_imports(dask_address)  # and one that cannot unpickle the stages: one line, not ten failures


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad argument is the project's one line, ``error: <what>``, and exit status 2 (argparse's
    own prints the usage first, over several lines)."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (--help lists the options)\n")


def add_run_arguments(parser: argparse.ArgumentParser, set_help: str) -> None:
    """What a flow run takes, on ``parser``: --root, --workers, -S KEY=VALUE (``set_help``) and the runner's."""
    parser.add_argument("--root", default=".", help="repository root holding dvc.yaml (default: .)")
    parser.add_argument(
        "--workers",
        type=workers_argument,
        default=None,
        help="stages at once (default: one per GPU, else one per CPU core)",
    )
    parser.add_argument(
        "-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=set_help
    )
    add_runner_arguments(parser)


def add_runner_arguments(parser: argparse.ArgumentParser) -> None:
    """--runner, --dask-address and --worker-checkouts, on ``parser``."""
    parser.add_argument(
        "--runner",
        choices=RUNNERS,
        default="thread",
        help="where stages run: a thread pool here (default) or a Dask cluster",
    )
    parser.add_argument(
        "--dask-address",
        default=None,
        metavar="tcp://HOST:PORT",
        help="with --runner dask: an existing cluster's scheduler (default: a LocalCluster of --workers processes)",
    )
    parser.add_argument(
        "--worker-checkouts",
        action="store_true",
        help="with --runner dask: each worker runs stages in a checkout of its own, inputs and outputs moved by the "
        "DVC remote (no shared file system)",
    )
