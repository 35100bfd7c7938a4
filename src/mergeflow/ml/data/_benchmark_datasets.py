"""The benchmark's datasets, one ``Benchmark`` entry each (``BENCHMARK``), and the papers' suites of them (``SUITES``).

An entry names the reader and its split kwargs, the clean class names and prompt templates (``prompts``), what must
be under ``suite.root`` and, for a dataset torchvision cannot download, the manual steps. ``benchmark`` reads them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from mergeflow.ml.data import prompts


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
