"""Regime checkpoints on disk (mergeflow.ml.regimes._checkpoint, issue 19): one safetensors file per round, written
atomically; a round trip of a real MIMA run's checkpoint (AdamW carries on a tiny ViT) is bit for bit, resuming from
the file repeats an uninterrupted run bit for bit, and a wrong identity or a damaged file is one line naming it."""

import json
import math
import pickletools
import struct

import pytest
import torch
from safetensors import safe_open

from mergeflow.core.errors import MergeflowError
from mergeflow.ml.regimes import REGISTRY, Checkpoint, load_checkpoint, save_checkpoint
from tests.test_regime_trainer import ADAMW, TASKS, THETA0, trainer

HYPERPARAMETERS = {"rounds": 3, "total_steps": 6, "schedule": "one_schedule", "optimizer_state": "carry"}
IDENTITY = {"regime": "mima", "hyperparameters": HYPERPARAMETERS, "tasks": TASKS, "theta0": "sha256:toy"}


class Killed(Exception):
    pass


def _checkpoints(after):
    """The checkpoints of a MIMA run killed after round ``after``."""
    got = []

    def hook(checkpoint):
        got.append(checkpoint)
        if checkpoint.round == after:
            raise Killed

    with pytest.raises(Killed):
        REGISTRY["mima"](THETA0, TASKS, trainer(ADAMW), on_round_end=hook, **HYPERPARAMETERS)
    return got


@pytest.fixture(scope="module")
def round_two():
    return _checkpoints(2)[-1]


def same(a, b, where="checkpoint"):
    """Equal bit for bit: the same types all the way down, tensors torch.equal with their dtype and shape."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}/{i}")
    elif hasattr(a, "__dataclass_fields__"):
        for name in a.__dataclass_fields__:
            same(getattr(a, name), getattr(b, name), f"{where}.{name}")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, where


def test_round_trip_of_a_mima_checkpoint_is_bit_for_bit(round_two, tmp_path):
    carry = round_two.carries["digits"]
    # what is being checked really is an AdamW state: int-keyed per-parameter tensors, floats, bools, None
    assert isinstance(carry["state"], dict) and all(isinstance(k, int) for k in carry["state"])
    assert isinstance(carry["param_groups"][0]["lr"], float) and isinstance(carry["param_groups"][0]["params"][0], int)
    assert len(round_two.records) == 2 and isinstance(next(iter(round_two.records[0].update_cosines)), tuple)
    path = tmp_path / "round-2.safetensors"
    save_checkpoint(path, round_two, identity=IDENTITY)
    loaded = load_checkpoint(path, identity=IDENTITY)
    assert isinstance(loaded, Checkpoint)
    same(loaded, round_two)


def test_resuming_from_the_loaded_checkpoint_repeats_an_uninterrupted_run(tmp_path):
    whole = REGISTRY["mima"](THETA0, TASKS, trainer(ADAMW), **HYPERPARAMETERS)
    path = tmp_path / "checkpoint.safetensors"
    with pytest.raises(Killed):

        def save_then_die(checkpoint):
            save_checkpoint(path, checkpoint, identity=IDENTITY)
            raise Killed

        REGISTRY["mima"](THETA0, TASKS, trainer(ADAMW), on_round_end=save_then_die, **HYPERPARAMETERS)
    resumed = REGISTRY["mima"](
        THETA0, TASKS, trainer(ADAMW), resume=load_checkpoint(path, identity=IDENTITY), **HYPERPARAMETERS
    )
    same(resumed.task_states, whole.task_states)
    same(resumed.model, whole.model)
    assert [r.round for r in resumed.rounds] == [1, 2, 3]
    same(resumed.rounds, whole.rounds)


def test_a_wrong_identity_is_one_line_naming_the_file_and_the_key(round_two, tmp_path):
    path = tmp_path / "ck.safetensors"
    save_checkpoint(path, round_two, identity=IDENTITY)
    with pytest.raises(MergeflowError) as err:
        load_checkpoint(path, identity={**IDENTITY, "theta0": "sha256:other"})
    message = str(err.value)
    assert str(path) in message and "'theta0'" in message and "\n" not in message
    with pytest.raises(MergeflowError, match="'tasks'"):
        load_checkpoint(path, identity={**IDENTITY, "tasks": ["digits"]})


def test_a_truncated_or_corrupt_file_is_one_line_naming_it(round_two, tmp_path):
    path = tmp_path / "ck.safetensors"
    save_checkpoint(path, round_two, identity=IDENTITY)
    data = path.read_bytes()
    for name, damaged in [
        ("truncated", data[: len(data) // 2]),
        ("header cut", data[:100]),
        ("garbage", b"\x00" * 7),
        ("flipped header", data[:8] + b"{" * 50 + data[58:]),
    ]:
        bad = tmp_path / f"{name}.safetensors"
        bad.write_bytes(damaged)
        with pytest.raises(MergeflowError) as err:
            load_checkpoint(bad, identity=IDENTITY)
        assert str(bad) in str(err.value) and "\n" not in str(err.value), name
    with pytest.raises(MergeflowError, match="not found"):
        load_checkpoint(tmp_path / "absent.safetensors", identity=IDENTITY)


def test_the_file_is_safetensors_with_no_pickle(round_two, tmp_path):
    path = tmp_path / "ck.safetensors"
    save_checkpoint(path, round_two, identity=IDENTITY)
    data = path.read_bytes()
    assert not data.startswith(b"\x80") and b"PK\x03\x04" not in data[:4]  # neither a pickle nor torch.save's zip
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])  # the whole header is JSON: safetensors' layout, no pickle in it
    metadata = json.loads(header["__metadata__"]["mergeflow"])
    assert metadata["identity"] == IDENTITY and metadata["checkpoint"]["round"] == 2
    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
        assert keys and all(isinstance(f.get_tensor(k), torch.Tensor) for k in keys)
    # everything after the header is raw tensor bytes, exactly as the header's offsets account for
    assert 8 + n + max(e["data_offsets"][1] for k, e in header.items() if k != "__metadata__") == len(data)
    with pytest.raises(Exception):  # and the file is no pickle stream
        list(pickletools.genops(data))


def test_a_kill_mid_write_leaves_the_previous_checkpoint(round_two, tmp_path, monkeypatch):
    path = tmp_path / "ck.safetensors"
    earlier = _checkpoints(1)[-1]
    save_checkpoint(path, earlier, identity=IDENTITY)
    before = path.read_bytes()
    import mergeflow.core.io

    def die_mid_write(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise Killed

    monkeypatch.setattr(mergeflow.core.io, "save_file", die_mid_write)
    with pytest.raises(Killed):
        save_checkpoint(path, round_two, identity=IDENTITY)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [path.name]
    assert load_checkpoint(path, identity=IDENTITY).round == 1
