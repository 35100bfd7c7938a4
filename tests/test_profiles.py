"""profiles/*.yaml: complete params files for the papers' benchmark, each valid, each giving DVC every parameter
dvc.yaml lists (DVC refuses a missing one), and in step with params.yaml (same sections and merge methods)."""

from pathlib import Path

import pytest
import yaml

from mergeflow.params import load_params
from mergeflow.ml.data.benchmark import SUITES

PROFILES = sorted(Path(__file__).resolve().parents[1].joinpath("profiles").glob("*.yaml"))


def _lookup(raw: dict, dotted: str):
    node = raw
    for part in dotted.split("."):
        assert isinstance(node, dict) and part in node, f"lacks {dotted}, which dvc.yaml lists"
        node = node[part]
    return node


def _dvc_params(repo_root, raw: dict) -> set[str]:
    """Every parameter dvc.yaml lists, a foreach stage's once per item of ``raw`` (a params file)."""
    stages = yaml.safe_load((repo_root / "dvc.yaml").read_text())["stages"]
    keys = set()
    for stage in stages.values():
        items = _lookup(raw, stage["foreach"][2:-1]) if "foreach" in stage else [None]
        for entry in stage.get("do", stage).get("params", []):
            for key in set(entry) if isinstance(entry, dict) else {entry}:
                keys |= {key.replace("${item}", str(item)) for item in items}
    return keys


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.stem)
def test_profile_is_complete_and_in_step_with_params_yaml(repo_root, path):
    params = load_params(path)
    raw, default = yaml.safe_load(path.read_text()), yaml.safe_load((repo_root / "params.yaml").read_text())
    for key in _dvc_params(repo_root, raw):
        _lookup(raw, key)
    assert list(raw) == list(default) and params.suite.name == path.stem
    if params.suite.source == "glue":
        from mergeflow.ml.data.glue import GLUE

        assert params.suite.tasks == list(GLUE) and params.backbone.pretrained == "hub" and params.finetune.train_head
        return
    if params.suite.modality == "text":
        from mergeflow.ml.data.text import special_ids
        from mergeflow.ml.data.text_suite import TASKS

        kwargs = params.backbone.kwargs
        if params.suite.source == "text2text":  # the classification tasks, written T5's way; pad is the decoder's start
            ids = special_ids(text2text=True)
            assert (
                params.suite.tasks == [t for t, spec in TASKS.items() if spec.kind == "classification"]
                and kwargs["vocab_size"] == ids["vocab_size"]
            )
            assert (kwargs["pad_token_id"], kwargs["decoder_start_token_id"], kwargs["eos_token_id"]) == (
                ids["<pad>"],
                ids["<pad>"],
                ids["</s>"],
            )
            return
        ids = special_ids()
        assert params.suite.tasks == list(TASKS) and kwargs["vocab_size"] == ids["vocab_size"]
        assert (kwargs["bos_token_id"], kwargs["pad_token_id"], kwargs["eos_token_id"]) == (
            ids["<s>"],
            ids["<pad>"],
            ids["</s>"],
        )
        assert (
            kwargs["max_position_embeddings"] >= params.suite.seq_len + ids["<pad>"] + 1
        )  # RoBERTa's positions start after the pad id
        return
    assert raw["merge"]["methods"] == default["merge"]["methods"]
    suite = path.stem.split("_")[0]
    assert (
        params.suite.tasks == SUITES[suite]
        and params.finetune.head == "zeroshot"
        and params.backbone.embedding == "clip"
    )
