"""How far a test score could move with another draw of test examples: the percentile bootstrap (Efron and
Tibshirani, An Introduction to the Bootstrap, 1993, ch. 13) over each task's test examples, from the predictions
the evaluations keep.

Every model is scored on the same resamples (one set of indices per task), so the difference of two models' scores
is a paired bootstrap: two merges that make mostly the same predictions get a narrow interval for their margin,
narrower than the two scores' own intervals would suggest. A task's score is recomputed from each resample with its
own metric (accuracy, Matthews correlation, accuracy and F1, Pearson and Spearman), and the average over tasks is
the summary's average."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mergeflow.ml.metrics import is_regression, score_predicted

RESAMPLES = 1000
LEVEL = 0.95  # the intervals' coverage


def resample_indices(sizes: Mapping[str, int], resamples: int = RESAMPLES, seed: int = 0) -> dict[str, torch.Tensor]:
    """Per task, ``resamples`` draws with replacement of its test examples' indices: [resamples, n]."""
    generator = torch.Generator().manual_seed(seed)
    return {task: torch.randint(0, n, (resamples, n), generator=generator) for task, n in sizes.items()}


def resampled_scores(metric: str, predicted: torch.Tensor, labels: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The task's score on each resample ([resamples] float64): accuracy from the examples right; the other
    classification metrics (GLUE's, of two or three classes) from each resample's confusion matrix, all resamples
    at once; regression's correlations from each resample in turn."""
    if is_regression(metric):
        return torch.tensor([score_predicted(metric, predicted[i], labels[i]) for i in indices], dtype=torch.float64)
    if metric == "accuracy":  # the share right on each resample; no confusion matrix (SUN397 has 397 classes)
        return (predicted == labels)[indices].double().mean(1)
    resamples = len(indices)
    classes = int(max(predicted.max(), labels.max())) + 1
    cell = (
        labels.long()[indices] * classes
        + predicted.long()[indices]
        + (torch.arange(resamples) * classes * classes)[:, None]
    )
    confusion = (
        torch.bincount(cell.flatten(), minlength=resamples * classes * classes)
        .view(resamples, classes, classes)
        .double()
    )
    n = confusion.sum((1, 2))
    correct = confusion.diagonal(dim1=1, dim2=2).sum(1)
    accuracy = correct / n
    if metric == "matthews":  # Gorodkin's form, as mergeflow.ml.metrics: 0 when either side is constant
        t, p = confusion.sum(2), confusion.sum(1)  # true and predicted counts per class
        denominator = ((n * n - (p * p).sum(1)) * (n * n - (t * t).sum(1))).sqrt()
        return torch.where(
            denominator > 0, (correct * n - (t * p).sum(1)) / denominator.clamp_min(1e-300), torch.zeros_like(n)
        )
    if metric == "accuracy_f1":
        true_positive = confusion[:, 1, 1] if classes > 1 else torch.zeros_like(n)
        both = (confusion[:, :, 1].sum(1) + confusion[:, 1, :].sum(1)) if classes > 1 else torch.zeros_like(n)
        f1 = torch.where(both > 0, 2 * true_positive / both.clamp_min(1), torch.zeros_like(n))
        return (accuracy + f1) / 2
    raise ValueError(f"metric '{metric}' has no bootstrap")


def resampled_averages(
    predictions: Mapping[str, Mapping[str, torch.Tensor]],
    labels: Mapping[str, torch.Tensor],
    metrics: Mapping[str, str],
    indices: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Per model (``predictions``: model -> task -> its test predictions), its average over the tasks on each
    resample ([resamples] float64), every model on the same resamples."""
    out = {}
    for name, by_task in predictions.items():
        missing = [t for t in labels if t not in by_task]
        if missing:
            raise ValueError(f"{name}: no test predictions for task {missing[0]}")
        out[name] = torch.stack([resampled_scores(metrics[t], by_task[t], labels[t], indices[t]) for t in labels]).mean(
            0
        )
    return out


def interval(samples: torch.Tensor, level: float = LEVEL) -> tuple[float, float]:
    """The percentile interval of bootstrap ``samples`` at ``level``."""
    tail = (1 - level) / 2
    low, high = torch.quantile(samples.double(), torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    return low, high
