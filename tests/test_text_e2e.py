"""The text modality end to end on a tiny text run, in this process: the same stage functions as for images (prepare,
pretrain, finetune, vectors, statistics, merge, report) on the text suite's eight tasks with a tiny RoBERTa-style
encoder, and every registered method merging its task vectors."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from mergeflow.core.errors import MergeflowError
from mergeflow.ml.merging import REGISTRY
from mergeflow.params import parse_params
from mergeflow.pipeline.stages import Layout, finetune, merge, prepare, pretrain, statistics, vectors

from .conftest import REPO

TINY_TEXT = {
    "suite": {"n_train": 48, "n_val": 16, "n_test": 16, "pretrain_images": 256},
    "backbone": {
        "kwargs": {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}
    },
    "pretrain": {"steps": 6, "batch_size": 32, "warmup_steps": 1},
    "probe": {"c_grid": [1.0]},
    "finetune": {"steps": 4, "batch_size": 16, "warmup_steps": 1},
    "statistics": {"examples": 8},
    "runtime": {"threads": 1},
}


def _tiny(raw: dict, override: dict) -> dict:
    for key, value in override.items():
        if key == "kwargs":
            raw[key] = raw[key] | value
        elif isinstance(value, dict):
            _tiny(raw[key], value)
        else:
            raw[key] = value
    return raw


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """(params, layout) of the tiny text run up to the statistics: the profile's own file with small sizes."""
    raw = _tiny(yaml.safe_load((REPO / "profiles" / "text8.yaml").read_text()), TINY_TEXT)
    return raw, _run_to_statistics(parse_params(raw), Layout(tmp_path_factory.mktemp("text-run")))


def _run_to_statistics(params, layout: Layout) -> Layout:
    """The stages up to the merges, in this process."""
    prepare(params, layout)
    pretrain(params, layout)
    for task in params.suite.tasks:
        finetune(params, task, layout)
    vectors(params, layout)
    statistics(params, layout)
    return layout


def test_each_task_is_scored_by_its_glue_metric(text_run):
    raw, layout = text_run
    metrics = {t: json.loads(layout.metrics("finetune", t).read_text()) for t in raw["suite"]["tasks"]}
    for task, record in metrics.items():
        for score in (record["individual"]["test"], record["probe"]["test"]):
            assert -1.0 <= score <= 1.0 and math.isfinite(score), task
    # a regression head has one output, a classifier one per class
    from mergeflow.core.io import load_state_dict

    assert load_state_dict(layout.head("similarity"))["weight"].shape[0] == 1
    assert load_state_dict(layout.head("inference"))["weight"].shape[0] == 3


# every method that merges any number of task models (the text suite has eight)
METHODS = sorted(name for name, method in REGISTRY.items() if method.tasks in (None, 8))


# RegMean++ and WEMoE walk a timm ViT's blocks (their activations, their MLPs): refused on a text encoder, one line
VIT_BLOCKS = {
    "regmean_plusplus": "merges a timm ViT block by block",
    "ada_svd": "merges a timm ViT block by block",
    "wemoe": "the backbone has no blocks",
}


@pytest.mark.parametrize("name", METHODS)
def test_every_method_merges_text_models(text_run, name):
    raw, layout = text_run
    raw = json.loads(json.dumps(raw))
    raw["merge"]["methods"] = [name]
    # one setting: the paper's, its optimisation (AdaMerging's, Surgery's, WUDI's, ...) cut to a few steps (and
    # gossip's rounds)
    raw["merge"][name] = {k: min(v, 3) if k in ("steps", "rounds") else v for k, v in REGISTRY[name].defaults.items()}
    params = parse_params(raw)
    if name in VIT_BLOCKS:
        with pytest.raises(MergeflowError, match=VIT_BLOCKS[name]):
            merge(params, name, layout)
        return
    merge(params, name, layout)
    evaluated = json.loads(layout.metrics("evaluate", name).read_text())
    average = evaluated["average"]["target"] if evaluated["kind"] == "negation" else evaluated["average"]
    assert -1.0 <= average <= 1.0 and math.isfinite(average), name


# ---------------------------------------------------------------- the text-to-text suite (T5-style)
TINY_T2T = {
    "suite": {
        "tasks": ["sentiment", "inference", "entailment"],
        "n_train": 48,
        "n_val": 16,
        "n_test": 16,
        "pretrain_images": 256,
    },
    "backbone": {
        "kwargs": {"d_model": 16, "d_kv": 8, "d_ff": 32, "num_layers": 2, "num_decoder_layers": 1, "num_heads": 2}
    },
    "pretrain": {"steps": 6, "batch_size": 32, "warmup_steps": 1},
    "finetune": {"steps": 4, "batch_size": 16, "warmup_steps": 1},
    "statistics": {"examples": 8},
    "studies": {
        "run": ["ctl"],
        "ctl": {"examples": 8, "pairs": 2, "average_sizes": [3], "scratch_steps": 2, "stitch_examples": 8},
    },
    "runtime": {"threads": 1},
}
T2T_METHODS = ["task_arithmetic", "ties", "cart", "fisher", "regmean", "adamerging"]


@pytest.fixture(scope="module")
def t2t_run(tmp_path_factory):
    raw = _tiny(yaml.safe_load((REPO / "profiles" / "t2t7.yaml").read_text()), TINY_T2T)
    raw["merge"]["adamerging"] = {"steps": 3, "lr": 0.005}
    params = parse_params(raw)
    return params, _run_to_statistics(params, Layout(tmp_path_factory.mktemp("t2t-run")))


def test_a_text_to_text_model_is_scored_by_its_answer_words(t2t_run):
    """theta0's score under the verbalizer, recomputed with transformers' own model on the padded batch: the
    answer among the task's words with the largest first-token logit."""
    import torch
    from transformers import T5ForConditionalGeneration

    from mergeflow.core.io import load_state_dict
    from mergeflow.ml.data import load_task
    from mergeflow.ml.models import new_backbone

    params, layout = t2t_run
    config = new_backbone(params.backbone).net.config
    ref = T5ForConditionalGeneration(config).eval()
    ref.load_state_dict(load_state_dict(layout.pretrained), strict=False)  # the tied aliases follow shared.weight
    ref.tie_weights()
    data = load_task(layout.task_data("sentiment"))
    ids = data.test.inputs.long()
    with torch.no_grad():
        logits = ref(
            input_ids=ids,
            attention_mask=(ids != config.pad_token_id).long(),
            decoder_input_ids=torch.full((len(ids), 1), config.decoder_start_token_id),
        ).logits[:, 0]
    expected = float((logits[:, data.answers].argmax(1) == data.test.labels).float().mean())
    record = json.loads(layout.metrics("finetune", "sentiment").read_text())
    assert record["probe"]["head"] == "verbalizer" and record["probe"]["test"] == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("name", T2T_METHODS)
def test_methods_merge_text_to_text_models(t2t_run, name):
    params, layout = t2t_run
    merge(params.model_copy(update={"merge": params.merge.model_copy(update={"methods": [name]})}), name, layout)
    average = json.loads(layout.metrics("evaluate", name).read_text())["average"]
    assert 0.0 <= average <= 1.0 and math.isfinite(average), name


def test_study_ctl_reads_the_encoders_and_decoders_features(t2t_run):
    from mergeflow.pipeline.merge import study

    params, layout = t2t_run
    merge(
        params.model_copy(update={"merge": params.merge.model_copy(update={"methods": ["task_arithmetic"]})}),
        "task_arithmetic",
        layout,
    )
    result = study(params, "ctl", layout)
    assert len(result["claims"]) == 8
    report = (layout.root / "studies" / "ctl" / "report.md").read_text()
    assert (
        "blocks 0–1 the encoder's, the mean of the real tokens; blocks 2–2 the decoder's, at the first generated token"
        in report
    )
