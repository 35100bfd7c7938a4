"""Task data: every source (the embedded suite, ImageFolder trees, torchvision datasets) is converted once, by
the ``prepare`` stage, into one safetensors file per task holding uint8 images [N, H, W, 3] and int64 labels for
the train, val and test splits. Every later stage reads only those files, and checks each when reading it
(``check_task``): a mistake in one is one line naming the file, the array and what was expected.

Importing this package imports no torch (``mergeflow check`` calls ``check_layout``, which must stay fast): the
functions that handle tensors import it themselves."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from mergeflow.ml.data._arrays import ARRAYS, SPLITS, check_array_names
from mergeflow.ml.data.images import resize_image
from mergeflow.core.errors import MergeflowError

if TYPE_CHECKING:
    import torch

    from mergeflow.config import Params, SuiteConfig
    from mergeflow.core.layout import Layout


@dataclass(frozen=True)
class Split:
    inputs: torch.Tensor  # uint8 images [N, H, W, 3], or text's int32 token ids [N, L]
    labels: torch.Tensor  # int64 [N]; a regression task's float32 scores


@dataclass(frozen=True)
class TaskData:
    name: str
    classes: list[str]
    train: Split | None  # None: not read (load_task's splits)
    val: Split | None
    test: Split | None
    # the task's score (mergeflow.ml.metrics): accuracy for images, GLUE's metric for a text task
    metric: str = "accuracy"
    # a text-to-text task's answers: each class's word's token id (metadata 'answers'), what its verbalizer head reads
    answers: list[int] | None = None

    def split(self, name: str) -> Split:
        return getattr(self, name)


def _integer_dtypes() -> tuple:
    import torch

    return (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _shape(tensor: torch.Tensor) -> tuple[int, ...]:
    return tuple(tensor.shape)


def check_task(
    arrays: dict[str, torch.Tensor],
    classes,
    source: str,
    image_size: int | None = None,
    splits: tuple[str, ...] = SPLITS,
) -> None:
    """Raise one line naming ``source`` (the task file), the array at fault and what was expected, unless
    ``arrays`` holds exactly ARRAYS: uint8 images [N, S, S, 3] (S = image_size, or the same square size in every
    split when None), integer labels [N] in 0 .. len(classes) - 1, at least one image per split."""
    import torch

    if not isinstance(classes, list) or len(classes) < 2 or not all(isinstance(c, str) for c in classes):
        raise MergeflowError(
            f"{source}: metadata 'classes' is {json.dumps(classes)[:60]}, "
            "expected a JSON list of at least two class names"
        )
    check_array_names(arrays, source, splits)
    size = image_size
    if size is None and arrays[f"{splits[0]}_x"].ndim == 4:
        size = arrays[f"{splits[0]}_x"].shape[1]  # no size given: every split must have the first's square size
    for split in splits:
        x, y = arrays[f"{split}_x"], arrays[f"{split}_y"]
        expected_x = f"uint8 images [N, {size}, {size}, 3]" if size else "uint8 images [N, H, H, 3]"
        if x.dtype != torch.uint8:
            raise MergeflowError(
                f"{source}: array '{split}_x' has dtype {str(x.dtype).removeprefix('torch.')}, expected {expected_x}"
            )
        if x.ndim != 4 or _shape(x)[1:] != (size, size, 3):
            raise MergeflowError(f"{source}: array '{split}_x' has shape {_shape(x)}, expected {expected_x}")
        if y.dtype not in _integer_dtypes():
            raise MergeflowError(
                f"{source}: array '{split}_y' has dtype "
                f"{str(y.dtype).removeprefix('torch.')}, expected integer labels [N]"
            )
        if y.ndim != 1:
            raise MergeflowError(f"{source}: array '{split}_y' has shape {_shape(y)}, expected integer labels [N]")
        if len(x) == 0:
            raise MergeflowError(f"{source}: array '{split}_x' is empty, expected at least one image")
        if len(x) != len(y):
            raise MergeflowError(f"{source}: array '{split}_x' has {len(x)} images but '{split}_y' has {len(y)} labels")
        low, high = int(y.min()), int(y.max())
        if low < 0 or high >= len(classes):
            raise MergeflowError(
                f"{source}: array '{split}_y' has label {low if low < 0 else high}, "
                f"but the task declares {len(classes)} classes"
            )
        if split == "train" and low == high:
            # the probe's logistic regression needs two classes to tell apart
            raise MergeflowError(f"{source}: array 'train_y' holds only label {low}, expected at least two classes")


def check_corpus(
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
    source: str,
    image_size: int,
    labels: dict[str, torch.Tensor] | None = None,
) -> None:
    """The pretraining corpus, from its arrays' shapes and dtypes (a file's header is enough): uint8 'images'
    [N, S, S, 3] (S = image_size) and, for each pretraining head, integer labels [N]; when ``labels`` (the arrays
    themselves) are given, no negative label either."""
    import torch

    expected_images = f"uint8 images [N, {image_size}, {image_size}, 3]"
    if "images" not in specs:
        raise MergeflowError(
            f"{source}: array 'images' is missing (the pretraining corpus "
            f"holds {expected_images} and integer labels [N] per head)"
        )
    shape, dtype = specs["images"]
    if dtype != torch.uint8 or len(shape) != 4 or shape[1:] != (image_size, image_size, 3):
        raise MergeflowError(
            f"{source}: array 'images' has dtype {str(dtype).removeprefix('torch.')} "
            f"and shape {shape}, expected {expected_images}"
        )
    for name, (labels_shape, labels_dtype) in specs.items():
        if name != "images" and (labels_dtype not in _integer_dtypes() or labels_shape != shape[:1]):
            raise MergeflowError(
                f"{source}: array '{name}' has dtype {str(labels_dtype).removeprefix('torch.')} and shape "
                f"{labels_shape}, expected integer labels [{shape[0]}], one per image"
            )
    for name, y in (labels or {}).items():
        # a head has as many classes as its largest label plus one: a negative label would index from the end
        if name != "images" and len(y) and int(y.min()) < 0:
            raise MergeflowError(f"{source}: array '{name}' has label {int(y.min())}, expected labels >= 0")


def save_task(path: Path, task: str, arrays: dict[str, np.ndarray], classes: list[str], image_size: int) -> None:
    import torch

    from mergeflow.core.io import save_state_dict

    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}
    check_task(tensors, classes, str(path), image_size)
    tensors.update({k: v.long() for k, v in tensors.items() if k.endswith("_y")})
    save_state_dict(path, tensors, {"task": task, "classes": json.dumps(classes)})


def load_task(path: str | Path, image_size: int | None = None, splits: tuple[str, ...] = SPLITS) -> TaskData:
    """Read a task file and check it (``check_task``): images of ``image_size`` when given, labels within the
    declared classes; labels come back as int64. Only ``splits`` are read (a merge reads val and test: at 224
    pixels a train split is gigabytes); the others are None."""
    from mergeflow.core.io import load_metadata, load_state_dict

    path = Path(path)
    if not path.is_file():
        raise MergeflowError(f"{path}: task data not found (the prepare stage writes it)")
    if splits == SPLITS:
        tensors = load_state_dict(path, check=False)
    else:
        from mergeflow.core.io import LazyStateDict

        lazy = LazyStateDict(path, check=False)
        tensors = {k: lazy[k] for k in lazy.keys() if k.split("_")[0] in splits or k not in ARRAYS}
    meta = load_metadata(path)
    if "classes" not in meta:
        raise MergeflowError(
            f"{path}: metadata 'classes' is missing (a task file declares its class names, a JSON list)"
        )
    try:
        classes = json.loads(meta["classes"])
    except json.JSONDecodeError:
        raise MergeflowError(f"{path}: metadata 'classes' is not JSON, expected a JSON list of class names") from None
    metric = meta.get("metric", "accuracy")
    if meta.get("modality", "image") == "text":
        from mergeflow.ml.data.text import check_text_task
        from mergeflow.ml.metrics import is_regression

        check_text_task(tensors, classes, metric, str(path), splits=splits)
        labels = (lambda y: y.float()) if is_regression(metric) else (lambda y: y.long())
        answers = _answers(meta, classes, path)
    else:
        check_task(tensors, classes, str(path), image_size, splits)
        labels, answers = (lambda y: y.long()), None  # noqa: E731
    return TaskData(
        name=meta.get("task", path.stem),
        classes=classes,
        **{s: Split(tensors[f"{s}_x"], labels(tensors[f"{s}_y"])) if s in splits else None for s in SPLITS},
        metric=metric,
        answers=answers,
    )


def _answers(meta: dict[str, str], classes: list[str], path: Path) -> list[int] | None:
    """A text-to-text task's answer token ids (metadata 'answers'): one distinct non-negative id per class."""
    if "answers" not in meta:
        return None
    try:
        answers = json.loads(meta["answers"])
    except json.JSONDecodeError:
        answers = None
    if (
        not isinstance(answers, list)
        or len(answers) != len(classes)
        or len(set(answers)) != len(answers)
        or not all(isinstance(a, int) and not isinstance(a, bool) and a >= 0 for a in answers)
    ):
        raise MergeflowError(
            f"{path}: metadata 'answers' is {meta['answers'][:60]}, expected "
            f"a JSON list of {len(classes)} distinct token ids (one per class)"
        )
    return answers


def load_tasks(params: Params, layout: Layout, splits: tuple[str, ...] = SPLITS) -> dict[str, TaskData]:
    """Every task of ``params.suite``, read from the pipeline's files (the prepare stage's outputs)."""
    return {t: load_task(layout.task_data(t), params.suite.image_size, splits) for t in params.suite.tasks}


def _decode_files(files, size: int, mode: str) -> np.ndarray:
    """Image files decoded one at a time, each resized at once into a preallocated uint8 [n, size, size, 3]."""
    from PIL import Image

    out = np.empty((len(files), size, size, 3), dtype=np.uint8)
    for i, f in enumerate(files):
        try:
            with Image.open(f) as img:
                out[i] = resize_image(img, size, mode)
        except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as err:
            raise MergeflowError(f"{f}: not a readable image ({_first_line(err)})") from None
    return out


def _first_line(err: BaseException) -> str:
    return (str(err).splitlines() or [""])[0] or type(err).__name__


def _split_off(x: np.ndarray, y: np.ndarray, n: int, rng: np.random.Generator):
    order = rng.permutation(len(x))
    return (x[order[n:]], y[order[n:]]), (x[order[:n]], y[order[:n]])


def _cap(x: np.ndarray, y: np.ndarray, n: int, rng: np.random.Generator):
    if len(x) <= n:
        return x, y
    keep = np.sort(rng.choice(len(x), n, replace=False))
    return x[keep], y[keep]


IMAGEFOLDER_LAYOUT = "<root>/<task>/{train,val,test}/<class>/<image>, val/ optional"


def imagefolder_layout(root: str | Path, task: str) -> tuple[Path, list[str]]:
    """The folder of ImageFolder task ``task`` under ``root`` and its classes (train/'s class folders, sorted),
    after checking its layout from folder listings alone (no image is opened): train/ and test/ (val/ optional)
    of class folders, no class outside train's, no empty class folder."""
    if not Path(root).is_dir():
        raise MergeflowError(
            f"suite.root: '{root}' not found (expected a folder of task folders: {IMAGEFOLDER_LAYOUT})"
        )
    base = Path(root) / task
    if not base.is_dir():
        raise MergeflowError(
            f"suite.tasks: task '{task}' has no folder in suite.root "
            f"('{base}' not found; expected {IMAGEFOLDER_LAYOUT})"
        )
    missing = [split for split in ("train", "test") if not (base / split).is_dir()]
    if missing:
        raise MergeflowError(
            f"suite.root: '{base}' needs train/ and test/ subdirectories of class folders ({missing[0]}/ is missing)"
        )
    classes = sorted(p.name for p in (base / "train").iterdir() if p.is_dir())
    if not classes:
        raise MergeflowError(f"suite.root: '{base / 'train'}' has no class folders")
    for split in SPLITS:
        if not (base / split).is_dir():
            continue
        folders = sorted(p for p in (base / split).iterdir() if p.is_dir())
        stranger = next((p for p in folders if p.name not in classes), None)
        if stranger is not None:
            raise MergeflowError(f"{stranger}: class '{stranger.name}' is not among the train classes")
        if not any(next(p.iterdir(), None) is not None for p in folders):
            raise MergeflowError(f"{base / split}: no images")
        if empty := next((p for p in folders if next(p.iterdir(), None) is None), None):
            raise MergeflowError(
                f"{empty}: an empty class folder (class '{empty.name}' would "
                f"have no {split} image: add images or remove the folder)"
            )
    return base, classes


def check_layout(cfg: SuiteConfig, task: str, download: bool = False) -> None:
    """Whether what ``build_task`` reads for ``task`` is there, checked cheaply, importing no torch: the embedded
    suite's task names; an ImageFolder task's folders (``imagefolder_layout``); a torchvision dataset's files
    (``benchmark.check_files``: what torchvision's own readers check first). The prepare stage calls it before it
    builds anything, and ``mergeflow check`` before any stage runs. One line naming suite.tasks or suite.root."""
    if cfg.source in ("embedded", "text", "text2text"):
        from mergeflow.ml.data import embedded, text_suite

        known = embedded.TASKS if cfg.source == "embedded" else text_suite.TASKS
        if task not in known:
            raise MergeflowError(
                f"suite.tasks: the {cfg.source} suite has no task '{task}' (tasks: {', '.join(known)})"
            )
    elif cfg.source == "glue":
        from mergeflow.ml.data.glue import check_glue

        check_glue(cfg.root, task)
    elif cfg.source == "imagefolder":
        imagefolder_layout(cfg.root, task)
    else:
        from mergeflow.ml.data import benchmark

        benchmark.check_files(task, cfg.root, download)


def _imagefolder_task(cfg: SuiteConfig, task: str, seed: int) -> tuple[dict[str, np.ndarray], list[str]]:
    """<root>/<task>/{train,val,test}/<class>/<image>; without val/, validation is split off train. The splits and
    caps are drawn over the file lists; only the files kept are decoded, each resized as it is read."""
    base, classes = imagefolder_layout(cfg.root, task)
    index = {c: i for i, c in enumerate(classes)}

    def listing(split: str) -> tuple[np.ndarray, np.ndarray]:
        files, labels = [], []
        for cls_dir in sorted(p for p in (base / split).iterdir() if p.is_dir()):
            if cls_dir.name not in index:
                raise MergeflowError(f"{cls_dir}: class '{cls_dir.name}' is not among the train classes")
            for f in sorted(cls_dir.iterdir()):
                files.append(str(f))
                labels.append(index[cls_dir.name])
        if not files:
            raise MergeflowError(f"{base / split}: no images")
        return np.asarray(files, dtype=object), np.asarray(labels, dtype=np.int64)

    rng = np.random.default_rng(seed)
    train = listing("train")
    if (base / "val").is_dir():
        val = listing("val")
    else:
        train, val = _split_off(*train, min(cfg.n_val, len(train[0]) // 5), rng)
    test = listing("test")
    arrays = {}
    for split, (files, y), n in (("train", train, cfg.n_train), ("val", val, cfg.n_val), ("test", test, cfg.n_test)):
        files, arrays[f"{split}_y"] = _cap(files, y, n, rng)
        arrays[f"{split}_x"] = _decode_files(files, cfg.image_size, getattr(cfg, "resize", "squash"))
    return arrays, classes


def _torchvision_task(
    cfg: SuiteConfig, task: str, seed: int, download: bool = False
) -> tuple[dict[str, np.ndarray], list[str]]:
    """A benchmark dataset by the papers' name (``benchmark.BENCHMARK``: SUN397, Cars, ..., KMNIST) or any other
    torchvision dataset class by name, read from suite.root; downloaded only when ``download``. Only the picked
    images are decoded: n_train + n_val of train (val split off it), n_test of test, each resized as it is decoded
    into its place in a preallocated array (train and val are views of one array: no copy)."""
    from mergeflow.ml.data import benchmark

    size, mode = cfg.image_size, getattr(cfg, "resize", "squash")
    pool = benchmark.open_split(task, cfg.root, "train", download)
    pick = np.sort(
        np.random.default_rng(seed + 1).choice(len(pool), min(cfg.n_train + cfg.n_val, len(pool)), replace=False)
    )
    # the val split off the picks (as _split_off): row k holds pick order[k], val the first n_val rows, train the rest
    order = np.random.default_rng(seed).permutation(len(pick))
    rows = np.empty_like(order)
    rows[order] = np.arange(len(order))
    x, y = pool.read(pick, size, mode, rows)
    n_val = min(cfg.n_val, len(x))
    test_pool = benchmark.open_split(task, cfg.root, "test", download)
    test_pick = np.sort(
        np.random.default_rng(seed).choice(len(test_pool), min(cfg.n_test, len(test_pool)), replace=False)
    )
    test_x, test_y = test_pool.read(test_pick, size, mode)
    entry = benchmark.entry(task)
    if entry.classes is not None:
        classes = list(entry.classes)
    else:
        classes = [str(c) for c in getattr(pool.parts[0][0], "classes", [])] or [
            str(i) for i in range(int(max(y.max(), test_y.max())) + 1)
        ]
    return {
        "train_x": x[n_val:],
        "train_y": y[n_val:],
        "val_x": x[:n_val],
        "val_y": y[:n_val],
        "test_x": test_x,
        "test_y": test_y,
    }, classes


def class_names(task: str, root: str | None = None, download: bool = False) -> list[str]:
    """Clean class names for a zero-shot head (see ``benchmark.class_names``)."""
    from mergeflow.ml.data import benchmark

    return benchmark.class_names(task, root, download)


def templates(task: str) -> list[str]:
    """Zero-shot prompt templates, each with one '{}' (see ``benchmark.templates``)."""
    from mergeflow.ml.data import benchmark

    return benchmark.templates(task)


def build_task(
    cfg: SuiteConfig, task: str, seed: int, download: bool | None = None
) -> tuple[dict[str, np.ndarray], list[str]]:
    """The task's arrays and class names. ``download`` (torchvision): may missing datasets be fetched; None:
    suite.download (the prepare stage passes ``Params.downloads()``, which --download also sets)."""
    download = getattr(cfg, "download", False) if download is None else download
    check_layout(cfg, task, download)
    if cfg.source == "embedded":
        from mergeflow.ml.data import embedded

        arrays = embedded.make_task(task, cfg.n_train, cfg.n_val, cfg.n_test, cfg.image_size, seed)
        return arrays, [str(i) for i in range(embedded.TASKS[task])]
    if cfg.source == "imagefolder":
        return _imagefolder_task(cfg, task, seed)
    return _torchvision_task(cfg, task, seed, download=download)


def write_task(
    path: Path, cfg: SuiteConfig, task: str, seed: int, download: bool | None = None, backbone=None
) -> dict[str, int]:
    """Build the task and save it (atomically, checked: ``save_task``) in this process: the prepare stage's worker,
    so that the stage's parent never holds any task's arrays. Returns the split sizes."""
    if cfg.modality == "text":  # the text suite, or GLUE tokenized with the backbone's own tokenizer
        from mergeflow.ml.data.text import write_text_task

        check_layout(cfg, task)
        return write_text_task(Path(path), cfg, task, seed, backbone, bool(download))
    arrays, classes = build_task(cfg, task, seed, download=download)
    save_task(Path(path), task, arrays, classes, cfg.image_size)
    return {s: int(len(arrays[f"{s}_y"])) for s in SPLITS}


def task_bytes(cfg: SuiteConfig) -> int:
    """About the most memory one task's worker holds: its images, and safetensors' copy of them while saving."""
    if cfg.modality == "text":
        return 2 * (cfg.n_train + cfg.n_val + cfg.n_test) * cfg.seq_len * 4
    return 2 * (cfg.n_train + cfg.n_val + cfg.n_test) * cfg.image_size**2 * 3


def build_pretraining_corpus(cfg: SuiteConfig, seed: int) -> dict[str, np.ndarray]:
    from mergeflow.ml.data import embedded

    return embedded.make_pretraining_corpus(cfg.pretrain_images, cfg.image_size, seed)


def write_pretraining_corpus(path: Path, cfg: SuiteConfig, seed: int, build: bool = True) -> int:
    """Build (``build``; else an empty one: a pretrained backbone needs none) and save the pretraining corpus in this
    process. Returns its number of images (text: of sentences, and data/tokenizer.json beside it)."""
    import torch

    if cfg.source in ("text", "text2text"):
        from mergeflow.ml.data.text import write_text_corpus

        return write_text_corpus(path, cfg, seed, build)

    from mergeflow.core.io import save_state_dict

    tensors = {k: torch.from_numpy(v) for k, v in (build_pretraining_corpus(cfg, seed) if build else {}).items()}
    empty = {"images": torch.zeros(0, cfg.image_size, cfg.image_size, 3, dtype=torch.uint8)}
    save_state_dict(path, tensors or empty, {"heads": json.dumps(sorted(k for k in tensors if k != "images"))})
    return int(len(tensors.get("images", [])))
