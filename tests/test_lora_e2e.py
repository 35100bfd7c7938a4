"""LoRA end to end on the tiny profile: `mergeflow repro` with the lora regime and study added to the shared tiny
run. Each task vector is stored as its factors (smaller than a full one), reads back as a dense vector of rank at
most r on the adapted weights and zero elsewhere, every method of regimes.methods.lora merges it, and study@lora
gives each claim a verdict from those numbers. Also the study's claims on hand-chosen numbers."""

import pytest
import torch

from mergeflow.params import apply_overrides
from mergeflow.core.io import LazyStateDict
from mergeflow.core.files import read_json
from mergeflow.ml.lora import is_adapter
from mergeflow.studies.lora import LoraSettings, Point, _alignments, claim_alignment, claim_knots, claim_loss
from mergeflow.ml.task_vectors import read_task_vector

from .conftest import copy_project, run
from .profiles import TINY

TASKS = TINY["suite"]["tasks"]


@pytest.mark.e2e
def test_lora_regime_merges_and_study(tiny_reference, tiny_env, tmp_path):
    root = copy_project(tiny_reference[0], tmp_path / "lora")
    apply_overrides(
        root / "params.yaml",
        [
            "regimes.run=[one_epoch,mima,lora]",
            "regimes.lora.ranks=[1,2]",
            "regimes.methods.lora=[task_arithmetic,ties,knots]",
            "studies.run=[lora]",
        ],
    )
    run("git commit -qam lora", root, tiny_env)
    run("mergeflow repro", root, tiny_env)

    metrics = read_json(root / "metrics/regime/lora.json")
    pretrained = LazyStateDict(root / "models/pretrained.safetensors")
    for rank in (1, 2):
        variant = f"lora_rank{rank}"
        storage = metrics["variants"][variant]["storage_bytes"]
        assert 0 < storage["task_vector"] < storage["full_task_vector"] / 3
        for t in TASKS:
            path = root / f"regimes/lora/{variant}/vectors/{t}.safetensors"
            assert is_adapter(path)
            tv = read_task_vector(path, pretrained)
            assert tv.keys() == pretrained.keys() and len(tv.adapted) == 4  # qkv, proj, fc1, fc2 of the one block
            for key in tv:
                if key in tv.adapted:
                    assert 0 < torch.linalg.matrix_rank(tv[key]) <= rank, key
                else:
                    assert not tv[key].any(), key
        for method in ("task_arithmetic", "ties", "knots"):
            evaluation = read_json(root / f"metrics/regime_merge/lora/{variant}/evaluate/{method}.json")
            assert set(evaluation["accuracy"]) == set(TASKS)
    study = read_json(root / "metrics/studies/lora.json")
    verdicts = {c["id"]: c["verdict"] for c in study["claims"]}
    assert set(verdicts) == {"knots.1", "knots.2", "knots.3"} and "not measured" not in verdicts.values()
    assert (root / "studies/lora/lora_by_rank.png").stat().st_size > 10_000
    assert "| LoRA r = 2 |" in (root / "studies/lora/report.md").read_text()


def test_alignment_of_shared_and_orthogonal_subspaces():
    u = torch.eye(4, dtype=torch.float64)
    same = {
        "a": {"w": torch.outer(u[0], torch.ones(3, dtype=torch.float64))},
        "b": {"w": 2 * torch.outer(u[0], torch.arange(3.0, dtype=torch.float64))},
    }
    assert _alignments(same, ["w"], 1)[0] == pytest.approx(1.0)
    apart = {
        "a": {"w": torch.outer(u[0], torch.ones(3, dtype=torch.float64))},
        "b": {"w": torch.outer(u[1], torch.ones(3, dtype=torch.float64))},
    }
    assert _alignments(apart, ["w"], 1)[0] == pytest.approx(0.0)
    # rank 2 against rank 2 sharing one of two directions: |U_a^T
    # U_b|_F^2 / 2 = 1/2; the energy in the top 2 is all of it
    a = torch.outer(u[0], torch.tensor([1.0, 0, 0], dtype=torch.float64)) + torch.outer(
        u[1], torch.tensor([0, 1.0, 0], dtype=torch.float64)
    )
    b = torch.outer(u[0], torch.tensor([1.0, 0, 0], dtype=torch.float64)) + torch.outer(
        u[2], torch.tensor([0, 0, 1.0], dtype=torch.float64)
    )
    assert _alignments({"a": {"w": a}, "b": {"w": b}}, ["w"], 2) == (pytest.approx(0.5), pytest.approx(1.0))


def test_claims_follow_the_numbers():
    s = LoraSettings()
    p4 = Point(
        4, alignment=0.10, full_alignment=0.30, normalized={"task_arithmetic": 70.0, "ties": 72.0, "knots": 75.0}
    )
    p16 = Point(
        16, alignment=0.20, full_alignment=0.25, normalized={"task_arithmetic": 74.0, "ties": 73.0, "knots": 73.5}
    )
    full = Point(None, normalized={"task_arithmetic": 80.0, "ties": 81.0})
    assert claim_alignment([p4, p16], s).holds is True
    assert (
        claim_alignment([p4, p16], LoraSettings(alignment_margin=0.1)).holds is False
    )  # r = 16: 0.20 is not below 0.25 - 0.1
    assert claim_knots([p4], s).holds is True and claim_knots([p4, p16], s).holds is False  # r = 16: 73.5 < 74.0
    assert claim_loss([p4, p16], full, s).holds is True
    assert claim_loss([p4, p16], Point(None, normalized={"task_arithmetic": 73.0, "ties": 81.0}), s).holds is False
    assert claim_knots([Point(4, normalized={"task_arithmetic": 1.0})], s).holds is None
    assert claim_loss([p4], Point(None), s).verdict == "not measured"
