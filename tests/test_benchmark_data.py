"""The task-arithmetic benchmark through ``build_task`` (source torchvision): the ta8 stand-ins (tests/standins.py)
read by the real readers, the one-line message for a missing dataset, opt-in downloads, and the registry's
templates and class lists."""

from types import SimpleNamespace

import numpy as np
import pytest
import torchvision.datasets as tvd

from mergeflow.data import benchmark, build_task, class_names, templates
from mergeflow.errors import MergeflowError
from tests.standins import USED, write_standins

TA8 = benchmark.SUITES["ta8"]
REAL_CLASS_COUNTS = {"SUN397": 397, "Cars": 196, "RESISC45": 45, "EuroSAT": 10, "SVHN": 10, "GTSRB": 43, "MNIST": 10, "DTD": 47}


def _cfg(root, **kw):
    return SimpleNamespace(source="torchvision", root=str(root), image_size=16, n_train=12, n_val=4, n_test=6, **kw)


@pytest.fixture(scope="module")
def standins(tmp_path_factory):
    return write_standins(tmp_path_factory.mktemp("benchmark"), TA8, seed=0)


@pytest.mark.parametrize("task", TA8)
def test_standin_reads_through_build_task(standins, task):
    arrays, classes = build_task(_cfg(standins), task, seed=3)
    assert len(classes) == REAL_CLASS_COUNTS[task] and classes == class_names(task)
    for split, n in (("train", 12), ("val", 4), ("test", 6)):
        x, y = arrays[f"{split}_x"], arrays[f"{split}_y"]
        assert x.dtype == np.uint8 and x.shape[1:] == (16, 16, 3) and len(x) == len(y)
        assert 0 < len(x) <= n and set(y.tolist()) <= set(USED[task])
        # the stand-in's k-th class has its bright bar in the k-th quarter of rows: labels must name the image's class
        bar = x.astype(int).mean(axis=(2, 3)).argmax(1) // 4
        assert [USED[task].index(int(label)) for label in y] == bar.tolist()
    again, _ = build_task(_cfg(standins), task, seed=3)
    assert all(np.array_equal(arrays[k], again[k]) for k in arrays)


def test_missing_dataset_is_one_line_with_how_to_fetch(tmp_path):
    for task, how in (("MNIST", "--download"), ("SVHN", "--download"), ("Cars", "Kaggle"), ("RESISC45", "NWPU-RESISC45.rar"), ("FER2013", "Kaggle")):
        with pytest.raises(MergeflowError) as err:
            build_task(_cfg(tmp_path), task, seed=0)
        message = str(err.value)
        assert "\n" not in message and task in message and str(tmp_path) in message and how in message
        assert "download=True" not in message


def test_download_reaches_torchvision_only_when_asked(tmp_path, monkeypatch):
    seen = []

    class FakeMNIST:
        classes = [str(i) for i in range(10)]

        def __init__(self, root, train, download):
            seen.append(download)
            raise RuntimeError("Dataset not found. You can use download=True to download it")

    monkeypatch.setattr(tvd, "MNIST", FakeMNIST)
    with pytest.raises(MergeflowError, match="could not be downloaded") as err:
        build_task(_cfg(tmp_path, download=True), "MNIST", seed=0)
    assert "download=True" not in str(err.value)
    with pytest.raises(MergeflowError, match="--download"):
        build_task(_cfg(tmp_path), "MNIST", seed=0)
    assert seen == [True, False]


def test_registry_covers_the_three_suites_with_templates_and_classes():
    assert len(benchmark.SUITES["ta8"]) == 8 and len(benchmark.SUITES["ta14"]) == 14 and len(benchmark.SUITES["ta20"]) == 20
    assert benchmark.SUITES["ta20"][:14] == benchmark.SUITES["ta14"] and benchmark.SUITES["ta14"][:8] == TA8
    assert set(benchmark.SUITES["ta20"]) == set(benchmark.BENCHMARK)
    for task, entry in benchmark.BENCHMARK.items():
        assert templates(task) and all(t.count("{}") == 1 for t in templates(task)), task
        assert hasattr(tvd, entry.reader) or entry.reader == "RESISC45", task
        if entry.classes is not None:
            assert len(entry.classes) >= 2 and len(set(entry.classes)) == len(entry.classes), task
    assert len(class_names("Flowers102")) == 102 and len(class_names("FER2013")) == 7
    with pytest.raises(MergeflowError, match="suite.root"):
        class_names("CIFAR100")  # taken from the dataset itself, as the papers do


def test_unknown_torchvision_class_keeps_working_and_unknown_name_is_one_line(tmp_path):
    assert templates("Omniglot") == ["a photo of a {}."]
    with pytest.raises(MergeflowError, match="Nonsense"):
        build_task(_cfg(tmp_path), "Nonsense", seed=0)
