"""`mergeflow <stage>`: one stage of dvc.yaml run in this process, on the task or method its option or DVC_STAGE
names, with this stage's kernels and threads, and what wrote its outputs recorded (provenance.json)."""

from __future__ import annotations

import argparse
import os

from mergeflow.core.errors import MergeflowError
from mergeflow.core.stage_table import STAGES


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


def configure_stage(params) -> str:
    """This stage process's kernels and threads (mergeflow.core.reproducibility.configure), before any stage work; its
    device ('cpu' or 'cuda')."""
    from mergeflow.core.devices import cuda_devices
    from mergeflow.core.reproducibility import configure

    configure(params.runtime.deterministic, params.threads())
    return "cuda" if params.runtime.device != "cpu" and cuda_devices() else "cpu"


def run_stage(args: argparse.Namespace) -> int:
    """The stage ``args.command`` names, in this process: exit status 0 once its outputs are written."""
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
