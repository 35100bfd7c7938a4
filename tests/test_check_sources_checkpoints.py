"""`mergeflow check` on finetune.checkpoints: a published fine-tune that safetensors cannot read, that is not a
PyTorch checkpoint, or that is of another shape than the backbone, its pretrained file or the other fine-tunes is one
line naming the key and the path; the shapes a model's name says are the ones timm builds, in every naming."""

from __future__ import annotations

import pytest

from mergeflow.runner.checks import check_project
from mergeflow.ml.weights_header import architecture, expected_architecture, safetensors_shapes
from tests.test_check_sources import _project, _refused, _timm_shapes, _write


def _with_checkpoints(tmp_path, repo_root, checkpoints, **backbone):
    def edit(raw):
        raw["finetune"]["checkpoints"] = checkpoints
        raw["backbone"].update(backbone)

    return _project(tmp_path, repo_root, edit)[0]


def test_checkpoints_that_safetensors_cannot_read(tmp_path, repo_root):
    root = _with_checkpoints(tmp_path, repo_root, {"digits": "ft/digits.safetensors", "signs": "hf:someone/signs"})
    source, key = root / "params.yaml", "finetune.checkpoints.digits"
    path = root / "ft" / "digits.safetensors"
    _write(path, _timm_shapes())
    check_project(root)  # right shapes; the hub spec is not a local file
    whole = path.read_bytes()
    path.write_bytes(whole[:-100])  # cut short: the header describes data that is not there
    assert (
        _refused(root)
        == f"{source}: {key}: 'ft/digits.safetensors' is not a readable safetensors file (Error while deserializing "
        "header: incomplete metadata, file not fully covered)"
    )
    path.write_bytes((20).to_bytes(8, "little") + b'{"a": not json}     ')
    assert _refused(root).startswith(
        f"{source}: {key}: 'ft/digits.safetensors' is not a readable "
        "safetensors file (Error while deserializing header: "
    )
    path.write_bytes((10**12).to_bytes(8, "little") + b"{}")
    assert _refused(root).startswith(f"{source}: {key}: 'ft/digits.safetensors' is not a readable safetensors file (")


def test_pytorch_checkpoints_are_judged_by_their_first_bytes(tmp_path, repo_root):
    import torch

    root = _with_checkpoints(tmp_path, repo_root, {"digits": "ft/digits.pt"})
    path = root / "ft" / "digits.pt"
    path.parent.mkdir()
    torch.save({"cls_token": torch.zeros(1, 1, 4)}, path)  # a zip: its tensors are the stage's to read
    check_project(root)
    torch.save({"cls_token": torch.zeros(1)}, path, _use_new_zipfile_serialization=False)  # the legacy pickle
    check_project(root)
    path.write_text("model weights\n")
    assert (
        _refused(root) == f"{root / 'params.yaml'}: finetune.checkpoints.digits: 'ft/digits.pt' is "
        "not a PyTorch checkpoint (neither a zip (torch.save) nor a pickle: it "
        "starts with b'mode'); name a .safetensors file or a torch.save checkpoint"
    )
    path.write_bytes(b"")
    assert (
        _refused(root)
        == f"{root / 'params.yaml'}: finetune.checkpoints.digits: 'ft/digits.pt' is not a PyTorch checkpoint (it is "
        "empty); name a .safetensors file or a torch.save checkpoint"
    )


@pytest.mark.parametrize(
    "shapes, says",
    [
        (
            _timm_shapes(patch=16),
            "its patch size is 16 (tensor 'patch_embed.proj.weight' [128, 3, 16, 16]), not 8 "
            "(backbone.kwargs.patch_size = 8)",
        ),
        (
            _timm_shapes(width=192),
            "its width is 192 (tensor 'patch_embed.proj.weight' [192, "
            "3, 8, 8]), not 128 (backbone.kwargs.embed_dim = 128)",
        ),
        (_timm_shapes(depth=12), "its depth is 12 (12 blocks 'blocks.<i>.*'), not 4 (backbone.kwargs.depth = 4)"),
        (
            _timm_shapes(channels=1),
            "its input channels is 1 (tensor 'patch_embed.proj.weight' "
            "[128, 1, 8, 8]), not 3 (backbone.model vit_tiny_patch16_224)",
        ),
        # open_clip's and Hugging Face's namings, read as they are named
        (
            {"visual.class_embedding": (128,), "visual.conv1.weight": (128, 3, 16, 16)},
            "its patch size is 16 (tensor 'visual.conv1.weight' [128, "
            "3, 16, 16]), not 8 (backbone.kwargs.patch_size = 8)",
        ),
        (
            {
                "vision_model.embeddings.class_embedding": (128,),
                "vision_model.embeddings.patch_embedding.weight": (128, 3, 8, 8),
            }
            | {f"vision_model.encoder.layers.{i}.layer_norm1.weight": (128,) for i in range(6)},
            "its depth is 6 (6 blocks 'vision_model.encoder.layers.<i>.*'), not 4 (backbone.kwargs.depth = 4)",
        ),
    ],
)
def test_checkpoints_of_another_shape_than_the_backbone(tmp_path, repo_root, shapes, says):
    root = _with_checkpoints(tmp_path, repo_root, {"signs": "ft/signs.safetensors"})
    _write(root / "ft" / "signs.safetensors", shapes)
    assert (
        _refused(root)
        == f"{root / 'params.yaml'}: finetune.checkpoints.signs: 'ft/signs.safetensors' does not fit backbone.model "
        f"vit_tiny_patch16_224: {says}"
    )


def test_checkpoints_against_the_pretrained_file_and_each_other(tmp_path, repo_root):
    source = tmp_path / "params.yaml"
    # against backbone.pretrained's own file: its token count too (a fine-tune made at another image size)
    _write(tmp_path / "theta0.safetensors", _timm_shapes())
    _write(tmp_path / "ft" / "digits.safetensors", _timm_shapes(tokens=50))
    root = _with_checkpoints(tmp_path, repo_root, {"digits": "ft/digits.safetensors"}, pretrained="theta0.safetensors")
    assert (
        _refused(root) == f"{source}: finetune.checkpoints.digits: 'ft/digits.safetensors' does not "
        "fit backbone.pretrained 'theta0.safetensors': its token count is 50 "
        "(tensor 'pos_embed' [1, 50, 128]), not 17 (tensor 'pos_embed' [1, 17, 128])"
    )
    # a backbone whose shape its name does not say: the fine-tunes must at least agree with each other
    _write(tmp_path / "ft" / "digits.safetensors", _timm_shapes())
    _write(tmp_path / "ft" / "signs.safetensors", _timm_shapes(width=64))
    root = _with_checkpoints(
        tmp_path,
        repo_root,
        {"digits": "ft/digits.safetensors", "signs": "ft/signs.safetensors"},
        model="deit_tiny_patch16_224",
        pretrained=None,
    )
    assert (
        _refused(root)
        == f"{source}: finetune.checkpoints.signs: 'ft/signs.safetensors' does not fit finetune.checkpoints.digits "
        "'ft/digits.safetensors': its width is 64 (tensor 'patch_embed.proj.weight' [64, 3, 8, 8]), not 128 "
        "(tensor 'patch_embed.proj.weight' [128, 3, 8, 8])"
    )
    _write(tmp_path / "ft" / "signs.safetensors", {"fc.weight": (10, 128), "fc.bias": (10,)})
    assert (
        _refused(root)
        == f"{source}: finetune.checkpoints.signs: 'ft/signs.safetensors' is not a CLIP or ViT image tower: found "
        "neither open_clip's 'visual.class_embedding', Hugging Face's '[vision_model.]embeddings.class_embedding' "
        "nor timm's 'cls_token' (first tensors: 'fc.bias', 'fc.weight')"
    )


@pytest.mark.parametrize(
    "name",
    [
        "vit_tiny_patch16_224",
        "vit_small_patch32_384",
        "vit_medium_patch16_clip_224",
        "vit_base_patch32_clip_quickgelu_224.openai",
        "vit_large_patch14_clip_224",
        "vit_huge_patch14_clip_224",
    ],
)
def test_the_shapes_said_by_a_name_are_the_ones_timm_builds(name):
    import timm
    import torch

    for kwargs in ({}, {"embed_dim": 96, "depth": 3, "patch_size": 4, "num_heads": 2}):
        with torch.device("meta"):
            net = timm.create_model(name.split(".")[0], pretrained=False, **kwargs)
        built = architecture({k: tuple(v.shape) for k, v in net.state_dict().items()})
        said = expected_architecture(name, kwargs)
        assert {f: v for f, (v, _) in said.items()} == {f: built[f][0] for f in said}, (name, kwargs)
    assert (
        expected_architecture("deit_tiny_patch16_224", {}) is None
        and expected_architecture("vit_base_patch16_plus_240", {}) is None
    )


def test_the_three_namings_say_the_same_shape(tmp_path):
    """open_clip's, Hugging Face's and timm's tiny CLIP towers of one shape (width 64, 2 blocks, patch 32 at 224
    pixels: 7 x 7 + 1 tokens), and what mergeflow.ml.checkpoints converts them to, read from safetensors headers."""
    import open_clip
    import torch
    from safetensors.torch import save_file as save_torch

    from mergeflow.ml.checkpoints import to_timm_clip
    from tests.test_checkpoints import hf_clip, timm_clip

    expected = {"width": 64, "channels": 3, "patch": 32, "depth": 2, "tokens": 7 * 7 + 1}
    clip = open_clip.model.CLIP(
        32,
        dict(layers=2, width=64, head_width=32, mlp_ratio=2, patch_size=32, image_size=224),
        dict(context_length=8, vocab_size=50, width=32, heads=2, layers=1),
        quick_gelu=True,
    )
    for name, state in (
        ("open_clip", clip.state_dict()),
        ("hugging_face", hf_clip().state_dict()),
        ("timm", timm_clip().state_dict()),
    ):
        for form, tensors in (("as published", state), ("converted", to_timm_clip(state, source=name))):
            path = tmp_path / f"{name}-{form}.safetensors"
            save_torch(
                {k: v.detach().clone().contiguous() for k, v in tensors.items() if isinstance(v, torch.Tensor)},
                str(path),
            )
            facts = architecture(safetensors_shapes(path))
            assert {f: v for f, (v, _) in facts.items()} == expected, (name, form, facts)
