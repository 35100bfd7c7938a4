"""A task's score and training loss, by its metric: what a head's outputs are measured with.

Image tasks are scored by accuracy. Text tasks carry GLUE's metric for the task they mirror (Wang et al., ICLR 2019,
arXiv:1804.07461): Matthews correlation (CoLA), accuracy (SST-2, MNLI, QNLI, RTE), the mean of accuracy and the F1
of class 1 (MRPC, QQP: GLUE's leaderboard averages the two it reports), and for the one regression task the mean of
the Pearson and Spearman correlations of the predicted and true scores (STS-B). A regression head has one output;
its loss is the squared error, every other head's the cross-entropy. Every score is in [-1, 1], a fraction where the
metric is one (accuracy, F1), so that the summary's averages and normalised scores read as for images.

Importing this module loads no torch: the task files' checks and ``mergeflow check`` read METRICS.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

METRICS = ("accuracy", "matthews", "accuracy_f1", "pearson_spearman")
REGRESSION = ("pearson_spearman",)


def is_regression(metric: str) -> bool:
    return metric in REGRESSION


def check_metric(metric: str, source: str) -> str:
    if metric not in METRICS:
        raise ValueError(f"{source}: metric '{metric}' is not one of {', '.join(METRICS)}")
    return metric


def task_loss(outputs: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """A batch's training loss: the squared error of a regression head's one output when the labels are scores
    (float: a regression task's, as its file holds them), else the cross-entropy of the class labels."""
    from torch import nn

    if labels.is_floating_point():
        return nn.functional.mse_loss(outputs.float()[:, 0], labels.float(), reduction=reduction)
    return nn.functional.cross_entropy(outputs.float(), labels, reduction=reduction)


def _pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denominator = float(x.norm() * y.norm())
    return (
        float((x * y).sum()) / denominator if denominator > 0 else 0.0
    )  # a constant prediction correlates with nothing


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks from 0, ties given their mean rank (as Spearman's coefficient defines them)."""
    import torch

    values, inverse, counts = torch.unique(x.double(), return_inverse=True, return_counts=True)
    first = torch.cumsum(counts, 0) - counts
    return (first + (counts - 1) / 2.0).double()[inverse]


def _matthews(predicted: torch.Tensor, labels: torch.Tensor) -> float:
    """Gorodkin's multi-class form, which for two classes is (TP TN - FP FN) / sqrt(...): 0 when either side is
    constant (GLUE's convention, scikit-learn's too)."""
    import torch

    classes = int(max(predicted.max(), labels.max())) + 1
    confusion = torch.zeros(classes, classes, dtype=torch.float64)
    confusion.index_put_(
        (labels.long(), predicted.long()), torch.ones(len(labels), dtype=torch.float64), accumulate=True
    )
    t, p = confusion.sum(1), confusion.sum(0)  # true and predicted counts per class
    n, correct = confusion.sum(), confusion.trace()
    denominator = float(((n * n - (p * p).sum()) * (n * n - (t * t).sum())).sqrt())
    return float(correct * n - (t * p).sum()) / denominator if denominator > 0 else 0.0


def _f1(predicted: torch.Tensor, labels: torch.Tensor) -> float:
    true_positive = float(((predicted == 1) & (labels == 1)).sum())
    predicted_positive, positive = float((predicted == 1).sum()), float((labels == 1).sum())
    return 2 * true_positive / (predicted_positive + positive) if predicted_positive + positive else 0.0


def predicted(metric: str, outputs: torch.Tensor) -> torch.Tensor:
    """What a head's ``outputs`` [N, C] predict: the class (argmax), or a regression head's score."""
    return outputs.float()[:, 0] if is_regression(metric) else outputs.argmax(1)


def score_predicted(metric: str, predictions: torch.Tensor, labels: torch.Tensor) -> float:
    """The metric of ``predictions`` (``predicted``'s) against ``labels`` [N]."""
    if is_regression(metric):
        return (_pearson(predictions, labels) + _pearson(_ranks(predictions), _ranks(labels))) / 2
    accuracy = float((predictions == labels).double().mean())
    if metric == "accuracy":
        return accuracy
    if metric == "matthews":
        return _matthews(predictions, labels)
    if metric == "accuracy_f1":
        return (accuracy + _f1(predictions, labels)) / 2
    raise ValueError(f"metric '{metric}' is not one of {', '.join(METRICS)}")


def score(metric: str, outputs: torch.Tensor, labels: torch.Tensor) -> float:
    """The metric of a head's ``outputs`` [N, C] (regression: [N, 1]) against ``labels`` [N]."""
    return score_predicted(metric, predicted(metric, outputs), labels)
