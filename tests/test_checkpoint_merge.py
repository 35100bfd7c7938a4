"""`mergeflow merge-checkpoints`: checkpoint files (single, or Hugging Face's shards) merged outside the pipeline,
against the formulas computed by hand on tiny tensors; refusals in one line, nothing written."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from mergeflow.cli import main
from mergeflow.core.io import load_metadata, load_state_dict
from mergeflow.pipeline.checkpoint_merge import merge_checkpoints


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "blocks.0.weight": torch.randn(4, 3, generator=g),
        "blocks.0.bias": torch.randn(4, generator=g).to(torch.bfloat16),
        "position_ids": torch.arange(5),  # an integer buffer, the same in every model
    }


@pytest.fixture
def checkpoints(tmp_path):
    """theta0 and two fine-tunes as files, and the second fine-tune also as a sharded Hugging Face folder."""
    paths = {}
    for name, seed in (("base", 0), ("digits", 1), ("signs", 2)):
        state = _state(seed)
        state["position_ids"] = torch.arange(5)
        paths[name] = tmp_path / f"{name}.safetensors"
        save_file(state, str(paths[name]))
    folder = tmp_path / "signs-hf"
    folder.mkdir()
    signs = load_state_dict(paths["signs"])
    save_file({"blocks.0.weight": signs["blocks.0.weight"]}, str(folder / "model-00001-of-00002.safetensors"))
    rest = {k: v for k, v in signs.items() if k != "blocks.0.weight"}
    save_file(rest, str(folder / "model-00002-of-00002.safetensors"))
    weight_map = {"blocks.0.weight": "model-00001-of-00002.safetensors"} | dict.fromkeys(
        rest, "model-00002-of-00002.safetensors"
    )
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    paths["signs-hf"] = folder
    return paths


def _by_hand(paths, fine_tunes, combine) -> dict[str, torch.Tensor]:
    base = load_state_dict(paths["base"])
    taus = [{k: load_state_dict(paths[f])[k].float() - base[k].float() for k in base} for f in fine_tunes]
    return {k: combine(base[k].float(), [t[k] for t in taus]).to(base[k].dtype) for k in base}


def test_task_arithmetic_is_theta0_plus_lam_times_the_sum_in_the_bases_dtypes(checkpoints, tmp_path):
    out = tmp_path / "merged.safetensors"
    record = merge_checkpoints(
        "task_arithmetic", checkpoints["base"], [checkpoints["digits"], checkpoints["signs"]], {"lam": 0.5}, out
    )
    merged = load_state_dict(out)
    expected = _by_hand(checkpoints, ["digits", "signs"], lambda b, taus: b + 0.5 * (taus[0] + taus[1]))
    assert {k: v.dtype for k, v in merged.items()} == {k: v.dtype for k, v in expected.items()}
    for k in expected:
        torch.testing.assert_close(merged[k], expected[k], rtol=0, atol=1e-6)
    assert torch.equal(merged["position_ids"], torch.arange(5))
    assert record["options"] == {"lam": 0.5} and set(record["finetuned"]) == {"digits", "signs"}
    meta = load_metadata(out)
    assert meta == record | {"base": str(checkpoints["base"])} and meta["method"] == "task_arithmetic"


def test_a_sharded_folder_reads_as_its_single_file(checkpoints, tmp_path):
    """Weight averaging (theta0 + mean tau: the models' mean) of a file and a sharded folder, through the command."""
    out = tmp_path / "averaged.safetensors"
    argv = ["merge-checkpoints", "--method", "weight_averaging", "--base", str(checkpoints["base"])]
    assert main([*argv, str(checkpoints["digits"]), str(checkpoints["signs-hf"]), "-o", str(out)]) == 0
    merged = load_state_dict(out)
    expected = _by_hand(checkpoints, ["digits", "signs"], lambda b, taus: b + (taus[0] + taus[1]) / 2)
    for k in expected:
        torch.testing.assert_close(merged[k], expected[k], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--method", "tie"], "error: --method tie: not a registered method; did you mean ties"),
        (["--method", "fisher"], "error: --method fisher: reads train stats, which checkpoint files do not hold"),
        (["--method", "emr"], "error: --method emr: gives one model per task, not one merged checkpoint"),
        (["--method", "slerp", "--set", "t=0.3"], "error: --method slerp: merges exactly 2 fine-tuned models, given 3"),
        (["--method", "ties", "--set", "k=[0.1,0.2]"], "error: --set k: a list is a grid, searched on validation"),
        (["--method", "ties", "--set", "kk=0.1"], "error: --set kk: unknown hyperparameter (allowed: "),
        (["--method", "ties", "--set", "k=2"], "error: --set k: expected a fraction"),
        (["--method", "ties", "--set", "k"], "error: --set k: expected key=value"),
        (["--method", "task_negation"], "error: --method task_negation: negates one fine-tune's task vector, given 3"),
    ],
)
def test_what_files_alone_cannot_merge_is_one_line_and_writes_nothing(checkpoints, tmp_path, capsys, argv, message):
    out = tmp_path / "merged.safetensors"
    models = [str(checkpoints[n]) for n in ("digits", "signs", "signs-hf")]
    assert main(["merge-checkpoints", "--base", str(checkpoints["base"]), *argv, *models, "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err
    assert not out.exists() and not list(tmp_path.glob("*.tmp*"))


def test_a_checkpoint_of_another_shape_names_the_tensor(checkpoints, tmp_path, capsys):
    other = tmp_path / "other.safetensors"
    save_file(_state(3) | {"blocks.0.weight": torch.zeros(4, 4)}, str(other))
    out = tmp_path / "merged.safetensors"
    argv = ["merge-checkpoints", "--method", "ties", "--base", str(checkpoints["base"]), str(other), "-o", str(out)]
    assert main(argv) == 2
    assert "tensor 'blocks.0.weight' has shape (4, 4), expected (4, 3)" in capsys.readouterr().err
    assert not out.exists()


def test_the_pipelines_merge_comes_out_of_its_checkpoint_files(tiny_reference, tmp_path):
    """TIES on the tiny reference run's checkpoints at the hyperparameters its merge stage chose gives the stage's
    merged model (to float32 rounding: the stage forms lam's value by interpolating between lam = 0 and 1)."""
    root = tiny_reference[0]
    chosen = json.loads((root / "metrics" / "merge" / "ties.json").read_text())["hyperparameters"]
    tasks = ["digits", "house_numbers", "count"]
    out = tmp_path / "ties.safetensors"
    merge_checkpoints(
        "ties",
        root / "models" / "pretrained.safetensors",
        [root / "models" / "finetuned" / f"{t}.safetensors" for t in tasks],
        chosen,
        out,
    )
    merged, stage = load_state_dict(out), load_state_dict(root / "merged" / "ties.safetensors")
    assert set(merged) == set(stage)
    for k in stage:
        torch.testing.assert_close(merged[k], stage[k], rtol=0, atol=1e-6)


def test_a_yaml_config_merges_as_the_flags_do(checkpoints, tmp_path, capsys):
    """--config: the same merge written as YAML (paths relative to the file) gives the flags' bytes."""
    flags = tmp_path / "flags.safetensors"
    argv = ["merge-checkpoints", "--method", "ties", "--set", "k=0.5", "--base", str(checkpoints["base"])]
    assert main([*argv, str(checkpoints["digits"]), str(checkpoints["signs-hf"]), "-o", str(flags)]) == 0
    config = tmp_path / "merge.yaml"
    config.write_text(
        "method: ties\nbase: base.safetensors\nmodels: [digits.safetensors, signs-hf]\noptions: {k: 0.5}\n"
        "output: from-yaml.safetensors\n"
    )
    assert main(["merge-checkpoints", "--config", str(config)]) == 0
    assert (tmp_path / "from-yaml.safetensors").is_file()
    merged, expected = load_state_dict(tmp_path / "from-yaml.safetensors"), load_state_dict(flags)
    assert all(torch.equal(merged[k], expected[k]) for k in expected)
    capsys.readouterr()


@pytest.mark.parametrize(
    "text, message",
    [
        ("method: ties\nbase: b\nmodels: [a]\noutput: o\nmodel: [c]\n", "model: unknown key; did you mean models"),
        ("method: ties\nbase: b\noutput: o\n", "models: missing"),
        ("method: ties\nbase: b\nmodels: a\noutput: o\n", "models: expected a list of paths"),
        ("- ties\n", "expected a mapping of method, base, models, options, output"),
    ],
)
def test_a_bad_config_is_one_line_naming_the_key(tmp_path, capsys, text, message):
    config = tmp_path / "merge.yaml"
    config.write_text(text)
    assert main(["merge-checkpoints", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {config}: {message}") and err.count("\n") == 1, err


def test_config_and_flags_together_or_neither_are_refused(checkpoints, tmp_path, capsys):
    config = tmp_path / "merge.yaml"
    config.write_text("method: ties\nbase: b\nmodels: [a]\noutput: o\n")
    assert main(["merge-checkpoints", "--config", str(config), "--method", "ties"]) == 2
    assert "says everything; give it alone" in capsys.readouterr().err
    assert main(["merge-checkpoints", "--method", "ties", str(checkpoints["digits"]), "-o", "x"]) == 2
    assert capsys.readouterr().err == "error: merge-checkpoints: --base is required (or --config FILE)\n"
