"""Data sources: the embedded suite, an ImageFolder tree and a timm checkpoint from a local file (both written by
the test itself), through the real stage functions."""

import numpy as np
import pytest
import timm
import torch
import yaml
from PIL import Image
from safetensors.torch import save_file

from mergeflow.pipeline import stages
from mergeflow.params import parse_params
from mergeflow.ml.data import embedded, load_task
from mergeflow.core.errors import MergeflowError
from mergeflow.core.io import load_state_dict
from mergeflow.pipeline.stages import Layout

KWARGS = {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 1, "num_heads": 2}


def test_embedded_suite_is_deterministic_and_well_formed():
    a = embedded.make_task("digits", 40, 10, 12, 32, seed=3)
    b = embedded.make_task("digits", 40, 10, 12, 32, seed=3)
    for split, n in (("train", 40), ("val", 10), ("test", 12)):
        assert a[f"{split}_x"].shape == (n, 32, 32, 3) and a[f"{split}_x"].dtype == np.uint8
        assert np.array_equal(a[f"{split}_x"], b[f"{split}_x"]) and np.array_equal(a[f"{split}_y"], b[f"{split}_y"])
        assert a[f"{split}_y"].min() >= 0 and a[f"{split}_y"].max() < embedded.TASKS["digits"]
    assert not np.array_equal(a["train_x"][:10], a["val_x"])
    corpus = embedded.make_pretraining_corpus(64, 32, seed=0)
    assert corpus["images"].shape == (64, 32, 32, 3)
    assert set(corpus) == {"images", *embedded.PRETRAIN_HEADS}


def test_embedded_unknown_task_is_rejected():
    with pytest.raises(ValueError, match="cars"):
        embedded.make_task("cars", 4, 4, 4, 32, seed=0)


def _write_imagefolder(root, task, classes, per_split):
    rng = np.random.default_rng(0)
    for split, n in per_split.items():
        for ci, cls in enumerate(classes):
            d = root / task / split / cls
            d.mkdir(parents=True)
            for i in range(n):
                img = np.zeros((20, 24, 3), np.uint8)
                img[..., ci] = 200  # class = dominant channel: learnable
                img += rng.integers(0, 40, img.shape, dtype=np.uint8)
                Image.fromarray(img).save(d / f"{i}.png")


def test_imagefolder_and_local_timm_checkpoint_through_the_stages(repo_root, tmp_path):
    root = tmp_path / "folders"
    _write_imagefolder(root, "colours", ["red", "green", "blue"], {"train": 12, "test": 4})
    weights = tmp_path / "vit.safetensors"
    reference = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0, **KWARGS)
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(weights))

    raw = yaml.safe_load((repo_root / "params.yaml").read_text())
    raw["suite"] = {
        "name": "folders",
        "source": "imagefolder",
        "root": str(root),
        "tasks": ["colours"],
        "image_size": 32,
        "n_train": 30,
        "n_val": 6,
        "n_test": 12,
        "pretrain_images": 0,
    }
    # a CLS-token checkpoint, as on the hub: keep its own pooling (avg pooling would swap norm for a fresh fc_norm)
    raw["backbone"] = {
        "model": "vit_tiny_patch16_224",
        "kwargs": KWARGS,
        "pretrained": str(weights),
        "input_norm": "pretrained_cfg",
        "global_pool": "token",
    }
    raw["finetune"] = {"steps": 3, "batch_size": 8, "lr": 1e-3}
    raw["regimes"]["run"] = []  # MIMA's default 4 rounds do not split 3 steps (and this test runs no regime)
    params = parse_params(raw)
    layout = Layout(tmp_path / "repo")

    stages.prepare(params, layout)
    task = load_task(layout.task_data("colours"))
    assert task.classes == ["blue", "green", "red"]
    assert (
        len(task.train.labels) == 30 and len(task.val.labels) == 6 and len(task.test.labels) == 12
    )  # val split off train
    assert task.train.inputs.shape[1:] == (32, 32, 3)

    stages.pretrain(params, layout)
    loaded = load_state_dict(layout.pretrained)
    assert all(torch.equal(loaded[k], v) for k, v in reference.state_dict().items())

    metrics = stages.finetune(params, "colours", layout)
    assert 0.0 <= metrics["probe"]["test"] <= 1.0 and metrics["steps"] == 3
    assert set(load_state_dict(layout.finetuned("colours"))) == set(loaded)


def test_missing_local_weights_file_is_one_line(repo_root, tmp_path):
    raw = yaml.safe_load((repo_root / "params.yaml").read_text())
    raw["backbone"]["pretrained"] = str(tmp_path / "absent.safetensors")
    with pytest.raises(MergeflowError, match=r"backbone.pretrained: weights file '.*absent.safetensors' not found"):
        stages.pretrain(parse_params(raw), Layout(tmp_path))
    assert not (tmp_path / "models").exists()


def test_imagefolder_without_test_split_is_one_line(repo_root, tmp_path):
    _write_imagefolder(tmp_path, "t", ["a", "b"], {"train": 2})
    raw = yaml.safe_load((repo_root / "params.yaml").read_text())
    raw["suite"] = {"source": "imagefolder", "root": str(tmp_path), "tasks": ["t"]}
    with pytest.raises(MergeflowError, match=r"suite.root: '.*t' needs train/ and test/"):
        stages.prepare(parse_params(raw), Layout(tmp_path / "repo"))


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda t: (t / "train" / "red" / "3.png").write_bytes((t / "train" / "red" / "3.png").read_bytes()[:60]),
            r"3.png",
        ),
        (
            lambda t: [f.unlink() for f in (t / "train" / "blue").iterdir()],
            r"train/blue: an empty class folder \(class 'blue' would have no train image",
        ),
    ],
    ids=[
        "truncated image",
        "empty class folder",
    ],  # a layout error (a class outside train's): tests/test_check_sources.py
)
def test_a_broken_imagefolder_task_writes_no_task_and_no_import_link(repo_root, tmp_path, damage, message):
    """prepare converts every task or none: with the second task's folder broken, the first task's file (converted
    already, or not) is not left in data/, nor an imports/ link; the error is one line naming the file."""
    root = tmp_path / "folders"
    _write_imagefolder(root, "good", ["red", "green", "blue"], {"train": 6, "test": 3})
    _write_imagefolder(root, "broken", ["red", "green", "blue"], {"train": 6, "test": 3})
    damage(root / "broken")
    raw = yaml.safe_load((repo_root / "params.yaml").read_text())
    raw["suite"] = {
        "source": "imagefolder",
        "root": str(root),
        "tasks": ["good", "broken"],
        "image_size": 32,
        "n_train": 12,
        "n_val": 4,
        "n_test": 6,
        "pretrain_images": 8,
    }
    layout = Layout(tmp_path / "repo")
    with pytest.raises(MergeflowError, match=message):
        stages.prepare(parse_params(raw), layout)
    left = sorted(str(p.relative_to(layout.root)) for p in layout.root.rglob("*") if not p.is_dir())
    assert left == [], left


def test_checkpoints_are_byte_identical_across_processes(tmp_path):
    """The same tensors and metadata saved by two processes give the same bytes: DVC hashes files, so anything
    else (safetensors writes its metadata map in a per-process random order) re-runs every later stage."""
    import hashlib
    import subprocess
    import sys

    script = (
        "import sys, torch; from mergeflow.core.io import save_state_dict;"
        "save_state_dict(sys.argv[1], {'w': torch.arange(6.0).reshape(2, 3), 'b': torch.ones(2)},"
        " {k: k.upper() for k in ('model', 'kwargs', 'global_pool', 'input_norm', 'task', 'epoch')})"
    )
    paths = [tmp_path / f"run{i}.safetensors" for i in range(3)]
    for path in paths:
        subprocess.run([sys.executable, "-c", script, str(path)], check=True)
    assert len({hashlib.md5(p.read_bytes()).hexdigest() for p in paths}) == 1
    from mergeflow.core.io import load_metadata

    assert load_metadata(paths[0])["global_pool"] == "GLOBAL_POOL"


def test_a_merge_reads_only_the_splits_it_evaluates(tmp_path):
    # at 224 pixels a train split is gigabytes: merges read val and test only, equal to the full read
    arrays = embedded.make_task("digits", 40, 10, 12, 32, seed=3)
    from mergeflow.ml.data import save_task

    save_task(tmp_path / "digits.safetensors", "digits", arrays, [str(i) for i in range(10)], 32)
    full = load_task(tmp_path / "digits.safetensors", 32)
    some = load_task(tmp_path / "digits.safetensors", 32, ("val", "test"))
    assert some.train is None and some.classes == full.classes
    for split in ("val", "test"):
        assert torch.equal(some.split(split).inputs, full.split(split).inputs) and torch.equal(
            some.split(split).labels, full.split(split).labels
        )
