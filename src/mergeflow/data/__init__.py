"""Task data: every source (the embedded suite, ImageFolder trees, torchvision datasets) is converted once, by
the ``prepare`` stage, into one safetensors file per task holding uint8 images [N, H, W, 3] and int64 labels for
the train, val and test splits. Every later stage reads only those files, and checks each when reading it
(``check_task``): a mistake in one is one line naming the file, the array and what was expected."""

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
    train: Split | None  # None: not read (load_task's splits)
    val: Split | None
    test: Split | None

    def split(self, name: str) -> Split:
        return getattr(self, name)


ARRAYS = tuple(f"{split}_{part}" for split in SPLITS for part in ("x", "y"))
_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _shape(tensor: torch.Tensor) -> tuple[int, ...]:
    return tuple(tensor.shape)


def check_task(arrays: dict[str, torch.Tensor], classes, source: str, image_size: int | None = None, splits: tuple[str, ...] = SPLITS) -> None:
    """Raise one line naming ``source`` (the task file), the array at fault and what was expected, unless
    ``arrays`` holds exactly ARRAYS: uint8 images [N, S, S, 3] (S = image_size, or the same square size in every
    split when None), integer labels [N] in 0 .. len(classes) - 1, at least one image per split."""
    if not isinstance(classes, list) or len(classes) < 2 or not all(isinstance(c, str) for c in classes):
        raise MergeflowError(f"{source}: metadata 'classes' is {json.dumps(classes)[:60]}, expected a JSON list of at least two class names")
    for name in ARRAYS:
        if name not in arrays and name.split("_")[0] in splits:
            raise MergeflowError(f"{source}: array '{name}' is missing (a task file holds {', '.join(ARRAYS)})")
    unexpected = sorted(set(arrays) - set(ARRAYS))
    if unexpected:
        raise MergeflowError(f"{source}: unexpected array '{unexpected[0]}' (a task file holds only {', '.join(ARRAYS)})")
    size = image_size
    if size is None and arrays[f"{splits[0]}_x"].ndim == 4:
        size = arrays[f"{splits[0]}_x"].shape[1]  # no size given: every split must have the first's square size
    for split in splits:
        x, y = arrays[f"{split}_x"], arrays[f"{split}_y"]
        expected_x = f"uint8 images [N, {size}, {size}, 3]" if size else "uint8 images [N, H, H, 3]"
        if x.dtype != torch.uint8:
            raise MergeflowError(f"{source}: array '{split}_x' has dtype {str(x.dtype).removeprefix('torch.')}, expected {expected_x}")
        if x.ndim != 4 or _shape(x)[1:] != (size, size, 3):
            raise MergeflowError(f"{source}: array '{split}_x' has shape {_shape(x)}, expected {expected_x}")
        if y.dtype not in _INTEGER_DTYPES:
            raise MergeflowError(f"{source}: array '{split}_y' has dtype {str(y.dtype).removeprefix('torch.')}, expected integer labels [N]")
        if y.ndim != 1:
            raise MergeflowError(f"{source}: array '{split}_y' has shape {_shape(y)}, expected integer labels [N]")
        if len(x) == 0:
            raise MergeflowError(f"{source}: array '{split}_x' is empty, expected at least one image")
        if len(x) != len(y):
            raise MergeflowError(f"{source}: array '{split}_x' has {len(x)} images but '{split}_y' has {len(y)} labels")
        low, high = int(y.min()), int(y.max())
        if low < 0 or high >= len(classes):
            raise MergeflowError(f"{source}: array '{split}_y' has label {low if low < 0 else high}, but the task declares {len(classes)} classes")
        if split == "train" and low == high:
            # the probe's logistic regression needs two classes to tell apart
            raise MergeflowError(f"{source}: array 'train_y' holds only label {low}, expected at least two classes")


def check_corpus(specs: dict[str, tuple[tuple[int, ...], torch.dtype]], source: str, image_size: int, labels: dict[str, torch.Tensor] | None = None) -> None:
    """The pretraining corpus, from its arrays' shapes and dtypes (a file's header is enough): uint8 'images'
    [N, S, S, 3] (S = image_size) and, for each pretraining head, integer labels [N]; when ``labels`` (the arrays
    themselves) are given, no negative label either."""
    expected_images = f"uint8 images [N, {image_size}, {image_size}, 3]"
    if "images" not in specs:
        raise MergeflowError(f"{source}: array 'images' is missing (the pretraining corpus holds {expected_images} and integer labels [N] per head)")
    shape, dtype = specs["images"]
    if dtype != torch.uint8 or len(shape) != 4 or shape[1:] != (image_size, image_size, 3):
        raise MergeflowError(f"{source}: array 'images' has dtype {str(dtype).removeprefix('torch.')} and shape {shape}, expected {expected_images}")
    for name, (labels_shape, labels_dtype) in specs.items():
        if name != "images" and (labels_dtype not in _INTEGER_DTYPES or labels_shape != shape[:1]):
            raise MergeflowError(f"{source}: array '{name}' has dtype {str(labels_dtype).removeprefix('torch.')} and shape {labels_shape}, expected integer labels [{shape[0]}], one per image")
    for name, y in (labels or {}).items():
        # a head has as many classes as its largest label plus one: a negative label would index from the end
        if name != "images" and len(y) and int(y.min()) < 0:
            raise MergeflowError(f"{source}: array '{name}' has label {int(y.min())}, expected labels >= 0")


def save_task(path: Path, task: str, arrays: dict[str, np.ndarray], classes: list[str], image_size: int) -> None:
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}
    check_task(tensors, classes, str(path), image_size)
    tensors.update({k: v.long() for k, v in tensors.items() if k.endswith("_y")})
    save_state_dict(path, tensors, {"task": task, "classes": json.dumps(classes)})


def load_task(path: str | Path, image_size: int | None = None, splits: tuple[str, ...] = SPLITS) -> TaskData:
    """Read a task file and check it (``check_task``): images of ``image_size`` when given, labels within the
    declared classes; labels come back as int64. Only ``splits`` are read (a merge reads val and test: at 224
    pixels a train split is gigabytes); the others are None."""
    path = Path(path)
    if not path.is_file():
        raise MergeflowError(f"{path}: task data not found (the prepare stage writes it)")
    if splits == SPLITS:
        tensors = load_state_dict(path, check=False)
    else:
        from mergeflow.io import LazyStateDict

        lazy = LazyStateDict(path, check=False)
        tensors = {k: lazy[k] for k in lazy.keys() if k.split("_")[0] in splits or k not in ARRAYS}
    meta = load_metadata(path)
    if "classes" not in meta:
        raise MergeflowError(f"{path}: metadata 'classes' is missing (a task file declares its class names, a JSON list)")
    try:
        classes = json.loads(meta["classes"])
    except json.JSONDecodeError:
        raise MergeflowError(f"{path}: metadata 'classes' is not JSON, expected a JSON list of class names") from None
    check_task(tensors, classes, str(path), image_size, splits)
    return TaskData(
        name=meta.get("task", path.stem),
        classes=classes,
        **{s: Split(tensors[f"{s}_x"], tensors[f"{s}_y"].long()) if s in splits else None for s in SPLITS},
    )


def _resize_uint8(images: list, size: int) -> np.ndarray:
    from PIL import Image

    out = np.empty((len(images), size, size, 3), dtype=np.uint8)
    for i, img in enumerate(images):
        pil = (img if isinstance(img, Image.Image) else Image.fromarray(np.asarray(img))).convert("RGB")  # grayscale too
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


def _torchvision_task(cfg: SuiteConfig, task: str, seed: int, download: bool = False) -> tuple[dict[str, np.ndarray], list[str]]:
    """A benchmark dataset by the papers' name (``benchmark.BENCHMARK``: SUN397, Cars, ..., KMNIST) or any other
    torchvision dataset class by name, read from suite.root; downloaded only when ``download``. Only the picked
    images are decoded: n_train + n_val of train (val split off it), n_test of test."""
    from mergeflow.data import benchmark

    def load(split: str, n: int, rng: np.random.Generator):
        pool = benchmark.open_split(task, cfg.root, split, download)
        pick = np.sort(rng.choice(len(pool), min(n, len(pool)), replace=False))
        images, labels = pool.read(pick)
        return _resize_uint8(images, cfg.image_size), labels, pool

    x, y, pool = load("train", cfg.n_train + cfg.n_val, np.random.default_rng(seed + 1))
    train, val = _split_off(x, y, cfg.n_val, np.random.default_rng(seed))
    test_x, test_y, _ = load("test", cfg.n_test, np.random.default_rng(seed))
    entry = benchmark.entry(task)
    if entry.classes is not None:
        classes = list(entry.classes)
    else:
        classes = [str(c) for c in getattr(pool.parts[0][0], "classes", [])] or [str(i) for i in range(int(max(y.max(), test_y.max())) + 1)]
    return {"train_x": train[0], "train_y": train[1], "val_x": val[0], "val_y": val[1], "test_x": test_x, "test_y": test_y}, classes


def class_names(task: str, root: str | None = None, download: bool = False) -> list[str]:
    """Clean class names for a zero-shot head (see ``benchmark.class_names``)."""
    from mergeflow.data import benchmark

    return benchmark.class_names(task, root, download)


def templates(task: str) -> list[str]:
    """Zero-shot prompt templates, each with one '{}' (see ``benchmark.templates``)."""
    from mergeflow.data import benchmark

    return benchmark.templates(task)


def build_task(cfg: SuiteConfig, task: str, seed: int) -> tuple[dict[str, np.ndarray], list[str]]:
    if cfg.source == "embedded":
        from mergeflow.data import embedded

        if task not in embedded.TASKS:
            raise MergeflowError(f"suite.tasks: the embedded suite has no task '{task}' (tasks: {', '.join(embedded.TASKS)})")
        arrays = embedded.make_task(task, cfg.n_train, cfg.n_val, cfg.n_test, cfg.image_size, seed)
        return arrays, [str(i) for i in range(embedded.TASKS[task])]
    if cfg.source == "imagefolder":
        return _imagefolder_task(cfg, task, seed)
    return _torchvision_task(cfg, task, seed, download=getattr(cfg, "download", False))


def build_pretraining_corpus(cfg: SuiteConfig, seed: int) -> dict[str, np.ndarray]:
    from mergeflow.data import embedded

    return embedded.make_pretraining_corpus(cfg.pretrain_images, cfg.image_size, seed)
