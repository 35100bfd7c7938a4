"""What machine and kernels wrote a stage's outputs: a record in the stage's log, in provenance.json (committed,
one entry a stage: what `mergeflow verify` and `mergeflow reproduce` print beside this machine when bytes differ),
and in each MLflow run.

``describe()`` reads the CPU, the library versions and the kernel settings without importing torch (`mergeflow
verify` stays light); ``describe(in_use=True)``, in a stage's process, adds the kernels torch, numpy and OpenBLAS
actually run and the threads they run on, and the GPU when the stage has one."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
from importlib import metadata
from pathlib import Path

PROVENANCE_FILE = "provenance.json"
# the CPU features that decide which kernels a library may pick
_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")


def cpu() -> dict[str, object]:
    """The CPU: its model, maker and the features that matter here (from /proc/cpuinfo), and the cores this process
    may use."""
    model, vendor, flags = platform.processor() or "unknown", "unknown", set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if key == "model name":
                model = value
            elif key == "vendor_id":
                vendor = value
            elif key == "flags":
                flags = set(value.split())
                break
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return {"model": model, "vendor": vendor, "features": [f for f in _FLAGS if f in flags], "cores": cores}


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "absent"


def describe(in_use: bool = False, device: str = "cpu") -> dict[str, object]:
    """This process's machine record: the CPU, the deterministic mode and its kernels, the versions, (``in_use``)
    the kernels and threads actually running and (``device`` cuda) the GPU."""
    from mergeflow.core.reproducibility import KERNEL_ENV, MODE_ENV

    deterministic = os.environ.get(MODE_ENV) != "0"
    record: dict[str, object] = {
        "cpu": cpu(),
        "deterministic": deterministic,
        "kernels": {k: os.environ.get(k, "") for k in KERNEL_ENV if os.environ.get(k)},
        "versions": {
            "python": platform.python_version(),
            "glibc": platform.libc_ver()[1] or "unknown",
            **{p: _version(p) for p in ("torch", "numpy", "scipy", "scikit-learn", "numba", "timm")},
        },
    }
    if in_use:
        import torch

        from mergeflow.core.reproducibility import kernels_in_use, stage_threads

        record["kernels"] = kernels_in_use()
        record["threads"] = {"torch": torch.get_num_threads(), "stage": stage_threads()}
        mkl = next((line.strip() for line in torch.__config__.show().splitlines() if "Math Kernel Library" in line), "")
        record["versions"]["mkl"] = (
            mkl.removeprefix("- ").split(" for ")[0].replace("Intel(R) oneAPI Math Kernel Library Version ", "")
            or "absent"
        )  # type: ignore[index]
        if device == "cuda":
            index = torch.cuda.current_device()
            record["gpu"] = {
                "model": torch.cuda.get_device_name(index),
                "cuda": torch.version.cuda,
                "driver": _nvidia_driver(),
            }
    return record


def _nvidia_driver() -> str:
    with contextlib.suppress(OSError):
        text = Path("/proc/driver/nvidia/version").read_text()
        for word in text.split():
            if word.count(".") >= 1 and word.replace(".", "").isdigit():
                return word
    return "unknown"


def summary(record: dict) -> str:
    """One line: 'AMD EPYC (AuthenticAMD; avx2 fma avx512f), 2 cores; deterministic: torch AVX2, MKL COMPATIBLE,
    GEMMs OpenBLAS Haswell on 2 threads; torch 2.14.1'."""
    c = record.get("cpu", {})
    return (
        f"{c.get('model', '?')} ({c.get('vendor', '?')}; {' '.join(c.get('features', [])) or 'no AVX2'}), "
        f"{c.get('cores', '?')} cores; " + environment(record)
    )


def environment(record: dict) -> str:
    """The summary without the CPU: the mode, the kernels, the GPU, torch's version. In deterministic mode on the
    CPU the same on every machine, as the bytes are."""
    kernels = record.get("kernels", {})
    line = ""
    mode = "deterministic" if record.get("deterministic") else "machine's own kernels"
    if "torch" in kernels:
        line += (
            f"{mode}: torch {kernels['torch']}, MKL {kernels.get('mkl')}, GEMMs on {kernels.get('gemm')}, OpenBLAS "
            f"{kernels.get('openblas')}, numpy {kernels.get('numpy')}"
        )
    else:
        line += f"{mode}" + (f": {', '.join(f'{k}={v}' for k, v in kernels.items())}" if kernels else "")
    if gpu := record.get("gpu"):
        line += f"; GPU {gpu.get('model')} (CUDA {gpu.get('cuda')}, driver {gpu.get('driver')})"
    return line + f"; torch {record.get('versions', {}).get('torch', '?')}"


def differences(recorded: dict, current: dict) -> list[str]:
    """What differs between two records that can decide bits: 'cpu.vendor: GenuineIntel -> AuthenticAMD', ..."""
    out = []

    def walk(a, b, path):
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(a.keys() | b.keys()):
                walk(a.get(key), b.get(key), f"{path}.{key}" if path else key)
        elif a != b:
            out.append(f"{path}: {a} -> {b}")

    walk(recorded, current, "")
    return out


def environment_markdown(entries: dict[str, dict]) -> str:
    """The report's section: each environment the stages of provenance.json ran in, with how many and which; the CPU
    of each stage is in provenance.json itself (a report's bytes must not follow the machine)."""
    if not entries:
        return ""
    groups: dict[str, list[str]] = {}
    for address, record in sorted(entries.items()):
        groups.setdefault(environment(record), []).append(address)
    lines = ["", "### Environment", ""]
    for env, addresses in groups.items():
        shown = ", ".join(addresses[:6]) + (f", ... ({len(addresses)} stages)" if len(addresses) > 6 else "")
        lines.append(f"- {env}: {shown}")
    lines += ["", "The CPU each stage ran on, the thread counts and every version: `provenance.json`.", ""]
    return "\n".join(lines)


def explain(stage: str, entries: dict[str, dict], here: dict) -> list[str]:
    """Why ``stage``'s bytes may differ: the machine provenance.json says wrote them, the one re-running it, and
    what differs between the two (the kernels aside: the asking process has not the stage's in use). [] when the
    project keeps no provenance.json at all."""
    if not entries:
        return []
    if (written := entries.get(stage)) is None:
        return [f"{stage}: provenance.json has no record of the machine that wrote it"]
    comparable = {k: written.get(k) for k in here}
    changed = [d for d in differences(comparable, here) if not d.startswith("kernels.")] or ["nothing recorded"]
    return [
        f"{stage}: written on {summary(written)}",
        f"{stage}: this machine: {summary(here)}; differs in {'; '.join(changed)}",
    ]


def record_stage(root: str | os.PathLike, address: str, record: dict) -> None:
    """Write ``record`` as ``address``'s entry of provenance.json (atomically, under a lock: stages end at once)."""
    from mergeflow.core.files import write_json

    root = Path(root)
    lock_dir = root / ".dvc" / "tmp" if (root / ".dvc").is_dir() else root
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / "provenance.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = recorded(root)
        entries[address] = record
        write_json(root / PROVENANCE_FILE, dict(sorted(entries.items())))


def recorded(root: str | os.PathLike) -> dict[str, dict]:
    """provenance.json's entries (stage address -> record); {} when there is none or it does not read."""
    path = Path(root) / PROVENANCE_FILE
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def tags(record: dict | None) -> dict[str, str]:
    """A machine record as MLflow tags: machine (the summary line), machine.cpu, .vendor, .cores, .deterministic,
    .kernels, .threads, .torch, .mkl, .gpu; {} without a record."""
    if not record:
        return {}
    c, kernels, versions = record.get("cpu", {}), record.get("kernels", {}), record.get("versions", {})
    out = {
        "machine": summary(record),
        "machine.cpu": str(c.get("model", "")),
        "machine.vendor": str(c.get("vendor", "")),
        "machine.cores": str(c.get("cores", "")),
        "machine.deterministic": str(bool(record.get("deterministic"))).lower(),
        "machine.kernels": ", ".join(f"{k}: {v}" for k, v in kernels.items()),
        "machine.threads": ", ".join(f"{k}: {v}" for k, v in record.get("threads", {}).items()),
        "machine.torch": str(versions.get("torch", "")),
        "machine.mkl": str(versions.get("mkl", "")),
    }
    if gpu := record.get("gpu"):
        out["machine.gpu"] = f"{gpu.get('model')} (CUDA {gpu.get('cuda')}, driver {gpu.get('driver')})"
    return out
