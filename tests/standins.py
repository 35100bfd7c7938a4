"""Small stand-ins for the ta8 benchmark datasets, written in each one's real on-disk layout (torchvision's, and the
papers' for RESISC45) so that the real readers read them: a few classes (labels among the real class list), a
handful of images per class, each class with its own colour and bar position so that a model can learn them."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
from PIL import Image

from mergeflow.ml.data import prompts

# per task: the class indices (into the real list) the stand-in uses, and images per class in train / test
USED = {
    "MNIST": [0, 1, 2],
    "SVHN": [0, 3, 7],
    "GTSRB": [0, 14, 33],
    "EuroSAT": [0, 1, 9],
    "DTD": [0, 8, 46],
    "SUN397": [0, 8, 395],
    "Cars": [0, 1, 195],
    "RESISC45": [0, 4, 44],
}
PER_CLASS = {"train": 8, "test": 4}
SIZE = 32


def _image(k: int, rng: np.random.Generator, size: int = SIZE, gray: bool = False) -> np.ndarray:
    """Class k: a dominant colour (k % 3) and a bright bar at row band k, plus noise."""
    img = rng.integers(0, 60, (size, size, 3), dtype=np.uint8)
    img[..., k % 3] += 120
    band = (k * size // 4) % (size - size // 4)
    img[band : band + size // 4] = 250
    return img.mean(-1).astype(np.uint8) if gray else img


def _per_split(task: str, rng: np.random.Generator):
    """Yield (split, n-th image, class index, image) for the stand-in's classes."""
    for split, n in PER_CLASS.items():
        for k, cls in enumerate(USED[task]):
            for i in range(n):
                yield split, i, cls, _image(k, rng, gray=task == "MNIST")


def _idx(path: Path, array: np.ndarray) -> None:
    # the idx format: 0x0000, dtype code 0x08 (uint8), number of dims, then big-endian int32 dims
    path.write_bytes(struct.pack(f">HBB{array.ndim}I", 0, 8, array.ndim, *array.shape) + array.tobytes())


def write_mnist(root: Path, rng) -> None:
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for split, prefix in (("train", "train"), ("test", "t10k")):
        items = [(cls, img) for s, _, cls, img in _per_split("MNIST", rng) if s == split]
        images = np.stack([np.asarray(Image.fromarray(img).resize((28, 28))) for _, img in items])
        _idx(raw / f"{prefix}-images-idx3-ubyte", images)
        _idx(raw / f"{prefix}-labels-idx1-ubyte", np.asarray([c for c, _ in items], np.uint8))


def write_svhn(root: Path, rng) -> None:
    from scipy.io import savemat

    base = root / "svhn"
    base.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        items = [(cls, img) for s, _, cls, img in _per_split("SVHN", rng) if s == split]
        x = np.stack([img for _, img in items], axis=-1)  # [32, 32, 3, N], as SVHN's .mat
        y = np.asarray([[c if c else 10] for c, _ in items], np.uint8)  # SVHN writes digit 0 as label 10
        savemat(base / f"{split}_32x32.mat", {"X": x, "y": y})


def write_gtsrb(root: Path, rng) -> None:
    base = root / "gtsrb"
    test_dir = base / "GTSRB" / "Final_Test" / "Images"
    test_dir.mkdir(parents=True, exist_ok=True)
    rows = ["Filename;Width;Height;Roi.X1;Roi.Y1;Roi.X2;Roi.Y2;ClassId"]
    for split, i, cls, img in _per_split("GTSRB", rng):
        if split == "train":
            folder = base / "GTSRB" / "Training" / f"{cls:05d}"
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(img).save(folder / f"00000_{i:05d}.ppm")
        else:
            name = f"{len(rows) - 1:05d}.ppm"
            Image.fromarray(img).save(test_dir / name)
            rows.append(f"{name};{SIZE};{SIZE};0;0;{SIZE - 1};{SIZE - 1};{cls}")
    (base / "GT-final_test.csv").write_text("\n".join(rows) + "\n")


EUROSAT_FOLDERS = [
    "AnnualCrop",
    "Forest",
    "HerbaceousVegetation",
    "Highway",
    "Industrial",
    "Pasture",
    "PermanentCrop",
    "Residential",
    "River",
    "SeaLake",
]


def write_eurosat(root: Path, rng) -> None:
    # one folder of all images: mergeflow splits off the test set itself
    for split, i, cls, img in _per_split("EuroSAT", rng):
        folder = root / "eurosat" / "2750" / EUROSAT_FOLDERS[cls]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(folder / f"{EUROSAT_FOLDERS[cls]}_{split}{i}.jpg", quality=95)


def write_dtd(root: Path, rng) -> None:
    data = root / "dtd" / "dtd"
    (data / "labels").mkdir(parents=True, exist_ok=True)
    lists = {"train": [], "val": [], "test": []}
    for split, i, cls, img in _per_split("DTD", rng):
        name = prompts.DTD_CLASSES[cls]
        (data / "images" / name).mkdir(parents=True, exist_ok=True)
        file = f"{name}_{split}{i:04d}.jpg"
        Image.fromarray(img).save(data / "images" / name / file, quality=95)
        # DTD's train1 and val1 are both training images here (the papers train on both): half of train each
        lists["test" if split == "test" else ("train" if i % 2 else "val")].append(f"{name}/{file}")
    for split, lines in lists.items():
        (data / "labels" / f"{split}1.txt").write_text("\n".join(lines) + "\n")


SUN397_PATHS = {0: "a/abbey", 8: "a/apartment_building/outdoor", 395: "y/yard"}  # real ClassName.txt entries


def write_sun397(root: Path, rng) -> None:
    data = root / "SUN397"
    data.mkdir(parents=True, exist_ok=True)
    (data / "ClassName.txt").write_text("".join(f"/{p}\n" for p in SUN397_PATHS.values()))
    for split, i, cls, img in _per_split("SUN397", rng):
        folder = data / SUN397_PATHS[cls]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(folder / f"sun_{split}{i:04d}.jpg", quality=95)


def write_cars(root: Path, rng) -> None:
    from scipy.io import savemat

    base = root / "stanford_cars"
    (base / "devkit").mkdir(parents=True, exist_ok=True)
    savemat(base / "devkit" / "cars_meta.mat", {"class_names": np.array(prompts.CARS_CLASSES, dtype=object)[None]})
    annotations = {"train": [], "test": []}
    for split, i, cls, img in _per_split("Cars", rng):
        (base / f"cars_{split}").mkdir(exist_ok=True)
        fname = f"{len(annotations[split]) + 1:05d}.jpg"
        Image.fromarray(img).save(base / f"cars_{split}" / fname, quality=95)
        annotations[split].append((fname, cls + 1))  # devkit classes count from 1
    for split, path in (
        ("train", base / "devkit" / "cars_train_annos.mat"),
        ("test", base / "cars_test_annos_withlabels.mat"),
    ):
        record = np.array(annotations[split], dtype=[("fname", object), ("class", object)])
        savemat(path, {"annotations": record[None]})


def write_resisc45(root: Path, rng) -> None:
    base = root / "resisc45"
    lists = {"train": [], "val": [], "test": []}
    for split, i, cls, img in _per_split("RESISC45", rng):
        folder_name = prompts.RESISC45_CLASSES[cls].replace(" ", "_")
        folder = base / "NWPU-RESISC45" / folder_name
        folder.mkdir(parents=True, exist_ok=True)
        file = f"{folder_name}_{split}{i:03d}.jpg"
        Image.fromarray(img).save(folder / file, quality=95)
        lists[split].append(file)
    for split, names in lists.items():
        (base / f"resisc45-{split}.txt").write_text("".join(f"{n}\n" for n in names))


WRITERS = {
    "MNIST": write_mnist,
    "SVHN": write_svhn,
    "GTSRB": write_gtsrb,
    "EuroSAT": write_eurosat,
    "DTD": write_dtd,
    "SUN397": write_sun397,
    "Cars": write_cars,
    "RESISC45": write_resisc45,
}


def write_standins(root, tasks=tuple(WRITERS), seed: int = 0) -> Path:
    """Write the stand-ins of ``tasks`` (ta8 names) under ``root``; returns root."""
    root = Path(root)
    for t, task in enumerate(tasks):
        WRITERS[task](root, np.random.default_rng([seed, t]))
    return root
