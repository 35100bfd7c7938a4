"""Measured throughputs kept per machine, so that `mergeflow plan` measures once and then answers in seconds.

One JSON file per measurement, named by a hash of what the figures depend on (the backbone's architecture, the
image size and batch sizes, float32, the device's name, the threads, torch's and timm's versions, this machine),
under ``$XDG_CACHE_HOME/mergeflow/runner/plan`` (``~/.cache/mergeflow/runner/plan``). Written atomically: two plans at
once leave one whole file. A file that does not read back or names another key is measured again.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from dataclasses import asdict, fields
from importlib import metadata
from pathlib import Path

from mergeflow.config import Params
from mergeflow.core.errors import MergeflowError
from mergeflow.core.files import atomic_path
from mergeflow.runner.plan import measure
from mergeflow.runner.plan.measure import ModelShape, Throughput, architecture_key, model_shape, remember_shape

# bumped when the measuring changes what a figure means: older files are then not read
MEASURE_VERSION = 1


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mergeflow" / "plan"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(params: Params) -> str:
    """The device the stages run on, by its hardware name (a file measured on one GPU model does not serve
    another); as models.select_device picks it, without importing timm with it (seconds)."""
    import torch

    cuda = params.runtime.device == "cuda" or (params.runtime.device == "auto" and torch.cuda.is_available())
    if cuda:  # cuda asked for and absent: measuring says so, as every stage would
        return f"cuda ({torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'})"
    return f"cpu ({_cpu_model()})"


def measurement_key(params: Params) -> dict:
    """Everything the measured figures depend on."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "measure_version": MEASURE_VERSION,
        "architecture": architecture_key(params),
        "image_size": params.suite.image_size,
        "eval_batch_size": params.runtime.eval_batch_size,
        "train_batch_size": params.finetune.batch_size,
        "decode": params.suite.source != "embedded",
        "dtype": "float32",
        "device": device_name(params),
        "threads": params.threads() or torch.get_num_threads(),
        "cores": cores,
        "host": platform.node(),
        "torch": _version("torch"),
        "timm": _version("timm"),
        "python": platform.python_version(),
    }


def cache_path(key: dict, directory: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return (directory or cache_dir()) / f"throughput-{digest}.json"


def _read(path: Path, key: dict) -> tuple[Throughput, ModelShape] | None:
    try:
        entry = json.loads(path.read_text())
        if entry.get("key") != json.loads(json.dumps(key)):
            return None
        known = {f.name for f in fields(Throughput)}
        throughput = Throughput(**{k: v for k, v in entry["throughput"].items() if k in known})
        s = entry["shape"]
        shape = ModelShape(int(s["parameters"]), tuple(tuple(m) for m in s["matrices"]), int(s["features"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return throughput, shape


def cached_throughput(
    params: Params,
    *,
    remeasure: bool = False,
    directory: Path | None = None,
    process_start: tuple[float, int] | None = None,
) -> tuple[Throughput, dict]:
    """The throughput for ``params`` on this machine: from the cache when it holds it (and not ``remeasure``),
    else measured and stored; also measured again when the cached figures were taken on a busy machine and it is
    idle now (``process_start``: as measure_throughput takes it). Also (dict) where it came from: {"cached": bool,
    "path": str}; a cache that cannot be written is noted on stderr, and the plan goes on."""
    key = measurement_key(params)
    path = cache_path(key, directory)
    if not remeasure:
        found = _read(path, key)
        # figures taken on a busy machine are bounds: the first plan that finds it idle measures again
        if found is not None and not (found[0].busy and not measure.machine_busy()):
            throughput, shape = found
            remember_shape(params, shape)
            return throughput, {"cached": True, "path": str(path)}
    throughput = measure.measure_throughput(params, process_start=process_start)
    shape = model_shape(params)
    entry = {"key": key, "throughput": asdict(throughput), "shape": asdict(shape)}
    try:
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(entry, indent=1) + "\n")
    except (OSError, MergeflowError) as err:  # a read-only or full home: the plan itself still stands
        print(
            f"warning: {path}: the measured throughput is not cached ({getattr(err, 'strerror', None) or err})",
            file=sys.stderr,
        )
        return throughput, {"cached": False, "path": None}
    return throughput, {"cached": False, "path": str(path)}
