"""CLIP's namings (open_clip's, Hugging Face transformers') to timm's, and ``read_checkpoint``: a published
fine-tune as the pipeline's state dict, checked against the pretrained backbone."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from mergeflow.ml.checkpoints.reader import read_tensors
from mergeflow.ml.checkpoints.unpickler import _printable
from mergeflow.core.errors import MergeflowError
from mergeflow.core.io import StateDict, check_compatible, load_state_dict
from mergeflow.ml.lora import apply_adapter, is_peft_adapter, read_peft_adapter
from mergeflow.ml.weights_header import clip_naming


def _from_open_clip(state: StateDict, prefix: str) -> StateDict:
    """open_clip's image tower (``<prefix>visual.*``) in timm's naming, by timm's own converter (the one timm
    loads OpenAI's CLIP weights with): ``visual.proj`` [D, E] becomes ``head.weight`` [E, D] and a zero bias."""
    from timm.models.vision_transformer import _convert_openai_clip

    return _convert_openai_clip(state, None, prefix=prefix + "visual.")


def _from_hugging_face(state: StateDict, vm: str, projection: str) -> StateDict:
    """transformers' CLIP image tower (its names under ``vm``: 'vision_model.' in CLIPVisionModelWithProjection,
    CLIPModel and transformers 4's CLIPVisionModel files, '' in transformers 5's CLIPVisionModel) -> timm's
    VisionTransformer: the separate q, k, v projections concatenated into timm's qkv; ``projection``
    (``visual_projection.weight`` [E, D], no bias), when present, becomes the head."""
    enc = vm + "encoder.layers."
    out = {
        "cls_token": state[vm + "embeddings.class_embedding"].reshape(1, 1, -1),
        "pos_embed": state[vm + "embeddings.position_embedding.weight"].unsqueeze(0),
        "patch_embed.proj.weight": state[vm + "embeddings.patch_embedding.weight"],
    }
    used = {
        vm + "embeddings.class_embedding",
        vm + "embeddings.position_embedding.weight",
        vm + "embeddings.patch_embedding.weight",
        vm + "embeddings.position_ids",
        projection,
    }
    renames = {vm + "pre_layrnorm.": "norm_pre.", vm + "post_layernorm.": "norm."}
    for i in sorted({int(k[len(enc) :].split(".")[0]) for k in state if k.startswith(enc)}):
        src, dst = f"{enc}{i}.", f"blocks.{i}."
        renames |= {
            src + "layer_norm1.": dst + "norm1.",
            src + "layer_norm2.": dst + "norm2.",
            src + "self_attn.out_proj.": dst + "attn.proj.",
            src + "mlp.fc1.": dst + "mlp.fc1.",
            src + "mlp.fc2.": dst + "mlp.fc2.",
        }
        for kind in ("weight", "bias"):
            qkv = [f"{src}self_attn.{p}_proj.{kind}" for p in "qkv"]
            out[f"{dst}attn.qkv.{kind}"] = torch.cat([state[k] for k in qkv])
            used |= set(qkv)
    for key, value in state.items():
        for src, dst in renames.items():
            if key.startswith(src):
                out[dst + key[len(src) :]] = value
                used.add(key)
    left = sorted(
        k
        for k in state
        if k.startswith(vm) and k not in used and not k.startswith(("text_model.", "text_projection.", "logit_scale"))
    )
    if left:  # a tensor this conversion does not know would otherwise vanish without a word
        raise MergeflowError(
            f"tensor '{_printable(left[0])}' has no place in timm's CLIP image tower ({len(left)} such)"
        )
    if projection in state:
        out["head.weight"] = state[projection]
        out["head.bias"] = torch.zeros(state[projection].shape[0], dtype=state[projection].dtype)
    return out


# the parts of a whole CLIP's names that only its text tower has (open_clip's, Hugging Face's)
_TEXT_TOWER = {
    "transformer",
    "token_embedding",
    "positional_embedding",
    "ln_final",
    "text_projection",
    "logit_scale",
    "attn_mask",
    "text_model",
}


def _keep_image_tower(name: str) -> bool:
    """Whether tensor ``name`` may belong to the image tower (read_tensors then skips the text tower's storages)."""
    parts = name.split(".")
    return "visual" in parts or "vision_model" in parts or not _TEXT_TOWER & set(parts)


def to_timm_clip(state: StateDict, *, source: str) -> StateDict:
    """``state`` (open_clip, Hugging Face or timm naming, under any prefix) as timm's CLIP image tower; text tower
    tensors dropped. Raises one line when the naming is none of these (``weights_header.clip_naming``, which
    ``mergeflow check`` reads from a file's header)."""
    kind, prefix = clip_naming(state) or (None, None)
    if kind == "open_clip":
        return _from_open_clip(state, prefix)
    if kind == "hugging_face":
        try:
            return _from_hugging_face(state, prefix, prefix.removesuffix("vision_model.") + "visual_projection.weight")
        except KeyError as err:
            raise MergeflowError(f"{source}: Hugging Face CLIP naming, but tensor {err} is missing") from None
        except MergeflowError as err:
            raise MergeflowError(f"{source}: {err}") from None
    if kind == "timm":  # under DistributedDataParallel's 'module.' prefix, or none
        return {k.removeprefix(prefix): v for k, v in state.items()} if prefix else dict(state)
    first = ", ".join(f"'{_printable(k)}'" for k in list(state)[:3])
    raise MergeflowError(
        f"{source}: not a CLIP image tower: found neither open_clip's 'visual.class_embedding', Hugging Face's "
        f"'[vision_model.]embeddings.class_embedding' nor timm's 'cls_token' (first tensors: {first})"
    )


def read_checkpoint(
    path_or_state: str | Path | Mapping[str, torch.Tensor],
    *,
    source: str | None = None,
    reference: Mapping[str, torch.Tensor] | None = None,
    projection_from: Mapping[str, torch.Tensor] | None = None,
) -> StateDict:
    """A fine-tuned (or pretrained) CLIP image tower in timm's naming, ready to be a task's backbone.

    ``path_or_state``: a safetensors file, a PyTorch checkpoint (read by :func:`read_tensors`, never unpickled by
    torch), or tensors already in memory; the naming (open_clip, Hugging Face, timm) is told by the keys. A peft
    LoRA adapter (``adapter_model.safetensors`` beside its ``adapter_config.json``, modules named as the backbone
    names them) gives ``reference`` + s B A on its modules (mergeflow.ml.lora).
    ``projection_from``: a timm CLIP state (the pretrained backbone's) whose ``head`` stands in for a missing
    projection (FusionBench's ``CLIPVisionModel`` files: the projection was frozen, its task vector is zero).
    ``reference``: the pipeline's pretrained timm state; the result must match its keys and shapes, and takes
    its floating dtypes. ``source`` names the checkpoint in errors (its path by default).
    """
    if not isinstance(path_or_state, Mapping) and is_peft_adapter(path_or_state):  # a LoRA fine-tune: theta0 + s B A
        source = source or str(path_or_state)
        if reference is None:
            raise MergeflowError(
                f"{source}: a peft LoRA adapter needs the pretrained backbone (reference) to be applied to"
            )
        factors, scale = read_peft_adapter(path_or_state)
        return apply_adapter(reference, factors, scale, source=source)
    if isinstance(path_or_state, Mapping):
        source = source or "checkpoint"
        state = dict(path_or_state)
    else:
        path = Path(path_or_state)
        source = source or str(path)
        if path.suffix == ".safetensors":
            state = load_state_dict(path)
        else:
            state = read_tensors(path, keep=_keep_image_tower)
    state = to_timm_clip(state, source=source)
    if "head.weight" not in state and projection_from is not None:
        if "head.weight" not in projection_from:
            raise MergeflowError(
                f"{source}: holds no visual projection, and projection_from has no 'head.weight' to take it from"
            )
        state["head.weight"] = projection_from["head.weight"].clone()
        state["head.bias"] = (
            projection_from["head.bias"].clone()
            if "head.bias" in projection_from
            else torch.zeros(state["head.weight"].shape[0])
        )
    elif "head.weight" not in state and reference is not None and "head.weight" in reference:
        raise MergeflowError(
            f"{source}: holds no visual projection (a CLIPVisionModel without visual_projection); pass the pretrained "
            "backbone's state as projection_from"
        )
    if reference is not None:
        state = {
            k: v.to(reference[k].dtype)
            if k in reference and v.is_floating_point() and reference[k].is_floating_point()
            else v
            for k, v in state.items()
        }
        check_compatible(reference, state, reference_name="the pretrained backbone", other_name=source)
    return state
