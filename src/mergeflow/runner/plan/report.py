"""The plan of a DVC project (which stages will run, each one's estimate, the total, the stages whose peak memory
exceeds the machine's) and its printing: a table, or JSON."""

from __future__ import annotations

import os
import re
from dataclasses import asdict
from pathlib import Path

from mergeflow.config import Params
from mergeflow.core.errors import MergeflowError
from mergeflow.runner.plan.measure import Throughput, model_shape
from mergeflow.runner.plan.work import STAGE_GAP_S, compute_seconds, overhead_seconds, peak_bytes, stage_work


def machine_memory(tp: Throughput) -> tuple[int | None, str]:
    """(bytes, what) the stages' peaks are held against: the GPU's memory when the device is CUDA, else the RAM
    (MemTotal, or a cgroup's lower limit: a container's). None when neither can be read."""
    if tp.device.startswith("cuda"):
        return (tp.device_memory_bytes or None), "GPU memory"
    total = None
    try:
        found = re.search(r"^MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
        total = int(found.group(1)) * 1024 if found else None
    except OSError:
        pass
    if total is None and hasattr(os, "sysconf"):
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit() and (total is None or int(limit) < total):
            total = int(limit)
    except OSError:
        pass
    return total, "RAM"


def make_plan(
    params: Params,
    nodes,
    stale: set[str],
    tp: Throughput | None,
    *,
    include_all: bool = False,
    memory_bytes: int | None = None,
    memory_of: str = "RAM",
) -> dict:
    """Every stage (``nodes``: graph.StageNode, in order) with whether it will run, its estimate (those
    that will run, or all with ``include_all``), and the total of those that will run. With ``memory_bytes``
    (the machine's), each estimated stage says whether its peak exceeds it, and ``exceeds_memory`` lists them.
    ``tp`` may be None only when nothing is estimated (no stage will run, and not ``include_all``)."""
    n_params = model_shape(params).parameters
    rows, total = [], 0.0
    for node in nodes:
        will_run = node.address in stale
        row = {
            "stage": node.address,
            "will_run": will_run,
            "estimated": False,
            "seconds": None,
            "compute_seconds": None,
            "overhead_seconds": None,
            "peak_memory_bytes": None,
            "exceeds_memory": None,
            "work": None,
            "notes": [],
        }
        if will_run or include_all:
            work = stage_work(params, node.address)
            if work is None:
                row["notes"] = ["not estimated"]
            else:
                compute, overhead, peak = (
                    compute_seconds(work, tp),
                    overhead_seconds(tp, first=will_run and not any(r["will_run"] and r["estimated"] for r in rows)),
                    peak_bytes(work, tp, n_params),
                )
                row |= {
                    "estimated": True,
                    "seconds": compute + overhead,
                    "compute_seconds": compute,
                    "overhead_seconds": overhead,
                    "peak_memory_bytes": peak,
                    "exceeds_memory": None if memory_bytes is None else peak > memory_bytes,
                    "notes": work.notes,
                    "work": {k: v for k, v in asdict(work).items() if k not in ("notes", "trains") and v},
                }
                if will_run:
                    total += row["seconds"]
        rows.append(row)
    unestimated = [r["stage"] for r in rows if r["will_run"] and not r["estimated"]]
    return {
        "device": tp.device if tp else None,
        "throughput": asdict(tp) if tp else None,
        "parameters": n_params,
        "stages": rows,
        "total_seconds": total,
        "will_run": sum(r["will_run"] for r in rows),
        "not_estimated": unestimated,
        "machine_memory_bytes": memory_bytes,
        "machine_memory_of": memory_of,
        "exceeds_memory": [r["stage"] for r in rows if r["exceeds_memory"]],
    }


def project_plan(
    root: str | Path,
    params: Params,
    *,
    include_all: bool = False,
    throughput: Throughput | None = None,
    remeasure: bool = False,
    process_start: tuple[float, int] | None = None,
) -> dict:
    """The plan of the DVC project at ``root`` (its stages and which are out of date, as ``dvc status`` says),
    with the throughput given, or this machine's cached one (measured when not cached, or ``remeasure``)."""
    from dvc.repo import Repo

    from mergeflow.runner.graph import check_repo, stage_graph, stale_stages

    check_repo(root)
    with Repo(str(root)) as repo:  # one repository for the graph and the status
        nodes = stage_graph(repo)
        stale = stale_stages(repo, nodes)
    source = {"cached": False, "path": None}
    if not stale and not include_all and throughput is None:  # nothing to estimate: nothing measured either
        return make_plan(params, nodes, stale, None) | {"throughput_source": source}
    if throughput is None:
        from mergeflow.runner.plan.cache import cached_throughput

        throughput, source = cached_throughput(params, remeasure=remeasure, process_start=process_start)
    memory, memory_of = machine_memory(throughput)
    plan = make_plan(
        params, nodes, stale, throughput, include_all=include_all, memory_bytes=memory, memory_of=memory_of
    )
    plan["throughput_source"] = source
    return plan


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {seconds % 60:02.0f} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _batches(tp: dict, kind: str) -> str:
    timed = tp.get("timed_at", {}).get(kind, [])
    extrapolated = f", from {' and '.join(map(str, timed))}" if timed and timed != [tp["batches"][kind]] else ""
    return f"batch {tp['batches'][kind]}{extrapolated}"


def device_line(plan: dict) -> str:
    tp = plan["throughput"]
    source = plan.get("throughput_source") or {}
    if tp.get("calibration"):
        when = (
            f"from {tp['calibration']} (measured {tp['measured_at']}): search {tp['search_img_s']:.0f} img/s, "
            f"AdaMerging {tp['adaptation_img_s']:.0f} img/s, reading {tp['load_bytes_per_s'] / 1e9:.2f} GB/s"
        )
    elif tp.get("measured_at"):
        when = f"measured {tp['measured_at']} at load {tp['load_average']:.1f}"
    else:
        when = "given"
    if tp.get("busy"):
        when += " (busy: the next plan on an idle machine measures again)"
    kept = f", cached in {source['path']} (--remeasure measures again)" if source.get("path") else ""
    return (
        f"device {plan['device']}, {tp['threads']} threads; backbone {plan['parameters'] / 1e6:.2f} M parameters: "
        f"forward {tp['forward_img_s']:.0f} img/s ({_batches(tp, 'forward')}), "
        f"train {tp['train_img_s']:.0f} img/s ({_batches(tp, 'train')}), per-example gradient "
        f"{1000 * tp['example_grad_s']:.1f} ms, parameter pass {1000 * tp['param_pass_s']:.2f} ms, "
        f"SVD {1000 * tp['svd_s']:.1f} ms; stage server's imports {tp['import_s']:.1f} s once, {STAGE_GAP_S:.2f} s "
        f"between stages; {when}{kept}; memory: {tp['memory_source']}"
    )


def memory_warning(plan: dict) -> str | None:
    """One line naming the stages whose peak exceeds the machine's memory; None when none does."""
    over = plan.get("exceeds_memory") or []
    if not over:
        return None
    peaks = {r["stage"]: r["peak_memory_bytes"] for r in plan["stages"]}
    listed = ", ".join(f"{s} ({_size(peaks[s])})" for s in over)
    return (
        f"warning: {len(over)} {'stages need' if len(over) > 1 else 'stage needs'} more than this machine's "
        f"{_size(plan['machine_memory_bytes'])} of {plan['machine_memory_of']} (marked !): {listed}"
    )


def plan_table(plan: dict):
    """A rich Table of the plan, its total in the caption; a peak over the machine's memory is marked "!"."""
    from rich.table import Table
    from rich.text import Text

    table = Table(
        title="mergeflow plan (one stage after another, as mergeflow repro on one GPU or 2 cores)", title_justify="left"
    )
    table.add_column("stage", no_wrap=True)
    table.add_column("will run")
    table.add_column("est. time", justify="right")
    table.add_column("peak memory", justify="right", no_wrap=True)
    table.add_column("notes", overflow="fold")
    for r in plan["stages"]:
        peak = (
            Text(_size(r["peak_memory_bytes"]) + " !", style="bold red")
            if r.get("exceeds_memory")
            else _size(r["peak_memory_bytes"])
        )
        table.add_row(
            r["stage"],
            "yes" if r["will_run"] else "up to date",
            _duration(r["seconds"]) if r["estimated"] else ("not estimated" if r["notes"] else "-"),
            peak,
            "; ".join(n for n in r["notes"] if n != "not estimated"),
        )
    missing = f"; not estimated: {', '.join(plan['not_estimated'])}" if plan["not_estimated"] else ""
    table.caption = f"total of the {plan['will_run']} stages that will run: {_duration(plan['total_seconds'])}{missing}"
    table.caption_justify = "left"
    return table


def print_plan(
    params_path: str,
    *,
    include_all: bool = False,
    as_json: bool = False,
    root: str = ".",
    remeasure: bool = False,
    calibration: str | None = None,
) -> int:
    """``mergeflow plan``: the table (or JSON) for the project in ``root``."""
    import json

    from rich.console import Console
    from rich.text import Text

    from mergeflow.params import load_params
    from mergeflow.runner.plan.measure import this_process_start

    # the `mergeflow` command's own start up to here is a stage process's: read before DVC and measuring add to it
    process_start = this_process_start()
    params = load_params(params_path)
    if not Path(root, "dvc.yaml").is_file():
        raise MergeflowError(f"{Path(root).resolve()}: no dvc.yaml (run `mergeflow plan` from the repository root)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the architecture only: nothing to fetch
    throughput = None
    if calibration:  # a GPU benchmark's figures instead of this machine's
        from mergeflow.runner.plan.calibration import throughput_from_bench

        throughput = throughput_from_bench(calibration, params)
    plan = project_plan(
        root, params, include_all=include_all, throughput=throughput, remeasure=remeasure, process_start=process_start
    )
    if as_json:
        print(json.dumps(plan, indent=2))
        return 0
    console = Console(width=min(Console().width, 140), highlight=False)
    console.print(plan_table(plan))
    warning = memory_warning(plan)
    if warning:
        console.print(Text(warning, style="bold red"))
    if plan["throughput"] is None:
        console.print("nothing to run, nothing measured (`mergeflow plan --all` estimates every stage)")
        return 0
    console.print(device_line(plan), soft_wrap=False)
    return 0
