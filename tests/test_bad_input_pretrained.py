"""backbone.pretrained from a file or the hub (issue 16): weights of another shape, unreadable files and pickles are
one line naming the file and the tensor, and `mergeflow pretrain` says the same (exit 2) and writes nothing."""

import os
import re

import pytest
import torch
import yaml

from mergeflow.core.errors import MergeflowError
from mergeflow.core.io import load_state_dict

TINY_VIT = {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 1, "num_heads": 2}


def _vit_state(**kwargs) -> dict[str, torch.Tensor]:
    """timm's own state dict of the tiny ViT (class-token pooling, as hub ViTs), or of a variant of it."""
    import timm

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0, **(TINY_VIT | kwargs))
    return {k: v.contiguous() for k, v in model.state_dict().items()}


def _pretrained_error(weights, global_pool: str = "token") -> str:
    from mergeflow.config import BackboneConfig
    from mergeflow.ml.models import Backbone

    cfg = BackboneConfig(
        model="vit_tiny_patch16_224",
        kwargs=TINY_VIT,
        pretrained=str(weights),
        global_pool=global_pool,
        input_norm="pretrained_cfg",
    )
    with pytest.raises(MergeflowError) as err:
        Backbone(cfg, pretrained=True)
    return str(err.value)


def _save_safetensors(path, state):
    from safetensors.torch import save_file

    save_file(state, str(path))
    return path


def _without(state, key):
    state.pop(key)
    return state


def _replaced(state, key, value):
    state[key] = value
    return state


# (what is wrong, a function of tmp_path writing the file, the message after "backbone.pretrained: <file>: ")
BAD_WEIGHT_FILES = [
    # embed_dim 32: qkv is (3 * 32, 32)
    (
        "qkv of another width",
        lambda p: _save_safetensors(
            p / "w.safetensors", _replaced(_vit_state(), "blocks.0.attn.qkv.weight", torch.zeros(96, 16))
        ),
        "tensor 'blocks.0.attn.qkv.weight' has shape (96, 16), the model expects (96, 32)",
    ),
    (
        "a wider ViT",
        lambda p: _save_safetensors(p / "w.safetensors", _vit_state(embed_dim=64)),
        "tensor 'cls_token' has shape (1, 1, 64), the model expects (1, 1, 32)",
    ),
    # a block holds norm1, attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2: 6 weights and 6 biases
    (
        "a deeper ViT",
        lambda p: _save_safetensors(p / "w.safetensors", _vit_state(depth=2)),
        "unexpected tensor 'blocks.1.attn.proj.bias' that the model does not have (12 unexpected)",
    ),
    (
        "a tensor missing",
        lambda p: _save_safetensors(p / "w.safetensors", _without(_vit_state(), "blocks.0.attn.qkv.weight")),
        "missing tensor 'blocks.0.attn.qkv.weight' that the model expects (1 missing)",
    ),
    # cls_token, pos_embed, patch_embed.proj (2), one block (12), norm (2): 18
    (
        "a ResNet",
        lambda p: _save_safetensors(
            p / "w.safetensors",
            {
                k: v.contiguous()
                for k, v in __import__("timm").create_model("resnet18", num_classes=0).state_dict().items()
            },
        ),
        "missing tensor 'cls_token' that the model expects (18 missing)",
    ),
    (
        "NaN weights",
        lambda p: _save_safetensors(
            p / "w.safetensors", _replaced(_vit_state(), "norm.bias", torch.full((32,), float("nan")))
        ),
        "tensor 'norm.bias' contains NaN or Inf",
    ),
    (
        "a pickled model",
        lambda p: (
            torch.save(__import__("timm").create_model("vit_tiny_patch16_224", num_classes=0, **TINY_VIT), p / "w.pth")
            or p / "w.pth"
        ),
        "holds pickled Python objects, not only tensors (torch.load(weights_only=True) refuses to unpickle "
        "timm.models.vision_transformer.VisionTransformer); "
        "save the model's state_dict() with safetensors.torch.save_file and point backbone.pretrained at that file",
    ),
    (
        "a training checkpoint with a step count",
        lambda p: torch.save(_vit_state() | {"step": 4}, p / "w.pth") or p / "w.pth",
        "entry 'step' is not a tensor (int), expected a state dict holding only tensors",
    ),
    (
        "a list of tensors",
        lambda p: torch.save(list(_vit_state().values()), p / "w.pth") or p / "w.pth",
        "holds list, expected a state dict (tensor name -> tensor)",
    ),
]


@pytest.mark.parametrize("write, message", [c[1:] for c in BAD_WEIGHT_FILES], ids=[c[0] for c in BAD_WEIGHT_FILES])
def test_bad_pretrained_weights_are_one_line_naming_file_and_tensor(tmp_path, write, message):
    weights = write(tmp_path)
    assert _pretrained_error(weights) == f"backbone.pretrained: {weights}: {message}"


def test_weights_of_another_pooling_say_which_to_use(tmp_path):
    weights = _save_safetensors(tmp_path / "w.safetensors", _vit_state())  # class-token pooling: norm, no fc_norm
    assert _pretrained_error(weights, global_pool="avg") == (
        f"backbone.pretrained: {weights}: missing tensor 'fc_norm.weight' that the model expects (2 missing); "
        "weights trained with class-token pooling need backbone.global_pool: token (not 'avg')"
    )


@pytest.mark.parametrize("contents", [b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all", b""])
def test_unreadable_weight_files_are_one_line(tmp_path, contents):
    (tmp_path / "w.safetensors").write_bytes(contents)
    assert re.fullmatch(
        rf"backbone.pretrained: {re.escape(str(tmp_path))}/w.safetensors: not a readable safetensors file \(.+\)",
        _pretrained_error(tmp_path / "w.safetensors"),
    )
    (tmp_path / "w.pth").write_bytes(contents or b"garbage")
    assert re.fullmatch(
        rf"backbone.pretrained: {re.escape(str(tmp_path))}/w.pth: not a readable PyTorch checkpoint \(.+\)",
        _pretrained_error(tmp_path / "w.pth"),
    )
    torch.save(_vit_state(), tmp_path / "cut.pth")
    (tmp_path / "cut.pth").write_bytes((tmp_path / "cut.pth").read_bytes()[:1000])  # a copy cut short
    assert re.fullmatch(
        rf"backbone.pretrained: {re.escape(str(tmp_path))}/cut.pth: not a readable PyTorch checkpoint \(.+\)",
        _pretrained_error(tmp_path / "cut.pth"),
    )


class _RunsCode:
    """Unpickling this runs a shell command: torch.load(weights_only=True) must refuse it before it runs."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_runs_code_is_refused_without_running_it(tmp_path):
    import pickle

    (tmp_path / "w.pth").write_bytes(pickle.dumps(_RunsCode(tmp_path / "ran"), protocol=2))
    assert _pretrained_error(tmp_path / "w.pth") == (
        f"backbone.pretrained: {tmp_path / 'w.pth'}: holds pickled Python objects, not only tensors "
        "(torch.load(weights_only=True) refuses to unpickle "
        "posix.system); save the model's state_dict() with "
        "safetensors.torch.save_file and point backbone.pretrained at that file"
    )
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize(
    "wrap",
    [
        lambda s: s,
        lambda s: {"epoch": 3, "state_dict": s},
        lambda s: {"model": {f"module.{k}": v for k, v in s.items()}},
    ],
    ids=["state dict", "training checkpoint", "DataParallel"],
)
def test_pytorch_checkpoints_of_tensors_load(tmp_path, wrap):
    from mergeflow.config import BackboneConfig
    from mergeflow.ml.models import Backbone

    state = _vit_state()
    torch.save(wrap(state), tmp_path / "w.pth")
    cfg = BackboneConfig(
        model="vit_tiny_patch16_224",
        kwargs=TINY_VIT,
        pretrained=str(tmp_path / "w.pth"),
        global_pool="token",
        input_norm="pretrained_cfg",
    )
    loaded = Backbone(cfg, pretrained=True).net.state_dict()
    assert set(loaded) == set(state) and all(torch.equal(loaded[k], v) for k, v in state.items())


# ---------------------------------------------------------- the same through the CLI: exit 2, one line, nothing written
def _cli_project(root, repo_root, pretrained: str):
    from tests.profiles import tiny_params

    raw = tiny_params(
        repo_root / "params.yaml",
        suite={"tasks": ["digits"]},
        backbone={"pretrained": pretrained, "global_pool": "token", "input_norm": "pretrained_cfg"},
    )
    (root / "params.yaml").write_text(yaml.safe_dump(raw))


def _run_cli(root, *args, **env):
    import subprocess
    import sys

    environment = {k: v for k, v in os.environ.items() if k != "DVC_STAGE"} | {"HF_HUB_OFFLINE": "1"} | env
    mergeflow = os.path.join(os.path.dirname(sys.executable), "mergeflow")
    return subprocess.run(
        [mergeflow, "--params", "params.yaml", *args], cwd=root, env=environment, capture_output=True, text=True
    )


def _files(root) -> dict[str, tuple[int, bytes]]:
    return {
        str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(root.rglob("*")) if p.is_file()
    }


HUB_OFFLINE = (
    "backbone.pretrained: hub: the weights of 'vit_tiny_patch16_224' "
    "(timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k on the Hugging Face hub) "
    "are not in the local cache, and downloads are off; download them once with network access "
    "(`mergeflow pretrain --download`, or `hf download timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k`), or set "
    "backbone.pretrained to a local weights file"
)


@pytest.mark.parametrize("case", ["control", "pickle", "shape", "hub offline"])
def test_pretrain_cli_with_bad_weights_exits_2_with_one_line_and_writes_nothing(tmp_path, repo_root, case):
    state = _vit_state()
    project = tmp_path / "project"
    project.mkdir()
    if case == "control":  # the same project with good weights: pretrain copies them into models/
        weights = _save_safetensors(tmp_path / "w.safetensors", state)
    elif case == "pickle":
        weights = tmp_path / "w.pth"
        torch.save(__import__("timm").create_model("vit_tiny_patch16_224", num_classes=0, **TINY_VIT), weights)
        message = (
            f"backbone.pretrained: {weights}: holds pickled Python objects, not only tensors "
            "(torch.load(weights_only=True) refuses to unpickle timm.models.vision_transformer.VisionTransformer); "
            "save the model's state_dict() with safetensors.torch.save_file and point backbone.pretrained at that file"
        )
    elif case == "shape":
        weights = _save_safetensors(
            tmp_path / "w.safetensors", _replaced(state, "blocks.0.attn.qkv.weight", torch.zeros(96, 16))
        )
        message = (
            f"backbone.pretrained: {weights}: tensor 'blocks.0.attn.qkv.weight' "
            "has shape (96, 16), the model expects (96, 32)"
        )
    else:
        weights, message = "hub", HUB_OFFLINE
    _cli_project(project, repo_root, str(weights))
    before = _files(project)
    result = _run_cli(
        project, "pretrain", HF_HOME=str(tmp_path / "empty-hf-home")
    )  # an empty cache, whatever this machine holds
    assert "Traceback" not in result.stderr, result.stderr
    if case == "control":
        assert result.returncode == 0, result.stderr
        loaded = load_state_dict(project / "models" / "pretrained.safetensors")
        assert all(torch.equal(loaded[k], v) for k, v in state.items())
        return
    assert (result.returncode, result.stderr) == (2, f"error: {message}\n")
    assert _files(project) == before
