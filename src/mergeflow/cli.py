"""The ``mergeflow`` command: one stage of the model-merging pipeline, the project check, the methods, the MLflow UI.

Under DVC and the Prefect flow a stage takes its task or method from DVC_STAGE (finetune@<task>, merge@<method>),
so no name from params.yaml is ever pasted into a shell command. Bad input or configuration prints one line,
``error: <what, where>``, and exits with status 2; a transient failure exits with status 75 (see mergeflow.core.errors).
"""

from __future__ import annotations

import argparse
import os
import sys

from mergeflow import __version__
from mergeflow.core.errors import MergeflowError, TransientError
from mergeflow.core.stage_table import STAGES


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


def _parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    argv = list(sys.argv[1:] if argv is None else argv)
    tasks, methods_help, studies_help = _choices(argv)

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
    return parser


def _stage_item(given: str | None, stage: str, what: str) -> str:
    """The task or method a stage runs on: the option, else DVC_STAGE's '<stage>@<name>'."""
    if given is not None:
        return given
    address = os.environ.get("DVC_STAGE", "")
    prefix, _, name = address.partition("@")
    if prefix != stage or not name:
        raise MergeflowError(
            f"{stage}: no --{what} given, and DVC_STAGE ({address or 'unset'}) is not {stage}@<{what}>"
        )
    return name


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


def _stage(args: argparse.Namespace) -> int:
    from mergeflow.runner.lifetime import die_with_parent

    die_with_parent()  # before the seconds of torch's import: a launcher killed meanwhile takes the stage with it
    from mergeflow.core.files import sweep_temporaries
    from mergeflow.params import load_params
    from mergeflow.pipeline import stages

    sweep_temporaries(stages.Layout().output_roots)  # what interrupted writes left (of processes now gone)

    params = load_params(args.params)
    item = STAGES[args.command].item.option if STAGES[args.command].item else None
    if item:  # the stage's address, by hand as under DVC: its share of the cores (Params.stage_share) follows from it
        name = _stage_item(getattr(args, item), args.command, item)
        os.environ["DVC_STAGE"] = f"{args.command}@{name}"
    if args.command == "track":
        from mergeflow.report.tracking import track

        track(params)
        return 0
    from mergeflow.core.reproducibility.machine import describe, record_stage, summary

    device = configure_stage(params)
    address = f"{args.command}@{name}" if item else args.command
    machine = describe(in_use=True, device=device)
    print(f"{address}: {summary(machine)}", flush=True)
    if args.command == "replicate":
        if not name.isdecimal():
            raise MergeflowError(f"replicate: seed {name!r} is not a whole number (seeds in {args.params})")
        stages.replicate(params, int(name))
    elif item:
        getattr(stages, args.command)(params, name)
    else:
        getattr(stages, args.command)(params)
    record_stage(".", address, machine)  # what wrote its outputs (provenance.json)
    return 0


# every command but the stages (core.stage_table: _stage runs each) and serve (main hands it to flows.serve)
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
}


def run_command(args: argparse.Namespace) -> int:
    return COMMANDS.get(args.command, _stage)(args)


def _value(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _values(values, most: int = 8) -> str:
    """A grid, its middle elided when long: [0.05, 0.1, 0.15, ..., 1] (20 values)."""
    shown = [_value(v) for v in values]
    if len(shown) > most:
        return f"[{', '.join(shown[:3])}, ..., {shown[-1]}] ({len(shown)} values)"
    return f"[{', '.join(shown)}]"


def _space(fixed: dict, grid: dict, per_task: dict, method=None) -> str:
    """One method's hyperparameters, one a line: a grid searched on validation, a grid searched per task, or a
    fixed value; with ``method``, each one's default (the value used without validation data) and allowed values."""
    from mergeflow.ml.merging import ANY_NUMBER

    def name(k: str) -> str:
        if method is None:
            return k
        allowed = method.ranges.get(k)
        return f"{k}={_value(method.defaults[k])}" + (
            f" ({allowed})" if allowed is not None and allowed != ANY_NUMBER else ""
        )

    lines = [f"{name(k)}{',' if method else ''} grid {_values(v)}" for k, v in grid.items()]
    lines += [f"{name(k)}{',' if method else ''} per-task grid {_values(v)}" for k, v in per_task.items()]
    lines += [name(k) if method else f"{k}={_value(v)}" for k, v in fixed.items() if k not in per_task]
    return "\n".join(lines) or "(no hyperparameters)"


def methods_table(params, source: str = "params.yaml"):
    """A rich Table: each method, whether merge.methods runs it, the hyperparameters ``params`` makes effective
    (Params.merge.overrides through the method's search_space) and the paper's defaults and grids."""
    from rich.table import Table

    from mergeflow.ml.merging import DATA, REGISTRY

    table = Table(
        title=f"merging methods (* = in merge.methods of {source})"
        if params
        else "merging methods: the papers' defaults",
        show_lines=True,
        title_justify="left",
    )
    table.add_column("method", no_wrap=True)
    if params:
        table.add_column(f"effective ({source})", overflow="fold", ratio=1)
    table.add_column("paper's defaults", overflow="fold", ratio=1)
    for name in sorted(REGISTRY):
        method = REGISTRY[name]
        fixed, grid = method.search_space()
        paper = _space(fixed, grid, method.per_task_space(), method)
        kind = "" if method.kind == "model" else f"\n({method.kind.replace('_', '-')})"
        kind += f"\n(reads {DATA[method.reads]})" if method.reads else ""
        if not params:
            table.add_row(f"{name}{kind}", f"{paper}\n[dim]{method.paper}[/dim]")
            continue
        overrides = params.merge.overrides(name)
        fixed, grid = method.search_space(overrides)
        effective = _space(fixed, grid, method.per_task_space(overrides))
        marked = f"{name} *" if name in params.merge.methods else name
        table.add_row(
            f"{marked}{kind}",
            effective if overrides else f"{effective}\n[dim](the defaults)[/dim]",
            f"{paper}\n[dim]{method.paper}[/dim]",
        )
    return table


def print_methods(params_path: str) -> int:
    from rich.console import Console

    from mergeflow.params import load_params

    try:
        params = load_params(params_path)
    except MergeflowError as err:  # the registry's own defaults still help
        print(f"warning: {err}; showing the papers' defaults only", file=sys.stderr)
        params = None
    console = Console(width=min(Console().width, 120), highlight=False)
    console.print(methods_table(params, params_path))
    return 0


def print_regimes(params_path: str) -> int:
    """Each regime: its paper and defaults; for those regimes.run lists, the variants (with the keyword arguments
    the regime function gets) and the methods they are merged with. Then the studies."""
    from mergeflow.params import load_params
    from mergeflow.ml.regimes import REGISTRY as REGIMES
    from mergeflow.studies import REGISTRY as STUDIES

    import shutil
    import textwrap

    def say(text: str, indent: int) -> None:  # wrapped to the terminal, continued lines indented further
        print(
            textwrap.fill(
                text,
                shutil.get_terminal_size((100, 24)).columns,
                initial_indent=" " * indent,
                subsequent_indent=" " * (indent + 4),
                break_on_hyphens=False,
            )
        )

    params = load_params(params_path)
    print(f"regimes (standard is finetune's; * = in regimes.run of {params_path}):")
    for name, regime in sorted(REGIMES.items()):
        running = name in params.regimes.run
        say(f"{name}{' *' if running else ''}: {regime.formula}", 2)
        say(f"[{regime.paper}]", 6)
        if running:
            for variant, kwargs in params.regimes.config(name).variants(name, params.finetune.steps).items():
                shown = ", ".join(f"{k}={v}" for k, v in kwargs.items()) or "one epoch per task"
                say(f"{variant}: {shown}; merged with {', '.join(params.regimes.methods_of(name))}", 6)
    print("studies (* = in studies.run):")
    for name, spec in sorted(STUDIES.items()):
        say(f"{name}{' *' if name in params.studies.run else ''}: {spec.title}", 2)
        say(f"[{spec.paper}]", 6)
    return 0


def mlflow_ui(port: int, host: str) -> int:
    """``mlflow ui`` on the store ``track`` logs to, so that the Prefect summary artifact's link opens."""
    from pathlib import Path

    from mergeflow.config.environment import mlflow_ui_port
    from mergeflow.report.tracking import tracking_uri
    from mergeflow.runner.ui import serve

    return serve(
        tracking_uri(Path.cwd()), host, mlflow_ui_port() if port is None else port
    )  # the port track's and the Prefect summary's links name


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


def configure_stage(params) -> str:
    """This stage process's kernels and threads (mergeflow.core.reproducibility.configure), before any stage work; its
    device ('cpu' or 'cuda')."""
    from mergeflow.core.devices import cuda_devices
    from mergeflow.core.reproducibility import configure

    configure(params.runtime.deterministic, params.threads())
    return "cuda" if params.runtime.device != "cpu" and cuda_devices() else "cpu"


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
