"""params.yaml validation: one line naming the key and what is allowed, exit status 2, nothing written."""

import subprocess
import sys

import pytest
import yaml

from mergeflow.config import load_params, parse_params
from mergeflow.errors import MergeflowError


def test_repository_params_are_valid(repo_root):
    params = load_params(repo_root / "params.yaml")
    assert len(params.suite.tasks) >= 8
    assert params.merge.overrides("task_arithmetic")["lam"][0] == 0.05


def _with(repo_root, section, key, value):
    raw = yaml.safe_load((repo_root / "params.yaml").read_text())
    raw[section][key] = value
    return raw


@pytest.mark.parametrize(
    "section, key, value, pattern",
    [
        ("finetune", "lrr", 0.1, r"unknown key 'finetune.lrr' \(allowed here: steps, epochs, batch_size, lr,"),
        ("finetune", "steps", "many", r"finetune.steps: Input should be a valid integer"),
        ("finetune", "lr", -1.0, r"finetune.lr: Input should be greater than 0 \(got -1.0\)"),
        ("finetune", "optimizer", "adam", r"finetune.optimizer: Input should be 'adamw', 'sgd' or 'gd'"),
        ("suite", "tasks", ["digits", "digits"], r"suite.tasks: task 'digits' is listed twice"),
    ],
)
def test_bad_values_name_the_key(repo_root, section, key, value, pattern):
    with pytest.raises(MergeflowError, match=pattern):
        parse_params(_with(repo_root, section, key, value), "params.yaml")


def test_cli_bad_params_exit_2_one_line_nothing_written(repo_root, tmp_path):
    bad = _with(repo_root, "finetune", "lr", "fast")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(bad))
    proc = subprocess.run([sys.executable, "-m", "mergeflow.cli", "prepare"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "finetune.lr" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]


def test_cli_unknown_task_is_one_line(repo_root, tmp_path):
    (tmp_path / "params.yaml").write_text((repo_root / "params.yaml").read_text())
    proc = subprocess.run([sys.executable, "-m", "mergeflow.cli", "finetune", "--task", "cars"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: params.yaml: suite.tasks has no task 'cars' (tasks: {', '.join(load_params(tmp_path / 'params.yaml').suite.tasks)})"
    assert not (tmp_path / "models").exists()
