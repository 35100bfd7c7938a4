"""The text modality's parts on tiny models: task files, the tokenizer, the encoder's features, masked-LM pretraining,
the regression probe and the statistics, each against an independent route (the tokenizer's own decoding, the
example alone without padding, scikit-learn's ridge, a formula by hand)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from mergeflow.config import BackboneConfig, ProbeConfig, SuiteConfig
from mergeflow.core.errors import MergeflowError
from mergeflow.core.io import load_state_dict, save_state_dict
from mergeflow.ml.data import load_task, text_suite
from mergeflow.ml.data.text import special_ids, write_text_corpus, write_text_task
from mergeflow.ml.models import build_backbone, new_backbone
from mergeflow.ml.statistics import fisher_diagonal, input_grams
from mergeflow.ml.text_training import mask_tokens, pretrain_masked_lm
from mergeflow.ml.probes import fit_probe

IDS = special_ids()
TINY_TEXT = BackboneConfig(
    library="transformers",
    model="roberta",
    global_pool="token",
    kwargs={
        "vocab_size": IDS["vocab_size"],
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 32,
        "max_position_embeddings": 40,
        "bos_token_id": 0,
        "pad_token_id": 1,
        "eos_token_id": 2,
        "type_vocab_size": 1,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    },
)
SUITE = SuiteConfig(
    source="text", tasks=list(text_suite.TASKS), seq_len=32, n_train=16, n_val=8, n_test=8, pretrain_images=64
)


def _ids(*rows: list[int], length: int = 12) -> torch.Tensor:
    return torch.tensor([[IDS["<s>"], *r, IDS["</s>"]] + [IDS["<pad>"]] * (length - len(r) - 2) for r in rows])


# ---------------------------------------------------------------- task files
def test_a_text_task_file_round_trips_and_decodes_to_its_words(tmp_path):
    from tokenizers import Tokenizer

    write_text_task(tmp_path / "similarity.safetensors", SUITE, "similarity", seed=3)
    write_text_corpus(tmp_path / "pretrain.safetensors", SUITE, seed=3)
    task = load_task(tmp_path / "similarity.safetensors")
    assert task.metric == "pearson_spearman" and task.classes == ["score"] and task.train.labels.dtype == torch.float32
    assert task.train.inputs.shape == (len(task.train.labels), 32)
    raw = text_suite.make_task("similarity", 16, 8, 8, 3)
    decoded = Tokenizer.from_file(str(tmp_path / "tokenizer.json")).decode(
        task.test.inputs[0].tolist(), skip_special_tokens=True
    )
    assert decoded.split() == raw["test_a"][0] + raw["test_b"][0]  # the pair, in order, nothing lost
    torch.testing.assert_close(task.test.labels, torch.as_tensor(raw["test_y"], dtype=torch.float32))
    corpus = load_state_dict(tmp_path / "pretrain.safetensors")["tokens"]
    assert corpus.shape == (64, 32) and int(corpus[:, 0].eq(IDS["<s>"]).sum()) == 64
    classes = load_task(tmp_path / "similarity.safetensors")
    assert classes.train.inputs.dtype == torch.int32


@pytest.mark.parametrize(
    ("array", "value", "message"),
    [
        (
            "train_x",
            torch.full((4, 32), 99999, dtype=torch.int32),
            "array 'train_x' has token id 99999, outside the vocabulary",
        ),
        (
            "train_x",
            torch.zeros(4, 32),
            "array 'train_x' has dtype float32 and shape \\(4, 32\\), expected integer token ids",
        ),
        ("val_y", torch.zeros(8, dtype=torch.int64), "array 'val_y' has dtype int64, expected finite float scores"),
    ],
)
def test_bad_text_task_data_is_one_line_naming_the_array(tmp_path, array, value, message):
    path = tmp_path / "similarity.safetensors"
    write_text_task(path, SUITE, "similarity", seed=0)
    tensors = load_state_dict(path, check=False)
    tensors[array] = value if array != "train_x" or value.dtype != torch.int32 else value
    if array == "train_x":
        tensors["train_y"] = tensors["train_y"][:4]
    meta = {"task": "similarity", "classes": json.dumps(["score"]), "metric": "pearson_spearman", "modality": "text"}
    save_state_dict(path, tensors, meta)
    from mergeflow.ml.data.text import check_text_task

    with pytest.raises(MergeflowError, match=f"^{path}: {message}"):
        check_text_task(tensors, ["score"], "pearson_spearman", str(path), vocab_size=IDS["vocab_size"])
    if "vocabulary" not in message:
        with pytest.raises(MergeflowError, match=f"^{path}: {message}"):
            load_task(path)


# ---------------------------------------------------------------- the encoder
def test_features_do_not_depend_on_padding_or_the_batch():
    torch.manual_seed(0)
    backbone = new_backbone(TINY_TEXT).eval()
    batch = _ids([10, 11, 12], [20, 21, 22, 23, 24, 25])
    with torch.no_grad():
        together = backbone(batch)
        alone = torch.cat([backbone(_ids([10, 11, 12], length=5)), backbone(_ids([20, 21, 22, 23, 24, 25], length=8))])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)


def test_mean_pooling_is_the_mean_of_the_real_tokens():
    torch.manual_seed(1)
    backbone = new_backbone(TINY_TEXT.model_copy(update={"global_pool": "avg"})).eval()
    ids = _ids([10, 11, 12], length=9)
    with torch.no_grad():
        hidden = (
            backbone.net.base_model.__class__.__mro__[1].forward(backbone.net, input_ids=ids[:, :5]).last_hidden_state
        )
        torch.testing.assert_close(backbone(ids), hidden.mean(1), rtol=1e-5, atol=1e-5)


def test_seed_003s_encoder_features_are_each_layers_real_tokens_mean():
    """study@ctl's f_l of a text encoder: layer l's output averaged over the real tokens, against the base model's
    own hidden states on the example alone (no padding at all)."""
    torch.manual_seed(2)
    backbone = new_backbone(TINY_TEXT.model_copy(update={"kwargs": TINY_TEXT.kwargs | {"num_hidden_layers": 2}})).eval()
    layers = backbone.feature_layers()
    feats = [None] * len(layers)
    hooks = [
        m.register_forward_hook(lambda _m, _i, out, k=k, pool=pool: feats.__setitem__(k, pool(out)))
        for k, (m, pool) in enumerate(layers)
    ]
    with torch.no_grad():
        backbone(_ids([10, 11, 12], [20, 21, 22, 23, 24, 25], length=11))
        for h in hooks:
            h.remove()
        base = backbone.net.__class__.__mro__[1].forward
        alone = [
            base(backbone.net, input_ids=_ids(words, length=len(words) + 2), output_hidden_states=True).hidden_states
            for words in ([10, 11, 12], [20, 21, 22, 23, 24, 25])
        ]
    assert len(layers) == 2
    for layer in range(2):
        torch.testing.assert_close(feats[layer], torch.cat([h[layer + 1].mean(1) for h in alone]), rtol=1e-5, atol=1e-5)


def test_a_save_pretrained_folder_loads_by_name(tmp_path):
    from transformers import RobertaConfig, RobertaModel

    config = RobertaConfig(**TINY_TEXT.kwargs)
    saved = RobertaModel(config, add_pooling_layer=False)
    saved.save_pretrained(tmp_path / "encoder")
    loaded = new_backbone(TINY_TEXT.model_copy(update={"pretrained": str(tmp_path / "encoder")}), pretrained=True)
    for name, tensor in saved.state_dict().items():
        torch.testing.assert_close(loaded.net.state_dict()[name], tensor, rtol=0, atol=0)
    with pytest.raises(MergeflowError, match="is not a transformers model folder"):
        new_backbone(TINY_TEXT.model_copy(update={"pretrained": str(tmp_path)}), pretrained=True)


# ---------------------------------------------------------------- masked-LM pretraining
def test_masking_picks_real_tokens_only_at_about_fifteen_percent():
    from transformers import RobertaConfig

    config = RobertaConfig(**TINY_TEXT.kwargs)
    config.mask_token_id = IDS["<mask>"]
    ids = _ids(*[list(range(10, 40))] * 200, length=32)
    masked, targets = mask_tokens(ids, config, torch.Generator().manual_seed(0), first_word=5)
    chosen = targets != -100
    assert not chosen[:, 0].any() and not chosen[:, 31].any()  # <s> and </s> never
    assert abs(float(chosen[:, 1:31].float().mean()) - 0.15) < 0.01
    assert torch.equal(targets[chosen], ids[chosen])
    replaced = masked[chosen] == IDS["<mask>"]
    assert abs(float(replaced.float().mean()) - 0.8) < 0.03
    assert torch.equal(masked[~chosen], ids[~chosen])


def test_masked_lm_pretraining_lowers_the_loss_and_fills_the_backbone(tmp_path):
    from mergeflow.config import PretrainConfig

    write_text_corpus(tmp_path / "pretrain.safetensors", SUITE.model_copy(update={"pretrain_images": 256}), seed=0)
    tokens = load_state_dict(tmp_path / "pretrain.safetensors")["tokens"]
    schedule = PretrainConfig(steps=40, batch_size=32, lr=3e-3, weight_decay=0.0, warmup_steps=4)
    torch.manual_seed(0)
    state, curve = pretrain_masked_lm(TINY_TEXT, tokens, schedule, special=IDS, seed=0, device=torch.device("cpu"))
    first, last = sum(curve.loss[:5]) / 5, sum(curve.loss[-5:]) / 5
    assert first > 0.9 * torch.log(torch.tensor(float(IDS["vocab_size"]))) and last < first - 0.5
    backbone = build_backbone(TINY_TEXT, state)  # the base model's tensors, every one, by name
    assert set(state) == set(backbone.net.state_dict())
    with pytest.raises(MergeflowError, match="backbone.kwargs.vocab_size: 7, but the tokenizer"):
        pretrain_masked_lm(
            TINY_TEXT.model_copy(update={"kwargs": TINY_TEXT.kwargs | {"vocab_size": 7}}),
            tokens,
            schedule,
            special=IDS,
            seed=0,
            device=torch.device("cpu"),
        )


# ---------------------------------------------------------------- heads and statistics
def test_the_regression_probe_is_scikit_learns_ridge():
    from sklearn.linear_model import Ridge

    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(60, 5, generator=g), torch.randn(20, 5, generator=g)
    w = torch.randn(5, generator=g)
    y, yv = x @ w + 0.3 * torch.randn(60, generator=g), v @ w
    probe = fit_probe(x, y, v, yv, ProbeConfig(c_grid=[0.5]), seed=0, metric="pearson_spearman")
    mu, sd = x.mean(0), x.std(0) + 1e-6
    ridge = Ridge(alpha=1 / 0.5).fit(((x - mu) / sd).double().numpy(), y.double().numpy())
    expected = ridge.predict(((v - mu) / sd).double().numpy())
    torch.testing.assert_close(probe.head(v)[:, 0].double(), torch.as_tensor(expected), rtol=1e-4, atol=1e-4)
    assert probe.head.out_features == 1


class _Linear(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x)


def test_regression_fisher_is_the_squared_residual_times_the_input_squared():
    # f(x) = w . x, log p(y|x) = -(y - f)^2 / 2: its gradient is (y - f) x, so F = mean((y - f)^2 x^2)
    net = nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        net.weight.copy_(torch.tensor([[1.0, -2.0, 0.5]]))
    head = nn.Linear(1, 1)
    with torch.no_grad():
        head.weight.fill_(1.0), head.bias.zero_()
    x, y = torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, 1.0]]), torch.tensor([3.0, -1.0])
    fisher = fisher_diagonal(
        _Linear(net), head, x, y, generator=torch.Generator(), device=torch.device("cpu"), regression=True
    )
    residual = y - x @ net.weight[0].detach()
    torch.testing.assert_close(fisher["weight"][0], (residual[:, None] ** 2 * x**2).mean(0))


def test_grams_leave_the_padding_out():
    torch.manual_seed(2)
    backbone = new_backbone(TINY_TEXT).eval()
    padded = input_grams(backbone, _ids([10, 11], [20, 21, 22, 23, 24]), batch_size=2, device=torch.device("cpu"))
    one = input_grams(backbone, _ids([10, 11], length=4), batch_size=1, device=torch.device("cpu"))
    other = input_grams(backbone, _ids([20, 21, 22, 23, 24], length=7), batch_size=1, device=torch.device("cpu"))
    for name, gram in padded.items():
        torch.testing.assert_close(gram, one[name] + other[name], rtol=1e-4, atol=1e-4)


def test_cart_averages_the_embedding_tables_and_low_ranks_the_attention_and_mlp_matrices():
    # seed 002 on RoBERTa: the low rank applies to the matrices of attention and MLP, the rest is averaged
    from mergeflow.ml.merging import REGISTRY

    torch.manual_seed(3)
    theta0 = {k: v.clone() for k, v in new_backbone(TINY_TEXT).net.state_dict().items()}
    taus = {t: {k: 0.01 * torch.randn(v.shape) for k, v in theta0.items()} for t in "abc"}
    merged = REGISTRY["cart"](theta0, taus, rank_ratio=0.25, lam=2.0)
    average = REGISTRY["weight_averaging"](theta0, taus)
    for key in (
        "embeddings.word_embeddings.weight",
        "embeddings.position_embeddings.weight",
        "encoder.layer.0.attention.output.LayerNorm.weight",
    ):
        torch.testing.assert_close(merged[key], average[key])
    query = "encoder.layer.0.attention.self.query.weight"
    assert not torch.allclose(merged[query], average[query])
