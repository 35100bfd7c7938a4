"""`mergeflow merge-checkpoints -o FOLDER`: the merge as a Hugging Face model folder (the base's config and tokenizer
files, the weights whole or sharded with their index), read back with safetensors and with transformers to the
single-file output's tensors; the shards as huggingface_hub splits them; an error part-way leaves no folder; a
tensor-local method merged a chunk at a time gives the whole merge's bytes."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mergeflow.cli import main
from mergeflow.core.io import load_state_dict
from mergeflow.pipeline import checkpoint_merge, checkpoint_output
from mergeflow.pipeline.checkpoint_merge import merge_checkpoints


def _roberta_folders(root, n_finetunes=2):
    """A tiny RobertaModel saved with save_pretrained as the base (plus a tokenizer file and a README), and
    fine-tunes: the base's parameters plus noise, saved the same way."""
    from transformers import RobertaConfig, RobertaModel

    config = RobertaConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=24,
    )
    torch.manual_seed(0)
    model = RobertaModel(config)
    model.save_pretrained(root / "base")
    (root / "base" / "tokenizer_config.json").write_text('{"model_max_length": 22}\n')
    (root / "base" / "README.md").write_text("the base's card, not the merge's\n")
    paths = []
    for t in range(n_finetunes):
        tuned = RobertaModel(config)
        tuned.load_state_dict(model.state_dict())
        with torch.no_grad():
            for p in tuned.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(t + 1)))
        tuned.save_pretrained(root / f"ft{t}")
        paths.append(root / f"ft{t}")
    return root / "base", paths


def _folder_tensors(folder):
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors |= load_file(str(path))
    return tensors


def test_a_sharded_folder_holds_the_single_files_tensors_and_loads_in_transformers(tmp_path):
    from huggingface_hub import split_torch_state_dict_into_shards
    from transformers import RobertaModel

    base, finetuned = _roberta_folders(tmp_path)
    single, folder = tmp_path / "merged.safetensors", tmp_path / "merged"
    merge_checkpoints("task_arithmetic", base, finetuned, {"lam": 0.5}, single)
    argv = ["merge-checkpoints", "--method", "task_arithmetic", "--set", "lam=0.5", "--base", str(base)]
    assert main([*argv, *map(str, finetuned), "-o", str(folder), "--max-shard-size", "8KB"]) == 0
    expected = load_state_dict(single)

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    n = len(shards)
    assert n >= 3 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(set(index["weight_map"].values())) == shards and set(index["weight_map"]) == set(expected)
    for name in shards:  # each tensor in the file the index names, and each shard within 8 kB unless one tensor
        with safe_open(str(folder / name), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            keys = set(f.keys())
        assert keys == {k for k, v in index["weight_map"].items() if v == name}
        size = sum(expected[k].numel() * expected[k].element_size() for k in keys)
        assert size <= 8_000 or len(keys) == 1
    total = sum(v.numel() * v.element_size() for v in expected.values())
    assert index["metadata"] == {"total_size": total, "total_parameters": sum(v.numel() for v in expected.values())}
    text = (folder / "model.safetensors.index.json").read_text()
    assert text == json.dumps(index, indent=2, sort_keys=True) + "\n"  # transformers' save_pretrained's form
    # the split as huggingface_hub makes it, the tensors in the base file's order
    order = checkpoint_merge.read_checkpoint(base).specs()
    split = split_torch_state_dict_into_shards({k: expected[k] for k in order}, max_shard_size="8KB")
    assert split.tensor_to_filename == index["weight_map"] and split.metadata["total_size"] == total

    merged = _folder_tensors(folder)
    assert set(merged) == set(expected) and all(torch.equal(merged[k], expected[k]) for k in expected)
    model = RobertaModel.from_pretrained(folder)
    state = model.state_dict()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    assert (folder / "config.json").read_bytes() == (base / "config.json").read_bytes()
    assert (folder / "tokenizer_config.json").read_bytes() == (base / "tokenizer_config.json").read_bytes()
    assert not (folder / "README.md").exists()
    record = json.loads((folder / "mergeflow.json").read_text())
    assert record["method"] == "task_arithmetic" and record["options"] == {"lam": 0.5}


def test_a_model_within_the_shard_size_is_one_model_safetensors_without_an_index(tmp_path):
    base, finetuned = _roberta_folders(tmp_path)
    folder = tmp_path / "merged"
    merge_checkpoints("ties", base, finetuned, {"k": 0.3, "trim_scope": "tensor"}, folder)
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json",
        "mergeflow.json",
        "model.safetensors",
        "tokenizer_config.json",
    ]
    single = tmp_path / "merged.safetensors"
    merge_checkpoints("ties", base, finetuned, {"k": 0.3, "trim_scope": "tensor"}, single)
    merged, expected = load_state_dict(folder / "model.safetensors"), load_state_dict(single)
    assert all(torch.equal(merged[k], expected[k]) for k in expected)


def test_an_error_after_a_shard_is_written_leaves_no_folder(tmp_path, monkeypatch, capsys):
    """A fine-tune whose last tensor holds NaN: the shards before it are written into the temporary folder, then the
    error; no output folder, no temporary left, and an earlier output of the same name stays as it was."""
    base, finetuned = _roberta_folders(tmp_path)
    state = load_file(str(finetuned[1] / "model.safetensors"))
    last = list(checkpoint_merge.read_checkpoint(base).specs())[-1]
    state[last] = state[last].clone()
    state[last].view(-1)[0] = float("nan")
    save_file(state, str(finetuned[1] / "model.safetensors"), metadata={"format": "pt"})
    written = []
    real_save = checkpoint_output.save_file
    monkeypatch.setattr(
        checkpoint_output, "save_file", lambda t, path, **kw: (written.append(path), real_save(t, path, **kw))
    )
    argv = ["merge-checkpoints", "--method", "task_arithmetic", "--base", str(base), *map(str, finetuned)]
    capsys.readouterr()  # save_pretrained's progress bars
    assert main([*argv, "-o", str(tmp_path / "merged"), "--max-shard-size", "8KB"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"tensor '{last}' contains NaN or Inf" in err, err
    assert len(written) >= 2  # shards were written before the error
    assert not (tmp_path / "merged").exists() and not list(tmp_path.glob(".merged*"))

    (tmp_path / "merged").mkdir()
    (tmp_path / "merged" / "model.safetensors").write_bytes(b"an earlier merge")
    assert main([*argv, "-o", str(tmp_path / "merged"), "--max-shard-size", "8KB"]) == 2
    assert [p.name for p in (tmp_path / "merged").iterdir()] == ["model.safetensors"]
    assert (tmp_path / "merged" / "model.safetensors").read_bytes() == b"an earlier merge"


def _state(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(6, 5, generator=g),
        "a.bias": torch.randn(6, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(7, 6, generator=g),
        "c.weight": torch.randn(3, 7, generator=g).to(torch.bfloat16),
    }


@pytest.mark.parametrize(
    "method, options",
    [
        *[(name, {}) for name in sorted(checkpoint_merge.TENSOR_LOCAL)],
        ("ties", {"trim_scope": "tensor"}),
        ("dare_ties", {"p": 0.5, "seed": 3}),
        ("slerp", {"space": "weights", "t": 0.3}),
    ],
)
def test_a_tensor_local_method_merged_tensor_by_tensor_gives_the_whole_merges_bytes(
    tmp_path, monkeypatch, method, options
):
    """Each tensor its own chunk (CHUNK_BYTES = 1) against the method called once on the whole in-memory model."""
    from mergeflow.ml.merging import REGISTRY

    paths = []
    for name, seed in (("base", 0), ("ft1", 1), ("ft2", 2)):
        paths.append(tmp_path / f"{name}.safetensors")
        save_file(_state(seed), str(paths[-1]))
    monkeypatch.setattr(checkpoint_merge, "CHUNK_BYTES", 1)
    calls = []
    real = REGISTRY[method].fn

    def spy(theta0, taus, **hyperparameters):
        calls.append(list(theta0))
        return real(theta0, taus, **hyperparameters)

    monkeypatch.setitem(REGISTRY, method, dataclasses.replace(REGISTRY[method], fn=spy))
    out = tmp_path / "merged.safetensors"
    merge_checkpoints(method, paths[0], paths[1:], options, out)
    assert sorted(calls) == sorted([k] for k in _state(0))  # one call a tensor
    theta0 = {k: v.float() for k, v in _state(0).items()}
    taus = {f"ft{i}": {k: v.float() - theta0[k] for k, v in _state(i).items()} for i in (1, 2)}
    whole = real(theta0, taus, **{**REGISTRY[method].defaults, **options})
    merged = load_state_dict(out)
    for key, value in _state(0).items():
        assert torch.equal(merged[key], whole[key].to(value.dtype)), key


@pytest.mark.parametrize(
    "extra, output, message",
    [
        (["--max-shard-size", "5XB"], "merged", "error: --max-shard-size 5XB: expected bytes or a size such as 5GB"),
        (["--max-shard-size", "0"], "merged", "error: --max-shard-size 0: expected a positive size"),
        (["--max-shard-size", "1GB"], "merged.safetensors", "error: --max-shard-size: "),
    ],
)
def test_a_bad_shard_size_is_one_line_and_writes_nothing(tmp_path, capsys, extra, output, message):
    paths = []
    for name, seed in (("base", 0), ("ft1", 1)):
        paths.append(tmp_path / f"{name}.safetensors")
        save_file(_state(seed), str(paths[-1]))
    argv = ["merge-checkpoints", "--method", "task_arithmetic", "--base", str(paths[0]), str(paths[1])]
    assert main([*argv, "-o", str(tmp_path / output), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err
    assert not (tmp_path / output).exists()


def test_a_yaml_config_writes_the_folder_its_max_shard_size_says(tmp_path, capsys):
    for name, seed in (("base", 0), ("ft1", 1), ("ft2", 2)):
        save_file(_state(seed), str(tmp_path / f"{name}.safetensors"))
    models = "models: [ft1.safetensors, ft2.safetensors]\noptions: {lam: 0.5}\n"
    (tmp_path / "merge.yaml").write_text(f"method: task_arithmetic\nbase: base.safetensors\n{models}output: out\n")
    (tmp_path / "sharded.yaml").write_text(
        f"method: task_arithmetic\nbase: base.safetensors\n{models}output: sharded\nmax_shard_size: 200\n"
    )
    (tmp_path / "bad.yaml").write_text(f"method: ties\nbase: b\n{models}output: o\nmax_shard_size: [1]\n")
    assert main(["merge-checkpoints", "--config", str(tmp_path / "merge.yaml")]) == 0
    assert main(["merge-checkpoints", "--config", str(tmp_path / "sharded.yaml")]) == 0
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    # in the base file's order (safetensors': a.weight 120 B, b.weight 168 B, a.bias bf16 12 B, c.weight bf16 42 B),
    # at most 200 bytes a shard: 120 | 168 + 12 | 42
    shard = "model-0000{}-of-00003.safetensors".format
    assert index["weight_map"] == {"a.weight": shard(1), "b.weight": shard(2), "a.bias": shard(2), "c.weight": shard(3)}
    assert index["metadata"]["total_size"] == 12 + 120 + 168 + 42
    whole, sharded = load_state_dict(tmp_path / "out" / "model.safetensors"), _folder_tensors(tmp_path / "sharded")
    assert set(whole) == set(sharded) and all(torch.equal(whole[k], sharded[k]) for k in whole)
    capsys.readouterr()
    assert main(["merge-checkpoints", "--config", str(tmp_path / "bad.yaml")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'bad.yaml'}: max_shard_size: expected a size such as 5GB\n"
