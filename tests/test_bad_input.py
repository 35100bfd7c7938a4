"""Missing or corrupt checkpoints, mismatched task vectors, NaN weights: one clear line, no partial output; the
same for a full disk, and outputs with the user's normal permissions (backbone.pretrained's weights:
tests/test_bad_input_pretrained.py)."""

import os

import pytest
import torch
import yaml

from mergeflow.pipeline import stages
from mergeflow.params import parse_params
from mergeflow.core.errors import MergeflowError
from mergeflow.core.io import check_compatible, load_state_dict, save_state_dict
from mergeflow.core.files import atomic_path
from mergeflow.pipeline.stages import Layout

from .test_bad_input_pretrained import _cli_project, _run_cli, _save_safetensors, _vit_state


def _params(repo_root, tasks):
    raw = yaml.safe_load((repo_root / "params.yaml").read_text())
    raw["suite"]["tasks"] = tasks
    return parse_params(raw)


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"blocks.0.mlp.fc1.weight": torch.randn(4, 3, generator=g), "norm.bias": torch.randn(3, generator=g)}


def test_missing_checkpoint(tmp_path):
    with pytest.raises(MergeflowError, match=r"nope.safetensors: checkpoint not found"):
        load_state_dict(tmp_path / "nope.safetensors")


def test_corrupt_checkpoint(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(MergeflowError, match=r"bad.safetensors: not a readable safetensors file"):
        load_state_dict(path)


def test_corrupt_checkpoint_read_lazily(tmp_path):
    from mergeflow.core.io import LazyStateDict

    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(MergeflowError, match=r"bad.safetensors: not a readable safetensors file"):
        LazyStateDict(path)
    save_state_dict(tmp_path / "ok.safetensors", _state())
    truncated = (tmp_path / "ok.safetensors").read_bytes()[:-8]
    (tmp_path / "short.safetensors").write_bytes(truncated)
    with pytest.raises(
        MergeflowError, match=r"short.safetensors: not a readable safetensors file \(tensor data runs past the end"
    ):
        LazyStateDict(tmp_path / "short.safetensors")


def test_nan_weights_read_lazily_name_the_tensor(tmp_path):
    from safetensors.torch import save_file

    from mergeflow.core.io import LazyStateDict

    state = _state()
    state["blocks.0.mlp.fc1.weight"][0, 0] = float("inf")
    save_file(state, str(tmp_path / "inf.safetensors"))
    lazy = LazyStateDict(tmp_path / "inf.safetensors")
    assert torch.equal(lazy["norm.bias"], state["norm.bias"])
    with pytest.raises(MergeflowError, match=r"inf.safetensors: tensor 'blocks.0.mlp.fc1.weight' contains NaN or Inf"):
        lazy["blocks.0.mlp.fc1.weight"]


def test_nan_weights_name_the_tensor(tmp_path):
    from safetensors.torch import save_file

    state = _state()
    state["norm.bias"][1] = float("nan")
    save_file(state, str(tmp_path / "nan.safetensors"))
    with pytest.raises(MergeflowError, match=r"nan.safetensors: tensor 'norm.bias' contains NaN or Inf"):
        load_state_dict(tmp_path / "nan.safetensors")
    with pytest.raises(MergeflowError, match=r"tensor 'norm.bias' contains NaN"):
        save_state_dict(tmp_path / "out.safetensors", state)
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize(
    "change, pattern",
    [
        (lambda s: s.pop("norm.bias"), r"missing tensor 'norm.bias'"),
        (lambda s: s.update(extra=torch.zeros(1)), r"unexpected tensor 'extra'"),
        (lambda s: s.update({"norm.bias": torch.zeros(5)}), r"tensor 'norm.bias' has shape \(5,\), expected \(3,\)"),
        (
            lambda s: s.update({"norm.bias": torch.zeros(3, dtype=torch.float64)}),
            r"tensor 'norm.bias' has dtype torch.float64, expected torch.float32",
        ),
    ],
)
def test_mismatched_checkpoints_name_the_tensor(change, pattern):
    other = _state(1)
    change(other)
    with pytest.raises(MergeflowError, match=pattern):
        check_compatible(_state(), other, reference_name="theta0", other_name="theta_t")


def test_vectors_stage_with_mismatched_finetuned_checkpoint_writes_nothing(repo_root, tmp_path):
    layout = Layout(tmp_path)
    params = _params(repo_root, ["digits", "count"])
    save_state_dict(layout.pretrained, _state(0))
    save_state_dict(layout.finetuned("digits"), _state(1))
    bad = _state(2)
    bad["blocks.0.mlp.fc1.weight"] = torch.zeros(4, 4)
    save_state_dict(layout.finetuned("count"), bad)
    with pytest.raises(
        MergeflowError,
        match=r"count.safetensors: tensor 'blocks.0.mlp.fc1.weight' has shape \(4, 4\), expected \(4, 3\)",
    ):
        stages.vectors(params, layout)
    assert not layout.vectors.exists() and not layout.metrics("vectors").exists()
    assert [p.name for p in layout.vectors.parent.iterdir() if p.name.startswith(".vectors")] == []


def test_vectors_stage_computes_differences_and_cosines(repo_root, tmp_path):
    layout = Layout(tmp_path)
    params = _params(repo_root, ["digits", "count"])
    theta0 = _state(0)
    save_state_dict(layout.pretrained, theta0)
    tau = {
        "digits": {k: torch.ones_like(v) for k, v in theta0.items()},
        "count": {k: -2 * torch.ones_like(v) for k, v in theta0.items()},
    }
    for t in tau:
        save_state_dict(layout.finetuned(t), {k: theta0[k] + tau[t][k] for k in theta0})
    stages.vectors(params, layout)
    got = load_state_dict(layout.vectors / "count.safetensors")
    assert all(torch.allclose(got[k], tau["count"][k]) for k in theta0)
    stats = __import__("json").loads((layout.vectors / "stats.json").read_text())
    assert stats["cosine"][0][1] == pytest.approx(-1.0)
    assert stats["norms"]["count"] == pytest.approx(2 * (15**0.5))


def test_atomic_path_leaves_nothing_on_failure(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_path(tmp_path / "out.json") as tmp:
            tmp.write_text("half")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_feature_preservation_without_corpus_images_names_file_and_key(repo_root, tmp_path):
    """A pretrained (hub or file) backbone comes with no pretraining corpus: preserve_features must be off."""
    params = _params(repo_root, ["digits"])
    assert params.finetune.preserve_features.weight > 0
    layout = Layout(tmp_path)
    save_state_dict(layout.pretrain_corpus, {"images": torch.zeros(0, 32, 32, 3, dtype=torch.uint8)})
    with pytest.raises(
        MergeflowError,
        match=r"pretrain.safetensors: finetune.preserve_features needs .* set finetune.preserve_features.weight to 0",
    ):
        stages._feature_anchor(params, layout, None, 0, torch.device("cpu"))
    assert not (tmp_path / "models").exists()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_finite_check_by_one_sum_is_exact(dtype):
    """check_finite sums each tensor once; a sum that overflows although every entry is finite must pass, and one
    NaN or Inf among large finite entries must still be named."""
    from mergeflow.core.io import check_finite

    big = torch.full((4,), torch.finfo(dtype).max, dtype=dtype)  # sums to Inf in any precision
    check_finite({"big": big}, "x.safetensors")
    for bad in (float("nan"), float("inf"), -float("inf")):
        tensor = big.clone()
        tensor[2] = bad
        with pytest.raises(MergeflowError, match=r"x.safetensors: tensor 'w' contains NaN or Inf"):
            check_finite({"w": tensor}, "x.safetensors")


def test_lazy_reader_converts_dtypes_and_reads_empty_tensors(tmp_path):
    from safetensors.torch import save_file

    from mergeflow.core.io import LazyStateDict

    state = {
        "w": torch.randn(5, 7).to(torch.bfloat16),
        "e": torch.zeros(0, 3),
        "i": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    }
    save_file(state, str(tmp_path / "m.safetensors"))
    lazy = LazyStateDict(tmp_path / "m.safetensors")
    assert all(torch.equal(lazy[k], v) and lazy[k].dtype == v.dtype for k, v in state.items())
    out = torch.full((35,), float("nan"))
    lazy.read_into("w", out)  # bf16 on disk into a float32 buffer: exact
    assert torch.equal(out, state["w"].float().reshape(-1))
    strided = torch.zeros(70)[::2]  # not contiguous: read, then copied in
    lazy.read_into("w", strided)
    assert torch.equal(strided, state["w"].float().reshape(-1))


def test_lazy_reader_names_the_tensor_when_the_file_shrinks_after_opening(tmp_path):
    from mergeflow.core.io import LazyStateDict

    save_state_dict(tmp_path / "m.safetensors", _state())
    lazy = LazyStateDict(tmp_path / "m.safetensors")
    last = max(lazy._entries, key=lambda k: lazy._entries[k][2][1])  # the tensor stored last in the file
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "m.safetensors").write_bytes(data[:-8])  # same inode: the open descriptor sees the shorter file
    with pytest.raises(MergeflowError, match=rf"m.safetensors: file ends inside tensor '{last}'"):
        lazy[last]


@pytest.mark.parametrize("threads", [1, 3])
def test_a_tensor_of_many_chunks_reads_whole_on_threads_and_a_short_file_is_named(tmp_path, monkeypatch, threads):
    """A tensor larger than the read chunk is read in chunks on the stage's threads (a split's images): the same
    bytes as on one thread, and a file cut short inside it still names the tensor."""
    from safetensors.torch import save_file

    from mergeflow.core import io

    monkeypatch.setattr(io, "READ_CHUNK_BYTES", 1000)  # 64 MiB otherwise: 25 chunks here
    images = torch.randint(0, 256, (25, 10, 10, 10), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    save_file({"test_x": images}, str(tmp_path / "t.safetensors"))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        lazy = io.LazyStateDict(tmp_path / "t.safetensors")
        assert torch.equal(lazy["test_x"], images)
        data = (tmp_path / "t.safetensors").read_bytes()
        (tmp_path / "t.safetensors").write_bytes(data[:-1500])  # the last two chunks' bytes, partly
        with pytest.raises(MergeflowError, match=r"t.safetensors: file ends inside tensor 'test_x'"):
            lazy["test_x"]
    finally:
        torch.set_num_threads(previous)


# ---------------------------------------------------------------- a full disk (issue 16)
NO_SPACE = "could not be written: no space left on device (the partial file was removed; free space and run again)"


@pytest.fixture
def temporary_files_on_a_full_device(monkeypatch):
    """atomic_path's temporary file becomes a link to /dev/full: every write to it fails with ENOSPC, for real."""
    import tempfile

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")

    def mkstemp(dir, prefix):
        name = os.path.join(dir, f"{prefix}full")
        os.symlink("/dev/full", name)
        return os.open(name, os.O_WRONLY), name

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)


def test_full_disk_while_writing_json_is_one_line_and_leaves_nothing(tmp_path, temporary_files_on_a_full_device):
    from mergeflow.core.files import write_json

    with pytest.raises(MergeflowError) as err:
        write_json(tmp_path / "metrics" / "finetune.json", {"accuracy": [0.5] * 10000})
    assert str(err.value) == f"{tmp_path / 'metrics' / 'finetune.json'}: {NO_SPACE}"
    assert list((tmp_path / "metrics").iterdir()) == []


def _safetensors_runs_out_of_space(monkeypatch):
    """safetensors' own error when its file system is full (seen on a 64 KiB tmpfs: it carries the errno only in its
    text), after writing part of the file."""
    from safetensors import SafetensorError

    def save_file(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\x00" * 100)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr("mergeflow.core.io.save_file", save_file)


def test_full_disk_while_saving_tensors_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    _safetensors_runs_out_of_space(monkeypatch)
    out = tmp_path / "models" / "pretrained.safetensors"
    with pytest.raises(MergeflowError) as err:
        save_state_dict(out, _state())
    assert str(err.value) == f"{out}: {NO_SPACE}"
    assert list(out.parent.iterdir()) == []


def test_full_disk_inside_an_atomic_directory_names_the_file_where_it_was_going(tmp_path, monkeypatch):
    _safetensors_runs_out_of_space(monkeypatch)
    with pytest.raises(MergeflowError) as err:
        with atomic_path(tmp_path / "vectors", directory=True) as tmp:
            (tmp / "stats.json").write_text("{}")
            save_state_dict(tmp / "digits.safetensors", _state())
    assert str(err.value) == f"{tmp_path / 'vectors' / 'digits.safetensors'}: {NO_SPACE}"
    assert list(tmp_path.iterdir()) == []


def test_quota_exceeded_is_one_line_and_other_write_errors_pass_through(tmp_path):
    import errno

    with pytest.raises(MergeflowError) as err:
        with atomic_path(tmp_path / "a.json"):
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
    assert (
        str(err.value) == f"{tmp_path / 'a.json'}: could not be written: disk quota exceeded "
        "(the partial file was removed; free space and run again)"
    )
    with pytest.raises(PermissionError):  # not a lack of space: not relabelled as one
        with atomic_path(tmp_path / "b.json"):
            raise PermissionError(errno.EACCES, "Permission denied")
    assert list(tmp_path.iterdir()) == []


def test_full_file_system_through_the_cli(tmp_path, repo_root):
    """A real full file system (a 16 KiB tmpfs on models/, which needs root): pretrain's 60 KB backbone does not fit."""
    import subprocess

    project = tmp_path / "project"
    (project / "models").mkdir(parents=True)
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(project / "models")], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("mounting a small tmpfs needs root (and CAP_SYS_ADMIN)")
    try:
        _cli_project(project, repo_root, str(_save_safetensors(tmp_path / "w.safetensors", _vit_state())))
        result = _run_cli(project, "pretrain")
        assert (result.returncode, result.stderr) == (2, f"error: models/pretrained.safetensors: {NO_SPACE}\n")
        assert list((project / "models").iterdir()) == []
    finally:
        subprocess.run(["umount", str(project / "models")], check=True)


# ---------------------------------------------------------------- permissions (issue 16)
@pytest.mark.parametrize(
    "umask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)], ids=["umask 022", "umask 027"]
)
def test_outputs_get_the_users_normal_permissions(tmp_path, umask, file_mode, dir_mode):
    """Not mkstemp's 0600 or mkdtemp's 0700: what open() and mkdir() give under the umask."""
    import stat

    from mergeflow.core.files import _umask, write_json

    previous = os.umask(umask)
    try:
        assert _umask() == umask and os.umask(umask) == umask  # read without being changed
        save_state_dict(tmp_path / "m.safetensors", _state())
        write_json(tmp_path / "m.json", {})
        with atomic_path(tmp_path / "vectors", directory=True) as tmp:
            save_state_dict(tmp / "digits.safetensors", _state())
            (tmp / "stats.json").write_text("{}")
        modes = {
            p.name: stat.S_IMODE(p.stat().st_mode) for p in [*tmp_path.iterdir(), *(tmp_path / "vectors").iterdir()]
        }
    finally:
        os.umask(previous)
    assert modes == {
        "m.safetensors": file_mode,
        "m.json": file_mode,
        "vectors": dir_mode,
        "digits.safetensors": file_mode,
        "stats.json": file_mode,
    }
