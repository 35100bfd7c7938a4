"""Validating params.yaml needs no torch: `mergeflow check` answers in well under a second, `--help` and
`--version` at once (the issue "The daily loop in minutes"). The merge methods and the studies register from their
own modules, which import torch (and numba, through the compiled kernels) inside their functions: mergeflow.ml.merging.

Each check runs in a fresh interpreter, since this one has torch loaded already."""

import json
import os
import pkgutil
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "numba")


def fresh(code: str, cwd: Path = REPO) -> dict:
    """``out``, the dict ``code`` builds, with "heavy": the packages of HEAVY it imported (which module imports one:
    ``python -X importtime -c ...``), run by a new interpreter on this tree's sources."""
    code += (
        f"\nimport json, sys\nout['heavy'] = sorted({{m.split('.')[0] for "
        f"m in sys.modules}} & {set(HEAVY)!r})\nprint(json.dumps(out))\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH")) if p),
        "HF_HUB_OFFLINE": "1",
    }
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def modules_of(package: str) -> set[str]:
    """The registering modules of a package of src/mergeflow (its files not starting with '_'), by name."""
    from mergeflow.ml.merging import NOT_METHODS

    return {
        m.name
        for m in pkgutil.iter_modules([str(REPO / "src" / "mergeflow" / package)])
        if not m.name.startswith("_") and m.name not in NOT_METHODS
    }


def test_params_and_the_registries_load_without_torch_or_numba():
    out = fresh(f"""
from mergeflow.params import load_params
params = load_params({str(REPO / "params.yaml")!r})
import mergeflow.ml.merging
from mergeflow.ml.merging import REGISTRY
from mergeflow.studies import REGISTRY as STUDIES
from mergeflow.ml.regimes import REGISTRY as REGIMES
out = {{
    "regimes": {{name: [list(r.methods), r.own_model, r.settings_model is not None, params.regimes.methods_of(name) if \
r.settings_model else None] for name, r in REGIMES.items()}},
    "methods": {{name: [m.fn.__module__.rsplit(".", 1)[1], m.kind, m.reads, m.coefficient, m.defaults, m.grid, \
m.per_task_grid, {{k: str(r) for k, r in m.ranges.items()}}] for name, m in REGISTRY.items()}},
    "joint": sorted(name for name, m in REGISTRY.items() if m.joint),
    "studies": sorted(STUDIES),
    "merge_methods": params.merge.methods,
}}
""")
    assert out["heavy"] == [], f"validating params.yaml imported {out['heavy']}"
    from mergeflow.ml.lora import DEFAULT_TARGETS
    from mergeflow.ml.merging import REGISTRY
    from mergeflow.ml.regimes import REGISTRY as REGIMES
    from mergeflow.ml.regimes.lora import TARGETS

    # every regime registered without torch as with it, its settings and default methods beside its function
    assert set(out["regimes"]) == set(REGIMES) == modules_of("ml/regimes") and TARGETS == DEFAULT_TARGETS
    assert out["regimes"]["mima"][:3] == [["weight_averaging", "task_arithmetic", "ties"], True, True]
    assert out["regimes"]["standard"][2] is False  # the pipeline's own fine-tune: no regime@standard stage

    # every method module registered, and each method as the full import (torch loaded) registers it
    assert {module for module, *_ in out["methods"].values()} == modules_of("ml/merging")
    assert set(out["methods"]) == set(REGISTRY)
    for name, m in REGISTRY.items():
        full = [
            m.fn.__module__.rsplit(".", 1)[1],
            m.kind,
            m.reads,
            m.coefficient,
            m.defaults,
            m.grid,
            m.per_task_grid,
            {k: str(r) for k, r in m.ranges.items()},
        ]
        assert out["methods"][name] == json.loads(json.dumps(full)), name
    assert out["joint"] == sorted(name for name, m in REGISTRY.items() if m.joint) and "breadcrumbs" in out["joint"]
    assert set(out["studies"]) == modules_of("studies")
    assert out["merge_methods"]


def test_the_light_registry_still_refuses_a_bad_override():
    out = fresh("""
from mergeflow.ml.merging import REGISTRY, validate_overrides
out = {"errors": []}
for overrides in ({"gamma": 0.9, "beta": 0.2}, {"alpha": "big"}, {"rounding": "ceil"}):
    try:
        validate_overrides(REGISTRY["breadcrumbs"], overrides, where="merge.breadcrumbs")
    except ValueError as err:
        out["errors"].append(str(err))
""")
    assert out["heavy"] == []
    assert (
        len(out["errors"]) == 3
        and "gamma + beta <= 1" in out["errors"][0]
        and out["errors"][2].startswith("merge.breadcrumbs.rounding:")
    )


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["check"], ["methods"]])
def test_check_help_version_and_methods_import_no_torch(argv, tmp_path):
    """In a copy of the project's params.yaml, dvc.yaml and dvc.lock, as on a fresh clone: no good copy of the lock
    yet, which `check` writes (through mergeflow.core.files, not the torch-importing mergeflow.core.io)."""
    for name in ("params.yaml", "dvc.yaml", "dvc.lock"):
        shutil.copy(REPO / name, tmp_path / name)
    out = fresh(
        f"""
from mergeflow.cli import main
try:
    code = main({argv!r})
except SystemExit as exit:
    code = exit.code
out = {{"code": code}}
""",
        cwd=tmp_path,
    )
    assert out["code"] in (0, None)
    assert out["heavy"] == [], f"mergeflow {' '.join(argv)} imported {out['heavy']}"


def test_a_stage_command_sent_to_the_stage_server_imports_no_torch():
    """`mergeflow <stage>` started by `mergeflow repro` or the flow asks for its parent-death signal, then hands its
    arguments to the stage server: neither may import torch (2 s a stage, 27 stages in the tiny run)."""
    out = fresh("""
import mergeflow.runner.lifetime, mergeflow.runner.stage_server, mergeflow.cli
from mergeflow.runner.lifetime import die_with_parent
from mergeflow.runner.stage_server import forward
out = {}
""")
    assert out["heavy"] == []


@pytest.mark.skipif(
    __import__("mergeflow.core.devices", fromlist=["x"]).gpu_driver_present(),
    reason="a GPU driver here: torch is asked",
)
def test_mergeflow_repro_on_a_machine_without_a_gpu_driver_imports_no_torch_to_find_none():
    """`mergeflow repro` asks for the GPUs before it starts its stage servers, and the stages' threads ask how many
    GPUs the run shares: where no GPU driver is installed both answer at once, without torch (1.2 s here)."""
    out = fresh("""
import os
os.environ.pop("CUDA_VISIBLE_DEVICES", None)
from mergeflow.params import load_params
from mergeflow.runner.gpus import visible_gpus
params = load_params("params.yaml")
out = {"gpus": visible_gpus(), "threads": params.stage_share("merge@ties", cores=16)}
""")
    assert out == {"gpus": [], "threads": 2, "heavy": []}


def test_the_check_for_lost_mlflow_runs_imports_no_torch(tmp_path):
    """`mergeflow repro` asks, before any stage, whether MLflow's store still holds track's run: without
    mergeflow.report.tracking's imports (torch and timm: 2.8 s of each run's start on this machine)."""
    out = fresh(f"""
from pathlib import Path
from mergeflow.core.mlflow_store import tracked_runs_lost
out = {{"lost": tracked_runs_lost(Path({str(tmp_path)!r}))}}
""")
    assert out == {"lost": None, "heavy": []}  # no results/ yet: nothing to have lost
