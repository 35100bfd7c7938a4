"""The task-arithmetic benchmark through ``build_task`` (source torchvision): the ta8 stand-ins (tests/standins.py)
read by the real readers, the one-line message for a missing dataset, opt-in downloads, and the registry's
templates and class lists."""

from types import SimpleNamespace

import numpy as np
import pytest
import torchvision.datasets as tvd

from mergeflow.ml.data import benchmark, build_task, class_names, templates
from mergeflow.core.errors import MergeflowError
from tests.standins import USED, write_standins

TA8 = benchmark.SUITES["ta8"]
REAL_CLASS_COUNTS = {
    "SUN397": 397,
    "Cars": 196,
    "RESISC45": 45,
    "EuroSAT": 10,
    "SVHN": 10,
    "GTSRB": 43,
    "MNIST": 10,
    "DTD": 47,
}


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
    for task, how in (
        ("MNIST", "--download"),
        ("SVHN", "--download"),
        ("Cars", "Kaggle"),
        ("RESISC45", "NWPU-RESISC45.rar"),
        ("FER2013", "Kaggle"),
    ):
        with pytest.raises(MergeflowError) as err:
            build_task(_cfg(tmp_path), task, seed=0)
        message = str(err.value)
        assert "\n" not in message and task in message and str(tmp_path) in message and how in message
        assert "download=True" not in message


def _fake_mnist(seen: list):
    """torchvision's MNIST as it fails without data, recording the download argument it was given."""

    class FakeMNIST:
        classes = [str(i) for i in range(10)]

        def __init__(self, root, train, download):
            seen.append(download)
            raise RuntimeError("Dataset not found. You can use download=True to download it")

    return FakeMNIST


def _mnist_files(root) -> None:
    """MNIST's four raw file names, empty: enough for the cheap layout check (check_layout), which then lets
    torchvision's reader (faked here) have its say."""
    (root / "MNIST" / "raw").mkdir(parents=True)
    for name in (
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    ):
        (root / "MNIST" / "raw" / name).write_bytes(b"")


def test_download_reaches_torchvision_only_when_asked(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(tvd, "MNIST", _fake_mnist(seen))
    with pytest.raises(MergeflowError, match="could not be downloaded") as err:
        build_task(_cfg(tmp_path, download=True), "MNIST", seed=0)
    assert "download=True" not in str(err.value)
    _mnist_files(tmp_path)
    with pytest.raises(MergeflowError, match="--download"):
        build_task(_cfg(tmp_path), "MNIST", seed=0)
    assert seen == [True, False]


def test_registry_covers_the_three_suites_with_templates_and_classes():
    assert (
        len(benchmark.SUITES["ta8"]) == 8
        and len(benchmark.SUITES["ta14"]) == 14
        and len(benchmark.SUITES["ta20"]) == 20
    )
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


# ---------------------------------------------------------------- resizing: suite.resize


@pytest.mark.parametrize("shape", [(23, 37), (41, 19), (30, 30)])  # landscape, portrait (odd margins), square
def test_resize_modes_match_pil_and_torchvision_by_hand(shape):
    from PIL import Image
    from torchvision import transforms

    from mergeflow.ml.data import resize_image

    rng = np.random.default_rng(0)
    array = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
    size = 16
    # squash: the whole image to size x size, bilinear (the embedded suite's and your data's default)
    squash = resize_image(Image.fromarray(array), size, "squash")
    assert squash.dtype == np.uint8 and squash.shape == (size, size, 3)
    assert np.array_equal(squash, np.asarray(Image.fromarray(array).resize((size, size), Image.BILINEAR)))
    # crop: CLIP's eval transform, torchvision's Resize(S, bicubic) + CenterCrop(S) on the same PIL image
    clip = transforms.Compose(
        [transforms.Resize(size, interpolation=transforms.InterpolationMode.BICUBIC), transforms.CenterCrop(size)]
    )
    crop = resize_image(Image.fromarray(array), size, "crop")
    assert crop.shape == (size, size, 3) and np.array_equal(crop, np.asarray(clip(Image.fromarray(array))))
    assert np.array_equal(resize_image(array, size, "crop"), crop)  # an array as well as a PIL image
    if shape[0] != shape[1]:
        assert not np.array_equal(crop, squash)
    gray = rng.integers(0, 256, shape, dtype=np.uint8)  # grayscale: three equal channels
    assert np.array_equal(
        resize_image(Image.fromarray(gray), size, "crop"), np.asarray(clip(Image.fromarray(gray).convert("RGB")))
    )


def test_crop_mode_through_build_task(standins):
    squash, classes = build_task(_cfg(standins, resize="squash"), "EuroSAT", seed=3)
    crop, same_classes = build_task(_cfg(standins, resize="crop"), "EuroSAT", seed=3)
    assert classes == same_classes
    for split in ("train", "val", "test"):
        assert np.array_equal(squash[f"{split}_y"], crop[f"{split}_y"])  # the same images picked, resized otherwise
        assert crop[f"{split}_x"].shape == squash[f"{split}_x"].shape and not np.array_equal(
            crop[f"{split}_x"], squash[f"{split}_x"]
        )


# ---------------------------------------------------------------- missing against unreadable files


def test_a_damaged_file_is_named_not_reported_missing(tmp_path):
    write_standins(tmp_path, ["SVHN", "Cars"], seed=0)
    for task, damaged in (
        ("SVHN", tmp_path / "svhn" / "train_32x32.mat"),
        ("Cars", tmp_path / "stanford_cars" / "devkit" / "cars_meta.mat"),
    ):
        damaged.write_bytes(b"MATLAB 5.0 MAT-file, this is not one" + bytes(range(256)) * 4)
        with pytest.raises(MergeflowError) as err:
            build_task(_cfg(tmp_path), task, seed=0)
        message = str(err.value)
        assert "\n" not in message and message.startswith(f"suite.root: {task}: {damaged}: not readable (")
        assert "not found" not in message and "--download" not in message and "Kaggle" not in message
    (tmp_path / "svhn" / "train_32x32.mat").unlink()
    with pytest.raises(MergeflowError) as err:
        build_task(_cfg(tmp_path), "SVHN", seed=0)
    assert (
        str(err.value)
        == f"suite.root: SVHN not found under '{tmp_path}' ({tmp_path / 'svhn' / 'train_32x32.mat'} is missing) "
        f"(expected <root>/svhn/{{train,test}}_32x32.mat); run with --download (or suite.download: true)"
    )


def test_an_undecodable_image_names_the_task_and_the_file(tmp_path):
    write_standins(tmp_path, ["SUN397"], seed=0)
    files = sorted((tmp_path / "SUN397").rglob("*.jpg"))
    for f in files:  # a truncated JPEG: its header opens, its pixels do not decode
        f.write_bytes(f.read_bytes()[:200])
    with pytest.raises(MergeflowError) as err:
        build_task(_cfg(tmp_path), "SUN397", seed=0)
    message = str(err.value)
    assert "\n" not in message and message.startswith("suite.root: SUN397: ") and ": not readable (" in message
    assert any(str(f) in message for f in files)


# ---------------------------------------------------------------- --download reaches the prepare stage's readers


class _InProcess:
    """ProcessPoolExecutor's interface, running each job at once in this process (monkeypatched torchvision classes
    do not reach spawned workers)."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def submit(self, fn, *args, **kwargs):
        from concurrent.futures import Future

        future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as err:  # noqa: BLE001 - handed to the caller through the future, as a pool would
            future.set_exception(err)
        return future

    def shutdown(self, wait=True, cancel_futures=False):
        pass


def test_prepare_takes_the_download_permission_from_the_command_line(repo_root, tmp_path, monkeypatch):
    import yaml

    from mergeflow.pipeline import stages, train
    from mergeflow.config.environment import DOWNLOAD_ENV
    from mergeflow.params import parse_params

    seen = []
    monkeypatch.setattr(tvd, "MNIST", _fake_mnist(seen))
    monkeypatch.setattr(train, "process_pool", _InProcess)  # prepare's worker pool, in this process
    raw = yaml.safe_load((repo_root / "params.yaml").read_text())
    raw["suite"] = {
        "source": "torchvision",
        "root": str(tmp_path / "data"),
        "download": False,
        "tasks": ["MNIST"],
        "image_size": 16,
        "n_train": 12,
        "n_val": 4,
        "n_test": 6,
        "pretrain_images": 0,
    }
    params = parse_params(raw)
    monkeypatch.setenv(DOWNLOAD_ENV, "1")  # what `mergeflow prepare --download` sets
    assert params.downloads() and not params.suite.download
    with pytest.raises(MergeflowError, match="could not be downloaded"):
        stages.prepare(params, stages.Layout(tmp_path / "repo"))
    monkeypatch.delenv(DOWNLOAD_ENV)
    _mnist_files(tmp_path / "data")
    with pytest.raises(MergeflowError, match="--download"):
        stages.prepare(params, stages.Layout(tmp_path / "repo"))
    # build_task's own argument: download=None is suite.download, an explicit value wins
    with pytest.raises(MergeflowError):
        build_task(_cfg(tmp_path, download=False), "MNIST", seed=0, download=True)
    with pytest.raises(MergeflowError):
        build_task(_cfg(tmp_path, download=True), "MNIST", seed=0)
    assert seen == [True, False, True, True]
    assert not (tmp_path / "repo" / "data" / "tasks" / "MNIST.safetensors").exists()
