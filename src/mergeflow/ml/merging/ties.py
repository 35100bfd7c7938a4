"""TIES-merging: trim, elect sign, disjoint merge.

Yadav et al., "TIES-Merging: Resolving interference when merging models", NeurIPS 2023 (arXiv:2306.01708).
1. trim: keep the top-k fraction of |tau_t| in each task vector, zero the rest;
2. elect: gamma = sgn(sum_t trimmed tau_t) (the sign of the total mass);
3. disjoint mean: per entry, the mean of the trimmed entries whose sign equals gamma;
theta = theta0 + lam * that.

``trim_scope='global'`` (the original code) makes one cut per task over the whole flattened model; it needs a
first pass over the model, done one task vector at a time (peak: one task vector's magnitudes). ``'tensor'``
(mergekit, PEFT) cuts each tensor separately and streams like every element-wise method.

``rounding`` is how many of n entries "the top-k fraction" is (_rounding.top_k_count): ``'ties_original'``
(default, the authors' code: floor(k n) + 1), ``'floor'`` (PEFT and mergekit: floor(k n)) or ``'round'``
(mergeflow's earlier rule: round(k n), at least 1). Entries tied with the cut are all kept.
"""

from __future__ import annotations

from collections.abc import Mapping
from math import prod
from typing import TYPE_CHECKING

from mergeflow.ml.merging import ANY_NUMBER, POSITIVE_FRACTION, Choice, register
from mergeflow.ml.merging._rounding import TOP_K, top_k_count

if TYPE_CHECKING:
    import numpy as np
    import torch

LAMBDA_GRID = [round(0.8 + 0.1 * i, 2) for i in range(18)]  # 0.8, 0.9, ..., 2.5
TRIM_SCOPE = Choice(("global", "tensor"))
# the trim's hyperparameters, shared by the methods built on TIES' vector (consensus_ties, tall_ties: with ties_k)
TRIM_RANGES = {"trim_scope": TRIM_SCOPE, "rounding": TOP_K}


def cut_in_place(mags: np.ndarray, k: float, rounding: str):
    """The smallest of the top-k fraction of 1-D magnitudes ``mags`` (inf when it keeps none), exactly, reordering
    them in place: by introselect on their bit patterns (_tensors.partition_magnitudes), in linear time."""
    import numpy as np

    from mergeflow.ml.merging._tensors import partition_magnitudes

    count = top_k_count(mags.size, k, rounding)
    if count == 0:
        return mags.dtype.type(np.inf)
    i = mags.size - count
    partition_magnitudes(mags, i)
    return mags[i]


def magnitude_cut(values: np.ndarray, k: float, rounding: str):
    """cut_in_place of |values| (values unchanged; the magnitudes go to the thread's scratch buffer)."""
    from mergeflow.ml.merging._tensors import magnitudes_of

    return cut_in_place(magnitudes_of(values), k, rounding)


def topk_threshold(magnitudes: torch.Tensor, k: float, rounding: str) -> torch.Tensor:
    """magnitude_cut of a tensor's magnitudes (flattened), in their compute dtype."""
    import torch

    from mergeflow.ml.merging._tensors import compute_dtype

    flat = magnitudes.detach().to(compute_dtype(magnitudes.dtype)).reshape(-1).numpy()
    return torch.tensor(magnitude_cut(flat, k, rounding))


def global_thresholds(task_vectors: Mapping[str, Mapping[str, torch.Tensor]], k: float, rounding: str) -> list[float]:
    """Pass 1 of a global trim: each task's cut over its whole flattened vector, one task at a time (float64 when
    any tensor is)."""
    import numpy as np
    import torch

    from mergeflow.core.io import tensor_specs
    from mergeflow.ml.merging._tensors import compute_dtype, read_stack

    cuts = []
    for tv in task_vectors.values():
        specs = tensor_specs(tv)
        sizes = [prod(shape) for shape, _ in specs.values()]
        dtype = torch.float64 if any(compute_dtype(d) == torch.float64 for _, d in specs.values()) else torch.float32
        flat = torch.empty(sum(sizes), dtype=dtype)  # one task's vector, read tensor by tensor (no list, no cat)
        for piece, key in zip(flat.split(sizes), tv):
            read_stack([tv], key, piece.unsqueeze(0))
        mags = np.abs(flat.numpy(), out=flat.numpy())
        cuts.append(float(cut_in_place(mags, k, rounding)))
    return cuts


def trim_cuts(task_vectors, k: float, trim_scope: str, rounding: str):
    """map_stacked's prepare for a trim: task t's magnitude cut of a tensor (global cuts: computed once)."""
    if trim_scope == "global":
        cuts = global_thresholds(task_vectors, k, rounding)
        return lambda key, t, tau: cuts[t]
    return lambda key, t, tau: float(magnitude_cut(tau, k, rounding))


def cuts_array(cuts: list[float], dtype: np.dtype) -> np.ndarray:
    """The cuts in the taus' dtype. A cut that dtype cannot hold (a float64 global cut met by a float32 tensor) is
    rounded up, so |tau| >= cut keeps the same entries."""
    import numpy as np

    out = np.array(cuts, dtype)
    low = out < np.array(cuts, np.float64)
    out[low] = np.nextafter(out[low], dtype.type(np.inf))
    return out


def ties_vector(taus: tuple[np.ndarray, ...], cuts: list[float]) -> torch.Tensor:
    """The TIES-merged task vector (before scaling) of T flat tensors, trimming task t at |tau_t| >= cuts[t]."""
    from mergeflow.ml.merging._kernels import disjoint_mean
    from mergeflow.ml.merging._tensors import kernel_vector

    return kernel_vector(disjoint_mean, taus, cuts_array(cuts, taus[0].dtype))


@register(
    "ties",
    paper="Yadav et al. 2023, TIES-Merging (arXiv:2306.01708)",
    defaults={"k": 0.2, "trim_scope": "global", "rounding": "ties_original", "lam": 1.0},
    grid={"lam": LAMBDA_GRID},
    coefficient="lam",
    ranges={"k": POSITIVE_FRACTION, **TRIM_RANGES, "lam": ANY_NUMBER},
)
def ties(pretrained, task_vectors, *, k, trim_scope, rounding, lam):
    from mergeflow.ml.merging._tensors import map_stacked, plus_scaled

    return map_stacked(
        pretrained,
        task_vectors,
        lambda theta0, taus, cuts: plus_scaled(theta0, lam, ties_vector(taus, cuts)),
        prepare=trim_cuts(task_vectors, k, trim_scope, rounding),
    )
