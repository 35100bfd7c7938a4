"""GLUE's metrics (mergeflow.ml.metrics) against scikit-learn's and scipy's, and against counts worked by hand."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import f1_score, matthews_corrcoef

from mergeflow.ml import metrics


def _logits(predicted: list[int], classes: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(predicted), classes).float()


def test_matthews_by_hand():
    # TP = 2, TN = 1, FP = 1, FN = 1: (2*1 - 1*1) / sqrt(3*3*2*2) = 1/6
    labels, predicted = [1, 1, 1, 0, 0], [1, 1, 0, 1, 0]
    assert metrics.score("matthews", _logits(predicted, 2), torch.tensor(labels)) == pytest.approx(1 / 6)


def test_matthews_against_scikit_learn_and_constant_prediction():
    g = torch.Generator().manual_seed(0)
    for classes in (2, 3):
        labels = torch.randint(0, classes, (200,), generator=g)
        predicted = torch.where(
            torch.rand(200, generator=g) < 0.7, labels, torch.randint(0, classes, (200,), generator=g)
        )
        assert metrics.score("matthews", _logits(predicted.tolist(), classes), labels) == pytest.approx(
            matthews_corrcoef(labels, predicted)
        )
    assert metrics.score("matthews", _logits([1] * 5, 2), torch.tensor([0, 1, 0, 1, 1])) == 0.0


def test_accuracy_f1_is_their_mean():
    labels, predicted = torch.tensor([1, 0, 1, 1, 0, 0]), [1, 1, 0, 1, 0, 0]
    accuracy = 4 / 6
    f1 = f1_score(labels, predicted)  # TP 2, FP 1, FN 1: 2/3
    assert f1 == pytest.approx(2 / 3)
    assert metrics.score("accuracy_f1", _logits(predicted, 2), labels) == pytest.approx((accuracy + f1) / 2)
    assert metrics.score("accuracy", _logits(predicted, 2), labels) == pytest.approx(accuracy)


def test_pearson_spearman_against_scipy_with_ties():
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 6, (100,), generator=g).float()  # many ties, as STS-B's half-point scores have
    outputs = (labels + torch.randn(100, generator=g)).round().unsqueeze(1)
    expected = (pearsonr(outputs[:, 0], labels).statistic + spearmanr(outputs[:, 0], labels).statistic) / 2
    assert metrics.score("pearson_spearman", outputs, labels) == pytest.approx(expected)
    assert metrics.score("pearson_spearman", torch.ones(5, 1), torch.arange(5.0)) == 0.0


def test_losses_by_kind():
    outputs, scores = torch.tensor([[1.0], [3.0]]), torch.tensor([2.0, 2.0])
    assert float(metrics.task_loss(outputs, scores)) == pytest.approx(1.0)  # float scores: squared error
    assert float(metrics.task_loss(outputs, scores, reduction="sum")) == pytest.approx(2.0)
    logits, labels = torch.tensor([[0.0, 0.0]]), torch.tensor([1])
    assert float(metrics.task_loss(logits, labels)) == pytest.approx(torch.log(torch.tensor(2.0)).item())
