"""``mergeflow <stage>``: one sub-command per pipeline stage, each a thin call into ``mergeflow.stages``.

Errors in the input or configuration print one line, ``error: <what, where>``, and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys

from mergeflow.errors import MergeflowError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mergeflow", description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml", help="the configuration file (default: params.yaml)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("prepare", help="generate or convert every task's data and the pretraining corpus")
    sub.add_parser("pretrain", help="pretrain the backbone on the corpus, or load real pretrained weights")
    sub.add_parser("finetune", help="linear probe, then fine-tune the backbone on one task").add_argument("--task", required=True)
    sub.add_parser("vectors", help="task vectors and their statistics")
    sub.add_parser("merge", help="merge with one method (hyperparameters chosen on validation), then test it on every task").add_argument("--method", required=True)
    sub.add_parser("report", help="summary table and bar chart")
    sub.add_parser("track", help="record the pipeline's outputs in MLflow")
    sub.add_parser("methods", help="list every registered merging method")
    return parser


def run_command(args: argparse.Namespace) -> None:
    if args.command == "methods":
        from mergeflow.merging import REGISTRY

        for name in sorted(REGISTRY):
            print(REGISTRY[name].describe())
        return

    from mergeflow import stages
    from mergeflow.config import load_params

    params = load_params(args.params)
    if args.command == "track":
        from mergeflow.tracking import track

        track(params)
    elif args.command in ("finetune",):
        stages.finetune(params, args.task)
    elif args.command == "merge":
        stages.merge(params, args.method)
    else:
        getattr(stages, args.command)(params)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        run_command(args)
    except MergeflowError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
