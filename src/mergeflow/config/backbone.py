"""What params.yaml's ``backbone`` section may say, checked when it loads, without importing timm or transformers
(``mergeflow check`` stays well under a second): a bad setting is one line naming its key before any stage runs,
not a traceback from the library in the middle of a fine-tune.

The constructor's own arguments of timm's Vision Transformer are listed here (tests/test_config.py holds the list
to timm's signature, so an upgrade that renames one fails there); a model of another timm family, or of
transformers, is checked for what every family shares and built by its library at the first stage that needs it.
"""

from __future__ import annotations

from typing import Any

from mergeflow.core.errors import did_you_mean

# timm's VisionTransformer.__init__ arguments a params.yaml may set (num_classes and global_pool are mergeflow's;
# the layer classes, device and dtype are not settings). A transformers configuration keeps any key as an
# attribute its model may read (T5 reads decoder_start_token_id, which no T5Config field declares): not checked by name
VIT_KWARGS = frozenset(
    {
        "img_size",
        "patch_size",
        "in_chans",
        "embed_dim",
        "depth",
        "num_heads",
        "mlp_ratio",
        "qkv_bias",
        "qk_norm",
        "scale_attn_norm",
        "scale_mlp_norm",
        "proj_bias",
        "init_values",
        "class_token",
        "pos_embed",
        "no_embed_class",
        "reg_tokens",
        "pre_norm",
        "final_norm",
        "fc_norm",
        "pool_include_prefix",
        "dynamic_img_size",
        "dynamic_img_pad",
        "drop_rate",
        "pos_drop_rate",
        "patch_drop_rate",
        "proj_drop_rate",
        "attn_drop_rate",
        "drop_path_rate",
        "weight_init",
        "fix_init",
    }
)
# set by mergeflow from other keys: a features-only backbone, backbone.global_pool, backbone.pretrained
RESERVED_KWARGS = ("num_classes", "global_pool", "pretrained_cfg_overlay")
# sizes that are counts (a ViT's, and any timm or transformers model's of these names)
POSITIVE_INTS = (
    "img_size",
    "patch_size",
    "in_chans",
    "embed_dim",
    "depth",
    "num_heads",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "d_model",
    "d_kv",
    "d_ff",
    "num_layers",
    "num_decoder_layers",
    "vocab_size",
    "max_position_embeddings",
)
RATES = (
    "drop_rate",
    "pos_drop_rate",
    "patch_drop_rate",
    "proj_drop_rate",
    "attn_drop_rate",
    "drop_path_rate",
    "dropout_rate",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
)

# the pooled features a head reads: a ViT's (timm's '' keeps every token, which no head here reads), any timm
# model's adaptive pooling, a text encoder's first token or mean
VIT_POOLS = ("token", "avg", "max", "avgmax", "map")
TIMM_POOLS = ("avg", "max", "avgmax", "catavgmax", "fast", "token", "map")
TEXT_POOLS = ("token", "avg")

# the last part of the linear layers' names (what LoRA's targets name), where the family is known: a ViT's blocks
# (fused qkv, or q and kv in the attention pool of global_pool: map) and CLIP's projection head; transformers'
# encoders (tests/test_config.py holds each to the modules the library builds)
LINEAR_LAYERS = {
    ("timm", "vit_"): ("qkv", "proj", "fc1", "fc2", "head", "q", "kv"),
    ("transformers", "roberta"): ("query", "key", "value", "dense"),
    ("transformers", "bert"): ("query", "key", "value", "dense"),
    ("transformers", "t5"): ("q", "k", "v", "o", "wi", "wo"),
}


def linear_layers(library: str, model: str) -> tuple[str, ...] | None:
    """The linear layers' last names of a backbone, or None for a family not listed (checked when it is built)."""
    return next(
        (
            names
            for (lib, prefix), names in LINEAR_LAYERS.items()
            if lib == library and (model.startswith(prefix) if lib == "timm" else model == prefix)
        ),
        None,
    )


MAX_IMG_SIZE = 4096  # pixels a side: a ViT's position table at 16-pixel patches is then 65k rows
MAX_WIDTH = 1 << 16  # a width, depth or count any published backbone is far below


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive(key: str, value: Any, most: int) -> str | None:
    values = value if isinstance(value, (list, tuple)) and key in ("img_size", "patch_size") else [value]
    if key in ("img_size", "patch_size") and isinstance(value, (list, tuple)) and len(value) != 2:
        return f"backbone.kwargs.{key}: expected one size or two (height, width), got {value!r}"
    for v in values:
        if not _number(v) or not isinstance(v, int) or not 1 <= v <= most:
            return f"backbone.kwargs.{key}: expected a whole number from 1 to {most}, got {v!r}"
    return None


def check_backbone(library: str, model: str, kwargs: dict[str, Any], global_pool: str) -> str | None:
    """The first thing wrong with a backbone section, as one line naming its key; None if nothing is."""
    vit = library == "timm" and model.startswith("vit_")
    for key in RESERVED_KWARGS:
        if key in kwargs:
            return (
                f"backbone.kwargs.{key}: mergeflow sets it (a features-only backbone, backbone.global_pool, "
                "backbone.pretrained); remove it"
            )
    if vit:
        for key in kwargs:
            if key not in VIT_KWARGS:
                return (
                    f"backbone.kwargs.{key}: not an argument of timm's VisionTransformer "
                    f"({did_you_mean(key, sorted(VIT_KWARGS))}it takes {len(VIT_KWARGS)})"
                )
    for key, value in kwargs.items():
        if key in POSITIVE_INTS and (why := _positive(key, value, MAX_IMG_SIZE if key == "img_size" else MAX_WIDTH)):
            return why
        if key in RATES and not (_number(value) and 0 <= value < 1):
            return f"backbone.kwargs.{key}: a dropout rate, from 0 up to (not including) 1, got {value!r}"
        if key == "mlp_ratio" and not (_number(value) and 0 < value <= 64):
            return f"backbone.kwargs.mlp_ratio: expected a number above 0 and at most 64, got {value!r}"
    width, heads = kwargs.get("embed_dim"), kwargs.get("num_heads")
    if vit and isinstance(width, int) and isinstance(heads, int) and width % heads:
        return f"backbone.kwargs: embed_dim {width} does not split into num_heads {heads} equal heads"
    pools = TEXT_POOLS if library == "transformers" else VIT_POOLS if vit else TIMM_POOLS
    if global_pool not in pools:
        what = "a text backbone's" if library == "transformers" else "a ViT's" if vit else "a timm model's"
        return f"backbone.global_pool: {global_pool!r} is not {what} pooling (one of {', '.join(pools)})"
    return None
