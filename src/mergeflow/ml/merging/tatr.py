"""TATR, Task Arithmetic in Trust Region: task arithmetic on the entries where the task vectors do not conflict.

Sun et al., "Task Arithmetic in Trust Region: A Training-Free Model Merging Approach to Navigate Knowledge
Conflicts", ICLR 2025 (arXiv:2501.15065). Reference code read: FusionBench's
fusion_bench/method/trust_region/clip_task_arithmetic.py (TaskArithmeticWithTrustRegionForCLIP) and utils.py.

The conflict of entry k is Omega[k] = sum_{i != j} |g_i[k]| |tau_j[k]|, g_i a proxy of task i's gradient. This module
is the data-free variant (FusionBench's ``zero_shot=true``): g_i = tau_i, so Omega = sum_i |tau_i| (S - |tau_i|) with
S = sum_j |tau_j|. Over the whole flattened model (every key at once, as the reference flattens every trainable
tensor) the cut c is Omega's value at sorted position min(floor(q n), n - 1), q = ``quantile``; the trust region m
keeps the entries with Omega < c (``cut='strict'``, FusionBench's rule: entries tied with c are dropped too, even at
q = 1) or Omega <= c (``'inclusive'``: q = 1 keeps every entry, which is task arithmetic), and
theta = theta0 + lam sum_t m * tau_t (lam 0.3 and q 0.99: FusionBench's defaults).
Not ported: the gradient variant, g_i = the mean |per-example gradient| of theta0's loss on task i's training
examples (with a zero-shot head); the stage ``statistics`` computes Fisher diagonals of the fine-tuned models instead.
Peak memory: one model-sized vector of Omega beside the merge (the cut is exact, by introselect).
"""

from __future__ import annotations

from math import prod

from mergeflow.ml.merging import ANY_NUMBER, FRACTION, Choice, register
from mergeflow.ml.merging.task_arithmetic import LAMBDA_GRID

CUT = Choice(("strict", "inclusive"))


def conflict(taus):
    """Omega = sum_i |tau_i| (S - |tau_i|), S = sum_j |tau_j|, of a [T, ...] stack: sum over ordered pairs i != j of
    |tau_i| |tau_j|, as the reference's double loop (zero for one task)."""
    magnitudes = taus.abs()
    return (magnitudes * (magnitudes.sum(0) - magnitudes)).sum(0)


def checked_stack(task_vectors, key, shape):
    """The [T, *shape] stack of tensor ``key``; one line naming the task and key that lacks it or differs in shape."""
    import torch

    from mergeflow.ml.merging._tensors import as_compute

    for t, tv in task_vectors.items():
        if key not in tv:
            raise ValueError(f"tatr: task vector '{t}' has no tensor '{key}'")
        if tuple(tv[key].shape) != tuple(shape):
            raise ValueError(f"tatr: task vector '{t}' tensor '{key}' has shape {tuple(tv[key].shape)}, not {shape}")
    return torch.stack([as_compute(tv[key]) for tv in task_vectors.values()])


def conflict_cut(pretrained, task_vectors, quantile):
    """(c, dtype): Omega's value at sorted position min(floor(q n), n - 1) over every entry of the model, computed in
    float64 when any tensor computes in float64, else float32."""
    import torch

    from mergeflow.core.io import tensor_specs
    from mergeflow.ml.merging._tensors import compute_dtype, partition_magnitudes

    specs = tensor_specs(pretrained)
    sizes = [prod(shape) for shape, _ in specs.values()]
    dtype = torch.float64 if any(compute_dtype(d) == torch.float64 for _, d in specs.values()) else torch.float32
    flat = torch.empty(sum(sizes), dtype=dtype)
    for piece, (key, (shape, _)) in zip(flat.split(sizes), specs.items()):
        piece.copy_(conflict(checked_stack(task_vectors, key, shape)).reshape(-1))
    n = flat.numel()
    if n == 0:
        raise ValueError("tatr: the pretrained state dict has no entries")
    position = max(0, min(int(n * quantile), n - 1))
    values = flat.numpy()
    partition_magnitudes(values, position)  # Omega >= 0: its bit patterns order as its values
    return torch.tensor(values[position], dtype=dtype), dtype


@register(
    "tatr",
    paper="Sun et al. 2025, Task Arithmetic in Trust Region (arXiv:2501.15065)",
    defaults={"quantile": 0.99, "cut": "strict", "lam": 0.3},
    grid={"quantile": [0.9, 0.95, 0.99], "lam": LAMBDA_GRID},
    coefficient="lam",
    ranges={"quantile": FRACTION, "cut": CUT, "lam": ANY_NUMBER},
)
def tatr(pretrained, task_vectors, *, quantile, cut, lam):
    from mergeflow.ml.merging._tensors import map_tensors

    threshold, dtype = conflict_cut(pretrained, task_vectors, quantile)

    def merge(key, theta0, taus):
        omega = conflict(taus).to(dtype)  # the same arithmetic as the cut's pass, so the same values
        trusted = omega < threshold if cut == "strict" else omega <= threshold
        return theta0 + lam * (taus * trusted).sum(0)

    return map_tensors(pretrained, task_vectors, merge)
