"""The text backbone: a Hugging Face ``transformers`` encoder (RoBERTa-style), features only.

Token ids travel as integer tensors [N, L], padded with the model's ``pad_token_id``; the encoder builds its
attention mask from them, so every stage feeds it as it feeds an image backbone its uint8 images. Its feature is the
first token's (``<s>``, what RoBERTa's classification head reads: ``global_pool: token``) or the mean of the
unpadded tokens' (``avg``); the per-task heads are linear, as for images. The net's state dict is exactly the
transformers base model's (no pooler): ``save_pretrained`` folders and the hub's weights load into it by name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from mergeflow.config import BackboneConfig
from mergeflow.core.errors import MergeflowError


def model_config(cfg: BackboneConfig):
    """The transformers configuration of the backbone: ``backbone.model`` (a model_type) with ``backbone.kwargs``;
    with ``backbone.pretrained``, the configuration of its folder or of the hub model ``backbone.model`` (the local
    cache's), ``kwargs`` overriding it."""
    from transformers import AutoConfig

    source = cfg.model if cfg.pretrained == "hub" else cfg.pretrained
    try:
        if source is None:
            return AutoConfig.for_model(cfg.model, **cfg.kwargs)
        if cfg.pretrained != "hub" and not (Path(source) / "config.json").is_file():
            raise MergeflowError(
                f"backbone.pretrained: '{source}' is not a transformers model "
                "folder (no config.json; save one with save_pretrained)"
            )
        return AutoConfig.from_pretrained(source, **cfg.kwargs)
    except (ValueError, TypeError, KeyError, OSError) as err:
        what = (
            f"model type '{cfg.model}' with backbone.kwargs"
            if source is None
            else f"'{source}'" + (" (hub: download it once with --download)" if cfg.pretrained == "hub" else "")
        )
        raise MergeflowError(
            f"backbone: transformers could not configure {what} "
            f"({str(err).splitlines()[0] if str(err) else type(err).__name__})"
        ) from None


def trim_padding(ids: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(``ids`` cut after the batch's last real token, their mask of real tokens): padding is on the right, and the
    columns that are padding in every row change no real token's output, only the time (a task's examples fill a
    third of seq_len, the corpus' sentences a sixth)."""
    mask = ids != pad_id
    length = max(1, int(mask.sum(1).max())) if len(ids) else ids.shape[1]
    return ids[:, :length], mask[:, :length]


@functools.cache
def _features_class(base: type) -> type:
    """``base`` (a transformers base model class) whose forward takes token ids alone and returns the pooled feature."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids, mask = trim_padding(input_ids.long(), self.config.pad_token_id)
        self.real_tokens = mask  # what feature_layers' pooling reads
        hidden = base.forward(self, input_ids=ids, attention_mask=mask.long()).last_hidden_state
        if self.pooling == "token":
            return hidden[:, 0]
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)

    return type(f"{base.__name__}Features", (base,), {"forward": forward, "__module__": __name__})


def _base_class(config) -> type:
    from transformers import MODEL_MAPPING

    try:
        return MODEL_MAPPING[type(config)]
    except KeyError:
        raise MergeflowError(
            f"backbone.model: transformers has no base model for model type '{config.model_type}'"
        ) from None


def _no_pooler(config) -> dict:
    """BERT-style base models' pooler (a dense layer on the first token, trained by next-sentence prediction) is not
    part of the backbone: the per-task heads read the features themselves."""
    return {"add_pooling_layer": False} if config.model_type in ("roberta", "bert", "xlm-roberta") else {}


def load_pretrained(cls: type, cfg: BackboneConfig, config, **kwargs) -> nn.Module:
    """``cls.from_pretrained`` on backbone.pretrained: a save_pretrained folder, or with "hub" backbone.model as a hub
    id, read from the local cache unless downloads are on (the caller's hub_access); a failure is one line."""
    source = cfg.model if cfg.pretrained == "hub" else cfg.pretrained
    try:
        return cls.from_pretrained(source, config=config, **kwargs)
    except (OSError, ValueError, RuntimeError) as err:
        where = (
            f"hub: '{source}' (download it once with --download, or save it with save_pretrained and point "
            "backbone.pretrained at the folder)"
            if cfg.pretrained == "hub"
            else source
        )
        raise MergeflowError(
            f"backbone.pretrained: {where}: transformers could not load it ({str(err).splitlines()[0]})"
        ) from None


def build_encoder(cfg: BackboneConfig, *, pretrained: bool = False) -> nn.Module:
    """The encoder with random init, or with the weights of ``backbone.pretrained``'s ``save_pretrained`` folder."""
    if cfg.global_pool not in ("token", "avg"):
        raise MergeflowError(
            "backbone.global_pool: a text backbone pools the first token "
            f"('token') or the mean of the tokens ('avg'), not '{cfg.global_pool}'"
        )
    config = model_config(cfg)
    if pretrained and cfg.pretrained is not None:
        # a save_pretrained folder, or with "hub" backbone.model as a hub id (roberta-base), read from the local cache
        # unless downloads are on (the caller's hub_access)
        net = load_pretrained(_features_class(_base_class(config)), cfg, config, **_no_pooler(config))
    else:
        net = _features_class(_base_class(config))(config, **_no_pooler(config))
    net.pooling = cfg.global_pool
    return net


class TextBackbone(nn.Module):
    """Integer token ids [N, L] -> pooled features [N, D]."""

    embedding = "pooled"
    input_norm = "none"

    def __init__(self, cfg: BackboneConfig, *, pretrained: bool = False):
        super().__init__()
        self.net = build_encoder(cfg, pretrained=pretrained)

    @property
    def num_features(self) -> int:
        return int(self.net.config.hidden_size)

    def normalise(self, token_ids: torch.Tensor) -> torch.Tensor:
        return token_ids  # the net reads the ids themselves (and masks their padding)

    def embed(self, features: torch.Tensor) -> torch.Tensor:
        return features

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.net(token_ids)

    feature_reading = "encoder layer l's output, the mean of the real tokens"

    def feature_layers(self) -> list[tuple[nn.Module, Callable[[object], torch.Tensor]]]:
        """(layer, its output -> [N, D] feature) for each encoder layer: the real tokens' mean (seed 003's reading of
        an encoder, mergeflow.studies.ctl)."""
        return [(layer, functools.partial(mean_tokens, self.net)) for layer in self.net.encoder.layer]


def block_hidden(output) -> torch.Tensor:
    """A block's hidden states [N, L, D] (a transformers block may return them first in a tuple)."""
    return output[0] if isinstance(output, tuple) else output


def mean_tokens(net: nn.Module, output) -> torch.Tensor:
    """The mean over the real tokens (the last forward's ``net.real_tokens``) of a block's hidden states [N, L, D]."""
    hidden = block_hidden(output)
    weights = net.real_tokens.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)


def masked_lm(cfg: BackboneConfig) -> nn.Module:
    """The masked-LM model of ``cfg``'s architecture (its base model is the backbone's net, its decoder tied to the
    word embeddings), for pretraining on the text corpus."""
    from transformers import AutoModelForMaskedLM

    return AutoModelForMaskedLM.from_config(model_config(cfg))
