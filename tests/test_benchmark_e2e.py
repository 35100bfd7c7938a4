"""The papers' benchmark path, offline: profiles/ta8.yaml made tiny, through every stage function DVC's commands
call (prepare, pretrain, finetune@<task>, vectors, merge@<method>, report).

- the eight datasets are stand-ins written in each one's real on-disk layout (tests/standins.py);
- the backbone is CLIP ViT-B/32's image tower in the hub's architecture (timm's names and shapes, one block
  instead of twelve), random weights in a local file, as the hub's would be read;
- the zero-shot heads come from the real prompt templates through a random CLIP text tower (one narrow layer:
  the full one takes a minute on 2 cores for SUN397's 397 classes; tests/test_zeroshot.py covers the full one);
- MNIST is not fine-tuned but imported from a FusionBench-format checkpoint (Hugging Face's CLIPVisionModel,
  safetensors, without the projection).
"""

import pytest
import timm
import torch
import yaml
from safetensors.torch import save_file

from mergeflow.pipeline import stages
from mergeflow.params import parse_params
from mergeflow.ml.data import benchmark, load_task
from mergeflow.ml.evaluation import MIN_GAP
from mergeflow.report.summary import gap_cell
from mergeflow.core.io import load_state_dict
from mergeflow.core.files import read_json
from mergeflow.pipeline.stages import Layout
from .conftest import THREADS
from tests.standins import PER_CLASS, USED, write_standins

open_clip = pytest.importorskip("open_clip")
transformers = pytest.importorskip("transformers")

TA8 = benchmark.SUITES["ta8"]
# a data-free method of each family and one that learns on test inputs; at ViT-B widths the SVD methods and the
# statistics stage take half a minute each on 2 cores, and the embedded suite's end-to-end test runs them
METHODS = ["weight_averaging", "task_arithmetic", "ties", "adamerging"]


def _hub_architecture_weights(path):
    """CLIP ViT-B/32's image tower in timm's names and shapes (the hub's model.safetensors), one block deep."""
    net = timm.create_model(
        "vit_base_patch32_clip_quickgelu_224", pretrained=False, num_classes=512, global_pool="token", depth=1
    )
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path))


def _fusionbench_checkpoint(path):
    """A FusionBench-style fine-tune: transformers' CLIPVisionModel (no projection), ViT-B/32 widths, one layer."""
    config = transformers.CLIPVisionConfig(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=1,
        num_attention_heads=12,
        image_size=224,
        patch_size=32,
        hidden_act="quick_gelu",
    )
    torch.manual_seed(1)
    model = transformers.CLIPVisionModel(config)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return model


@pytest.fixture(scope="module")
def ta8_run(repo_root, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ta8")
    write_standins(tmp / "datasets", TA8)
    _hub_architecture_weights(tmp / "clip_b32.safetensors")
    _fusionbench_checkpoint(tmp / "mnist_finetuned.safetensors")
    raw = yaml.safe_load((repo_root / "profiles" / "ta8.yaml").read_text())
    raw["suite"] |= {"root": str(tmp / "datasets"), "n_train": 20, "n_val": 4, "n_test": 12}
    raw["backbone"] |= {"kwargs": {"depth": 1}, "pretrained": str(tmp / "clip_b32.safetensors"), "text": "random"}
    raw["finetune"] |= {
        "steps": 2,
        "batch_size": 8,
        "warmup_steps": 0,
        "lr": 1e-4,
        "checkpoints": {"MNIST": str(tmp / "mnist_finetuned.safetensors")},
    }
    raw["merge"] |= {
        "methods": METHODS,
        "task_arithmetic": {"lam": [0.3, 1.0]},
        "ties": {"k": 0.2, "lam": [1.0]},
        "adamerging": {"steps": 3, "batch_size": 4},
    }
    raw["runtime"] |= {"eval_batch_size": 64, "threads": THREADS}  # a worker's share of the cores under xdist
    params = parse_params(raw, "profiles/ta8.yaml (tiny)")
    layout = Layout(tmp / "repo")

    mp = pytest.MonkeyPatch()
    create = open_clip.create_model

    def narrow_text_tower(name, *args, **kwargs):
        text = dict(open_clip.get_model_config(name)["text_cfg"], width=64, heads=2, layers=1)
        return create(name, *args, text_cfg=text, **kwargs)

    mp.setattr(open_clip, "create_model", narrow_text_tower)
    try:
        stages.prepare(params, layout)
        stages.pretrain(params, layout)
        finetune = {t: stages.finetune(params, t, layout) for t in TA8}
        stages.vectors(params, layout)
        for m in METHODS:
            stages.merge(params, m, layout)
        report = stages.report(params, layout)
    finally:
        mp.undo()
    return params, layout, finetune, report


def test_every_dataset_arrives_with_its_real_class_names(ta8_run):
    params, layout, _, _ = ta8_run
    real = {"SUN397": 397, "Cars": 196, "RESISC45": 45, "EuroSAT": 10, "SVHN": 10, "GTSRB": 43, "MNIST": 10, "DTD": 47}
    for task in TA8:
        data = load_task(layout.task_data(task), params.suite.image_size)
        assert len(data.classes) == real[task] and data.classes == benchmark.class_names(task)
        assert data.train.inputs.shape[1:] == (224, 224, 3)
        # every stand-in image lands in one split (SUN397 and EuroSAT have no test split: a seeded one is made)
        total = len(USED[task]) * sum(PER_CLASS.values())
        sizes = [len(data.split(s).labels) for s in ("train", "val", "test")]
        assert sizes[1] == 4 and sizes[2] <= 12 and sum(sizes) <= total
        if benchmark.entry(task).test is not None:
            assert sizes[0] + sizes[1] == len(USED[task]) * PER_CLASS["train"]
        for split in ("train", "val", "test"):  # the labels index the real class list
            assert set(data.split(split).labels.tolist()) <= set(USED[task])


def test_heads_are_zero_shot_and_stay_frozen(ta8_run):
    params, layout, finetune, _ = ta8_run
    for task in TA8:
        head = load_state_dict(layout.head(task))
        # logit scale x unit rows (a random tower's scale is CLIP's init, 1/0.07), zero bias
        norms = head["weight"].norm(dim=1)
        torch.testing.assert_close(norms, torch.full_like(norms, 1 / 0.07), rtol=1e-4, atol=1e-4)
        assert head["weight"].shape == (len(benchmark.class_names(task)), 512) and not head["bias"].any()
        assert finetune[task]["probe"]["head"] == "zeroshot" and finetune[task]["probe"]["templates"] == len(
            benchmark.templates(task)
        )
    # fine-tuned backbones differ from theta0, except CLIP's projection bias, frozen at zero
    theta0 = load_state_dict(layout.pretrained)
    tuned = load_state_dict(layout.finetuned("DTD"))
    assert not torch.equal(tuned["blocks.0.attn.qkv.weight"], theta0["blocks.0.attn.qkv.weight"])
    assert not tuned["head.bias"].any() and finetune["DTD"]["steps"] == 2


def test_the_imported_fine_tune_is_the_published_one_with_theta0s_projection(ta8_run):
    params, layout, finetune, _ = ta8_run
    assert finetune["MNIST"]["steps"] == 0 and finetune["MNIST"]["imported"].endswith("mnist_finetuned.safetensors")
    # transformers 5 writes CLIPVisionModel's names without FusionBench's 'vision_model.' prefix: both are read
    published = {
        k.removeprefix("vision_model."): v for k, v in load_state_dict(params.finetune.checkpoints["MNIST"]).items()
    }
    imported, theta0 = load_state_dict(layout.finetuned("MNIST")), load_state_dict(layout.pretrained)
    q, k, v = (published[f"encoder.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(imported["blocks.0.attn.qkv.weight"], torch.cat([q, k, v]))
    assert torch.equal(imported["cls_token"].flatten(), published["embeddings.class_embedding"])
    # FusionBench's fine-tunes leave CLIP's projection as it was: its task vector is zero
    assert torch.equal(imported["head.weight"], theta0["head.weight"])
    assert torch.count_nonzero(load_state_dict(layout.vectors / "MNIST.safetensors")["head.weight"]) == 0


def test_every_method_lands_in_the_summary_under_the_suites_name(ta8_run):
    params, layout, finetune, report = ta8_run
    rows = {r["method"]: r for r in report["rows"]}
    assert read_json(layout.results / "summary.json")["rows"] == report["rows"]
    assert set(METHODS) <= set(rows)
    for method in METHODS:  # each row is its merge's own test evaluation, task by task
        evaluated = read_json(layout.metrics("evaluate", method))["accuracy"]
        assert {t: rows[method][t] for t in TA8} == evaluated
    # the gap is "n/a" exactly when the individual models do not beat the zero-shot heads by MIN_GAP
    probe = sum(finetune[t]["probe"]["test"] for t in TA8) / 8
    individual = sum(finetune[t]["individual"]["test"] for t in TA8) / 8
    assert (rows["task_arithmetic"]["gap_recovered"] is None) == (individual - probe < MIN_GAP)
    row = next(
        line for line in (layout.results / "summary.md").read_text().splitlines() if "| task_arithmetic |" in line
    )
    assert f"| {gap_cell(rows['task_arithmetic']['gap_recovered'])} |" in row
    from mergeflow.report.tracking import experiment_name

    assert experiment_name(params) == "mergeflow/ta8"
