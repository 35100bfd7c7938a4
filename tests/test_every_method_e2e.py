"""Every registered method runs as a pipeline stage on the tiny profile (`dvc exp run -S "merge.methods=$(mergeflow
methods --list)"` runs them all on any suite): merge@<method> end to end on a copy of the tiny reference run, each
at its paper's defaults (one setting: the stage, not its search, which tests/test_search.py covers), in this
process. SLERP-like methods, which merge exactly two task models, are refused up front on a suite of three."""

import json
import math
import subprocess
import sys

import pytest
import yaml

from mergeflow.core.errors import MergeflowError
from mergeflow.params import load_params, parse_params
from mergeflow.ml.merging import REGISTRY
from mergeflow.pipeline.stages import Layout, merge

from .conftest import copy_project


def test_a_method_for_two_tasks_is_refused_on_three(repo_root, tmp_path):
    params = yaml.safe_load((repo_root / "params.yaml").read_text())
    params["suite"]["tasks"] = ["digits", "signs", "count"]
    params["merge"]["methods"].append("slerp")
    with pytest.raises(
        MergeflowError, match="^params.yaml: merge.methods: slerp merges exactly 2 task models, and suite.tasks has 3$"
    ):
        parse_params(params)
    params["suite"]["tasks"] = ["digits", "signs"]
    parse_params(params)
    path = tmp_path / "params.yaml"
    params["suite"]["tasks"] = ["digits", "signs", "count"]
    params["merge"]["methods"].remove("slerp")
    path.write_text(yaml.safe_dump(params))
    listed = subprocess.run(
        [sys.executable, "-m", "mergeflow.cli", "--params", str(path), "methods", "--list"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert listed == "[" + ",".join(sorted(n for n in REGISTRY if n not in ("slerp", "nuslerp"))) + "]"


@pytest.mark.e2e
def test_every_method_runs_as_a_stage_on_the_tiny_profile(tiny_reference, tmp_path):
    root = copy_project(tiny_reference[0], tmp_path / "every-method")
    raw = yaml.safe_load((root / "params.yaml").read_text())
    ran_already = set(raw["merge"]["methods"])
    names = [
        n for n, m in sorted(REGISTRY.items()) if m.tasks in (None, len(raw["suite"]["tasks"])) and n not in ran_already
    ]
    raw["merge"]["methods"] += names
    for name in names:  # one setting each: the paper's defaults
        raw["merge"][name] = dict(REGISTRY[name].defaults)
    if "gossip_adamerging" in names:  # its defaults are 20 rounds x T nodes x 400 Adam steps: minutes, not seconds
        raw["merge"]["gossip_adamerging"] |= {"rounds": 2, "steps": 3}
    (root / "params.yaml").write_text(yaml.safe_dump(raw))
    params = load_params(root / "params.yaml")
    layout = Layout(root)
    assert len(names) >= 25
    for name in names:
        metrics = merge(params, name, layout)
        evaluated = json.loads(layout.metrics("evaluate", name).read_text())
        assert layout.merged(name).stat().st_size > 0, name
        assert evaluated["searched"] == {} or evaluated["kind"] == "per_task", (name, evaluated["searched"])
        average = evaluated["average"]["target"] if evaluated["kind"] == "negation" else evaluated["average"]
        assert 0.0 <= average <= 1.0 and math.isfinite(
            metrics["val_average"] if "val_average" in metrics else average
        ), name
