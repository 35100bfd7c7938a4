"""Task data: every source (the embedded suite, ImageFolder trees, torchvision datasets) is converted once, by
the ``prepare`` stage, into one safetensors file per task holding uint8 images [N, H, W, 3] and int64 labels for
the train, val and test splits. Every later stage reads only those files."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mergeflow.config import SuiteConfig
from mergeflow.errors import MergeflowError
from mergeflow.io import load_metadata, load_state_dict, save_state_dict

SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class Split:
    images: torch.Tensor  # uint8 [N, H, W, 3]
    labels: torch.Tensor  # int64 [N]


@dataclass(frozen=True)
class TaskData:
    name: str
    classes: list[str]
    train: Split
    val: Split
    test: Split

    def split(self, name: str) -> Split:
        return getattr(self, name)


def _check_arrays(arrays: dict[str, np.ndarray], task: str, image_size: int) -> None:
    for split in SPLITS:
        x, y = arrays.get(f"{split}_x"), arrays.get(f"{split}_y")
        if x is None or y is None:
            raise MergeflowError(f"task '{task}': split '{split}' is missing")
        if x.dtype != np.uint8 or x.ndim != 4 or x.shape[1:] != (image_size, image_size, 3):
            raise MergeflowError(f"task '{task}': {split}_x must be uint8 [N, {image_size}, {image_size}, 3], got {x.dtype} {x.shape}")
        if len(x) != len(y) or len(x) == 0:
            raise MergeflowError(f"task '{task}': {split} has {len(x)} images and {len(y)} labels")


def save_task(path: Path, task: str, arrays: dict[str, np.ndarray], classes: list[str], image_size: int) -> None:
    _check_arrays(arrays, task, image_size)
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}
    tensors.update({k: v.long() for k, v in tensors.items() if k.endswith("_y")})
    save_state_dict(path, tensors, {"task": task, "classes": json.dumps(classes)})


def load_task(path: str | Path) -> TaskData:
    path = Path(path)
    tensors = load_state_dict(path, check=False)
    meta = load_metadata(path)
    for split in SPLITS:
        for part in ("x", "y"):
            if f"{split}_{part}" not in tensors:
                raise MergeflowError(f"{path}: tensor '{split}_{part}' missing")
    classes = json.loads(meta.get("classes", "[]"))
    return TaskData(
        name=meta.get("task", path.stem),
        classes=classes,
        **{s: Split(tensors[f"{s}_x"], tensors[f"{s}_y"]) for s in SPLITS},
    )


def _resize_uint8(images: list[np.ndarray], size: int) -> np.ndarray:
    from PIL import Image

    out = np.empty((len(images), size, size, 3), dtype=np.uint8)
    for i, img in enumerate(images):
        pil = Image.fromarray(img).convert("RGB")
        out[i] = np.asarray(pil.resize((size, size), Image.BILINEAR))
    return out


def _split_off(x: np.ndarray, y: np.ndarray, n: int, rng: np.random.Generator):
    order = rng.permutation(len(x))
    return (x[order[n:]], y[order[n:]]), (x[order[:n]], y[order[:n]])


def _cap(x: np.ndarray, y: np.ndarray, n: int, rng: np.random.Generator):
    if len(x) <= n:
        return x, y
    keep = np.sort(rng.choice(len(x), n, replace=False))
    return x[keep], y[keep]


def _imagefolder_task(cfg: SuiteConfig, task: str, seed: int) -> tuple[dict[str, np.ndarray], list[str]]:
    """<root>/<task>/{train,val,test}/<class>/<image>; without val/, validation is split off train."""
    from PIL import Image

    base = Path(cfg.root) / task
    if not (base / "train").is_dir() or not (base / "test").is_dir():
        raise MergeflowError(f"suite.root: '{base}' needs train/ and test/ subdirectories of class folders")
    classes = sorted(p.name for p in (base / "train").iterdir() if p.is_dir())
    if not classes:
        raise MergeflowError(f"suite.root: '{base / 'train'}' has no class folders")
    index = {c: i for i, c in enumerate(classes)}

    def read(split: str) -> tuple[np.ndarray, np.ndarray]:
        images, labels = [], []
        for cls_dir in sorted(p for p in (base / split).iterdir() if p.is_dir()):
            if cls_dir.name not in index:
                raise MergeflowError(f"{cls_dir}: class '{cls_dir.name}' is not among the train classes")
            for f in sorted(cls_dir.iterdir()):
                try:
                    images.append(np.asarray(Image.open(f).convert("RGB")))
                except OSError:
                    raise MergeflowError(f"{f}: not a readable image") from None
                labels.append(index[cls_dir.name])
        if not images:
            raise MergeflowError(f"{base / split}: no images")
        return _resize_uint8(images, cfg.image_size), np.asarray(labels, dtype=np.int64)

    rng = np.random.default_rng(seed)
    train = read("train")
    if (base / "val").is_dir():
        val = read("val")
    else:
        train, val = _split_off(*train, min(cfg.n_val, len(train[0]) // 5), rng)
    test = read("test")
    arrays = {}
    for split, (x, y), n in (("train", train, cfg.n_train), ("val", val, cfg.n_val), ("test", test, cfg.n_test)):
        arrays[f"{split}_x"], arrays[f"{split}_y"] = _cap(x, y, n, rng)
    return arrays, classes


def _torchvision_task(cfg: SuiteConfig, task: str, seed: int) -> tuple[dict[str, np.ndarray], list[str]]:
    """A torchvision dataset class by name (MNIST, SVHN, CIFAR10, ...), read from suite.root, never downloaded."""
    import torchvision.datasets as tvd

    cls = getattr(tvd, task, None)
    if cls is None:
        raise MergeflowError(f"suite.tasks: '{task}' is not a torchvision dataset class")

    def load(train: bool):
        kwargs = {"split": "train" if train else "test"} if task in ("SVHN", "STL10", "DTD", "GTSRB", "EuroSAT") else {"train": train}
        try:
            ds = cls(root=cfg.root, download=False, **kwargs)
        except (RuntimeError, FileNotFoundError, TypeError) as err:
            raise MergeflowError(f"suite.root: torchvision {task} not readable under '{cfg.root}' ({str(err).splitlines()[0]})") from None
        rng = np.random.default_rng(seed + int(train))
        n = cfg.n_train + cfg.n_val if train else cfg.n_test
        pick = np.sort(rng.choice(len(ds), min(n, len(ds)), replace=False))
        images, labels = zip(*(ds[int(i)] for i in pick))
        x, y = _resize_uint8([np.asarray(im) for im in images], cfg.image_size), np.asarray(labels, dtype=np.int64)
        return x, y, [str(c) for c in getattr(ds, "classes", [])]

    rng = np.random.default_rng(seed)
    *train, classes = load(True)
    train, val = _split_off(*train, cfg.n_val, rng)
    *test, _ = load(False)
    classes = classes or [str(i) for i in range(int(train[1].max()) + 1)]
    return {"train_x": train[0], "train_y": train[1], "val_x": val[0], "val_y": val[1], "test_x": test[0], "test_y": test[1]}, classes


def build_task(cfg: SuiteConfig, task: str, seed: int) -> tuple[dict[str, np.ndarray], list[str]]:
    if cfg.source == "embedded":
        from mergeflow.data import embedded

        if task not in embedded.TASKS:
            raise MergeflowError(f"suite.tasks: the embedded suite has no task '{task}' (tasks: {', '.join(embedded.TASKS)})")
        arrays = embedded.make_task(task, cfg.n_train, cfg.n_val, cfg.n_test, cfg.image_size, seed)
        return arrays, [str(i) for i in range(embedded.TASKS[task])]
    if cfg.source == "imagefolder":
        return _imagefolder_task(cfg, task, seed)
    return _torchvision_task(cfg, task, seed)


def build_pretraining_corpus(cfg: SuiteConfig, seed: int) -> dict[str, np.ndarray]:
    from mergeflow.data import embedded

    return embedded.make_pretraining_corpus(cfg.pretrain_images, cfg.image_size, seed)
