"""GLUE read from the `datasets` on-disk format and tokenized with the backbone's own tokenizer (suite.source: glue),
on tiny tasks written here in exactly that format (DatasetDict.save_to_disk's files) and a tiny RoBERTa saved with
save_pretrained: nothing is downloaded."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
import torch

from mergeflow.config import BackboneConfig, SuiteConfig
from mergeflow.core.errors import MergeflowError
from mergeflow.ml.data import check_layout, load_task, write_task
from mergeflow.ml.data.glue import GLUE, TEST_SPLIT
from mergeflow.ml.models import new_backbone

WORDS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>", "a", "cat", "dog", "sat", "ran", "the", "is", "not", "big"]


def save_glue_task(root, task: str, splits: dict[str, dict[str, list]]) -> None:
    """What ``load_dataset("nyu-mll/glue", task).save_to_disk(root / task)`` writes, for the given columns."""
    base = root / task
    base.mkdir(parents=True)
    (base / "dataset_dict.json").write_text(json.dumps({"splits": list(splits)}))
    for split, columns in splits.items():
        (base / split).mkdir()
        table = pa.table(columns)
        with (
            pa.OSFile(str(base / split / "data-00000-of-00001.arrow"), "wb") as sink,
            pa.ipc.new_stream(sink, table.schema) as writer,
        ):
            writer.write_table(table)
        (base / split / "state.json").write_text(
            json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_split": split})
        )
        (base / split / "dataset_info.json").write_text(json.dumps({"builder_name": "glue", "config_name": task}))


def save_tiny_roberta(folder) -> BackboneConfig:
    """A tiny RoBERTa and a word-level tokenizer of WORDS, both with save_pretrained: what a hub folder holds."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, RobertaConfig, RobertaModel

    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        mask_token="<mask>",
    )
    fast.save_pretrained(folder)
    config = RobertaConfig(
        vocab_size=len(WORDS),
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=24,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    )
    RobertaModel(config, add_pooling_layer=False).save_pretrained(folder)
    return BackboneConfig(library="transformers", model="roberta", pretrained=str(folder), global_pool="token")


@pytest.fixture
def glue(tmp_path):
    pairs = {
        "sentence1": ["the cat sat", "a dog ran", "the dog is big", "a cat ran", "the cat is not big"],
        "sentence2": ["a cat sat", "the dog sat", "a dog", "the cat", "a big cat"],
    }
    save_glue_task(
        tmp_path / "glue",
        "stsb",
        {
            "train": pairs | {"label": pa.array([4.5, 2.0, 3.25, 1.0, 0.5], pa.float32()), "idx": list(range(5))},
            "validation": {
                "sentence1": ["the cat", "a dog"],
                "sentence2": ["a cat", "the cat"],
                "label": pa.array([5.0, 1.5], pa.float32()),
                "idx": [0, 1],
            },
        },
    )
    save_glue_task(
        tmp_path / "glue",
        "mnli",
        {
            "train": {
                "premise": pairs["sentence1"],
                "hypothesis": pairs["sentence2"],
                "label": [0, 1, 2, 1, 0],
                "idx": list(range(5)),
            },
            TEST_SPLIT["mnli"]: {"premise": ["the cat sat"], "hypothesis": ["a cat"], "label": [0], "idx": [0]},
        },
    )
    backbone = save_tiny_roberta(tmp_path / "roberta")
    suite = SuiteConfig(
        source="glue", root=str(tmp_path / "glue"), tasks=["stsb", "mnli"], seq_len=12, n_train=8, n_val=4, n_test=8
    )
    return suite, backbone, tmp_path


def test_a_glue_task_becomes_a_text_task_file(glue):
    from transformers import AutoTokenizer

    suite, backbone, tmp_path = glue
    sizes = write_task(tmp_path / "stsb.safetensors", suite, "stsb", seed=0, backbone=backbone)
    assert sizes == {"train": 4, "val": 1, "test": 2}  # n_val: a fifth of train at most; test: GLUE's validation
    task = load_task(tmp_path / "stsb.safetensors")
    assert task.metric == "pearson_spearman" and task.classes == ["score"]
    torch.testing.assert_close(task.test.labels, torch.tensor([5.0, 1.5]))
    tok = AutoTokenizer.from_pretrained(tmp_path / "roberta")
    assert tok.decode(task.test.inputs[1].tolist(), skip_special_tokens=True).split() == "a dog the cat".split()
    assert task.test.inputs[1].tolist() == [
        0,
        5,
        7,
        2,
        2,
        10,
        6,
        2,
        1,
        1,
        1,
        1,
    ]  # <s> a dog </s></s> the cat </s>, padded
    # every train and val example is one of train's, none twice
    labels = sorted(task.train.labels.tolist() + task.val.labels.tolist())
    assert labels == sorted([4.5, 2.0, 3.25, 1.0, 0.5])
    write_task(tmp_path / "mnli.safetensors", suite, "mnli", seed=0, backbone=backbone)
    mnli = load_task(tmp_path / "mnli.safetensors")
    assert mnli.classes == list(GLUE["mnli"][2]) and mnli.test.labels.tolist() == [0] and mnli.metric == "accuracy"
    # the backbone reads the ids the tokenizer wrote: its pad id is the tokenizer's
    encoder = new_backbone(backbone, pretrained=True)
    assert encoder.net.config.pad_token_id == tok.pad_token_id
    assert encoder(task.test.inputs).shape == (2, 8)


def test_what_is_missing_is_named_before_anything_runs(glue):
    suite, backbone, tmp_path = glue
    with pytest.raises(MergeflowError, match="^suite.root: '.*/glue/rte' has no dataset_dict.json"):
        check_layout(suite.model_copy(update={"tasks": ["rte"]}), "rte")
    with pytest.raises(MergeflowError, match="^suite.tasks: 'squad' is not a GLUE task"):
        check_layout(suite, "squad")
    (tmp_path / "glue" / "stsb" / "validation" / "state.json").unlink()
    with pytest.raises(
        MergeflowError, match="^suite.root: '.*/stsb/validation' is missing \\(GLUE's stsb needs its 'validation' split"
    ):
        check_layout(suite, "stsb")
    with pytest.raises(MergeflowError, match="^backbone.pretrained: .* is not a transformers model folder"):
        new_backbone(backbone.model_copy(update={"pretrained": str(tmp_path / "glue")}), pretrained=True)


def test_check_names_a_missing_model_before_any_stage(glue, repo_root):
    import yaml

    from mergeflow.params import parse_params
    from mergeflow.runner.checks import check_local_files

    suite, backbone, tmp_path = glue
    raw = yaml.safe_load((repo_root / "profiles" / "glue8.yaml").read_text())
    raw["backbone"]["model"] = "no-such-model-in-the-cache"
    with pytest.raises(
        MergeflowError,
        match="^params.yaml: backbone.pretrained: hub: 'no-such-model-in-the-cache' is not in the local Hugging Face "
        "cache, and downloads are off",
    ):
        check_local_files(parse_params(raw), tmp_path, "params.yaml")
    raw["backbone"]["pretrained"] = "glue"  # a folder without config.json
    with pytest.raises(
        MergeflowError, match="^params.yaml: backbone.pretrained: 'glue' is not a transformers model folder"
    ):
        check_local_files(parse_params(raw), tmp_path, "params.yaml")
    raw["backbone"]["pretrained"] = "roberta"
    check_local_files(parse_params(raw), tmp_path, "params.yaml")
