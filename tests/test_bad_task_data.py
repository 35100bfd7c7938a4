"""Bad task data (issue 16): each mistake in a task file is one line naming the file, the array and what was
expected; through the real CLI it exits 2 with no traceback and touches no output.

The task files are built here, small, with save_state_dict (not save_task, which would refuse them)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from mergeflow.pipeline import stages
from mergeflow.params import parse_params
from mergeflow.ml.data import load_task, save_task
from mergeflow.core.errors import MergeflowError
from mergeflow.core.io import save_state_dict
from mergeflow.ml.models import build_backbone, load_head
from mergeflow.pipeline.stages import Layout
from mergeflow.ml.probes import fit_probe
from tests.profiles import tiny_params

SIZES = {"train": 12, "val": 4, "test": 6}
TEN_CLASSES = [str(i) for i in range(10)]
ALL_ARRAYS = "train_x, train_y, val_x, val_y, test_x, test_y"
MERGEFLOW = Path(sys.executable).with_name("mergeflow")


def _arrays(size: int = 32) -> dict[str, torch.Tensor]:
    """A valid task: random uint8 images, labels 0, 1, ..., 9, 0, 1, ... (every class in train's 12)."""
    g = torch.Generator().manual_seed(0)
    arrays = {}
    for split, n in SIZES.items():
        arrays[f"{split}_x"] = torch.randint(0, 256, (n, size, size, 3), dtype=torch.uint8, generator=g)
        arrays[f"{split}_y"] = torch.arange(n) % 10
    return arrays


def _write(path: Path, arrays: dict, classes=TEN_CLASSES, **metadata) -> Path:
    meta = {"task": path.stem, "classes": json.dumps(classes)} if classes is not None else {"task": path.stem}
    save_state_dict(path, arrays, meta | metadata)
    return path


def _with(change):
    arrays = _arrays()
    change(arrays)
    return arrays


def _set(name, index, value):
    def change(arrays):
        arrays[name] = arrays[name].clone()
        arrays[name][index] = value

    return change


def test_a_valid_task_file_loads_with_int64_labels(tmp_path):
    arrays = _arrays()
    arrays["val_y"] = arrays["val_y"].to(torch.int32)  # any integer dtype is accepted, and comes back int64
    task = load_task(_write(tmp_path / "digits.safetensors", arrays), 32)
    assert task.classes == TEN_CLASSES and task.name == "digits"
    assert task.val.labels.dtype == torch.int64 and task.val.labels.tolist() == [0, 1, 2, 3]
    assert torch.equal(task.test.inputs, arrays["test_x"])


# (what is wrong, the array dict, the message after "<file>: ")
BAD_ARRAYS = [
    (
        "label 99 of 10 classes",
        _with(_set("test_y", 2, 99)),
        "array 'test_y' has label 99, but the task declares 10 classes",
    ),
    ("negative label", _with(_set("val_y", 0, -1)), "array 'val_y' has label -1, but the task declares 10 classes"),
    (
        "float32 images",
        _with(lambda a: a.update(test_x=a["test_x"].float())),
        "array 'test_x' has dtype float32, expected uint8 images [N, 32, 32, 3]",
    ),
    ("array missing", _with(lambda a: a.pop("test_x")), f"array 'test_x' is missing (a task file holds {ALL_ARRAYS})"),
    (
        "array misnamed",
        _with(lambda a: a.update(train_labels=a.pop("train_y"))),
        f"array 'train_y' is missing (a task file holds {ALL_ARRAYS})",
    ),
    (
        "unexpected array",
        _with(lambda a: a.update(extra_x=a["val_x"].clone())),
        f"unexpected array 'extra_x' (a task file holds only {ALL_ARRAYS})",
    ),
    (
        "images of another size",
        _with(lambda a: a.update(train_x=torch.zeros(12, 28, 28, 3, dtype=torch.uint8))),
        "array 'train_x' has shape (12, 28, 28, 3), expected uint8 images [N, 32, 32, 3]",
    ),
    (
        "channels first",
        _with(lambda a: a.update(val_x=a["val_x"].permute(0, 3, 1, 2).contiguous())),
        "array 'val_x' has shape (4, 3, 32, 32), expected uint8 images [N, 32, 32, 3]",
    ),
    (
        "grey images",
        _with(lambda a: a.update(test_x=a["test_x"][..., 0].contiguous())),
        "array 'test_x' has shape (6, 32, 32), expected uint8 images [N, 32, 32, 3]",
    ),
    (
        "float labels",
        _with(lambda a: a.update(train_y=a["train_y"].float())),
        "array 'train_y' has dtype float32, expected integer labels [N]",
    ),
    (
        "one-hot labels",
        _with(lambda a: a.update(test_y=torch.nn.functional.one_hot(a["test_y"], 10))),
        "array 'test_y' has shape (6, 10), expected integer labels [N]",
    ),
    (
        "empty split",
        _with(lambda a: a.update(val_x=a["val_x"][:0], val_y=a["val_y"][:0])),
        "array 'val_x' is empty, expected at least one image",
    ),
    (
        "one label short",
        _with(lambda a: a.update(test_y=a["test_y"][:5])),
        "array 'test_x' has 6 images but 'test_y' has 5 labels",
    ),
    (
        "one class in train",
        _with(lambda a: a.update(train_y=torch.full((12,), 3))),
        "array 'train_y' holds only label 3, expected at least two classes",
    ),
]


@pytest.mark.parametrize("arrays, message", [case[1:] for case in BAD_ARRAYS], ids=[case[0] for case in BAD_ARRAYS])
def test_bad_arrays_are_one_line_naming_file_and_array(tmp_path, arrays, message):
    path = _write(tmp_path / "digits.safetensors", arrays)
    with pytest.raises(MergeflowError) as err:
        load_task(path, 32)
    assert str(err.value) == f"{path}: {message}"


def test_without_image_size_every_split_needs_trains_square_size(tmp_path):
    arrays = _with(lambda a: a.update(test_x=torch.zeros(6, 16, 16, 3, dtype=torch.uint8)))
    path = _write(tmp_path / "digits.safetensors", arrays)
    with pytest.raises(MergeflowError) as err:
        load_task(path)
    assert str(err.value) == f"{path}: array 'test_x' has shape (6, 16, 16, 3), expected uint8 images [N, 32, 32, 3]"


@pytest.mark.parametrize(
    "classes, message",
    [
        (None, "metadata 'classes' is missing (a task file declares its class names, a JSON list)"),
        (["only"], "metadata 'classes' is [\"only\"], expected a JSON list of at least two class names"),
        (
            {"a": 0, "b": 1},
            'metadata \'classes\' is {"a": 0, "b": 1}, expected a JSON list of at least two class names',
        ),
        ([0, 1], "metadata 'classes' is [0, 1], expected a JSON list of at least two class names"),
    ],
)
def test_bad_classes_metadata_is_one_line(tmp_path, classes, message):
    path = _write(tmp_path / "digits.safetensors", _arrays(), classes)
    with pytest.raises(MergeflowError) as err:
        load_task(path, 32)
    assert str(err.value) == f"{path}: {message}"


def test_classes_metadata_that_is_not_json_is_one_line(tmp_path):
    path = tmp_path / "digits.safetensors"
    save_state_dict(path, _arrays(), {"task": "digits", "classes": "0,1,2"})
    with pytest.raises(MergeflowError) as err:
        load_task(path, 32)
    assert str(err.value) == f"{path}: metadata 'classes' is not JSON, expected a JSON list of class names"


def test_missing_and_corrupt_task_files_are_one_line(tmp_path):
    with pytest.raises(MergeflowError) as err:
        load_task(tmp_path / "digits.safetensors", 32)
    assert str(err.value) == f"{tmp_path / 'digits.safetensors'}: task data not found (the prepare stage writes it)"
    corrupt = tmp_path / "count.safetensors"
    corrupt.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(MergeflowError, match=rf"^{corrupt}: not a readable safetensors file \(.+\)$"):
        load_task(corrupt, 32)


def test_prepare_refuses_to_write_a_task_with_labels_beyond_its_classes(tmp_path):
    """save_task (the prepare stage's writer) runs the same check: a converter's mistake never reaches disk."""
    arrays = {k: v.numpy() for k, v in _arrays().items()}
    arrays["train_y"][5] = 10  # classes are 0..9
    path = tmp_path / "data" / "tasks" / "digits.safetensors"
    with pytest.raises(MergeflowError) as err:
        save_task(path, "digits", arrays, TEN_CLASSES, 32)
    assert str(err.value) == f"{path}: array 'train_y' has label 10, but the task declares 10 classes"
    assert not path.parent.exists() or list(path.parent.iterdir()) == []


def test_probe_head_has_one_row_per_declared_class(tmp_path):
    """The head's size comes from the task's declared classes, not from the largest label seen."""
    from mergeflow.config import ProbeConfig

    g = torch.Generator().manual_seed(0)
    labels = torch.arange(30) % 3  # classes 3 and 4 of 5 never occur
    features = torch.randn(30, 4, generator=g) + torch.nn.functional.one_hot(labels, 4).float() * 3
    probe = fit_probe(
        features[:24], labels[:24], features[24:], labels[24:], ProbeConfig(c_grid=[1.0]), seed=0, num_classes=5
    )
    assert probe.head.weight.shape == (5, 4)
    assert set(probe.head(features).argmax(1).tolist()) <= {0, 1, 2}  # an absent class is never predicted


def test_head_with_another_number_of_classes_than_its_task_is_one_line(tmp_path):
    head = tmp_path / "digits.safetensors"
    save_state_dict(head, {"weight": torch.zeros(11, 32), "bias": torch.zeros(11)})
    with pytest.raises(MergeflowError) as err:
        load_head(head, 32, num_classes=10, classes_source="data/tasks/digits.safetensors")
    assert (
        str(err.value) == f"{head}: tensor 'weight' has 11 rows, but data/tasks/digits.safetensors declares 10 classes"
    )
    assert load_head(head, 32, num_classes=11, classes_source="data/tasks/digits.safetensors").out_features == 11


# ---------------------------------------------------------------- the pretraining corpus
def _corpus(n: int = 8) -> dict[str, torch.Tensor]:
    return {
        "images": torch.zeros(n, 32, 32, 3, dtype=torch.uint8),
        "shape": torch.arange(n) % 4,
        "hue": torch.arange(n) % 2,
    }


BAD_CORPORA = [
    (
        "images missing",
        lambda c: c.pop("images"),
        "array 'images' is missing (the pretraining corpus holds "
        "uint8 images [N, 32, 32, 3] and integer labels [N] per head)",
    ),
    (
        "float images",
        lambda c: c.update(images=c["images"].float()),
        "array 'images' has dtype float32 and shape (8, 32, 32, 3), expected uint8 images [N, 32, 32, 3]",
    ),
    (
        "images of another size",
        lambda c: c.update(images=torch.zeros(8, 16, 16, 3, dtype=torch.uint8)),
        "array 'images' has dtype uint8 and shape (8, 16, 16, 3), expected uint8 images [N, 32, 32, 3]",
    ),
    (
        "labels short",
        lambda c: c.update(hue=c["hue"][:7]),
        "array 'hue' has dtype int64 and shape (7,), expected integer labels [8], one per image",
    ),
    (
        "float labels",
        lambda c: c.update(shape=c["shape"].float()),
        "array 'shape' has dtype float32 and shape (8,), expected integer labels [8], one per image",
    ),
]


@pytest.mark.parametrize("change, message", [c[1:] for c in BAD_CORPORA], ids=[c[0] for c in BAD_CORPORA])
def test_bad_pretraining_corpus_is_one_line_in_pretrain_and_finetune(tmp_path, repo_root, change, message):
    """pretrain reads the whole corpus; finetune's feature anchor only its header and images: both check it."""
    params = parse_params(tiny_params(repo_root / "params.yaml"))
    layout = Layout(tmp_path)
    corpus = _corpus()
    change(corpus)
    save_state_dict(layout.pretrain_corpus, corpus)
    for stage in (
        lambda: stages.pretrain(params, layout),
        lambda: stages._feature_anchor(params, layout, None, 0, torch.device("cpu")),
    ):
        with pytest.raises(MergeflowError) as err:
            stage()
        assert str(err.value) == f"{layout.pretrain_corpus}: {message}"
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["pretrain.safetensors"]


def _with_corpus_label(label: int) -> dict[str, torch.Tensor]:
    corpus = _corpus()
    corpus["hue"][3] = label
    return corpus


def test_negative_pretraining_label_is_one_line(tmp_path, repo_root):
    params = parse_params(tiny_params(repo_root / "params.yaml"))
    layout = Layout(tmp_path)
    save_state_dict(layout.pretrain_corpus, _with_corpus_label(-2))
    with pytest.raises(MergeflowError) as err:
        stages.pretrain(params, layout)
    assert str(err.value) == f"{layout.pretrain_corpus}: array 'hue' has label -2, expected labels >= 0"
    assert not layout.pretrained.exists()


# ---------------------------------------------------------------- through the real CLI
def _project(root: Path, repo_root: Path) -> tuple[Path, Layout]:
    """A tiny project, laid out like stages.Layout: params.yaml (tiny profile, tasks digits and count), valid task
    files, a backbone and a small pretraining corpus."""
    raw = tiny_params(repo_root / "params.yaml", suite={"tasks": ["digits", "count"]})
    (root / "params.yaml").write_text(yaml.safe_dump(raw))
    layout = Layout(root)
    params = parse_params(raw)
    for task in params.suite.tasks:
        _write(layout.task_data(task), _arrays())
    save_state_dict(layout.pretrained, build_backbone(params.backbone).net.state_dict())
    save_state_dict(
        layout.pretrain_corpus,
        {
            "images": torch.randint(
                0, 256, (32, 32, 32, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
            )
        },
    )
    return root / "params.yaml", layout


def _snapshot(root: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under the project, hidden temporary files included: (mtime in ns, contents)."""
    return {
        str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(root.rglob("*")) if p.is_file()
    }


def _run(root: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "DVC_STAGE"} | {"HF_HUB_OFFLINE": "1"} | env
    return subprocess.run(
        [str(MERGEFLOW), "--params", "params.yaml", *args], cwd=root, env=environment, capture_output=True, text=True
    )


def _assert_one_line_exit_2(result: subprocess.CompletedProcess, message: str) -> None:
    assert "Traceback" not in result.stderr, result.stderr
    assert (result.returncode, result.stderr) == (2, f"error: {message}\n")


@pytest.fixture(scope="module")
def finetuned_project(tmp_path_factory, repo_root):
    """The control: the same project with valid data fine-tunes (exit 0), so the failures below are the data's."""
    root = tmp_path_factory.mktemp("good")
    _, layout = _project(root, repo_root)
    result = _run(root, "finetune", "--task", "digits")
    assert result.returncode == 0, result.stderr
    assert load_head(layout.head("digits"), 32).out_features == 10
    return layout


CLI_CASES = [
    (
        "finetune",
        "digits",
        "test_y",
        _set("test_y", 2, 99),
        "array 'test_y' has label 99, but the task declares 10 classes",
    ),
    (
        "finetune",
        "digits",
        "test_x",
        lambda a: a.update(test_x=a["test_x"].float()),
        "array 'test_x' has dtype float32, expected uint8 images [N, 32, 32, 3]",
    ),
    (
        "finetune",
        "digits",
        "val_y",
        lambda a: a.pop("val_y"),
        f"array 'val_y' is missing (a task file holds {ALL_ARRAYS})",
    ),
    (
        "finetune",
        "digits",
        "train_x",
        lambda a: a.update(train_x=a["train_x"][:, :16].contiguous()),
        "array 'train_x' has shape (12, 16, 32, 3), expected uint8 images [N, 32, 32, 3]",
    ),
    ("merge", "count", "val_y", _set("val_y", 0, -1), "array 'val_y' has label -1, but the task declares 10 classes"),
]


@pytest.mark.parametrize("stage, task, array, change, message", CLI_CASES, ids=[f"{c[0]}-{c[2]}" for c in CLI_CASES])
def test_cli_bad_task_data_exits_2_with_one_line_and_touches_nothing(
    tmp_path, repo_root, finetuned_project, stage, task, array, change, message
):
    _, layout = _project(tmp_path, repo_root)
    if stage == "merge":  # its other inputs, valid: task vectors and heads for both tasks
        theta0 = build_backbone(
            parse_params(yaml.safe_load((tmp_path / "params.yaml").read_text())).backbone
        ).net.state_dict()
        for t in ("digits", "count"):
            save_state_dict(layout.vectors / f"{t}.safetensors", {k: torch.zeros_like(v) for k, v in theta0.items()})
            save_state_dict(layout.head(t), {"weight": torch.zeros(10, 32), "bias": torch.zeros(10)})
    _write(layout.task_data(task), _with(change))
    before = _snapshot(tmp_path)
    result = _run(
        tmp_path,
        stage,
        "--task" if stage == "finetune" else "--method",
        task if stage == "finetune" else "weight_averaging",
    )
    _assert_one_line_exit_2(result, f"data/tasks/{task}.safetensors: {message}")
    assert _snapshot(tmp_path) == before
