"""Arcee Fusion: take a fine-tuned model's change only where it is important, by a KL-weighted magnitude above a
dynamic threshold.

mergekit's ``arcee_fusion`` (mergekit/merge_methods/arcee_fusion.py; Arcee AI's MergeKit v0.1 release, 2025; no
paper). For the base theta0 and one fine-tuned model theta_1 = theta0 + tau, per tensor:
1. importance: s = |tau| * KL(p || q), with p = softmax(theta_1) + eps and q = softmax(theta0) + eps along the last
   axis (eps = 1e-8) and KL = sum p log(p / q) per row, so s_ij = |tau_ij| KL_i (a 1-D tensor is one row; a
   scalar's softmax is 1, its KL 0);
2. threshold: c = median(s) + 1.5 (q3(s) - q1(s)), each quantile q of the n entries the sorted s at index
   floor(q (n - 1)), as mergekit takes them;
3. fuse: theta0 + m tau, m = [s >= c].
A change that leaves every row's softmax unchanged (a constant shift per row) has KL 0 and scores 0 up to rounding;
where all the scores are equal the threshold equals them and all of tau is kept. Two identical models give theta0.

mergekit merges exactly two models (the base and one other) and refuses more. For T tasks mergeflow sums the T
masked task vectors, theta = theta0 + lam * sum_t m_t tau_t: at T = 1 and lam = 1 (the default) mergekit's merge,
at lam = 1/T the mean of the T pairwise merges. The masks keep the outliers of s (5.5% of the entries where s is
half-normal), so the sum adds mostly disjoint entries; lam is searched.
mergekit takes its quantiles from 1e6 entries drawn at random (unseeded) when a tensor has more; mergeflow's are
exact over every entry (mergekit's own for tensors of at most 1e6 entries), so a merge does not vary from run to run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mergeflow.ml.merging import ANY_NUMBER, register

if TYPE_CHECKING:
    import torch

EPS = 1e-8  # mergekit's, added to both softmaxes


def log_softmax_eps(rows: torch.Tensor) -> torch.Tensor:
    """log(softmax(rows) + eps) along the last axis."""
    import torch

    return torch.softmax(rows, dim=-1).add_(EPS).log_()


def importance(theta0: torch.Tensor, tau: torch.Tensor, log_q: torch.Tensor | None = None) -> torch.Tensor:
    """s = |tau| * KL(softmax(theta0 + tau) + eps || softmax(theta0) + eps), the KL taken per row (last axis);
    ``log_q``: log_softmax_eps of theta0's rows, computed once for every task."""
    import torch

    rows = theta0.reshape(theta0.shape or (1,))  # a scalar is a row of one entry
    tau_rows = tau.reshape(rows.shape)
    log_q = log_softmax_eps(rows) if log_q is None else log_q
    p = torch.softmax(rows + tau_rows, dim=-1).add_(EPS)
    kl = p.log().sub_(log_q).mul_(p).sum(-1, keepdim=True)  # sum p (log p - log q), in place: one temporary
    return tau_rows.abs().mul_(kl).reshape(tau.shape)


def dynamic_threshold(scores: torch.Tensor) -> torch.Tensor:
    """median + 1.5 IQR of ``scores``, each quantile q the sorted value at index floor(q (n - 1)) (mergekit's rule,
    exact: found by one linear-time partition)."""
    import numpy as np
    import torch

    flat = scores.reshape(-1).numpy()
    n = flat.size
    q1, median, q3 = (n - 1) // 4, (n - 1) // 2, 3 * (n - 1) // 4
    values = torch.from_numpy(np.partition(flat, [q1, median, q3])[[q1, median, q3]])
    return values[1] + 1.5 * (values[2] - values[0])


def fusion_mask(theta0: torch.Tensor, tau: torch.Tensor, log_q: torch.Tensor | None = None) -> torch.Tensor:
    """[*shape] bool: the entries of tau that Arcee Fusion takes (importance at or above the dynamic threshold)."""
    scores = importance(theta0, tau, log_q)
    return scores >= dynamic_threshold(scores)


@register(
    "arcee_fusion",
    paper="mergekit's arcee_fusion (Arcee AI, MergeKit v0.1, 2025)",
    defaults={"lam": 1.0},
    grid={"lam": [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0]},
    coefficient="lam",
    ranges={"lam": ANY_NUMBER},
)
def arcee_fusion(pretrained, task_vectors, *, lam):
    import torch

    from mergeflow.ml.merging._tensors import map_tensors

    def merge(key, theta0, taus):
        log_q = log_softmax_eps(theta0.reshape(theta0.shape or (1,)))
        kept = torch.zeros_like(theta0)
        for tau in taus:
            kept += torch.where(fusion_mask(theta0, tau, log_q), tau, 0.0)
        return theta0 + lam * kept

    return map_tensors(pretrained, task_vectors, merge)
