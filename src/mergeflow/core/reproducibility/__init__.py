"""The same bytes on any x86-64 machine: the deterministic mode (``runtime.deterministic``, on by default).

A float32 sum's last bits follow the order of its additions, and every fast CPU library picks that order from the
machine: the vector width (torch's AVX-512 kernels sum 16 lanes, its AVX2 ones 8), the cache sizes (MKL and oneDNN
block their GEMMs by them), the CPU's maker (MKL runs its Intel branches on Intel only) and the thread count
(partial sums per thread). After hundreds of training steps those bits are other weights and other accuracies.
The deterministic mode fixes every one of those choices, whatever launched the stage:

- before torch or numpy load (``pin_environment``, which ``import mergeflow`` runs): torch's own kernels are its AVX2
  build (``ATEN_CPU_CAPABILITY``), MKL runs its one branch that gives the same bits on Intel and AMD (``MKL_CBWR=
  COMPATIBLE``: what still calls MKL, the LAPACK of SVDs and solves), OpenBLAS its Haswell (AVX2 + FMA) kernels,
  whose blocking is fixed at build time (``OPENBLAS_CORETYPE``), and numpy its AVX2 loops;
- in the stage's process (``configure``): every float GEMM (``mm``, ``addmm``, ``bmm``, ``baddbmm``, and
  convolutions as unfold + GEMM) runs on those OpenBLAS kernels, split into a fixed number of blocks (``gemm``),
  oneDNN and NNPACK (which block by the machine) are off, and torch runs that same fixed number of threads, so that
  no partial sum depends on the machine's cores. The CPU flash attention stays: its blocking follows the sequence
  length alone, its products run on MKL's COMPATIBLE branch.

The thread count is the stage's (``Params.threads``: ``MERGEFLOW_THREADS``, ``runtime.threads``, else
``DETERMINISTIC_THREADS``), the same on 1 core or 64: it is part of what decides the bits, as the kernels are.
``runtime.deterministic: false`` trades the bits for each machine's fastest kernels and every core (bench/
determinism.py measures the difference; docs/benchmarks.md). A CUDA device keeps its own kernels: two runs on one
GPU model repeat each other, other GPU models and the CPU agree within a tolerance on the metrics
(mergeflow.runner.reproduce).
"""

from __future__ import annotations

import os
from pathlib import Path

# a stage's threads in deterministic mode unless params.yaml's runtime.threads says otherwise, whatever the cores:
# the 2-core machine the committed run was made on, at its full speed
DETERMINISTIC_THREADS = 2

# what each library reads when it loads: set before torch, numpy or scipy are imported
KERNEL_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",  # torch's vectorised kernels: the AVX2 build (every x86-64 CPU this runs on has it)
    "MKL_CBWR": "COMPATIBLE",  # MKL's branch that gives the same bits on every x86-64 CPU (its others: Intel only)
    "MKL_DYNAMIC": "FALSE",  # MKL uses the threads it is given, never fewer by its own choice
    "OMP_DYNAMIC": "FALSE",
    "OPENBLAS_CORETYPE": "Haswell",  # OpenBLAS's AVX2 + FMA kernels and their fixed blocking (no cache-size rule)
    "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR",  # numpy's AVX-512 loops off: its AVX2 ones
    # not the bits but the speed: torch's OpenMP threads wait 1,000 spins (not 10,000) before they sleep, so that
    # they leave the cores to the GEMMs' block threads (a pretraining step 8% faster on 2 cores)
    "GOMP_SPINCOUNT": "1000",
}

# "0" where a launcher chose the machine's own kernels (runtime.deterministic: false): its children, which import
# mergeflow again, keep them
MODE_ENV = "MERGEFLOW_DETERMINISTIC"
_replaced: dict[
    str, str | None
] = {}  # what pin_environment replaced (the user's value, or None): unpinning restores it
_inherited: bool | None = None


def pin_environment(deterministic: bool | None = None) -> None:
    """Set (or, with False, take back) KERNEL_ENV in this process's environment, which its children inherit; None:
    as MODE_ENV says (pinned unless it is "0"). Only effective before torch and numpy are imported: ``import
    mergeflow`` pins, and the ``mergeflow`` command takes the pins back at once when params.yaml says
    ``runtime.deterministic: false`` (restoring what the user had set)."""
    global _inherited
    if _inherited is None:  # a mergeflow process above this one pinned them: they are not the user's
        _inherited = os.environ.get(MODE_ENV) == "1"
    if deterministic is None:
        deterministic = os.environ.get(MODE_ENV) != "0"
    os.environ[MODE_ENV] = "1" if deterministic else "0"
    for key, value in KERNEL_ENV.items():
        if deterministic:
            if os.environ.get(key) != value:
                _replaced.setdefault(key, os.environ.get(key))
                os.environ[key] = value
        elif os.environ.get(key) == value and (key in _replaced or _inherited):
            previous = _replaced.pop(key, None)
            if previous is None:
                del os.environ[key]
            else:
                os.environ[key] = previous


def requested(params_path: str | os.PathLike = "params.yaml") -> bool:
    """``runtime.deterministic`` of the params file, read without validating it (and without torch): True when it
    is not set, or when the file does not load (the command then reports that itself)."""
    from mergeflow.core.errors import MergeflowError
    from mergeflow.core.yaml_files import read_yaml

    if not Path(params_path).is_file():
        return True
    try:
        raw = read_yaml(params_path)
    except MergeflowError:
        return True
    runtime = raw.get("runtime") if isinstance(raw, dict) else None
    value = runtime.get("deterministic", True) if isinstance(runtime, dict) else True
    return value is not False


_stage_threads: int | None = None


def stage_threads() -> int:
    """The threads this stage's parallel work may use (GEMMs, the merge kernels, readers): what ``configure`` set,
    else torch's count."""
    if _stage_threads:
        return _stage_threads
    import torch

    return torch.get_num_threads()


def kernels_in_use() -> dict[str, str]:
    """The CPU kernel paths this process runs: torch's capability, MKL's branch, OpenBLAS's core, numpy's SIMD."""
    import torch

    from mergeflow.core.reproducibility import gemm

    from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__

    simd = [
        f for f in __cpu_dispatch__ if __cpu_features__.get(f)
    ]  # numpy's dispatch targets this CPU runs, lowest first
    return {
        "torch": torch.backends.cpu.get_cpu_capability(),
        "mkl": os.environ.get("MKL_CBWR", "auto"),
        "openblas": gemm.openblas_core(),
        "numpy": simd[-1] if simd else "baseline",
        "gemm": f"OpenBLAS, {gemm.routed()} thread{'s' if gemm.routed() != 1 else ''}"
        if gemm.routed()
        else "torch's (MKL, oneDNN)",
    }


def configure(deterministic: bool, threads: int | None) -> None:
    """Set up this process for a stage: torch on ``threads`` threads (None: its default, every core). Deterministic
    (``threads`` then always given, DETERMINISTIC_THREADS by default): every CPU GEMM on OpenBLAS in ``threads``
    blocks (gemm.route), oneDNN and NNPACK off; the kernels pinned before torch loaded are checked (a torch imported
    before mergeflow runs the machine's own: refused, with the way out)."""
    import torch

    from mergeflow.core.errors import MergeflowError

    global _stage_threads
    if not deterministic:
        if threads:
            torch.set_num_threads(threads)
        _stage_threads = threads or torch.get_num_threads()
        return
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "DEFAULT") or os.environ.get("MKL_CBWR") != KERNEL_ENV["MKL_CBWR"]:
        raise MergeflowError(
            f"runtime.deterministic: torch runs its {capability} kernels here, loaded before mergeflow could pin them "
            "(import mergeflow before torch, or run the stage with the mergeflow command; runtime.deterministic: "
            "false runs the machine's own kernels)"
        )
    from mergeflow.core.reproducibility import gemm

    threads = threads or DETERMINISTIC_THREADS
    torch.set_num_threads(threads)
    # torch.use_deterministic_algorithms (seed_everything) fills each torch.empty with NaN: the GEMMs' outputs, which
    # they overwrite whole, paid a second pass over memory each (a quarter of a pretraining step)
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.mkldnn.enabled = False
    torch.backends.nnpack.set_flags(False)
    gemm.route(threads)
    _stage_threads = threads
