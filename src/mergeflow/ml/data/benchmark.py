"""The task-arithmetic benchmark's 20 datasets (task vectors, TIES, TALL masks: CLIP fine-tuned on 8, 14 or 20 tasks),
by the papers' names, read from ``suite.root`` in torchvision's own on-disk layout (RESISC45: the papers' layout).

Each ``Benchmark`` entry says which reader opens it and with which split kwargs, its clean class names and prompt
templates (``mergeflow.ml.data.prompts``), and, for the datasets torchvision cannot download, the manual steps.
``open_split`` gives a ``Pool`` of one split that decodes only the images it is asked for. Datasets without a test
split (EuroSAT, SUN397) are split with a fixed seed (``SPLIT_SEED``), the same for every run seed, so that the test
set never changes between runs."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from mergeflow.ml.data import prompts
from mergeflow.core.errors import MergeflowError

SPLIT_SEED = 0  # EuroSAT's and SUN397's train/test split: fixed, independent of the run seed
DOWNLOAD_HINT = "run with --download (or suite.download: true)"
GENERIC_TEMPLATES = ("a photo of a {}.",)


def _pretify_eurosat(folder: str) -> str:
    """The papers' EuroSAT cleaning: 'HerbaceousVegetation' -> 'herbaceous vegetation' -> 'brushland or shrubland'."""
    words = " ".join(w.lower() for w in re.findall(r"[A-Z](?:[a-z]+|[A-Z]*(?=[A-Z]|$))", folder))
    return prompts.EUROSAT_OURS_TO_OPENAI.get(words + " area" if words.endswith("al") else words, folder)


def _underscores(name: str) -> str:
    return name.replace("_", " ")


def _sun397(name: str) -> str:
    # torchvision strips ClassName.txt's "/a/"; the rest's "/" and "_" become spaces, as in the papers' folder names
    return name.replace("/", " ").replace("_", " ")


@dataclass(frozen=True)
class Benchmark:
    name: str  # the papers' name
    reader: str  # a torchvision.datasets class, or "RESISC45" (read_resisc45)
    train: tuple[dict, ...]  # kwargs of each torchvision split read as train (concatenated)
    test: tuple[dict, ...] | None  # None: a seeded split of train's images (test_fraction of them)
    templates: tuple[str, ...]
    classes: tuple[str, ...] | None  # fixed clean names; None: the dataset's own .classes, verbatim
    layout: str  # what must be under root
    subdir: str = ""  # the reader's root is <root>/<subdir> (the papers' convention, for SVHN's loose files)
    test_fraction: float = 0.0
    clean: Callable[[str], str] | None = None  # raw class name -> clean name; labels are remapped by name
    manual: str | None = None  # one line: how to fetch a dataset torchvision cannot download
    md5_free: bool = False  # when not downloading, check only that the files exist (see _without_md5)
    # what the reader of the train and of the test split needs before it reads anything (its own existence checks,
    # and the files it opens first), relative to root: "a|b" is a or b, a trailing "/" a folder (check_files)
    needs: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())

    @property
    def downloadable(self) -> bool:
        return self.manual is None


def _entry(name, reader, train, test, templates, classes, layout, **kw) -> Benchmark:
    return Benchmark(
        name,
        reader,
        tuple(train),
        None if test is None else tuple(test),
        tuple(templates),
        None if classes is None else tuple(classes),
        layout,
        **kw,
    )


def _same(*paths: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Needs of a reader that checks the whole dataset, whichever split it reads."""
    return paths, paths


def _idx_files(folder: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """MNIST's family: torchvision checks all four raw idx files for either split (or reads its legacy processed/)."""
    return _same(
        *(
            f"{folder}/raw/{prefix}-{kind}-ubyte|{folder}/processed/{legacy}"
            for prefix, legacy in (("train", "training.pt"), ("t10k", "test.pt"))
            for kind in ("images-idx3", "labels-idx1")
        )
    )


P = prompts  # short: the table below names a template and a class list per line
BENCHMARK: dict[str, Benchmark] = {
    e.name: e
    for e in (
        _entry(
            "SUN397",
            "SUN397",
            [{}],
            None,
            P.SUN397_TEMPLATE,
            P.SUN397_CLASSES,
            "<root>/SUN397/ClassName.txt and <root>/SUN397/<letter>/<class>[/<sub>]/sun_*.jpg",
            test_fraction=0.5,
            clean=_sun397,
            needs=(("SUN397/ClassName.txt",), ()),
        ),  # the papers' partition 1 is 50 train + 50 test per class: a seeded half here
        _entry(
            "Cars",
            "StanfordCars",
            [{"split": "train"}],
            [{"split": "test"}],
            P.CARS_TEMPLATE,
            P.CARS_CLASSES,
            "<root>/stanford_cars/{devkit/cars_meta.mat, devkit/cars_train_annos.mat, cars_train/, cars_test/, "
            "cars_test_annos_withlabels.mat}",
            manual="torchvision's URL is dead: put Kaggle's jessicali9530/stanford-cars-dataset "
            "(cars_train/, cars_test/), car_devkit.tgz's devkit/ and "
            "cars_test_annos_withlabels.mat in <root>/stanford_cars/ (pytorch/vision#7545)",
            needs=(
                (
                    "stanford_cars/devkit/",
                    "stanford_cars/devkit/cars_meta.mat",
                    "stanford_cars/devkit/cars_train_annos.mat",
                    "stanford_cars/cars_train/",
                ),
                (
                    "stanford_cars/devkit/",
                    "stanford_cars/devkit/cars_meta.mat",
                    "stanford_cars/cars_test_annos_withlabels.mat",
                    "stanford_cars/cars_test/",
                ),
            ),
        ),
        _entry(
            "RESISC45",
            "RESISC45",
            [{"split": "train"}],
            [{"split": "test"}],
            P.RESISC45_TEMPLATE,
            P.RESISC45_CLASSES,
            "<root>/resisc45/NWPU-RESISC45/<class>/<class>_NNN.jpg and <root>/resisc45/resisc45-{train,val,test}.txt",
            clean=_underscores,
            manual="not in torchvision: unrar NWPU-RESISC45.rar (the NWPU-RESISC45 authors' OneDrive) into "
            "<root>/resisc45/ and put resisc45-{train,val,test}.txt from "
            "storage.googleapis.com/remote_sensing_representations/ beside it",
            needs=(
                ("resisc45/NWPU-RESISC45/", "resisc45/resisc45-train.txt"),
                ("resisc45/NWPU-RESISC45/", "resisc45/resisc45-test.txt"),
            ),
        ),
        _entry(
            "EuroSAT",
            "EuroSAT",
            [{}],
            None,
            P.EUROSAT_TEMPLATE,
            P.EUROSAT_OURS_TO_OPENAI.values(),
            "<root>/eurosat/2750/<ClassName>/<ClassName>_N.jpg",
            test_fraction=0.1,
            clean=_pretify_eurosat,
            needs=(("eurosat/2750/",), ()),
        ),  # 10%: the papers' EuroSAT_splits test set is 2,700 of 27,000
        _entry(
            "SVHN",
            "SVHN",
            [{"split": "train"}],
            [{"split": "test"}],
            P.SVHN_TEMPLATE,
            P.DIGITS,
            "<root>/svhn/{train,test}_32x32.mat",
            subdir="svhn",
            md5_free=True,
            needs=(("svhn/train_32x32.mat",), ("svhn/test_32x32.mat",)),
        ),
        _entry(
            "GTSRB",
            "GTSRB",
            [{"split": "train"}],
            [{"split": "test"}],
            P.GTSRB_TEMPLATE,
            P.GTSRB_CLASSES,
            "<root>/gtsrb/GTSRB/Training/000NN/*.ppm, <root>/gtsrb/GTSRB/Final_Test/Images/*.ppm, "
            "<root>/gtsrb/GT-final_test.csv",
            clean=lambda folder: P.GTSRB_CLASSES[int(folder)],
            needs=(("gtsrb/GTSRB/Training/",), ("gtsrb/GTSRB/Final_Test/Images/", "gtsrb/GT-final_test.csv")),
        ),
        _entry(
            "MNIST",
            "MNIST",
            [{"train": True}],
            [{"train": False}],
            P.MNIST_TEMPLATE,
            P.DIGITS,
            "<root>/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte",
            needs=_idx_files("MNIST"),
        ),
        _entry(
            "DTD",
            "DTD",
            [{"split": "train", "partition": 1}, {"split": "val", "partition": 1}],
            [{"split": "test", "partition": 1}],
            P.DTD_TEMPLATE,
            P.DTD_CLASSES,
            "<root>/dtd/dtd/{images/<class>/*.jpg, labels/{train,val,test}1.txt}",
            clean=_underscores,
            needs=(
                ("dtd/dtd/", "dtd/dtd/labels/train1.txt", "dtd/dtd/labels/val1.txt"),
                ("dtd/dtd/", "dtd/dtd/labels/test1.txt"),
            ),
        ),  # train = train1 + val1, test = test1: the papers' prepared DTD split
        _entry(
            "CIFAR100",
            "CIFAR100",
            [{"train": True}],
            [{"train": False}],
            P.CIFAR100_TEMPLATE,
            None,
            "<root>/cifar-100-python/{train,test,meta}",
            needs=_same("cifar-100-python/train", "cifar-100-python/test", "cifar-100-python/meta"),
        ),
        _entry(
            "STL10",
            "STL10",
            [{"split": "train"}],
            [{"split": "test"}],
            P.STL10_TEMPLATE,
            P.STL10_CLASSES,
            "<root>/stl10_binary/{train,test}_{X,y}.bin, unlabeled_X.bin, class_names.txt",
            md5_free=True,
            needs=_same(*(f"stl10_binary/{f}.bin" for f in ("train_X", "train_y", "unlabeled_X", "test_X", "test_y"))),
        ),
        _entry(
            "Flowers102",
            "Flowers102",
            [{"split": "train"}],
            [{"split": "test"}],
            P.FLOWERS102_TEMPLATE,
            P.FLOWERS102_CLASSES,
            "<root>/flowers-102/{jpg/, imagelabels.mat, setid.mat}",
            needs=_same("flowers-102/jpg/", "flowers-102/imagelabels.mat", "flowers-102/setid.mat"),
        ),
        _entry(
            "OxfordIIITPet",
            "OxfordIIITPet",
            [{"split": "trainval"}],
            [{"split": "test"}],
            P.OXFORDPETS_TEMPLATE,
            None,
            "<root>/oxford-iiit-pet/{images/, annotations/{trainval,test}.txt}",
            needs=(
                ("oxford-iiit-pet/images/", "oxford-iiit-pet/annotations/trainval.txt"),
                ("oxford-iiit-pet/images/", "oxford-iiit-pet/annotations/test.txt"),
            ),
        ),
        _entry(
            "PCAM",
            "PCAM",
            [{"split": "train"}],
            [{"split": "test"}],
            P.PCAM_TEMPLATE,
            P.PCAM_CLASSES,
            "<root>/pcam/camelyonpatch_level_2_split_{train,test}_{x,y}.h5",
            needs=tuple(
                tuple(f"pcam/camelyonpatch_level_2_split_{s}_{xy}.h5" for xy in "xy") for s in ("train", "test")
            ),
        ),
        _entry(
            "FER2013",
            "FER2013",
            [{"split": "train"}],
            [{"split": "test"}],
            P.FER2013_TEMPLATE,
            P.FER2013_CLASSES,
            "<root>/fer2013/fer2013.csv (or icml_face_data.csv)",
            manual="from Kaggle (challenges-in-representation-learning-facial-expression-recognition-challenge): put "
            "fer2013.csv or icml_face_data.csv in <root>/fer2013/",
            needs=tuple(
                (f"fer2013/fer2013.csv|fer2013/icml_face_data.csv|fer2013/{s}.csv",) for s in ("train", "test")
            ),
        ),
        _entry(
            "EMNIST",
            "EMNIST",
            [{"split": "digits", "train": True}],
            [{"split": "digits", "train": False}],
            P.EMNIST_TEMPLATE,
            P.DIGITS,
            "<root>/EMNIST/raw/emnist-digits-{train,test}-{images-idx3,labels-idx1}-ubyte",
            needs=tuple(
                tuple(
                    f"EMNIST/raw/emnist-digits-{s}-{k}-ubyte|EMNIST/processed/{leg}_digits.pt"
                    for k in ("images-idx3", "labels-idx1")
                )
                for s, leg in (("train", "training"), ("test", "test"))
            ),
        ),
        _entry(
            "CIFAR10",
            "CIFAR10",
            [{"train": True}],
            [{"train": False}],
            P.CIFAR10_TEMPLATE,
            P.CIFAR10_CLASSES,
            "<root>/cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}",
            needs=_same(
                *(
                    f"cifar-10-batches-py/{f}"
                    for f in (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta")
                )
            ),
        ),
        _entry(
            "Food101",
            "Food101",
            [{"split": "train"}],
            [{"split": "test"}],
            P.FOOD101_TEMPLATE,
            None,
            "<root>/food-101/{images/<class>/*.jpg, meta/{train,test}.json}",
            needs=(("food-101/images/", "food-101/meta/train.json"), ("food-101/images/", "food-101/meta/test.json")),
        ),
        _entry(
            "FashionMNIST",
            "FashionMNIST",
            [{"train": True}],
            [{"train": False}],
            P.FASHIONMNIST_TEMPLATE,
            P.FASHIONMNIST_CLASSES,
            "<root>/FashionMNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte",
            needs=_idx_files("FashionMNIST"),
        ),
        _entry(
            "RenderedSST2",
            "RenderedSST2",
            [{"split": "train"}],
            [{"split": "test"}],
            P.SST2_TEMPLATE,
            P.RENDEREDSST2_CLASSES,
            "<root>/rendered-sst2/{train,test}/{negative,positive}/*.png",
            needs=tuple(tuple(f"rendered-sst2/{s}/{c}/" for c in ("negative", "positive")) for s in ("train", "test")),
        ),
        _entry(
            "KMNIST",
            "KMNIST",
            [{"train": True}],
            [{"train": False}],
            P.KMNIST_TEMPLATE,
            P.KMNIST_CLASSES,
            "<root>/KMNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte",
            needs=_idx_files("KMNIST"),
        ),
    )
}

# the papers' order (TALL masks' ALL_DATASETS; task vectors' eight)
SUITES = {
    "ta8": ["SUN397", "Cars", "RESISC45", "EuroSAT", "SVHN", "GTSRB", "MNIST", "DTD"],
    "ta14": [
        "SUN397",
        "Cars",
        "RESISC45",
        "EuroSAT",
        "SVHN",
        "GTSRB",
        "MNIST",
        "DTD",
        "CIFAR100",
        "STL10",
        "Flowers102",
        "OxfordIIITPet",
        "PCAM",
        "FER2013",
    ],
    "ta20": [
        "SUN397",
        "Cars",
        "RESISC45",
        "EuroSAT",
        "SVHN",
        "GTSRB",
        "MNIST",
        "DTD",
        "CIFAR100",
        "STL10",
        "Flowers102",
        "OxfordIIITPet",
        "PCAM",
        "FER2013",
        "EMNIST",
        "CIFAR10",
        "Food101",
        "FashionMNIST",
        "RenderedSST2",
        "KMNIST",
    ],
}


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
