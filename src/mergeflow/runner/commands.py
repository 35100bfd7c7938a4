"""What the ``mergeflow`` command's commands do with their parsed arguments (mergeflow.cli parses them): the
methods and regimes listings, plan, compare, remote, reproduce, verify, check and repro, the MLflow UI; a stage
command runs in runner.stage_command."""

from __future__ import annotations

import argparse
import os
import sys

from mergeflow.core.errors import MergeflowError
from mergeflow.runner.listings import print_methods, print_regimes
from mergeflow.runner.stage_command import run_stage


def _methods(args: argparse.Namespace) -> int:
    if args.list:
        from mergeflow.ml.merging import REGISTRY
        from mergeflow.params import load_params

        tasks = len(load_params(args.params).suite.tasks)
        print(f"[{','.join(sorted(name for name, m in REGISTRY.items() if m.tasks in (None, tasks)))}]")
        return 0
    return print_methods(args.params)


def _plan(args: argparse.Namespace) -> int:
    from mergeflow.runner.plan import print_plan

    return print_plan(
        args.params, include_all=args.all, as_json=args.json, remeasure=args.remeasure, calibration=args.calibration
    )


def _compare(args: argparse.Namespace) -> int:
    from mergeflow.runner.compare import compare, compare_leaderboards

    if args.revisions:
        if len(args.revisions) != 2:
            raise MergeflowError(
                f"compare: two revisions or none, not {len(args.revisions)} ({' '.join(args.revisions)})"
            )
        print(compare_leaderboards(*args.revisions))
        return 0
    print(compare(args.metric, args.all, args.md))
    return 0


def _remote(args: argparse.Namespace) -> int:
    from mergeflow.runner.remote import add_remote, default_remote

    if args.remote_command == "add":
        remote = add_remote(args.url, args.name, args.endpoint_url)
        print(
            f"default remote: {remote}, in .dvc/config (commit it); `dvc "
            "push` sends the run's outputs there, `dvc pull` restores them"
        )
    else:
        remote = default_remote()
        print(
            f"default remote: {remote}"
            if remote
            else "no DVC remote: the outputs live in this machine's cache only (`mergeflow remote add URL`)"
        )
    return 0


def _reproduce(args: argparse.Namespace) -> int:
    from mergeflow.runner.reproduce import reproduce

    report = reproduce(".", args.stages or None, args.tolerance, args.scratch)
    if failures := report.failures():
        expected = "the same bytes expected" if report.expect_bytes else f"tolerance {report.tolerance:g} points"
        print(
            f"error: not reproduced ({expected}): {'; '.join(failures[:8])}{'; ...' if len(failures) > 8 else ''}",
            file=sys.stderr,
        )
        return 1
    print(
        f"ok: {'every output the same bytes, ' if report.expect_bytes else ''}every "
        f"metric within {report.tolerance:g} points"
    )
    return 0


def _verify(args: argparse.Namespace) -> int:
    from mergeflow.runner.verify import verify

    print(verify("."))
    return 0


def _lost_track_notice() -> bool:
    """Whether MLflow's store lost track's runs (they are logged again), saying so."""
    from pathlib import Path

    from mergeflow.core.mlflow_store import tracked_runs_lost

    if lost := tracked_runs_lost(Path.cwd()):
        print(f"track: {lost}: logging every stage to MLflow again")
    return bool(lost)


def _check_or_repro(args: argparse.Namespace) -> int:
    from mergeflow.runner.checks import check_project

    params, notices = check_project(".", args.params)
    for notice in notices:
        print(f"warning: {notice}", file=sys.stderr)
    if args.command == "check":
        print(
            f"ok: {args.params} and dvc.yaml checked ({len(params.suite.tasks)} "
            f"tasks, {len(params.merge.methods)} methods)"
        )
        return 0
    from dvc.cli import main as dvc_main

    from mergeflow.core.lockfile import atomic_dvc_writes
    from mergeflow.runner.stage_server import SERVER_ENV, running_server

    if not args.dvc_args:  # the whole pipeline, stages at once (the scheduler starts the stage servers)
        from mergeflow.runner.scheduler import repro

        force = {"track"} if _lost_track_notice() else set()
        with atomic_dvc_writes():
            return repro(".", args.workers, force)
    # the stages fork from one process that has imported torch and timm (seconds saved a stage)
    with atomic_dvc_writes(), running_server() as address:
        if address:
            os.environ[SERVER_ENV] = address
        status = dvc_main(["repro", *args.dvc_args])
        if (
            status == 0 and not [a for a in args.dvc_args if not a.startswith("-")] and _lost_track_notice()
        ):  # the whole pipeline
            status = dvc_main(["repro", "--force", "--single-item", "track"])
        return status


def _merge_checkpoints(args: argparse.Namespace) -> int:
    from mergeflow.pipeline.checkpoint_merge import merge_checkpoints, parse_options, read_config

    given = {"--method": args.method, "--base": args.base, "CHECKPOINT": args.finetuned, "--output": args.output}
    if args.config:
        if any(given.values()) or args.set or args.max_shard_size:
            raise MergeflowError(f"merge-checkpoints: --config {args.config} says everything; give it alone")
        merge = read_config(args.config)
    else:
        missing = [name for name, value in given.items() if not value]
        if missing:
            raise MergeflowError(f"merge-checkpoints: {missing[0]} is required (or --config FILE)")
        merge = {"method": args.method, "base": args.base, "models": args.finetuned, "output": args.output}
        merge["options"] = parse_options(args.set)
        merge["max_shard_size"] = args.max_shard_size
    record = merge_checkpoints(
        merge["method"],
        merge["base"],
        merge["models"],
        merge["options"],
        merge["output"],
        max_shard_size=merge["max_shard_size"],
    )
    options = ", ".join(f"{k}={v}" for k, v in sorted(record["options"].items()))
    n = len(record["finetuned"])
    print(f"{merge['output']}: {record['method']} of {n} fine-tunes onto {record['base']} ({options})")
    return 0


# every command but the stages (core.stage_table: run_stage runs each) and serve (main hands it to flows.serve)
COMMANDS = {
    "methods": _methods,
    "regimes": lambda args: print_regimes(args.params),
    "ui": lambda args: mlflow_ui(args.port, args.host),
    "plan": _plan,
    "compare": _compare,
    "remote": _remote,
    "reproduce": _reproduce,
    "verify": _verify,
    "check": _check_or_repro,
    "repro": _check_or_repro,
    "merge-checkpoints": _merge_checkpoints,
}


def run_command(args: argparse.Namespace) -> int:
    """The command ``args`` names, run: its exit status."""
    return COMMANDS.get(args.command, run_stage)(args)


def mlflow_ui(port: int, host: str) -> int:
    """``mlflow ui`` on the store ``track`` logs to, so that the Prefect summary artifact's link opens."""
    from pathlib import Path

    from mergeflow.config.environment import mlflow_ui_port
    from mergeflow.core.mlflow_store import relative_artifact_paths
    from mergeflow.report.tracking import tracking_uri
    from mergeflow.runner.ui import serve

    relative_artifact_paths(Path.cwd())  # a workspace moved since its last track keeps its artifacts
    return serve(
        tracking_uri(Path.cwd()), host, mlflow_ui_port() if port is None else port
    )  # the port track's and the Prefect summary's links name
