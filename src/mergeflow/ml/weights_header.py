"""Weights files judged from their headers alone, importing no torch (``mergeflow check`` runs this and must stay
fast): a safetensors file's tensor names and shapes (read by safetensors' own parser, which checks that the header
is JSON and that the data it describes is all there), the CLIP image-tower naming a state dict uses (open_clip's,
Hugging Face's, timm's: ``mergeflow.ml.checkpoints`` converts by it), and the ViT shape those tensors say, to compare
with the backbone's before a fine-tune is imported."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path

Shapes = Mapping[str, tuple[int, ...]]
# one number of a ViT's shape, and what says it (a tensor and its shape, a block count, a key of params.yaml)
Fact = tuple[object, str]


def safetensors_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in a safetensors file, from its header; ValueError (one line) when safetensors cannot
    read the file (not safetensors, a header that is not JSON, data cut short)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except (SafetensorError, OSError) as err:
        raise ValueError((str(err).strip().splitlines() or [type(err).__name__])[0]) from None


def pytorch_file_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot be a PyTorch checkpoint (``torch.save``'s zip, or a pickle of protocol 2 or later, which
    every torch.save has written), from its first bytes; None when it may be one (reading it is the stage's)."""
    import zipfile

    with open(path, "rb") as f:
        head = f.read(4)
    if not head:
        return "it is empty"
    if zipfile.is_zipfile(path) or (head[0] == 0x80 and 2 <= head[1] <= 5):
        return None
    return f"neither a zip (torch.save) nor a pickle: it starts with {head!r}"


def _suffix_prefix(keys: Iterable[str], suffix: str) -> str | None:
    """The prefix before ``suffix`` on the shortest key ending with it ('model.' in an ImageEncoder), or None."""
    found = sorted((k for k in keys if k == suffix or k.endswith("." + suffix)), key=len)
    return found[0][: -len(suffix)] if found else None


def clip_naming(keys: Iterable[str]) -> tuple[str, str] | None:
    """The naming of a CLIP (or ViT) image tower's state dict, and the prefix its names share: ("open_clip",
    prefix) for ``<prefix>visual.*``; ("hugging_face", prefix) for ``<prefix>embeddings.*`` (prefix
    'vision_model.' or ''); ("timm", '') for timm's own, ("timm", 'module.') under DistributedDataParallel's
    prefix; None when it is none of these."""
    keys = list(keys)
    prefix = _suffix_prefix(keys, "visual.class_embedding")
    if prefix is not None:
        return "open_clip", prefix
    prefix = _suffix_prefix(keys, "embeddings.class_embedding")
    if prefix is not None and prefix + "embeddings.patch_embedding.weight" in keys:
        return "hugging_face", prefix
    if "cls_token" in keys and "patch_embed.proj.weight" in keys:
        return "timm", ""
    if "module.cls_token" in keys:
        return "timm", "module."
    return None


# per naming: the patch embedding [width, channels, patch, patch], a block's names, the positional embedding
_TENSORS = {
    "open_clip": ("visual.conv1.weight", "visual.transformer.resblocks.{}.", "visual.positional_embedding"),
    "hugging_face": ("embeddings.patch_embedding.weight", "encoder.layers.{}.", "embeddings.position_embedding.weight"),
    "timm": ("patch_embed.proj.weight", "blocks.{}.", "pos_embed"),
}
LABELS = {
    "width": "width",
    "channels": "input channels",
    "patch": "patch size",
    "depth": "depth",
    "tokens": "token count",
}


def architecture(shapes: Shapes) -> dict[str, Fact] | None:
    """The ViT shape a state dict's tensors say, whatever its naming: width, input channels and patch size (the
    patch embedding), depth (the blocks), token count (the positional embedding); each with the tensor it was read
    from. None when the naming is none ``clip_naming`` knows."""
    naming = clip_naming(shapes)
    if naming is None:
        return None
    kind, prefix = naming
    patch_name, block, pos_name = _TENSORS[kind]
    facts: dict[str, Fact] = {}
    patch = shapes.get(prefix + patch_name)
    if patch is not None and len(patch) == 4:
        said = f"tensor '{prefix + patch_name}' {list(patch)}"
        facts |= {
            "width": (patch[0], said),
            "channels": (patch[1], said),
            "patch": (patch[2] if patch[2] == patch[3] else tuple(patch[2:]), said),
        }
    pattern = re.compile(re.escape(prefix + block).replace(re.escape("{}"), r"(\d+)"))
    blocks = {int(m.group(1)) for name in shapes if (m := pattern.match(name))}
    if blocks:
        facts["depth"] = (len(blocks), f"{len(blocks)} blocks '{prefix + block.format('<i>')}*'")
    pos = shapes.get(prefix + pos_name)
    if pos is not None and len(pos) >= 2:
        facts["tokens"] = (pos[-2], f"tensor '{prefix + pos_name}' {list(pos)}")
    return facts


# timm's plain ViTs by name: vit_<size>_patch<P>[_clip[_quickgelu]]_<image size>[.<weights tag>], each size's
# (width, depth) as timm builds it (tests/test_check_sources_checkpoints.py builds every such timm model to compare)
VIT_SIZES = {
    "tiny": (192, 12),
    "small": (384, 12),
    "medium": (512, 12),
    "base": (768, 12),
    "large": (1024, 24),
    "huge": (1280, 32),
}
_VIT_NAME = re.compile(r"vit_(tiny|small|medium|base|large|huge)_patch(\d+)_(?:clip_(?:quickgelu_)?)?\d+")


def expected_architecture(model: str, kwargs: Mapping[str, object]) -> dict[str, Fact] | None:
    """The shape timm gives ``model`` (backbone.model) with ``kwargs`` (backbone.kwargs), for the plain ViTs
    ``_VIT_NAME`` matches, without building it (that needs torch); None for any other model."""
    m = _VIT_NAME.fullmatch(model.split(".")[0])
    if not m:
        return None
    width, depth = VIT_SIZES[m.group(1)]
    facts: dict[str, Fact] = {}
    for field, key, default in (
        ("width", "embed_dim", width),
        ("patch", "patch_size", int(m.group(2))),
        ("depth", "depth", depth),
        ("channels", "in_chans", 3),
    ):
        value = kwargs.get(key, default)
        if isinstance(value, int) and not isinstance(value, bool):
            facts[field] = (value, f"backbone.kwargs.{key} = {value}" if key in kwargs else f"backbone.model {model}")
    return facts


def mismatch(facts: Mapping[str, Fact], reference: Mapping[str, Fact]) -> str | None:
    """The first number of the shape on which ``facts`` and ``reference`` disagree, as 'its patch size is 16
    (tensor ...), the backbone's 32 (...)'; None when they agree wherever both say."""
    for field, label in LABELS.items():
        if field in facts and field in reference and facts[field][0] != reference[field][0]:
            return (
                f"its {label} is {facts[field][0]} ({facts[field][1]}), "
                f"not {reference[field][0]} ({reference[field][1]})"
            )
    return None
