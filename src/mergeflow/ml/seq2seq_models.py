"""The text-to-text backbone: a Hugging Face encoder-decoder (T5-style), read out at its first generated token.

A text-to-text model answers a classification task with a word ("sentiment : ..." -> "positive"). Its score for
each class is the language model's logit of the class's word at the first decoding step (the decoder fed only its
start token), so the backbone's output is that step's logits over the whole vocabulary [N, V], and a task's head is
its *verbalizer*: a frozen linear map that picks its answers' logits (``verbalizer_head``). Everything that makes
the answer, the encoder, the decoder and the language-model head (tied to the word embeddings, as T5's), belongs to
the backbone and merges; only the choice of the answer words is per task. This is T5's greedy first token
restricted to the task's answers (the seeds' T5 tasks also generate longer answers, which this readout does not).

Tied weights appear once in the state dict: ``shared.weight`` and not its aliases (``encoder.embed_tokens``,
``decoder.embed_tokens``, ``lm_head``), so a merge cannot give one tensor two values and safetensors can write it;
loading fills the aliases from their source.

Seed 003's features (``feature_layers``): per encoder block the mean of the real tokens' outputs, per decoder block
its output at the first generated token.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from mergeflow.config import BackboneConfig
from mergeflow.core.errors import MergeflowError
from mergeflow.ml.text_models import block_hidden, load_pretrained, mean_tokens, model_config, trim_padding


def aliases(model: nn.Module) -> dict[str, str]:
    """{alias: source} for every parameter registered under more than one name (tied weights), source first seen."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


@functools.cache
def _answering_class(base: type) -> type:
    """``base`` (a transformers seq2seq LM class) whose forward takes token ids alone and returns the first decoding
    step's logits, and whose state dict holds each tied weight once."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids, mask = trim_padding(input_ids.long(), self.config.pad_token_id)
        self.real_tokens = mask  # what feature_layers' encoder pooling reads
        start = torch.full((len(ids), 1), self.config.decoder_start_token_id, dtype=torch.long, device=ids.device)
        return base.forward(self, input_ids=ids, attention_mask=mask.long(), decoder_input_ids=start).logits[:, 0]

    def state_dict(self, *args, **kwargs):
        out = base.state_dict(self, *args, **kwargs)
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        for alias in aliases(self):
            out.pop(prefix + alias, None)
        return out

    def load_state_dict(self, state, strict: bool = True, assign: bool = False):
        state = dict(state)
        for alias, source in aliases(self).items():
            if source in state:
                state.setdefault(alias, state[source])
        return base.load_state_dict(self, state, strict=strict, assign=assign)

    members = {"forward": forward, "state_dict": state_dict, "load_state_dict": load_state_dict, "__module__": __name__}
    return type(f"{base.__name__}Answers", (base,), members)


def _lm_class(config) -> type:
    from transformers import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING

    try:
        return _answering_class(MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING[type(config)])
    except KeyError:
        raise MergeflowError(
            f"backbone.model: transformers has no sequence-to-sequence LM for model type '{config.model_type}'"
        ) from None


def build_seq2seq(cfg: BackboneConfig, config, *, pretrained: bool = False) -> nn.Module:
    """The encoder-decoder with random init, or with backbone.pretrained's weights (text_models.load_pretrained)."""
    cls = _lm_class(config)
    return load_pretrained(cls, cfg, config) if pretrained and cfg.pretrained is not None else cls(config)


class Seq2SeqBackbone(nn.Module):
    """Integer token ids [N, L] -> the first generated token's logits [N, vocab_size]."""

    embedding = "pooled"
    input_norm = "none"

    def __init__(self, cfg: BackboneConfig, *, pretrained: bool = False, config=None):
        super().__init__()
        self.net = build_seq2seq(cfg, config if config is not None else model_config(cfg), pretrained=pretrained)

    @property
    def num_features(self) -> int:
        return int(self.net.config.vocab_size)

    def normalise(self, token_ids: torch.Tensor) -> torch.Tensor:
        return token_ids

    def embed(self, features: torch.Tensor) -> torch.Tensor:
        return features

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.net(token_ids)

    @property
    def feature_reading(self) -> str:
        e, d = len(self.net.encoder.block), len(self.net.decoder.block)
        return (
            f"block l's output as seed 003 reads T5: blocks 0–{e - 1} the encoder's, the mean of the real tokens; "
            f"blocks {e}–{e + d - 1} the decoder's, at the first generated token"
        )

    @property
    def feature_names(self) -> list[str]:
        return [f"encoder {b}" for b in range(len(self.net.encoder.block))] + [
            f"decoder {b}" for b in range(len(self.net.decoder.block))
        ]

    def feature_layers(self) -> list[tuple[nn.Module, Callable[[object], torch.Tensor]]]:
        """(block, its output -> [N, D] feature) for each encoder then decoder block, as seed 003 reads T5: the
        encoder's real tokens mean-pooled, the decoder at the first generated token."""
        encoder_mean = functools.partial(mean_tokens, self.net)
        return [(b, encoder_mean) for b in self.net.encoder.block] + [(b, _first_token) for b in self.net.decoder.block]


def _first_token(output) -> torch.Tensor:
    return block_hidden(output)[:, 0]


def verbalizer_head(vocab_size: int, answers: list[int]) -> nn.Linear:
    """The linear head [C, V] that reads the logit of each class's answer word (a one-hot row each, no bias)."""
    if not answers or max(answers) >= vocab_size:
        raise MergeflowError(
            f"finetune.head: verbalizer: the task's answer token ids {answers} are not all within the model's "
            f"vocabulary of {vocab_size}"
        )
    head = nn.Linear(vocab_size, len(answers))
    with torch.no_grad():
        head.weight.zero_()
        head.weight[torch.arange(len(answers)), torch.tensor(answers)] = 1.0
        head.bias.zero_()
    return head


def denoising_lm(cfg: BackboneConfig) -> nn.Module:
    """The encoder-decoder of ``cfg``'s architecture as transformers builds it (its forward takes labels), for
    denoising pretraining on the text corpus; ``state_without_aliases`` gives its weights in the backbone's naming."""
    config = model_config(cfg)
    return _lm_class(config).__mro__[1](config)


def state_without_aliases(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s weights without the aliases of tied ones, detached on the CPU."""
    tied = aliases(model)
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if k not in tied}
