"""mergeflow: run one stage of the model-merging pipeline, check the project, or list the merging methods.

Under DVC and the Prefect flow a stage takes its task or method from DVC_STAGE (finetune@<task>, merge@<method>),
so no name from params.yaml is ever pasted into a shell command. Bad input or configuration prints one line,
``error: <what, where>``, and exits with status 2; a transient failure exits with status 75 (see mergeflow.errors).
"""

from __future__ import annotations

import argparse
import os
import sys

from mergeflow import __version__
from mergeflow.errors import MergeflowError, TransientError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mergeflow", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"mergeflow {__version__}")
    parser.add_argument("--params", default="params.yaml", help="the configuration file (default: params.yaml)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("prepare", help="generate or convert every task's data and the pretraining corpus")
    sub.add_parser("pretrain", help="pretrain the backbone on the corpus, or load real pretrained weights")
    sub.add_parser("finetune", help="linear probe, then fine-tune the backbone on one task").add_argument(
        "--task", help="one of suite.tasks (default: from DVC_STAGE=finetune@<task>, as DVC and the flow set it)"
    )
    sub.add_parser("vectors", help="task vectors and their statistics")
    sub.add_parser("merge", help="merge with one method (hyperparameters chosen on validation), then test it on every task").add_argument(
        "--method", help="one of merge.methods (default: from DVC_STAGE=merge@<method>, as DVC and the flow set it)"
    )
    sub.add_parser("report", help="summary table and bar chart")
    sub.add_parser("track", help="record the pipeline's outputs in MLflow")
    sub.add_parser("methods", help="list every registered merging method")
    sub.add_parser("check", help="validate params.yaml and what dvc.yaml takes from it; restore a cut-short dvc.lock")
    sub.add_parser("repro", help="`mergeflow check`, then `dvc repro [ARGS]` (any of its options) with dvc.lock written atomically")
    sub.add_parser("serve", add_help=False, help="schedule the pipeline: a Prefect deployment served from here (--cron EXPR or --interval SECONDS; serve --help)")
    return parser


def _stage_item(given: str | None, stage: str, what: str) -> str:
    """The task or method a stage runs on: the option, else DVC_STAGE's '<stage>@<name>'."""
    if given is not None:
        return given
    address = os.environ.get("DVC_STAGE", "")
    prefix, _, name = address.partition("@")
    if prefix != stage or not name:
        raise MergeflowError(f"{stage}: no --{what} given, and DVC_STAGE ({address or 'unset'}) is not {stage}@<{what}>")
    return name


def run_command(args: argparse.Namespace) -> int:
    if args.command == "methods":
        from mergeflow.merging import REGISTRY

        for name in sorted(REGISTRY):
            print(REGISTRY[name].describe())
        return 0
    if args.command in ("check", "repro"):
        from mergeflow.checks import check_project

        params, notices = check_project(".", args.params)
        for notice in notices:
            print(f"warning: {notice}", file=sys.stderr)
        if args.command == "check":
            print(f"ok: {args.params} and dvc.yaml checked ({len(params.suite.tasks)} tasks, {len(params.merge.methods)} methods)")
            return 0
        from dvc.cli import main as dvc_main

        from mergeflow.lockfile import atomic_dvc_writes

        with atomic_dvc_writes():
            return dvc_main(["repro", *args.dvc_args])

    from mergeflow import stages
    from mergeflow.config import load_params
    from mergeflow.orchestration import die_with_parent

    die_with_parent()
    from mergeflow.io import sweep_temporaries

    sweep_temporaries(stages.Layout().output_roots)  # what interrupted writes left (of processes now gone)

    params = load_params(args.params)
    if args.command == "track":
        from mergeflow.tracking import track

        track(params)
    elif args.command == "finetune":
        stages.finetune(params, _stage_item(args.task, "finetune", "task"))
    elif args.command == "merge":
        stages.merge(params, _stage_item(args.method, "merge", "method"))
    else:
        getattr(stages, args.command)(params)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, args.dvc_args = parser.parse_known_args(argv)
    if args.command == "serve":  # its options are flows.serve's (the Prefect flow lives in the repository, not in the package)
        sys.path.insert(0, os.getcwd())
        try:
            from flows.serve import main as serve
        except ImportError:
            print("error: mergeflow serve runs from the repository root (where flows/ and dvc.yaml are)", file=sys.stderr)
            return 2
        return serve(args.dvc_args)
    if args.dvc_args and args.command != "repro":
        parser.error(f"unrecognized arguments: {' '.join(args.dvc_args)}")
    try:
        return run_command(args)
    except MergeflowError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_status
    except MemoryError:
        err = TransientError("out of memory (other stages may hold it: run fewer at once with --workers)")
        print(f"error: {err}", file=sys.stderr)
        return err.exit_status
    except RuntimeError as err:
        if type(err).__name__ != "OutOfMemoryError":  # torch's, for a GPU's memory
            raise
        print(f"error: {TransientError('out of GPU memory (other stages may hold it: run fewer at once with --workers)')}", file=sys.stderr)
        return TransientError.exit_status
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
