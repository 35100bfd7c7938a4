"""`mergeflow check` finds before any stage what prepare or finetune would find minutes later: the suite's data
(an ImageFolder or torchvision root, a task folder without a split, an embedded task that does not exist) and a
published fine-tune that is missing, unreadable or of another shape than the backbone (those:
tests/test_check_sources_checkpoints.py); each one line naming the key and the path at fault, importing no torch."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import yaml
from safetensors.numpy import save_file

from mergeflow.runner.checks import check_project
from mergeflow.params import parse_params
from mergeflow.ml.data import benchmark, check_layout
from mergeflow.core.errors import MergeflowError
from tests.standins import write_standins

EMBEDDED = ["digits", "house_numbers", "signs", "rotation", "orientation", "texture", "count", "position"]


def _project(tmp_path, repo_root, edit=None):
    """A project folder with the repository's params.yaml, changed by ``edit(raw)``; returns (folder, raw)."""
    raw = yaml.safe_load((repo_root / "params.yaml").read_text())
    if edit:
        edit(raw)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    return tmp_path, raw


def _refused(root) -> str:
    with pytest.raises(MergeflowError) as err:
        check_project(root)
    assert "\n" not in str(err.value)
    return str(err.value)


def _cli_check(root):
    proc = subprocess.run(
        [sys.executable, "-m", "mergeflow.cli", "check"], cwd=root, capture_output=True, text=True, timeout=300
    )
    return proc.returncode, proc.stderr.strip().splitlines()


# ---------------------------------------------------------------- the embedded suite
def test_an_embedded_task_that_does_not_exist_through_the_cli(tmp_path, repo_root):
    root, _ = _project(tmp_path, repo_root, lambda raw: raw["suite"].update(tasks=["digits", "cars"]))
    before = sorted(p.name for p in root.iterdir())
    status, lines = _cli_check(root)
    assert status == 2
    assert lines == [
        f"error: params.yaml: suite.tasks: the embedded suite has no task 'cars' (tasks: {', '.join(EMBEDDED)})"
    ]
    assert sorted(p.name for p in root.iterdir()) == before


# ---------------------------------------------------------------- ImageFolder
def _imagefolder(tmp_path, repo_root, root_value, tasks=("pets",)):
    return _project(
        tmp_path,
        repo_root,
        lambda raw: raw["suite"].update(source="imagefolder", root=root_value, tasks=list(tasks), name="mine"),
    )[0]


def _folder_task(base, splits=("train", "test"), classes=("cat", "dog"), files=1):
    for split in splits:
        for cls in classes:
            (base / split / cls).mkdir(parents=True, exist_ok=True)
            for i in range(files):
                (base / split / cls / f"{i}.png").write_bytes(b"not decoded by the check")


def test_imagefolder_root_and_task_folders(tmp_path, repo_root):
    project = tmp_path / "project"
    project.mkdir()
    photos = tmp_path / "photos"
    root = _imagefolder(project, repo_root, str(photos))
    source = project / "params.yaml"
    assert (
        _refused(root) == f"{source}: suite.root: '{photos}' not found (expected a folder of task folders: "
        f"<root>/<task>/{{train,val,test}}/<class>/<image>, val/ optional)"
    )
    photos.mkdir()
    assert (
        _refused(root)
        == f"{source}: suite.tasks: task 'pets' has no folder in suite.root ('{photos / 'pets'}' not found; expected "
        f"<root>/<task>/{{train,val,test}}/<class>/<image>, val/ optional)"
    )
    _folder_task(photos / "pets", splits=("train",))
    assert (
        _refused(root) == f"{source}: suite.root: '{photos / 'pets'}' needs train/ and "
        "test/ subdirectories of class folders (test/ is missing)"
    )
    _folder_task(photos / "pets", splits=("test",), files=0)
    assert _refused(root) == f"{source}: {photos / 'pets' / 'test'}: no images"
    _folder_task(photos / "pets", splits=("val",), classes=("cat", "horse"))
    assert (
        _refused(root) == f"{source}: {photos / 'pets' / 'val' / 'horse'}: class 'horse' is not among the train classes"
    )
    for f in (photos / "pets" / "val" / "horse").iterdir():
        f.unlink()
    (photos / "pets" / "val" / "horse").rmdir()
    (photos / "pets" / "test" / "cat" / "0.png").write_bytes(b"")
    assert (
        _refused(root)
        == f"{source}: {photos / 'pets' / 'test' / 'dog'}: an empty class folder (class 'dog' would have no test "
        "image: add images or remove the folder)"
    )
    (photos / "pets" / "test" / "dog" / "0.png").write_bytes(b"")
    params, _ = check_project(root)
    assert params.suite.tasks == ["pets"]


def test_imagefolder_train_without_class_folders_and_a_relative_root(tmp_path, repo_root):
    # a relative suite.root is the repository root's, as the stages run there: not the caller's directory
    root = _imagefolder(tmp_path, repo_root, "photos")
    (tmp_path / "photos" / "pets" / "train").mkdir(parents=True)
    (tmp_path / "photos" / "pets" / "test").mkdir()
    assert (
        _refused(root)
        == f"{root / 'params.yaml'}: suite.root: '{tmp_path / 'photos' / 'pets' / 'train'}' has no class folders"
    )


def test_prepare_finds_the_same_layout_fault_before_it_starts_a_worker(tmp_path, repo_root, monkeypatch):
    from mergeflow.pipeline import stages, train

    root = _imagefolder(tmp_path, repo_root, str(tmp_path / "photos"))
    _folder_task(tmp_path / "photos" / "pets", splits=("train",))
    started = []
    monkeypatch.setattr(
        train, "process_pool", lambda *a, **k: started.append(a) or pytest.fail("a worker pool started")
    )
    params = parse_params(yaml.safe_load((root / "params.yaml").read_text()))
    with pytest.raises(MergeflowError) as err:
        stages.prepare(params, stages.Layout(tmp_path / "repo"))
    assert (
        str(err.value) == f"suite.root: '{tmp_path / 'photos' / 'pets'}' needs train/ "
        "and test/ subdirectories of class folders (test/ is missing)"
    )
    assert not started and not (tmp_path / "repo").exists()


# ---------------------------------------------------------------- torchvision
def _torchvision(tmp_path, repo_root, root_value, tasks, download=False):
    return _project(
        tmp_path,
        repo_root,
        lambda raw: raw["suite"].update(
            source="torchvision", root=root_value, tasks=tasks, download=download, name="bench"
        ),
    )[0]


def test_torchvision_root_missing_and_downloads(tmp_path, repo_root, monkeypatch):
    datasets = tmp_path / "datasets"
    root = _torchvision(tmp_path, repo_root, str(datasets), ["MNIST", "Cars"])
    layout = "<root>/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte"
    assert (
        _refused(root)
        == f"{root / 'params.yaml'}: suite.root: MNIST not found under '{datasets}' ('{datasets}' is missing) "
        f"(expected {layout}); run with --download (or suite.download: true)"
    )
    # with downloads allowed (--download sets MERGEFLOW_DOWNLOAD): MNIST is fetched, Cars cannot be
    monkeypatch.setenv("MERGEFLOW_DOWNLOAD", "1")
    message = _refused(root)
    assert message.startswith(
        f"{root / 'params.yaml'}: suite.root: Cars not found under '{datasets}' "
        f"('{datasets}' is missing) (expected <root>/stanford_cars/"
    )
    assert message.endswith("(pytorch/vision#7545)")
    monkeypatch.delenv("MERGEFLOW_DOWNLOAD")
    datasets.mkdir()
    first = datasets / "MNIST" / "raw" / "train-images-idx3-ubyte"
    assert (
        _refused(root)
        == f"{root / 'params.yaml'}: suite.root: MNIST not found under '{datasets}' ({first} is missing) (expected "
        f"{layout}); run with --download (or suite.download: true)"
    )


def test_torchvision_task_names(tmp_path):
    cfg = parse_params(
        {
            "suite": {"source": "torchvision", "root": str(tmp_path), "tasks": ["Omniglot", "Nonsense"]},
            "merge": {"methods": ["ties"]},
        }
    ).suite
    check_layout(cfg, "Omniglot")  # a torchvision dataset class outside the benchmark: its own reader checks its files
    with pytest.raises(MergeflowError) as err:
        check_layout(cfg, "Nonsense")
    assert (
        str(err.value) == "suite.tasks: 'Nonsense' is neither a benchmark dataset "
        f"({', '.join(benchmark.BENCHMARK)}) nor a torchvision dataset class"
    )
    import torchvision.datasets as tvd  # the list read from torchvision's source is the one it exports

    assert benchmark.torchvision_dataset_names() == frozenset(tvd.__all__)


@pytest.fixture(scope="module")
def standins(tmp_path_factory):
    return write_standins(tmp_path_factory.mktemp("benchmark"), benchmark.SUITES["ta8"], seed=0)


@pytest.mark.parametrize("task", benchmark.SUITES["ta8"])
def test_every_need_is_there_in_the_real_layout_and_torchvision_refuses_without_it(standins, task):
    """Each path check_files needs is present in the stand-ins' real layouts (so the check passes), and without
    it torchvision's own reader fails too: the check never refuses data prepare would read."""
    entry = benchmark.BENCHMARK[task]
    benchmark.check_files(task, str(standins))
    splits = ("train",) if entry.test is None else ("train", "test")
    for split, needs in zip(splits, entry.needs):
        for need in needs:
            path = standins / need.split("|")[0].rstrip("/")
            moved = path.with_name(path.name + ".away")
            path.rename(moved)
            try:
                with pytest.raises(MergeflowError) as err:
                    benchmark.check_files(task, str(standins))
                assert f"({path} is missing)" in str(err.value), (need, str(err.value))
                with pytest.raises(MergeflowError):
                    benchmark.open_split(task, str(standins), split)
            finally:
                moved.rename(path)


# ---------------------------------------------------------------- fine-tunes' files, in timm's naming
# (the checks of finetune.checkpoints: tests/test_check_sources_checkpoints.py)
KW = {"img_size": 32, "patch_size": 8, "embed_dim": 128, "depth": 4, "num_heads": 2}  # params.yaml's backbone


def _timm_shapes(width=128, patch=8, depth=4, tokens=17, channels=3):
    shapes = {
        "cls_token": (1, 1, width),
        "pos_embed": (1, tokens, width),
        "patch_embed.proj.weight": (width, channels, patch, patch),
    }
    return shapes | {f"blocks.{i}.norm1.weight": (width,) for i in range(depth)}


def _write(path, shapes):
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: np.zeros(v, np.float32) for k, v in shapes.items()}, str(path))


# ---------------------------------------------------------------- prepared data, and no torch
def test_a_run_fetched_with_dvc_pull_needs_no_raw_data(tmp_path, repo_root):
    root = _torchvision(tmp_path, repo_root, "datasets", ["MNIST"])
    assert "MNIST not found" in _refused(root)
    params = parse_params(yaml.safe_load((root / "params.yaml").read_text()))
    recorded = {"seed": params.seed, "backbone.pretrained": None} | {
        f"suite.{k}": v for k, v in params.suite.model_dump(mode="json").items() if k not in ("name", "download")
    }
    (root / "dvc.lock").write_text(
        yaml.safe_dump(
            {"schema": "2.0", "stages": {"prepare": {"cmd": "mergeflow prepare", "params": {"params.yaml": recorded}}}}
        )
    )
    assert "MNIST not found" in _refused(root)  # the prepared file is not here either
    (root / "data" / "tasks").mkdir(parents=True)
    (root / "data" / "tasks" / "MNIST.safetensors").write_bytes(b"prepared")
    check_project(root)
    recorded["suite.n_train"] += 1  # prepared for other settings: prepare runs again, and needs the datasets
    (root / "dvc.lock").write_text(
        yaml.safe_dump(
            {"schema": "2.0", "stages": {"prepare": {"cmd": "mergeflow prepare", "params": {"params.yaml": recorded}}}}
        )
    )
    assert "MNIST not found" in _refused(root)


BLOCKED = ("torch", "torchvision", "timm", "sklearn", "mlflow", "prefect", "dask", "distributed")


def test_the_new_checks_import_no_torch(tmp_path, repo_root):
    """Run the data and checkpoint checks after taking torch and the other heavy libraries out of reach (and every
    mergeflow module that imports them): any import of theirs fails, and none is loaded after."""
    photos = tmp_path / "photos"
    _folder_task(photos / "pets")
    _write(tmp_path / "ft" / "pets.safetensors", _timm_shapes())
    (tmp_path / "bench").mkdir()
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from mergeflow.params import parse_params
        import mergeflow.runner.checks as checks
        folders = parse_params({{"suite": {{"source": "imagefolder", "root": "photos", "tasks": ["pets"]}}, \
"finetune": {{"checkpoints": {{"pets": "ft/pets.safetensors"}}}}, "backbone": {{"kwargs": {KW!r}}}, "merge": \
{{"methods": ["ties"]}}}})
        bench = parse_params({{"suite": {{"source": "torchvision", "root": "bench", "tasks": ["Omniglot", "MNIST"], \
"download": True}}, "merge": {{"methods": ["ties"]}}}})
        blocked = {BLOCKED!r}
        keep = ("mergeflow", "mergeflow.config", "mergeflow.core.errors", "mergeflow.runner.checks")
        for name in list(sys.modules):
            if name.split(".")[0] in blocked or (name.startswith("mergeflow") and name not in keep and not \
name.startswith("mergeflow.config.")):
                del sys.modules[name]
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in blocked:
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        root = Path({str(tmp_path)!r})
        checks.check_local_files(folders, root, "params.yaml")
        checks.check_data(folders, root, "params.yaml")
        checks.check_data(bench, root, "params.yaml")
        loaded = sorted(n for n in sys.modules if n.split(".")[0] in blocked)
        print("loaded:", loaded)
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "loaded: []"
