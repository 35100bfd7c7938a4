"""Model Stock (Jang et al. 2024) against its formula on tiny tensors, and its paper's identities."""

import math

import pytest
import torch

from mergeflow.ml.merging import REGISTRY

MODEL_STOCK = REGISTRY["model_stock"]


def test_two_task_vectors_at_45_degrees_by_hand():
    """tau_a = (1, 0), tau_b = (1, 1): cos = 1/sqrt(2), t = 2 cos / (1 + cos), theta = theta0 + t (tau_a + tau_b)
    / 2."""
    theta0 = {"w": torch.tensor([[0.5, -1.0]])}
    taus = {"a": {"w": torch.tensor([[1.0, 0.0]])}, "b": {"w": torch.tensor([[1.0, 1.0]])}}
    cos = 1 / math.sqrt(2)
    t = 2 * cos / (1 + cos)
    expected = torch.tensor([[0.5 + t * 1.0, -1.0 + t * 0.5]])
    assert torch.allclose(MODEL_STOCK(theta0, taus)["w"], expected, atol=1e-6)


def test_three_task_vectors_take_the_mean_pairwise_cosine():
    e = torch.eye(3)
    taus = {"a": {"w": e[0] + e[1]}, "b": {"w": e[1] + e[2]}, "c": {"w": e[0] + e[2]}}  # every pair at cos 1/2
    t = 3 * 0.5 / (1 + 2 * 0.5)  # 0.75
    merged = MODEL_STOCK({"w": torch.zeros(3)}, taus)["w"]
    assert torch.allclose(merged, t * torch.full((3,), 2 / 3), atol=1e-6)


def test_identical_fine_tunes_give_that_model_and_orthogonal_ones_the_pretrained_model():
    """cos = 1 gives t = 1 (the average, here each model itself); cos = 0 gives t = 0 (theta0): the paper's two ends."""
    theta0 = {"w": torch.tensor([1.0, 2.0, 3.0])}
    same = {t: {"w": torch.tensor([0.3, -0.2, 0.1])} for t in "abc"}
    assert torch.allclose(MODEL_STOCK(theta0, same)["w"], theta0["w"] + same["a"]["w"], atol=1e-6)
    orthogonal = {"a": {"w": torch.tensor([1.0, 0.0, 0.0])}, "b": {"w": torch.tensor([0.0, 1.0, 0.0])}}
    assert torch.equal(MODEL_STOCK(theta0, orthogonal)["w"], theta0["w"])
    zero = {"a": {"w": torch.zeros(3)}, "b": {"w": torch.tensor([1.0, 0.0, 0.0])}}  # a zero task vector: cos 0
    assert torch.equal(MODEL_STOCK(theta0, zero)["w"], theta0["w"])


def test_filter_scope_gives_each_output_row_its_own_ratio():
    """Row 0: identical task vectors (t = 1); row 1: orthogonal ones (t = 0). Per tensor they share one ratio."""
    theta0 = {"w": torch.zeros(2, 2)}
    taus = {"a": {"w": torch.tensor([[1.0, 0.0], [1.0, 0.0]])}, "b": {"w": torch.tensor([[1.0, 0.0], [0.0, 1.0]])}}
    per_row = MODEL_STOCK(theta0, taus, scope="filter")["w"]
    assert torch.allclose(per_row, torch.tensor([[1.0, 0.0], [0.0, 0.0]]), atol=1e-6)
    cos = 1 / 2  # the whole tensors: <a, b> = 1, |a| = |b| = sqrt(2)
    t = 2 * cos / (1 + cos)
    assert torch.allclose(MODEL_STOCK(theta0, taus)["w"], t * torch.tensor([[1.0, 0.0], [0.5, 0.5]]), atol=1e-6)


def test_one_task_is_refused_in_one_line():
    with pytest.raises(ValueError, match="merge.model_stock: .* at least two tasks"):
        MODEL_STOCK({"w": torch.zeros(2)}, {"a": {"w": torch.ones(2)}})


def test_fusionbenchs_convention_averages_the_angles():
    """tau_a = (1, 0), tau_b = (0, 1), tau_c = (1, 1): angles 90, 45, 45 degrees. FusionBench: cos of their mean
    (60 degrees) = 1/2, t = 3/4; mergekit: the mean of the cosines (0 + 2/sqrt(2)) / 3."""
    theta0 = {"w": torch.zeros(2)}
    taus = {
        "a": {"w": torch.tensor([1.0, 0.0])},
        "b": {"w": torch.tensor([0.0, 1.0])},
        "c": {"w": torch.tensor([1.0, 1.0])},
    }
    mean_tau = torch.tensor([2 / 3, 2 / 3])
    assert torch.allclose(MODEL_STOCK(theta0, taus, average="angles")["w"], 0.75 * mean_tau, atol=1e-6)
    cos = math.sqrt(2) / 3
    assert torch.allclose(MODEL_STOCK(theta0, taus)["w"], 3 * cos / (1 + 2 * cos) * mean_tau, atol=1e-6)


def test_last_axis_scope_is_mergekits_filter_wise_on_a_3d_tensor():
    """A [2, 2, 2] tensor: mergekit's filter_wise takes the cosine along the last axis only, a ratio per [i, j];
    "filter" one per i over the flattened [2, 2]. [0, 0]: identical (t = 1); [0, 1]: orthogonal (t = 0)."""
    theta0 = {"w": torch.zeros(2, 2, 2)}
    a = torch.tensor([[[1.0, 0.0], [1.0, 0.0]], [[1.0, 1.0], [1.0, 1.0]]])
    b = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[1.0, 1.0], [1.0, 1.0]]])
    taus = {"a": {"w": a}, "b": {"w": b}}
    last = MODEL_STOCK(theta0, taus, scope="last_axis")["w"]
    assert torch.allclose(last, torch.tensor([[[1.0, 0.0], [0.0, 0.0]], [[1.0, 1.0], [1.0, 1.0]]]), atol=1e-6)
    # "filter", row 0: <a0, b0> = 1, |a0| = |b0| = sqrt(2): cos 1/2, t = 2/3; row 1: identical, t = 1
    per_row = MODEL_STOCK(theta0, taus, scope="filter")["w"]
    assert torch.allclose(per_row[0], (2 / 3) * (a[0] + b[0]) / 2, atol=1e-6) and torch.allclose(
        per_row[1], a[1], atol=1e-6
    )
