"""The task-arithmetic benchmark's 20 datasets (task vectors, TIES, TALL masks: CLIP fine-tuned on 8, 14 or 20 tasks),
by the papers' names, read from ``suite.root`` in torchvision's own on-disk layout (RESISC45: the papers' layout).

Each ``Benchmark`` entry (their table: ``_benchmark_datasets``) says which reader opens it and with which split
kwargs, its clean class names and prompt templates (``mergeflow.ml.data.prompts``), and, for the datasets
torchvision cannot download, the manual steps. ``open_split`` gives a ``Pool`` of one split that decodes only the
images it is asked for. Datasets without a test split (EuroSAT, SUN397) are split with a fixed seed
(``SPLIT_SEED``), the same for every run seed, so that the test set never changes between runs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from mergeflow.ml.data._benchmark_datasets import BENCHMARK, SUITES, Benchmark  # noqa: F401 - SUITES: exported here
from mergeflow.core.errors import MergeflowError

SPLIT_SEED = 0  # EuroSAT's and SUN397's train/test split: fixed, independent of the run seed
DOWNLOAD_HINT = "run with --download (or suite.download: true)"
GENERIC_TEMPLATES = ("a photo of a {}.",)


def generic(task: str) -> Benchmark:
    """Any other torchvision dataset class by name: its own classes, a generic template, a guessed split kwarg."""
    import inspect

    import torchvision.datasets as tvd

    cls = getattr(tvd, task, None)
    if not inspect.isclass(cls):
        raise MergeflowError(
            f"suite.tasks: '{task}' is neither a benchmark dataset "
            f"({', '.join(BENCHMARK)}) nor a torchvision dataset class"
        )
    params = inspect.signature(cls.__init__).parameters
    train, test = ({"split": "train"}, {"split": "test"}) if "split" in params else ({"train": True}, {"train": False})
    return Benchmark(
        task, task, (train,), (test,), GENERIC_TEMPLATES, None, f"torchvision {task}'s layout under <root>"
    )


def entry(task: str) -> Benchmark:
    return BENCHMARK[task] if task in BENCHMARK else generic(task)


def templates(task: str) -> list[str]:
    """The zero-shot prompt templates, format strings with one '{}' for the class name."""
    return list(entry(task).templates)


def class_names(task: str, root: str | None = None, download: bool = False) -> list[str]:
    """The clean class names for zero-shot heads: the fixed list where there is one, else the dataset's own
    ``.classes`` (read from ``root``), as the papers do."""
    e = entry(task)
    if e.classes is not None:
        return list(e.classes)
    if root is None:
        raise MergeflowError(f"suite.tasks: {task} takes its class names from the dataset: give suite.root")
    return [str(c) for c in _open(e, root, e.train[0], download).classes]


# ---------------------------------------------------------------- reading


class Pool:
    """One split: parts of (dataset, label table or None, indices into the dataset); decodes only what ``read``
    picks."""

    def __init__(self, parts: list[tuple[Any, np.ndarray | None, np.ndarray]], name: str = "", root: str = ""):
        self.parts = parts
        self.name, self.root = name, root
        self.offsets = np.cumsum([0] + [len(ix) for _, _, ix in parts])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def read(
        self, picks: np.ndarray, size: int, mode: str = "squash", rows: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The picked images as uint8 [len(picks), size, size, 3] and their labels; each image is resized
        (``mergeflow.ml.data.images.resize_image``) as it is decoded, and closed: one full-size image at a time. Pick j
        goes to row ``rows[j]`` (default j). An image that cannot be decoded is one line naming the task and file."""
        from mergeflow.ml.data.images import resize_image

        images = np.empty((len(picks), size, size, 3), dtype=np.uint8)
        labels = np.empty(len(picks), dtype=np.int64)
        for j, p in enumerate(picks):
            part = int(np.searchsorted(self.offsets, p, side="right")) - 1
            ds, table, ix = self.parts[part]
            i = int(ix[p - self.offsets[part]])
            row = j if rows is None else int(rows[j])
            try:
                image, label = ds[i]
                try:
                    images[row] = resize_image(image, size, mode)
                finally:
                    if hasattr(image, "close"):
                        image.close()
            except MergeflowError:
                raise
            except Exception as err:  # PIL's and the readers' errors for a damaged file are of many kinds
                where = (
                    _file_of(ds, i)
                    or _culprit(err, self.root)
                    or f"image {i} of {type(ds).__name__} under '{self.root}'"
                )
                raise MergeflowError(f"suite.root: {self.name}: {where}: not readable ({_first_line(err)})") from None
            labels[row] = int(label) if table is None else int(table[int(label)])
        return images, labels


def _first_line(err: BaseException) -> str:
    return (str(err).splitlines() or [""])[0] or type(err).__name__


def _file_of(ds, i: int) -> str | None:
    """The file image ``i`` of a torchvision dataset (or _Resisc45) is read from, where the dataset lists files."""
    for attr in ("samples", "_samples", "_image_files", "_images", "imgs"):
        files = getattr(ds, attr, None)
        if isinstance(files, (list, tuple)) and 0 <= i < len(files):
            item = files[i]
            item = item[0] if isinstance(item, tuple) else item
            if isinstance(item, (str, os.PathLike)):
                return str(item)
    return None


def _culprit(err: BaseException, root: str) -> str | None:
    """The file under ``root`` a reader was parsing when ``err`` was raised: the innermost frame of its traceback with
    a local naming an existing file there (a path, or an open file's name); None when there is none."""
    import traceback

    base = os.path.realpath(root) if root else None
    if base is None:
        return None
    frames = [frame for frame, _ in traceback.walk_tb(err.__traceback__)]
    for frame in reversed(frames):
        for value in list(frame.f_locals.values()):
            name = getattr(value, "name", None) if hasattr(value, "read") else value
            if isinstance(name, (str, os.PathLike)):
                try:
                    path = os.path.realpath(name)
                    if os.path.isfile(path) and os.path.commonpath([path, base]) == base:
                        return str(name)
                except (TypeError, ValueError, OSError):
                    continue
    return None


def _without_md5(cls):
    """SVHN and STL10 md5-hash their whole files (SVHN's 182 MB .mat, STL10's 2.6 GB binaries) on every
    construction; when not downloading, existence is enough: a damaged file still fails while it is parsed, and
    with download=True torchvision's own check stays, so that a bad file is fetched again."""

    class WithoutMD5(cls):
        def _check_integrity(self) -> bool:
            if cls.__name__ == "SVHN":
                return os.path.isfile(os.path.join(self.root, self.filename))
            return all(
                os.path.isfile(os.path.join(self.root, self.base_folder, f))
                for f, _ in self.train_list + self.test_list
            )

    WithoutMD5.__name__ = cls.__name__
    return WithoutMD5


def _missing(e: Benchmark, root: str, detail: str = "") -> str:
    how = e.manual or DOWNLOAD_HINT
    return f"suite.root: {e.name} not found under '{root}'{detail} (expected {e.layout}); {how}"


def torchvision_dataset_names() -> frozenset[str] | None:
    """The dataset classes torchvision.datasets exports, read from its source (its ``__all__``) without importing
    it (that would import torch); None when torchvision is not installed or its list cannot be read."""
    import ast
    import importlib.util

    try:
        spec = importlib.util.find_spec("torchvision")
        folder = Path(spec.submodule_search_locations[0]) if spec and spec.submodule_search_locations else None
        tree = ast.parse((folder / "datasets" / "__init__.py").read_text()) if folder else None
    except (ImportError, ValueError, OSError, SyntaxError):
        return None
    for node in tree.body if tree else ():
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            try:
                return frozenset(ast.literal_eval(node.value))
            except ValueError:
                return None
    return None


def missing_need(e: Benchmark, root: str, split: str) -> str | None:
    """The first of ``e.needs`` for ``split`` that is not under ``root`` (its first alternative's path), or None."""
    for need in e.needs[0 if split == "train" or e.test is None else 1]:
        options = need.split("|")
        if not any((Path(root) / o).is_dir() if o.endswith("/") else (Path(root) / o).is_file() for o in options):
            return str(Path(root) / options[0].rstrip("/"))
    return None


def check_files(task: str, root: str, download: bool = False) -> None:
    """Cheaply (a few file-system lookups, no dataset opened, no torch imported), whether ``task`` can be read from
    ``root``: a benchmark dataset's ``needs`` for both splits (unless missing files will be downloaded), or the
    name of another torchvision dataset class. One line, as the readers' own, naming the first path missing."""
    if task not in BENCHMARK:
        names = torchvision_dataset_names()
        if names is not None and task not in names:
            raise MergeflowError(
                f"suite.tasks: '{task}' is neither a benchmark dataset "
                f"({', '.join(BENCHMARK)}) nor a torchvision dataset class"
            )
        if not download and not Path(root).is_dir():
            raise MergeflowError(
                f"suite.root: '{root}' not found (torchvision {task}'s layout under <root>); {DOWNLOAD_HINT}"
            )
        return
    e = BENCHMARK[task]
    if download and e.downloadable:
        return  # torchvision fetches what is missing (and makes root)
    if not Path(root).is_dir():
        raise MergeflowError(_missing(e, root, f" ('{root}' is missing)"))
    for split in ("train", "test"):
        if absent := missing_need(e, root, split):
            raise MergeflowError(_missing(e, root, f" ({absent} is missing)"))


def _is_missing(err: BaseException) -> bool:
    """An absent file or folder (torchvision's own existence checks say 'Dataset not found'), not a damaged one."""
    return isinstance(err, (FileNotFoundError, NotADirectoryError)) or (
        isinstance(err, RuntimeError) and "not found" in str(err).lower()
    )


def _open(e: Benchmark, root: str, kwargs: dict, download: bool):
    """The reader of one split: a missing dataset is one line with how to fetch it; a file that is there but cannot
    be parsed (a damaged .mat, a truncated archive) is one line naming that file."""
    try:
        if e.reader == "RESISC45":
            return read_resisc45(e, root, kwargs["split"])
        import torchvision.datasets as tvd

        cls = getattr(tvd, e.reader)
        if e.md5_free and not download:
            cls = _without_md5(cls)
        where = os.path.join(root, e.subdir) if e.subdir else root
        args = dict(kwargs)
        if e.downloadable:
            args["download"] = download  # FER2013 and StanfordCars have no (working) download
        return cls(root=where, **args)
    except MergeflowError:
        raise
    except Exception as err:  # the readers' parse errors are of many kinds (ValueError, KeyError, MatReadError, ...)
        reason = _first_line(err).split(" You can use download=True")[0]
        if _is_missing(err):
            if download and e.downloadable:
                raise MergeflowError(f"suite.root: {e.name} could not be downloaded to '{root}' ({reason})") from None
            absent = getattr(err, "filename", None)
            # torchvision says 'not found or corrupted' when its md5 check fails (md5-free readers check existence only)
            checked = "corrupt" in reason and not (e.md5_free and not download)
            detail = f" ({absent} is missing)" if absent else (" or failing torchvision's md5 check" if checked else "")
            raise MergeflowError(_missing(e, root, detail)) from None
        culprit = _culprit(err, root)
        if culprit is None and download and e.downloadable:
            raise MergeflowError(f"suite.root: {e.name} could not be downloaded to '{root}' ({reason})") from None
        raise MergeflowError(
            f"suite.root: {e.name}: {culprit or f'its files under {root!r}'}: not readable ({reason})"
        ) from None


def _raw_classes(e: Benchmark, ds) -> list[str] | None:
    if e.reader == "GTSRB":  # train labels index the sorted class folders present; test labels are ClassIds
        folder = Path(ds._target_folder)
        return sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.name == "Training" else None
    return getattr(ds, "classes", None)


def _label_table(e: Benchmark, ds, root: str) -> np.ndarray | None:
    """Dataset label -> index in e.classes, by name, where the dataset numbers only the classes it holds
    (DTD's split files, EuroSAT's and RESISC45's folders, GTSRB's training folders, SUN397's ClassName.txt)."""
    if e.clean is None or e.classes is None:
        return None
    raw = _raw_classes(e, ds)
    if raw is None:
        return None
    index = {c: i for i, c in enumerate(e.classes)}
    table = []
    for name in raw:
        clean = e.clean(str(name))
        if clean not in index:
            raise MergeflowError(
                f"suite.root: {e.name} under '{root}' has class '{name}', not one of its {len(e.classes)} classes"
            )
        table.append(index[clean])
    return np.asarray(table, dtype=np.int64)


def _sorted_sun397(ds):
    # torchvision lists SUN397's files with rglob, in the file system's order: sort them so that picks are reproducible
    order = sorted(range(len(ds._image_files)), key=lambda i: str(ds._image_files[i]))
    ds._image_files = [ds._image_files[i] for i in order]
    ds._labels = [ds._labels[i] for i in order]
    return ds


def open_split(task: str, root: str, split: str, download: bool = False) -> Pool:
    """The 'train' or 'test' split of ``task`` under ``root``, as a Pool."""
    e = entry(task)
    kwargs_list = e.train if (split == "train" or e.test is None) else e.test
    parts = []
    for kwargs in kwargs_list:
        ds = _open(e, root, kwargs, download)
        if e.reader == "SUN397":
            ds = _sorted_sun397(ds)
        parts.append((ds, _label_table(e, ds, root), np.arange(len(ds))))
    if e.test is None:  # a fixed seeded split of the whole set
        ((ds, table, ix),) = parts
        order = np.random.default_rng(SPLIT_SEED).permutation(len(ix))
        n_test = max(1, round(e.test_fraction * len(ix)))
        parts = [(ds, table, np.sort(order[:n_test] if split == "test" else order[n_test:]))]
    if sum(len(ix) for _, _, ix in parts) == 0:
        raise MergeflowError(f"suite.root: {e.name} under '{root}' has no {split} images (expected {e.layout})")
    return Pool(parts, e.name, root)


class _Resisc45:
    """RESISC45 in the papers' (TorchGeo's) layout: <root>/resisc45/NWPU-RESISC45/<class>/<file>.jpg, the split
    named by <root>/resisc45/resisc45-<split>.txt (one file name a line)."""

    def __init__(self, base: Path, split: str):
        from PIL import Image

        self._open = Image.open
        names = set((base / f"resisc45-{split}.txt").read_text().split())
        self.classes = sorted(p.name for p in (base / "NWPU-RESISC45").iterdir() if p.is_dir())
        self.samples = [
            (f, i)
            for i, c in enumerate(self.classes)
            for f in sorted((base / "NWPU-RESISC45" / c).iterdir())
            if f.name in names
        ]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        path, label = self.samples[i]
        with self._open(path) as image:
            return image.convert("RGB"), label


def read_resisc45(e: Benchmark, root: str, split: str) -> _Resisc45:
    base = Path(root) / "resisc45"
    if not (base / "NWPU-RESISC45").is_dir() or not (base / f"resisc45-{split}.txt").is_file():
        raise MergeflowError(_missing(e, root))
    return _Resisc45(base, split)
