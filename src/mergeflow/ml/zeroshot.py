"""CLIP zero-shot classification heads, as the task-arithmetic papers build them (Ilharco et al. 2023, and seeds
002 and 004 after them): for each class, the prompt templates filled with the class name go through CLIP's text
tower; the L2-normalised text embeddings are averaged over templates, normalised again and scaled by CLIP's logit
scale. The head is a bias-free linear layer on the normalised image embedding (backbone.embedding: clip), frozen
while fine-tuning, so every task model and every merge is read out by the same head.

The text tower comes from open_clip (timm has no text towers): with ``backbone.text: hub`` from the same
Hugging Face repository as timm's image tower (timm's CLIP repositories hold open_clip's full model too).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from mergeflow.config import BackboneConfig
from mergeflow.core.errors import MergeflowError

# timm's CLIP image towers and open_clip's name of the same architecture
OPEN_CLIP_ARCHITECTURES = {
    "vit_base_patch32_clip_224": "ViT-B-32",
    "vit_base_patch32_clip_quickgelu_224": "ViT-B-32",
    "vit_base_patch16_clip_224": "ViT-B-16",
    "vit_base_patch16_clip_quickgelu_224": "ViT-B-16",
    "vit_large_patch14_clip_224": "ViT-L-14",
    "vit_large_patch14_clip_quickgelu_224": "ViT-L-14",
}


def open_clip_architecture(model: str) -> str:
    base = model.split(".")[0]
    if base not in OPEN_CLIP_ARCHITECTURES:
        raise MergeflowError(
            f"backbone.text: no open_clip text tower is known for '{model}' (known: "
            f"{', '.join(sorted(OPEN_CLIP_ARCHITECTURES))})"
        )
    return OPEN_CLIP_ARCHITECTURES[base]


def text_model(cfg: BackboneConfig, *, seed: int = 0) -> nn.Module:
    """open_clip's CLIP model for ``cfg.model``'s architecture with ``cfg.text``'s weights (its text tower is
    what is used): "hub", a local weights file, or "random" (seeded)."""
    import open_clip

    arch = open_clip_architecture(cfg.model)
    quick_gelu = "quickgelu" in cfg.model
    if cfg.text == "random":
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return open_clip.create_model(arch, pretrained=None, force_quick_gelu=quick_gelu).eval()
    if cfg.text == "hub":
        import timm

        hub_id = getattr(timm.models.get_pretrained_cfg(cfg.model), "hf_hub_id", None)
        if not hub_id:
            raise MergeflowError(
                f"backbone.text: hub: '{cfg.model}' names no hub weights (give a tag, e.g. "
                f"'{cfg.model.split('.')[0]}.openai')"
            )
        from huggingface_hub import constants

        tag = cfg.model.partition(".")[2]
        # open_clip's own configuration and weights for a tag it knows (openai: the same hub repository as
        # timm's image tower); else the repository's open_clip_config.json
        source = (
            dict(model_name=arch, pretrained=tag)
            if tag in open_clip.list_pretrained_tags_by_model(arch)
            else dict(model_name=f"hf-hub:{hub_id}")
        )
        try:
            return open_clip.create_model(**source, force_quick_gelu=quick_gelu).eval()
        except Exception as err:  # noqa: BLE001  the hub's errors, and open_clip's on a repository without its model
            if constants.HF_HUB_OFFLINE:
                raise MergeflowError(
                    f"backbone.text: hub: CLIP's text tower ({hub_id} on the Hugging Face hub) is not in the local "
                    f"cache and downloads are off; run with --download once, or `hf download {hub_id}`"
                ) from None
            raise MergeflowError(
                f"backbone.text: hub: could not get CLIP's text tower from {hub_id}: {type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}"
            ) from None
    from mergeflow.ml.checkpoints import read_tensors
    from mergeflow.core.io import load_state_dict

    path = Path(cfg.text or "")
    if not path.is_file():
        raise MergeflowError(f"backbone.text: '{path}' is neither hub, random nor a weights file")
    # open_clip's checkpoint, or task arithmetic's pickled ImageEncoder (read without unpickling it)
    state = load_state_dict(path) if path.suffix == ".safetensors" else read_tensors(path)
    state = {
        re.sub(r"^(module\.|model\.)+", "", k): v for k, v in state.items()
    }  # task_vectors' ImageEncoder keeps CLIP as .model
    model = open_clip.create_model(arch, pretrained=None, force_quick_gelu=quick_gelu)
    text_keys = {k for k in model.state_dict() if not k.startswith("visual.")}
    missing = sorted(text_keys - set(state))
    if missing:
        raise MergeflowError(
            f"backbone.text: {path}: tensor '{missing[0]}' of open_clip's "
            f"{arch} text tower is missing ({len(missing)} missing)"
        )
    for key in sorted(text_keys):
        if state[key].shape != model.state_dict()[key].shape:
            raise MergeflowError(
                f"backbone.text: {path}: tensor '{key}' has shape {tuple(state[key].shape)}, open_clip's {arch} "
                f"expects {tuple(model.state_dict()[key].shape)}"
            )
    model.load_state_dict({k: state[k] for k in text_keys}, strict=False)
    return model.eval()


@torch.no_grad()
def zeroshot_head(
    model: nn.Module, arch: str, classes: list[str], templates: list[str], *, device: torch.device | str = "cpu"
) -> nn.Linear:
    """The frozen head [C, E]: per class, logit_scale x normalise(mean over templates of normalise(text
    embedding)); zero bias."""
    import open_clip

    tokenizer = open_clip.get_tokenizer(arch)
    model = model.to(device)
    rows = []
    for name in classes:
        tokens = tokenizer([t.format(name) for t in templates]).to(device)
        embeddings = nn.functional.normalize(model.encode_text(tokens).float(), dim=-1)
        rows.append(nn.functional.normalize(embeddings.mean(0), dim=0))
    weight = torch.stack(rows) * model.logit_scale.exp().float()
    head = nn.Linear(weight.shape[1], weight.shape[0])
    head.weight.copy_(weight.cpu())
    head.bias.zero_()
    return head.requires_grad_(False)
