"""params.yaml validation: one line naming the key and what is allowed, exit status 2, nothing written."""

import json
import subprocess
import sys

import pytest
import yaml

from mergeflow.params import load_params, parse_params
from mergeflow.core.errors import MergeflowError


def test_repository_params_are_valid(repo_root):
    params = load_params(repo_root / "params.yaml")
    assert len(params.suite.tasks) >= 8
    assert params.merge.overrides("task_arithmetic")["lam"][0] == 0.05


def _with(repo_root, section, key, value):
    raw = yaml.safe_load((repo_root / "params.yaml").read_text())
    raw[section][key] = value
    return raw


@pytest.mark.parametrize(
    "section, key, value, pattern",
    [
        ("finetune", "lrr", 0.1, r"unknown key 'finetune.lrr' \(allowed here: steps, epochs, batch_size, lr,"),
        ("finetune", "steps", "many", r"finetune.steps: Input should be a valid integer"),
        ("finetune", "lr", -1.0, r"finetune.lr: Input should be greater than 0 \(got -1.0\)"),
        ("finetune", "optimizer", "adam", r"finetune.optimizer: Input should be 'adamw', 'sgd' or 'gd'"),
        ("suite", "tasks", ["digits", "digits"], r"suite.tasks: task 'digits' is listed twice"),
    ],
)
def test_bad_values_name_the_key(repo_root, section, key, value, pattern):
    with pytest.raises(MergeflowError, match=pattern):
        parse_params(_with(repo_root, section, key, value), "params.yaml")


@pytest.mark.parametrize(
    "backbone, message",
    [
        (
            {"kwargs": {"img_sise": 32}},
            "backbone.kwargs.img_sise: not an argument of timm's "
            "VisionTransformer (did you mean img_size? it takes 31)",
        ),
        ({"kwargs": {"img_size": -3}}, "backbone.kwargs.img_size: expected a whole number from 1 to 4096, got -3"),
        (
            {"kwargs": {"patch_size": [8, 8, 8]}},
            "backbone.kwargs.patch_size: expected one size or two (height, width), got [8, 8, 8]",
        ),
        ({"kwargs": {"depth": 2.5}}, "backbone.kwargs.depth: expected a whole number from 1 to 65536, got 2.5"),
        (
            {"kwargs": {"embed_dim": 128, "num_heads": 3}},
            "backbone.kwargs: embed_dim 128 does not split into num_heads 3 equal heads",
        ),
        (
            {"kwargs": {"drop_path_rate": 1.0}},
            "backbone.kwargs.drop_path_rate: a dropout rate, from 0 up to (not including) 1, got 1.0",
        ),
        (
            {"kwargs": {"num_classes": 10}},
            "backbone.kwargs.num_classes: mergeflow sets it (a features-only backbone, backbone.global_pool, "
            "backbone.pretrained); remove it",
        ),
        ({"global_pool": ""}, "backbone.global_pool: '' is not a ViT's pooling (one of token, avg, max, avgmax, map)"),
        (
            {"model": "resnet18", "kwargs": {}, "global_pool": "token_mean"},
            "backbone.global_pool: 'token_mean' is not a timm model's "
            "pooling (one of avg, max, avgmax, catavgmax, fast, token, map)",
        ),
        (
            {"library": "transformers", "model": "roberta", "kwargs": {"hidden_size": 0}},
            "backbone.kwargs.hidden_size: expected a whole number from 1 to 65536, got 0",
        ),
        (
            {"library": "transformers", "model": "roberta", "kwargs": {}, "global_pool": "max"},
            "backbone.global_pool: 'max' is not a text backbone's pooling (one of token, avg)",
        ),
    ],
)
def test_backbone_settings_are_checked_at_load(repo_root, backbone, message):
    """What timm's or transformers' constructor would refuse mid-stage (an AssertionError from timm for heads that do
    not split the width) is one line naming the key when params.yaml loads."""
    raw = yaml.safe_load((repo_root / "params.yaml").read_text())
    raw["backbone"] |= backbone
    with pytest.raises(MergeflowError) as err:
        parse_params(raw, "params.yaml")
    assert str(err.value) == f"params.yaml: {message}"


@pytest.mark.parametrize(
    "regime, settings, message",
    [
        (
            "lora",
            {"targets": ["qkv", "nomodule"]},
            "regimes.lora.targets: 'nomodule' names no linear layer of vit_tiny_patch16_224 (its layers end in qkv, "
            "proj, fc1, fc2, head, q, kv)",
        ),
        ("lora", {"lr": 1e308}, "regimes.lora.lr: Input should be less than or equal to 100 (got 1e+308)"),
        ("atm", {"rounds": [4, 0]}, "regimes.atm.rounds.1: Input should be greater than or equal to 1 (got 0)"),
        ("atm", {"steps": -5}, "regimes.atm.steps: expected at least 1 step a round, 'epoch' or empty (null) (got -5)"),
        ("mima", {"rounds": [-1]}, "regimes.mima.rounds.0: Input should be greater than or equal to 1 (got -1)"),
    ],
)
def test_a_regime_that_does_not_run_has_its_settings_checked_too(repo_root, regime, settings, message):
    raw = yaml.safe_load((repo_root / "params.yaml").read_text())
    assert regime not in raw["regimes"]["run"] or regime == "mima"
    raw["regimes"]["run"] = []
    raw["regimes"][regime] = (raw["regimes"].get(regime) or {}) | settings
    with pytest.raises(MergeflowError) as err:
        parse_params(raw, "params.yaml")
    assert str(err.value) == f"params.yaml: {message}"


def test_lora_targets_are_checked_against_a_text_backbone_when_given_or_run(repo_root):
    """A default that names a ViT's layers is no error on RoBERTa while LoRA does not run; given, or run, it is."""
    raw = yaml.safe_load((repo_root / "profiles" / "text8.yaml").read_text())
    raw["regimes"]["run"] = []
    raw["regimes"]["lora"].pop("targets")
    parse_params(raw, "params.yaml")
    for edit in ({"targets": ["qkv"]}, {}):
        changed = json.loads(json.dumps(raw))
        changed["regimes"]["lora"] |= edit
        changed["regimes"]["run"] = [] if edit else ["lora"]
        with pytest.raises(
            MergeflowError,
            match=r"^params.yaml: regimes.lora.targets: 'qkv' names no linear layer of roberta \(its layers end in "
            r"query, key, value, dense\)$",
        ):
            parse_params(changed, "params.yaml")


def test_the_linear_layers_named_are_the_ones_the_libraries_build():
    """config.backbone.LINEAR_LAYERS, what LoRA's targets are checked against at load, against the modules built."""
    import timm
    import transformers
    from torch import nn

    from mergeflow.config.backbone import linear_layers

    def names(net):
        return {name.rsplit(".", 1)[-1] for name, module in net.named_modules() if isinstance(module, nn.Linear)}

    vit = set().union(
        *(
            names(timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=1, **kw))
            for kw in (
                {"num_classes": 0},
                {"num_classes": 8, "global_pool": "token"},
                {"num_classes": 0, "global_pool": "map"},
            )
        )
    )
    assert vit == set(linear_layers("timm", "vit_base_patch32_clip_quickgelu_224.openai"))
    sizes = {
        "hidden_size": 32,
        "d_model": 32,
        "num_attention_heads": 2,
        "num_heads": 2,
        "intermediate_size": 64,
        "d_ff": 64,
        "num_hidden_layers": 1,
        "num_layers": 1,
        "vocab_size": 50,
    }
    for model_type in ("roberta", "bert", "t5"):
        built = transformers.AutoModel.from_config(transformers.AutoConfig.for_model(model_type, **sizes))
        assert names(built) == set(linear_layers("transformers", model_type)), model_type
    assert linear_layers("timm", "resnet18") is None


def test_the_vit_arguments_are_timms():
    """config.backbone.VIT_KWARGS is timm's VisionTransformer signature less what mergeflow sets and what is no
    setting."""
    import inspect

    from timm.models.vision_transformer import VisionTransformer

    from mergeflow.config.backbone import VIT_KWARGS

    not_settings = {
        "self",
        "num_classes",
        "global_pool",
        "embed_layer",
        "embed_norm_layer",
        "norm_layer",
        "act_layer",
        "block_fn",
        "mlp_layer",
        "attn_layer",
        "device",
        "dtype",
    }
    assert VIT_KWARGS == set(inspect.signature(VisionTransformer.__init__).parameters) - not_settings


def test_a_params_file_names_every_section_and_an_empty_one_takes_its_defaults(repo_root, tmp_path):
    from mergeflow.config import ProbeConfig

    raw = yaml.safe_load((repo_root / "params.yaml").read_text())
    path = tmp_path / "params.yaml"
    for gone, said in (
        ("probe", "section 'probe' is missing (`probe:` left empty takes its defaults)"),
        ("seed", "'seed' is missing"),
    ):
        path.write_text(yaml.safe_dump({k: v for k, v in raw.items() if k != gone}))
        with pytest.raises(MergeflowError) as err:
            load_params(path)
        assert str(err.value) == f"{path}: {said}: params.yaml writes out every top-level key"
    path.write_text(yaml.safe_dump(raw | {"probe": None}))  # `probe:`, as dvc exp run -S writes null
    assert load_params(path).probe == ProbeConfig()


def test_cli_bad_params_exit_2_one_line_nothing_written(repo_root, tmp_path):
    bad = _with(repo_root, "finetune", "lr", "fast")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(bad))
    proc = subprocess.run(
        [sys.executable, "-m", "mergeflow.cli", "prepare"], cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "finetune.lr" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]


def test_cli_unknown_task_is_one_line(repo_root, tmp_path):
    (tmp_path / "params.yaml").write_text((repo_root / "params.yaml").read_text())
    proc = subprocess.run(
        [sys.executable, "-m", "mergeflow.cli", "finetune", "--task", "cars"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip() == "error: params.yaml: suite.tasks has no task 'cars' (listed: "
        f"{', '.join(load_params(tmp_path / 'params.yaml').suite.tasks)})"
    )
    assert not (tmp_path / "models").exists()


def test_suite_name_is_the_suite_that_runs(repo_root, tmp_path):
    # params.yaml leaves suite.name empty: the embedded suite is "embedded"; pointed at other data, the MLflow
    # experiment takes the data's folder name, never "embedded"; a name given is kept
    raw = yaml.safe_load((repo_root / "params.yaml").read_text())
    assert raw["suite"]["name"] is None and parse_params(raw).suite.name == "embedded"
    raw["suite"] |= {"source": "imagefolder", "root": str(tmp_path / "my lab's photos")}
    assert parse_params(raw).suite.name == "my-lab-s-photos"
    raw["suite"]["name"] = "photos2026"
    assert parse_params(raw).suite.name == "photos2026"
    from mergeflow.report.tracking import experiment_name

    assert experiment_name(parse_params(raw)) == "mergeflow/photos2026"


@pytest.mark.parametrize(
    "edit, pattern",
    [
        (
            lambda raw: raw["finetune"].update(head="zeroshot"),
            r"finetune.head: zeroshot needs CLIP's image embedding and text tower",
        ),
        (
            lambda raw: raw["finetune"].update(checkpoints={"cars": "hf:someone/cars"}),
            r"finetune.checkpoints: 'cars' is not in suite.tasks",
        ),
        (
            lambda raw: raw["backbone"].update(embedding="clip"),
            r"backbone.embedding: clip embeds CLIP's class token .* set backbone.global_pool: token and "
            r"backbone.input_norm: pretrained_cfg \(not 'avg', 'center'\)",
        ),
        (
            lambda raw: raw["backbone"].update(embedding="clip", global_pool="token", input_norm="pretrained_cfg"),
            None,
        ),  # only a stage builds the model: models' error
        (
            lambda raw: raw["finetune"].update(checkpoints={"digits": "hf:no-owner"}),
            r"finetune.checkpoints.digits: 'hf:no-owner' is not hf:<owner>/<repo>\[@<revision>\]",
        ),
    ],
)
def test_clip_settings_are_checked_together(repo_root, edit, pattern):
    raw = yaml.safe_load((repo_root / "params.yaml").read_text())
    edit(raw)
    if pattern is None:
        parse_params(raw)
        return
    with pytest.raises(MergeflowError, match=pattern):
        parse_params(raw)


def test_check_finds_missing_weights_files_before_any_stage(repo_root, tmp_path):
    from mergeflow.runner.checks import check_project

    raw = yaml.safe_load((repo_root / "params.yaml").read_text())
    raw["finetune"]["checkpoints"] = {"digits": "published/digits.safetensors", "signs": "hf:someone/signs"}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(
        MergeflowError,
        match=r"params.yaml: finetune.checkpoints.digits: weights file 'published/digits.safetensors' not found$",
    ):
        check_project(tmp_path)
    (tmp_path / "published").mkdir()
    (tmp_path / "published" / "digits.safetensors").write_bytes(b"")  # found, but not safetensors: its header says so
    with pytest.raises(
        MergeflowError,
        match=r"finetune.checkpoints.digits: 'published/digits.safetensors' "
        r"is not a readable safetensors file \(.*header too small\)$",
    ):
        check_project(tmp_path)
    from safetensors.numpy import save_file

    import numpy as np

    # timm's names and params.yaml's backbone shapes (width 128, patch 8, 4 blocks): its tensors are the stage's to read
    kw = raw["backbone"]["kwargs"]
    shapes = {
        "cls_token": (1, 1, kw["embed_dim"]),
        "pos_embed": (1, 17, kw["embed_dim"]),
        "patch_embed.proj.weight": (kw["embed_dim"], 3, kw["patch_size"], kw["patch_size"]),
    }
    shapes |= {f"blocks.{i}.norm1.weight": (kw["embed_dim"],) for i in range(kw["depth"])}
    save_file(
        {k: np.zeros(v, np.float32) for k, v in shapes.items()}, str(tmp_path / "published" / "digits.safetensors")
    )
    check_project(tmp_path)
