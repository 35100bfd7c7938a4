"""Pretraining of the text backbone on the text suite's corpus: masked-language-model (RoBERTa's objective) for an
encoder, denoising for an encoder-decoder (``pretrain_denoising``).

Each step masks 15% of a batch's real tokens (never ``<s>``, ``</s>`` or padding), chosen afresh every step from a
seeded generator (RoBERTa's dynamic masking): 80% of them become ``<mask>``, 10% a random word, 10% stay; the loss
is the cross-entropy of the original tokens at those positions, through the masked-LM head whose decoder is tied to
the word embeddings. The backbone's weights are the masked-LM model's base model afterwards.
"""

from __future__ import annotations

import torch
from torch import nn

from mergeflow.config import BackboneConfig, ScheduleConfig
from mergeflow.core.errors import MergeflowError
from mergeflow.ml.text_models import masked_lm, trim_padding
from mergeflow.ml.training import Curve, train_loop

MASK_SHARE, REPLACE_SHARE, KEEP_SHARE = 0.15, 0.1, 0.1


def mask_tokens(
    ids: torch.Tensor, config, generator: torch.Generator, first_word: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the masked inputs, the targets: the original ids where masked, -100 elsewhere). Words are ids from
    ``first_word`` on (the special tokens come first)."""
    special = ids < first_word
    chosen = (torch.rand(ids.shape, generator=generator) < MASK_SHARE) & ~special
    draw = torch.rand(ids.shape, generator=generator)
    randoms = torch.randint(first_word, config.vocab_size, ids.shape, generator=generator)
    masked = torch.where(
        chosen & (draw < 1 - REPLACE_SHARE - KEEP_SHARE), torch.full_like(ids, config.mask_token_id), ids
    )
    masked = torch.where(chosen & (draw >= 1 - REPLACE_SHARE - KEEP_SHARE) & (draw < 1 - KEEP_SHARE), randoms, masked)
    return masked, torch.where(chosen, ids, torch.full_like(ids, -100))


def _decode(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The masked-LM head's logits (RoBERTa's ``lm_head``, BERT's ``cls``) of hidden states [M, D]."""
    head = getattr(model, "lm_head", None) or model.cls
    return head(hidden)


def _check_special(config, special: dict[str, int], keys: tuple[tuple[str, str], ...]) -> None:
    for name, key in keys:
        if getattr(config, key) != special[name]:
            raise MergeflowError(
                f"backbone.kwargs.{key}: {getattr(config, key)}, but the "
                f"tokenizer (data/tokenizer.json) gives {name} id {special[name]}"
            )
    if config.vocab_size != special["vocab_size"]:
        raise MergeflowError(
            f"backbone.kwargs.vocab_size: {config.vocab_size}, but the tokenizer (data/tokenizer.json) has "
            f"{special['vocab_size']} tokens"
        )


def _prepare(
    model: nn.Module, special: dict[str, int], keys: tuple[tuple[str, str], ...], seed: int, device: torch.device
) -> tuple[torch.Generator, int]:
    """``model``'s config checked against the tokenizer's ``special`` ids and given its mask id, the model on
    ``device``; returns the masking's generator and the first word's id (the special tokens come first)."""
    _check_special(model.config, special, keys)
    model.config.mask_token_id = special["<mask>"]
    model.to(device)
    return torch.Generator().manual_seed(seed + 2), max(
        special[name] for name in ("<s>", "<pad>", "</s>", "<unk>", "<mask>")
    ) + 1


def pretrain_masked_lm(
    cfg: BackboneConfig,
    tokens: torch.Tensor,
    schedule: ScheduleConfig,
    *,
    special: dict[str, int],
    seed: int,
    device: torch.device,
) -> tuple[dict[str, torch.Tensor], Curve]:
    """The base model's state dict after masked-LM training on ``tokens`` (int [N, L]), and the loss curve.
    ``special``: the tokenizer's special-token ids and vocabulary size, which the model's config must match."""
    model = masked_lm(cfg)
    config = model.config
    generator, first_word = _prepare(
        model, special, (("<pad>", "pad_token_id"), ("<s>", "bos_token_id"), ("</s>", "eos_token_id")), seed, device
    )

    def loss_fn(idx: torch.Tensor) -> torch.Tensor:
        ids, real = trim_padding(tokens[idx].long(), config.pad_token_id)
        masked, targets = mask_tokens(ids, config, generator, first_word)
        masked, targets, real = masked.to(device), targets.to(device), real.to(device)
        hidden = model.base_model(input_ids=masked, attention_mask=real.long()).last_hidden_state
        chosen = targets != -100  # the decoder runs on the masked positions only: a sixth of its cost
        return nn.functional.cross_entropy(_decode(model, hidden[chosen]).float(), targets[chosen])

    curve = train_loop(
        model, loss_fn, len(tokens), schedule, optimizer="adamw", seed=seed, device=device, desc="pretrain (masked LM)"
    )
    return {k: v.detach().cpu().clone() for k, v in model.base_model.state_dict().items()}, curve


def pretrain_denoising(
    cfg: BackboneConfig,
    tokens: torch.Tensor,
    schedule: ScheduleConfig,
    *,
    special: dict[str, int],
    seed: int,
    device: torch.device,
) -> tuple[dict[str, torch.Tensor], Curve]:
    """The encoder-decoder's state dict after denoising training on ``tokens`` (int [N, L]), and the loss curve. T5's
    objective with one sentinel: the encoder reads a sentence whose chosen words (15% of the real ones, afresh each
    step: ``mask_tokens``'s choice) are ``<mask>``, and the decoder writes those words in order, then ``</s>``
    (``masked_targets``); the cross-entropy of every target token. The decoder's first token is a masked word, as a
    fine-tuned model's first token is its answer."""
    from mergeflow.ml.seq2seq_models import denoising_lm, state_without_aliases

    model = denoising_lm(cfg)
    config = model.config
    generator, first_word = _prepare(
        model,
        special,
        (("<pad>", "pad_token_id"), ("</s>", "eos_token_id"), ("<pad>", "decoder_start_token_id")),
        seed,
        device,
    )

    def loss_fn(idx: torch.Tensor) -> torch.Tensor:
        ids, real = trim_padding(tokens[idx].long(), config.pad_token_id)
        _, chosen = mask_tokens(ids, config, generator, first_word)
        chosen = chosen != -100
        masked = torch.where(chosen, torch.full_like(ids, special["<mask>"]), ids)
        labels = masked_targets(ids, chosen, special["</s>"])
        return model(input_ids=masked.to(device), attention_mask=real.long().to(device), labels=labels.to(device)).loss

    curve = train_loop(
        model, loss_fn, len(tokens), schedule, optimizer="adamw", seed=seed, device=device, desc="pretrain (denoising)"
    )
    return state_without_aliases(model), curve


def masked_targets(ids: torch.Tensor, chosen: torch.Tensor, eos: int) -> torch.Tensor:
    """Per row, the ``chosen`` tokens of ``ids`` in order and then ``eos``, padded with -100 (ignored by the loss)."""
    counts = chosen.sum(1, keepdim=True)
    width = int(counts.max()) + 1 if len(ids) else 1
    first = torch.argsort((~chosen).to(torch.int8), dim=1, stable=True)  # the chosen positions first, in order
    picked = torch.nn.functional.pad(ids.gather(1, first), (0, 1))[:, :width]
    column = torch.arange(width).expand(len(ids), width)
    return torch.where(
        column < counts,
        picked,
        torch.where(column == counts, torch.full_like(picked, eos), torch.full_like(picked, -100)),
    )
