"""params.yaml validation: one line naming the key and what is allowed, exit status 2, nothing written."""

import subprocess
import sys

import pytest
import yaml

from mergeflow.params import load_params, parse_params
from mergeflow.core.errors import MergeflowError


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
    assert proc.stderr.strip() == f"error: params.yaml: suite.tasks has no task 'cars' (listed: {', '.join(load_params(tmp_path / 'params.yaml').suite.tasks)})"
    assert not (tmp_path / "models").exists()


def test_suite_name_is_the_suite_that_runs(repo_root, tmp_path):
    # params.yaml leaves suite.name empty: the embedded suite is "embedded"; pointed at other data, the MLflow
    # experiment takes the data's folder name, never "embedded"; a name given is kept
    raw = yaml.safe_load((repo_root / "params.yaml").read_text())
    assert raw["suite"]["name"] is None and parse_params(raw).suite.name == "embedded"
    raw["suite"] |= {"source": "imagefolder", "root": str(tmp_path / "my lab's photos")}
    assert parse_params(raw).suite.name == "my-lab-s-photos"
    raw["suite"]["name"] = "photos2026"
    assert parse_params(raw).suite.name == "photos2026"
    from mergeflow.report.tracking import experiment_name

    assert experiment_name(parse_params(raw)) == "mergeflow/photos2026"


@pytest.mark.parametrize(
    "edit, pattern",
    [
        (lambda raw: raw["finetune"].update(head="zeroshot"), r"finetune.head: zeroshot needs CLIP's image embedding and text tower"),
        (lambda raw: raw["finetune"].update(checkpoints={"cars": "hf:someone/cars"}), r"finetune.checkpoints: 'cars' is not in suite.tasks"),
        (lambda raw: raw["backbone"].update(embedding="clip"), r"backbone.embedding: clip embeds CLIP's class token .* set backbone.global_pool: token and backbone.input_norm: pretrained_cfg \(not 'avg', 'center'\)"),
        (lambda raw: raw["backbone"].update(embedding="clip", global_pool="token", input_norm="pretrained_cfg"), None),  # only a stage builds the model: models' error
        (lambda raw: raw["finetune"].update(checkpoints={"digits": "hf:no-owner"}), r"finetune.checkpoints.digits: 'hf:no-owner' is not hf:<owner>/<repo>\[@<revision>\]"),
    ],
)
def test_clip_settings_are_checked_together(repo_root, edit, pattern):
    raw = yaml.safe_load((repo_root / "params.yaml").read_text())
    edit(raw)
    if pattern is None:
        parse_params(raw)
        return
    with pytest.raises(MergeflowError, match=pattern):
        parse_params(raw)


def test_check_finds_missing_weights_files_before_any_stage(repo_root, tmp_path):
    from mergeflow.runner.checks import check_project

    raw = yaml.safe_load((repo_root / "params.yaml").read_text())
    raw["finetune"]["checkpoints"] = {"digits": "published/digits.safetensors", "signs": "hf:someone/signs"}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(MergeflowError, match=r"params.yaml: finetune.checkpoints.digits: weights file 'published/digits.safetensors' not found$"):
        check_project(tmp_path)
    (tmp_path / "published").mkdir()
    (tmp_path / "published" / "digits.safetensors").write_bytes(b"")  # found, but not safetensors: its header says so
    with pytest.raises(MergeflowError, match=r"finetune.checkpoints.digits: 'published/digits.safetensors' is not a readable safetensors file \(.*header too small\)$"):
        check_project(tmp_path)
    from safetensors.numpy import save_file

    import numpy as np

    # timm's names and params.yaml's backbone shapes (width 128, patch 8, 4 blocks): its tensors are the stage's to read
    kw = raw["backbone"]["kwargs"]
    shapes = {"cls_token": (1, 1, kw["embed_dim"]), "pos_embed": (1, 17, kw["embed_dim"]), "patch_embed.proj.weight": (kw["embed_dim"], 3, kw["patch_size"], kw["patch_size"])}
    shapes |= {f"blocks.{i}.norm1.weight": (kw["embed_dim"],) for i in range(kw["depth"])}
    save_file({k: np.zeros(v, np.float32) for k, v in shapes.items()}, str(tmp_path / "published" / "digits.safetensors"))
    check_project(tmp_path)
