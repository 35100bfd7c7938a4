"""The ``mergeflow`` command: one stage of the model-merging pipeline, the project check, the methods, the MLflow UI.

Under DVC and the Prefect flow a stage takes its task or method from DVC_STAGE (finetune@<task>, merge@<method>),
so no name from params.yaml is ever pasted into a shell command. Bad input or configuration prints one line,
``error: <what, where>``, and exits with status 2; a transient failure exits with status 75 (see mergeflow.core.errors).

This module parses the command line; what each command then does is mergeflow.runner.commands' (a stage's,
mergeflow.runner.stage_command's).
"""

from __future__ import annotations

import argparse
import os
import sys

from mergeflow import __version__
from mergeflow.core.errors import MergeflowError, TransientError
from mergeflow.core.stage_table import STAGES
from mergeflow.runner.commands import run_command


DESCRIPTION = """Model merging, end to end: fine-tune one backbone per task, merge the task vectors with each
method, evaluate and compare them. Each pipeline stage is a command; DVC or Prefect runs them."""
EPILOG = """common commands (from the repository root):
  mergeflow check                 validate params.yaml and what dvc.yaml takes from it
  mergeflow repro                 run the stale stages, checked first, two at once on 2 cores
  python -m flows.pipeline        the same with Prefect: stages at once, a summary artifact
  mergeflow plan                  which stages will run, each one's estimated time and memory here
  mergeflow verify                hash every output again: name each file whose bytes changed
  mergeflow reproduce             re-run pretrain, a fine-tune and a merge: dvc.lock's bytes again?
  mergeflow methods               the methods: grids params.yaml sets, beside the papers' defaults
  mergeflow regimes               the training-time regimes and studies params.yaml runs
  mergeflow ui                    the MLflow UI on what `track` logged (http://127.0.0.1:5000)
  mergeflow merge --method ties   one stage by hand (DVC and the flow run each stage so)

Bad input or configuration prints one line, "error: <what, where>", and exits with status 2; a
transient failure exits with status 75. `mergeflow COMMAND --help` describes each command."""


def _command_of(argv: list[str]) -> str | None:
    """The subcommand on the line (the first word that is not an option or --params' value), without parsing."""
    words = iter(argv)
    for word in words:
        if word == "--params":
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def _configured(argv: list[str]) -> tuple[str, object | None]:
    """The params file the command line names, and its Params, or None when it does not load: help must work
    with a broken or missing params.yaml (then it lists no tasks and marks no methods)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--params", default="params.yaml")
    path = pre.parse_known_args(argv)[0].params
    try:
        from mergeflow.params import load_params

        return path, load_params(path)
    except Exception:  # noqa: BLE001 - any failure only means no choices to list; the command itself reports it
        return path, None


def _choices(argv: list[str]) -> tuple[str, str, str]:
    """Help for finetune's --task, merge's --method and study's NAME: the names params.yaml and the registries
    give. Only those three commands' help pays for reading them: running a stage, `--help` and `--version` read
    nothing."""
    if _command_of(argv) not in ("finetune", "merge", "study") or not {"-h", "--help"} & set(argv):
        return (
            "a task of suite.tasks",
            "a method of merge.methods (`mergeflow methods` lists them)",
            "a study of studies.run (`mergeflow regimes` lists them)",
        )
    from mergeflow.ml.merging import REGISTRY
    from mergeflow.studies import REGISTRY as STUDIES

    path, params = _configured(argv)
    tasks = (
        f"one of {', '.join(params.suite.tasks)} (suite.tasks in {path})"
        if params
        else f"a task of suite.tasks in {path} ({path} did not load: none listed)"
    )
    running = set(params.merge.methods) if params else set()
    methods = ", ".join(f"{m}*" if m in running else m for m in sorted(REGISTRY))
    methods_help = f"one of {methods}" + (
        f" (* = in merge.methods of {path})" if running else f" ({path} did not load: merge.methods not marked)"
    )
    studying = set(params.studies.run) if params else set()
    studies = ", ".join(f"{s}*" if s in studying else s for s in sorted(STUDIES))
    studies_help = f"one of {studies}" + (f" (* = in studies.run of {path})" if studying else "")
    return tasks, methods_help, studies_help


def _add_stage_commands(sub, argv: list[str]) -> None:
    """A command per stage of the stage table, its task, method or study an option or argument (help lists
    the choices params.yaml and the registries give)."""
    tasks, methods_help, studies_help = _choices(argv)
    items = {
        "task": tasks,
        "method": methods_help,
        "name": studies_help,
    }  # the choices params.yaml and the registries give
    for stage in STAGES.values():
        command = sub.add_parser(stage.name, help=stage.help, description=stage.description)
        if item := stage.item:
            given = items.get(item.option, f"one of {item.params_list} in params.yaml")
            text = (
                f"{item.what}: {given}; default: from "
                f"DVC_STAGE={stage.name}@<{item.option}>, as DVC and the flow set it"
            )
            command.add_argument(
                *([item.option] if item.positional else [f"--{item.option}"]),
                **({"nargs": "?"} if item.positional else {}),
                metavar=item.option.upper(),
                help=text,
            )


def _add_listing_commands(sub) -> None:
    """What params.yaml runs and what a run would take: regimes, methods, plan."""
    sub.add_parser(
        "regimes",
        help="the training-time regimes and studies: what params.yaml runs, and each regime's variants",
        description="Every registered training-time regime (its paper and defaults) with the variants and merge "
        "methods params.yaml runs, and every study.",
    )
    methods = sub.add_parser(
        "methods",
        help="the merging methods: the grids params.yaml makes effective beside the papers' defaults",
        description="Every registered merging method: the hyperparameters and grids params.yaml makes effective, "
        "beside the paper's defaults; * marks the methods merge.methods runs.",
    )
    methods.add_argument(
        "--list",
        action="store_true",
        help="only the names of every method that can merge params.yaml's tasks (SLERP takes two), as the list "
        'merge.methods takes: dvc exp run -S "merge.methods=$(mergeflow methods --list)" runs them all',
    )
    plan = sub.add_parser(
        "plan",
        help="which stages will run, each one's estimated time and peak memory on this device, and the total",
        description="Which stages of dvc.yaml will run (out of date) and which are up to date, with each one's "
        "estimated wall time and peak memory on runtime.device (measured in seconds on the backbone's "
        "architecture, then kept per machine under ~/.cache/mergeflow/runner/plan), and the total; stages whose "
        "peak exceeds the machine's memory are flagged (mergeflow.runner.plan).",
    )
    plan.add_argument("--all", action="store_true", help="estimate every stage, up to date or not")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument(
        "--remeasure",
        action="store_true",
        help="measure this device's throughput again instead of reading this machine's cached one",
    )
    plan.add_argument(
        "--calibration",
        metavar="JSON",
        help="estimate from a GPU benchmark's figures (python bench/gpu.py "
        "--json JSON on that machine) instead of measuring here",
    )


def _add_checking_commands(sub) -> None:
    """The outputs and the configuration checked, and the stale stages run: verify, reproduce, check, repro."""
    sub.add_parser(
        "verify",
        help="hash every output dvc.lock records again from its bytes; name each file that changed or is missing",
        description="Hash every output dvc.lock records again, reading every byte (DVC itself trusts "
        "a file whose size and mtime are unchanged), and name each file that changed, is "
        "missing or was added to a folder output: exit status 2 if any. The Prefect flow "
        "runs it before its stages and re-runs the stages whose outputs changed.",
    )
    reproduce = sub.add_parser(
        "reproduce",
        help="re-run chosen stages in a scratch copy: same bytes as "
        "dvc.lock? each headline metric beside its recorded value",
        description="Re-run STAGES (default: the pretraining, the first task's fine-tune and one merge) in a scratch "
        "copy of this workspace, with whatever upstream stages the copy lacks, and print for each output whether "
        "its bytes are the ones dvc.lock records, and for each headline metric the recorded value, the re-run's "
        "and the difference; where bytes differ, the machine that wrote them beside this one. Exit status 1 past "
        "the tolerance: any other bytes when the deterministic mode on the CPU wrote them and runs here, else a "
        "metric that moved more than --tolerance points.",
    )
    reproduce.add_argument(
        "stages", nargs="*", metavar="STAGE", help="stages to re-run (finetune@digits, merge@ties, ...)"
    )
    reproduce.add_argument(
        "--tolerance",
        type=float,
        default=None,
        metavar="POINTS",
        help="the largest accepted change of a test accuracy, in points "
        "(default: 0 where the same bytes are expected, else 3)",
    )
    reproduce.add_argument(
        "--scratch", metavar="DIR", help="re-run in DIR and keep it (default: a temporary folder, removed after)"
    )
    sub.add_parser(
        "check",
        help="validate params.yaml and what dvc.yaml takes from it; restore a cut-short dvc.lock",
        description="Validate params.yaml in full and what dvc.yaml takes from it; restore a cut-short dvc.lock.",
    )
    repro = sub.add_parser(
        "repro",
        help="`mergeflow check`, then every stale stage, several at once (or `dvc repro ARGS`)",
        description="`mergeflow check`, then every stale stage of dvc.yaml, --workers at once as the cores allow, each "
        "recorded in dvc.lock as it completes. With any of dvc repro's options or stage names, `dvc repro ARGS` "
        "runs instead, one stage at a time. dvc.lock is written atomically either way.",
        usage="mergeflow repro [-h] [--workers N] [DVC_REPRO_ARGS ...]",
    )
    from mergeflow.runner.arguments import workers_argument  # no torch

    repro.add_argument(
        "--workers",
        type=workers_argument,
        default=None,
        metavar="N",
        help="stages at once (default: one per GPU, each stage a GPU to itself; else one per CPU core)",
    )


def _add_result_commands(sub) -> None:
    """The results looked at, shared and scheduled: ui, compare, remote, serve."""
    ui = sub.add_parser(
        "ui",
        help="the MLflow UI on the store `track` logs to (opens the Prefect summary's link)",
        description="Run `mlflow ui` on the store `track` logs to (mlflow.db here, or MLFLOW_TRACKING_URI); the link "
        "in the Prefect flow's summary artifact opens there.",
    )
    ui.add_argument(
        "--port",
        type=int,
        default=None,
        help="port to serve on (default: MERGEFLOW_MLFLOW_UI's port, else "
        "5000: where track's and the Prefect summary's links point)",
    )
    ui.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    compare = sub.add_parser(
        "compare",
        help="DVC experiments side by side (a column each: the parameters and "
        "headline numbers that differ), or two revisions' leaderboards",
        description="With no REVISION: the DVC experiments (`dvc exp show`) side by side, one column each: the "
        "parameters that differ, then each method's headline number that differs (and each study's verdict "
        "counts), a row each; fits a terminal where `dvc exp show` cannot. With two: the second revision's "
        "leaderboard against the first's, regime by regime, each score with its interval and the change.",
    )
    compare.add_argument(
        "revisions",
        nargs="*",
        metavar="REVISION",
        help="two revisions (a commit, branch or tag, an experiment's name, or workspace): the second's leaderboard "
        "against the first's, with the changes",
    )
    compare.add_argument(
        "--metric",
        default="test_avg",
        choices=("test_avg", "val_avg", "gap"),
        help="the headline number shown (default: test_avg)",
    )
    compare.add_argument("--all", action="store_true", help="every row, not only those that differ")
    compare.add_argument("--md", action="store_true", help="a Markdown table")
    remote = sub.add_parser(
        "remote",
        help="the DVC remote the run's outputs travel by: `remote add URL` sets it, `remote` shows it",
        description="Show the project's default DVC remote, or set one (`remote add URL`: a folder, s3://bucket/path, "
        "or any URL a DVC plugin reads) in .dvc/config, which git tracks; credentials stay in the environment. "
        "Then `dvc push` after a run, `dvc pull` on a clone.",
    )
    remote_sub = remote.add_subparsers(dest="remote_command", metavar="ACTION")
    remote_add = remote_sub.add_parser(
        "add",
        help="make URL the default remote",
        description="Make URL the project's default DVC remote (.dvc/config). S3's credentials come from "
        "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), never from the URL.",
    )
    remote_add.add_argument("url", help="a folder (kept as an absolute path), s3://bucket/path, ssh://host/path, ...")
    remote_add.add_argument("--name", default="storage", help="the remote's name (default: storage)")
    remote_add.add_argument("--endpoint-url", help="an S3-compatible server's address (MinIO, Ceph), for an s3:// URL")
    sub.add_parser(
        "serve",
        add_help=False,
        help="schedule the pipeline: a Prefect deployment served from "
        "here (--cron EXPR or --interval SECONDS; serve --help)",
    )


def _add_merge_checkpoints(sub) -> None:
    """merge-checkpoints: any checkpoint files merged with a registered method, outside the pipeline."""
    command = sub.add_parser(
        "merge-checkpoints",
        help="merge a base and fine-tuned checkpoints (safetensors files or Hugging Face folders) with one method",
        description="Merge fine-tuned checkpoints onto their base with a registered method at fixed options (the "
        "rest at its defaults), outside the pipeline: no data, no DVC. Each checkpoint is a safetensors file or a "
        "folder holding model.safetensors or Hugging Face's shards. The merge is written in the base's dtypes: an "
        "output named *.safetensors is one file, with the method, options and inputs in its metadata; any other "
        "output is a Hugging Face model folder: the base folder's config and tokenizer files, the weights as "
        "model.safetensors or, past --max-shard-size, as model-0000i-of-0000N.safetensors shards with "
        "model.safetensors.index.json, and mergeflow.json saying what was merged. Written atomically: an error "
        "leaves no output. Methods that read data refuse.",
    )
    command.add_argument("--method", help="a registered method (`mergeflow methods --list`)")
    command.add_argument("--base", metavar="CHECKPOINT", help="the pretrained checkpoint, theta0")
    command.add_argument("finetuned", nargs="*", metavar="CHECKPOINT", help="the fine-tuned checkpoints")
    command.add_argument(
        "-o",
        "--output",
        metavar="PATH",
        help="the merged model: a FILE.safetensors, or else a Hugging Face model folder",
    )
    command.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        help="a folder output's largest shard, as Hugging Face counts it (decimal units: 5GB, 500MB; default 5GB)",
    )
    command.add_argument(
        "--config",
        metavar="FILE",
        help="the merge as YAML instead (method, base, models, options, output, max_shard_size; paths relative to "
        "the file)",
    )
    command.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a hyperparameter's value (e.g. --set lam=0.3; `mergeflow methods` lists each method's), repeatable",
    )


def _parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command's parser, a subparser a command; ``argv`` decides whether help reads params.yaml (_choices)."""
    argv = list(sys.argv[1:] if argv is None else argv)

    parser = argparse.ArgumentParser(
        prog="mergeflow", description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--version", action="version", version=f"mergeflow {__version__}", help="print the version and exit"
    )
    parser.add_argument(
        "--params", default="params.yaml", metavar="FILE", help="the configuration file (default: params.yaml)"
    )
    parser.add_argument(
        "--download",
        action="store_true",
        help="download missing datasets and weights (torchvision, the Hugging Face hub); anywhere on the line, e.g. "
        "`mergeflow repro --download`",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_stage_commands(sub, argv)
    _add_listing_commands(sub)
    _add_checking_commands(sub)
    _add_result_commands(sub)
    _add_merge_checkpoints(sub)
    return parser


def _allow_downloads(argv: list[str] | None) -> list[str]:
    """--download anywhere on the line (also after `repro`, whose other options are DVC's): the stages this
    process runs, or DVC runs, may download what is missing. Set before anything reads the hub's settings."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--download" in argv:
        from mergeflow.config.environment import DOWNLOAD_ENV

        argv = [a for a in argv if a != "--download"]
        os.environ[DOWNLOAD_ENV] = "1"
        os.environ["HF_HUB_OFFLINE"] = "0"  # the Makefile's default forbids the hub
    return argv


def _forwarded(argv: list[str]) -> int | None:
    """A stage command's exit status when the run's stage server ran it (mergeflow.runner.stage_server), else None."""
    from mergeflow.runner.stage_server import SERVER_ENV, STAGE_COMMANDS, forward

    if (
        not os.environ.get(SERVER_ENV)
        or _command_of(argv) not in STAGE_COMMANDS
        or {"-h", "--help", "--download"} & set(argv)
    ):
        return None
    if os.environ.get("MERGEFLOW_DIE_WITH_PARENT"):
        from mergeflow.runner.lifetime import die_with_parent

        die_with_parent()
    return forward(argv)


def _params_path(argv: list[str]) -> str:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--params", default="params.yaml")
    return pre.parse_known_args(argv)[0].params


def main(argv: list[str] | None = None) -> int:
    as_command = argv is None  # the `mergeflow` command itself, not a call from Python
    argv = list(sys.argv[1:] if argv is None else argv)
    from mergeflow.core.reproducibility import pin_environment, requested

    # before anything imports torch or numpy (here, the stage server, DVC's stage commands): the deterministic
    # mode's kernels, or the machine's own where params.yaml sets runtime.deterministic: false
    pin_environment(requested(_params_path(argv)))
    if argv[:1] == ["_serve-stages"] and len(argv) == 2:  # mergeflow.runner.stage_server.running_server starts it
        from mergeflow.runner.stage_server import serve

        serve(argv[1], main)
        return 0
    if as_command and (status := _forwarded(argv)) is not None:
        return status
    argv = _allow_downloads(argv)
    parser = _parser(argv)
    args, args.dvc_args = parser.parse_known_args(argv)
    if (
        args.command == "serve"
    ):  # its options are flows.serve's (the Prefect flow lives in the repository, not in the package)
        sys.path.insert(0, os.getcwd())
        try:
            from flows.serve import main as serve
        except ImportError:
            print(
                "error: mergeflow serve runs from the repository root (where flows/ and dvc.yaml are)", file=sys.stderr
            )
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
        print(
            "error: "
            f"{TransientError('out of GPU memory (other stages may hold it: run fewer at once with --workers)')}",
            file=sys.stderr,
        )
        return TransientError.exit_status
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
