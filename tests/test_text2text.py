"""The text-to-text path on tiny models: the T5-style task files, the encoder-decoder backbone's readout (against
transformers' own forward on the padded batch), tied weights stored once, save_pretrained folders, the verbalizer
head, seed 003's pooled features (against the model's own hidden states) and denoising pretraining."""

from __future__ import annotations

import json

import pytest
import torch

from mergeflow.config import BackboneConfig, SuiteConfig
from mergeflow.core.errors import MergeflowError
from mergeflow.core.io import load_metadata, save_state_dict
from mergeflow.ml.data import load_task, text_suite
from mergeflow.ml.data.text import special_ids, text2text_words, tokenizer, write_text_corpus, write_text_task
from mergeflow.ml.models import backbone_state, build_backbone, new_backbone
from mergeflow.ml.seq2seq_models import Seq2SeqBackbone, aliases, verbalizer_head
from mergeflow.ml.text_training import pretrain_denoising
from mergeflow.params import parse_params

IDS = special_ids(text2text=True)
TINY_T5 = BackboneConfig(
    library="transformers",
    model="t5",
    global_pool="token",
    kwargs={
        "vocab_size": IDS["vocab_size"],
        "d_model": 16,
        "d_kv": 8,
        "d_ff": 32,
        "num_layers": 2,
        "num_decoder_layers": 1,
        "num_heads": 2,
        "dropout_rate": 0.0,
        "pad_token_id": 1,
        "eos_token_id": 2,
        "decoder_start_token_id": 1,
    },
)
SUITE = SuiteConfig(
    source="text2text", tasks=["sentiment", "inference"], seq_len=32, n_train=16, n_val=8, n_test=8, pretrain_images=64
)


def _batch() -> torch.Tensor:
    """Three examples of different lengths, padded on the right to 12."""
    rows = [[40, 41, 42], [50, 51, 52, 53, 54, 55, 56], [60]]
    return torch.tensor([[0, *r, 2] + [1] * (10 - len(r)) for r in rows])


def _reference(backbone: Seq2SeqBackbone):
    """transformers' own model class holding the backbone's weights (tied ones included)."""
    from transformers import T5ForConditionalGeneration

    ref = T5ForConditionalGeneration(backbone.net.config).eval()
    ref.load_state_dict(backbone.net.state_dict(), strict=False)  # the aliases are tied to shared.weight
    return ref


# ---------------------------------------------------------------- task files
def test_a_text_to_text_task_starts_with_its_name_and_answers_with_words(tmp_path):
    from tokenizers import Tokenizer

    write_text_task(tmp_path / "inference.safetensors", SUITE, "inference", seed=3)
    write_text_corpus(tmp_path / "pretrain.safetensors", SUITE, seed=3)
    task = load_task(tmp_path / "inference.safetensors")
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert task.answers == [tok.token_to_id(c) for c in ("entailment", "neutral", "contradiction")]
    raw = text_suite.make_task("inference", 16, 8, 8, 3)
    assert tok.decode(task.test.inputs[0].tolist(), skip_special_tokens=True).split() == [
        "inference",
        ":",
        *raw["test_a"][0],
        *raw["test_b"][0],
    ]
    # the text suite's ids are kept; the new words come after them
    plain, extended = tokenizer(8).get_vocab(), tok.get_vocab()
    assert all(extended[w] == i for w, i in plain.items()) and len(extended) == len(plain) + len(text2text_words())


def test_a_regression_task_has_no_text_to_text_form(tmp_path):
    cfg = SuiteConfig(source="text2text", tasks=["similarity"], seq_len=32, n_train=16, n_val=8, n_test=8)
    with pytest.raises(MergeflowError, match="'similarity' is a regression task"):
        write_text_task(tmp_path / "similarity.safetensors", cfg, "similarity", seed=0)
    assert not (tmp_path / "similarity.safetensors").exists()


def test_bad_answers_are_one_line_naming_the_file(tmp_path):
    path = tmp_path / "sentiment.safetensors"
    write_text_task(path, SUITE, "sentiment", seed=0)
    tensors = {k: v for k, v in __import__("safetensors.torch", fromlist=["load_file"]).load_file(path).items()}
    save_state_dict(path, tensors, load_metadata(path) | {"answers": json.dumps([7, 7])})
    with pytest.raises(
        MergeflowError,
        match=r"sentiment.safetensors: metadata 'answers' is \[7, 7\], expected a JSON list of 2 distinct token ids",
    ):
        load_task(path)


# ---------------------------------------------------------------- the backbone
def test_the_readout_is_the_first_generated_tokens_logits_whatever_the_padding():
    torch.manual_seed(0)
    backbone = new_backbone(TINY_T5).eval()
    ids = _batch()
    ref = _reference(backbone)
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=(ids != 1).long(), decoder_input_ids=torch.full((3, 1), 1)).logits[
            :, 0
        ]
        got = backbone(ids)
        alone = torch.cat([backbone(row[None]) for row in ids])  # each example trimmed to its own length
    assert got.shape == (3, IDS["vocab_size"]) and backbone.num_features == IDS["vocab_size"]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(alone, expected, rtol=1e-5, atol=1e-5)


def test_tied_weights_are_stored_once_and_load_back_tied():
    torch.manual_seed(0)
    backbone = new_backbone(TINY_T5)
    state = backbone_state(backbone)
    assert set(aliases(backbone.net)) == {
        "encoder.embed_tokens.weight",
        "decoder.embed_tokens.weight",
        "lm_head.weight",
    }
    assert "shared.weight" in state and not set(aliases(backbone.net)) & set(state)
    state["shared.weight"] = state["shared.weight"] + 1.0
    other = build_backbone(TINY_T5, state)
    assert (
        other.net.lm_head.weight is other.net.shared.weight
        and other.net.encoder.embed_tokens.weight is other.net.shared.weight
    )
    torch.testing.assert_close(other.net.lm_head.weight.detach(), state["shared.weight"])


def test_a_save_pretrained_folder_loads_by_name(tmp_path):
    torch.manual_seed(1)
    saved = new_backbone(TINY_T5)
    saved.net.save_pretrained(tmp_path / "t5")  # transformers' own format: config.json and model.safetensors
    loaded = new_backbone(
        BackboneConfig(library="transformers", model="t5", pretrained=str(tmp_path / "t5")), pretrained=True
    )
    for k, v in backbone_state(saved).items():
        torch.testing.assert_close(backbone_state(loaded)[k], v, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(_batch()), saved.eval()(_batch()))


def test_the_verbalizer_reads_each_answers_logit():
    logits = torch.randn(5, 30)
    head = verbalizer_head(30, [7, 3, 21])
    torch.testing.assert_close(head(logits), logits[:, [7, 3, 21]])
    with pytest.raises(
        MergeflowError, match="answer token ids \\[7, 30\\] are not all within the model's vocabulary of 30"
    ):
        verbalizer_head(30, [7, 30])


def test_seed_003s_features_are_the_encoders_mean_and_the_decoders_first_token():
    torch.manual_seed(2)
    backbone = new_backbone(TINY_T5).eval()
    ids = _batch()
    layers = backbone.feature_layers()
    assert len(layers) == 3 and backbone.feature_names == ["encoder 0", "encoder 1", "decoder 0"]
    feats = [None] * len(layers)
    hooks = [
        m.register_forward_hook(lambda _m, _i, out, k=k, pool=pool: feats.__setitem__(k, pool(out)))
        for k, (m, pool) in enumerate(layers)
    ]
    with torch.no_grad():
        backbone(ids)
        out = _reference(backbone)(
            input_ids=ids,
            attention_mask=(ids != 1).long(),
            decoder_input_ids=torch.full((3, 1), 1),
            output_hidden_states=True,
        )
    for h in hooks:
        h.remove()
    real = (ids != 1).float()
    # hidden_states[l + 1] is block l's output, but the last one is after the stack's final norm
    block0 = out.encoder_hidden_states[1]
    torch.testing.assert_close(
        feats[0], (block0 * real[..., None]).sum(1) / real.sum(1, keepdim=True), rtol=1e-5, atol=1e-5
    )
    with torch.no_grad():
        torch.testing.assert_close(
            backbone.net.decoder.final_layer_norm(feats[2]), out.decoder_hidden_states[-1][:, 0], rtol=1e-5, atol=1e-5
        )


def test_denoising_pretraining_lowers_the_loss_and_checks_the_tokenizer():
    from mergeflow.config import ScheduleConfig

    tok = tokenizer(32, text2text=True)
    tokens = torch.tensor([e.ids for e in tok.encode_batch([" ".join(s) for s in text_suite.make_corpus(96, 0)])])
    schedule = ScheduleConfig(steps=60, batch_size=32, lr=1e-2, warmup_steps=2)
    state, curve = pretrain_denoising(TINY_T5, tokens, schedule, special=IDS, seed=0, device=torch.device("cpu"))
    losses = [r["loss"] for r in curve.records()]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    assert set(state) == set(backbone_state(new_backbone(TINY_T5)))
    bad = TINY_T5.model_copy(update={"kwargs": TINY_T5.kwargs | {"decoder_start_token_id": 0}})
    with pytest.raises(
        MergeflowError, match="backbone.kwargs.decoder_start_token_id: 0, but the tokenizer .* gives <pad> id 1"
    ):
        pretrain_denoising(bad, tokens, schedule, special=IDS, seed=0, device=torch.device("cpu"))


def test_a_text_to_text_suite_takes_the_verbalizer_and_only_it():
    import yaml

    from .conftest import REPO

    raw = yaml.safe_load((REPO / "profiles" / "t2t7.yaml").read_text())
    assert parse_params(raw).finetune.head == "verbalizer"
    for change in ({"head": "probe"}, {"train_head": True}):
        with pytest.raises(MergeflowError, match="finetune.head: a text-to-text suite"):
            parse_params(json.loads(json.dumps(raw)) | {"finetune": raw["finetune"] | change})
