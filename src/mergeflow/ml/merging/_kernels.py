"""Compiled (numba) kernels of the element-wise methods: one pass over a tensor's T task vectors (``taus``: a
tuple of T flat arrays of one dtype, float32 or float64, which numba indexes ~3x faster than the rows of a [T, n]
array).

Each kernel walks the entries once and, for each, its T task values in task order, in registers, in the taus'
dtype: numba compiles one version per dtype, and the F0/F1 constants below (0, 1, +-1 and counts: exact in either)
widen to float64 in the float64 version. Per-task arrays passed beside the taus (cuts, lambdas) and scalars
(scale, keep_fraction) come in the taus' dtype, so a float32 merge is float32 arithmetic throughout. A
chain of torch/numpy ops over the stack instead makes a pass over memory per op (the benchmark of 2026-11-22: 2.7-9.4x
the time to read the inputs). Sums run in task order (torch's sum over a stack follows an order that depends on the
tensor's width), so a merge does not depend on how tensors are shaped or split.

Kernels are compiled on first use and cached beside this file (numba's cache): a process pays ~0.5 s to load
the cached kernels (measured: the first calls of the 9 kernel methods), not the ~6 s compile. The one-pass
kernels split their entries over numba's threads (as many as torch's, set by map_stacked; each entry is computed
alone, so the result does not depend on the thread count): on this 2-core machine that took 5-15% off the merges
in an interleaved A/B benchmark. They release the GIL, so the per-task kernels (DARE's drops) run on threads.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

kernel = njit(cache=True, nogil=True)
# the one-pass kernels run on the calling thread's numba threads (map_stacked sets them to torch's count); the
# per-task ones (drop_and_rescale) stay serial: map_stacked already runs them on threads, one task each
parallel_kernel = njit(cache=True, nogil=True, parallel=True)

F0 = np.float32(0)
F1 = np.float32(1)


@parallel_kernel
def add_scaled(base, scale, vector):
    """vector = base + scale * vector, in place."""
    for i in prange(vector.size):
        vector[i] = base[i] + scale * vector[i]


@kernel
def task_total(taus, i):
    """sum_t taus[t][i], summed in task order."""
    total = taus[0][i]
    for t in range(1, len(taus)):
        total += taus[t][i]
    return total


@parallel_kernel
def task_sum(taus, out):
    """out = sum_t taus[t], summed in task order."""
    for i in prange(out.size):
        out[i] = task_total(taus, i)


@parallel_kernel
def max_magnitude(taus, out):
    """out = the tau_t of largest magnitude, the first task on ties."""
    for i in prange(out.size):
        best = taus[0][i]
        top = abs(best)
        for t in range(1, len(taus)):
            value = taus[t][i]
            if abs(value) > top:
                top = abs(value)
                best = value
        out[i] = best


@kernel
def ties_entry(taus, cuts, i):
    """TIES' trim, sign election and disjoint mean of entry i: with trimmed tau_t = tau_t where |tau_t| >= cuts[t]
    (else 0), gamma = sgn(sum_t trimmed tau_t); gamma * (sum of the |trimmed tau_t| whose sign is gamma) / their
    count (0 where none)."""
    total = F0
    for t in range(len(taus)):
        value = taus[t][i]
        if abs(value) >= cuts[t]:
            total += value
    elected = F1 if total > F0 else (-F1 if total < F0 else F0)
    agreeing = F0
    count = F0
    for t in range(len(taus)):
        value = taus[t][i]
        aligned = value * elected
        if abs(value) >= cuts[t] and aligned > F0:
            agreeing += aligned
            count += F1
    return agreeing * elected / max(count, F1)


@parallel_kernel
def disjoint_mean(taus, cuts, out):
    """out = ties_entry of every entry."""
    for i in prange(out.size):
        out[i] = ties_entry(taus, cuts, i)


@kernel
def tall_holds(value, mtl, lam):
    """The TALL mask of one entry: |tau_t| >= lambda_t |tau_MTL - tau_t|."""
    return abs(value) >= abs(mtl - value) * lam


@parallel_kernel
def tall_masks(taus, mtl, lambdas, masks):
    """TALL masks: masks[t][i] = tall_holds(tau_t[i], mtl[i], lambdas[t])."""
    for t in range(len(taus)):
        tau, mask, lam = taus[t], masks[t], lambdas[t]
        for i in prange(mtl.size):
            mask[i] = tall_holds(tau[i], mtl[i], lam)


@kernel
def consensus_entry(taus, mtl, lambdas, min_tasks, i):
    """Entry i of the consensus vector: mtl (tau_MTL's entry i) where at least min_tasks TALL masks hold, else
    0 * mtl."""
    votes = 0
    for t in range(len(taus)):
        votes += tall_holds(taus[t][i], mtl, lambdas[t])
    return mtl if votes >= min_tasks else mtl * F0


@parallel_kernel
def consensus_of_sum(taus, lambdas, min_tasks, out):
    """Consensus TA: consensus_entry with tau_MTL = the task sum, computed on the fly (one pass, no tau_MTL array)."""
    for i in prange(out.size):
        out[i] = consensus_entry(taus, task_total(taus, i), lambdas, min_tasks, i)


@parallel_kernel
def consensus_of_ties(taus, cuts, lambdas, min_tasks, out):
    """Consensus TIES: consensus_entry with tau_MTL = ties_entry, computed on the fly."""
    for i in prange(out.size):
        out[i] = consensus_entry(taus, ties_entry(taus, cuts, i), lambdas, min_tasks, i)


@parallel_kernel
def banded_sum(taus, uppers, lowers, out):
    """Model Breadcrumbs: out = sum_t tau_t * (lowers[t, r] < |tau_t| <= uppers[t, r]), rows r of tau_t
    reshaped [rows, n / rows] (one row: cuts over the whole tensor)."""
    rows = uppers.shape[1]
    width = out.size // rows
    for r in prange(rows):
        for i in range(r * width, (r + 1) * width):
            total = F0
            for t in range(len(taus)):
                value = taus[t][i]
                kept = (lowers[t, r] < abs(value)) & (abs(value) <= uppers[t, r])  # branch-free: kept is unpredictable
                total = value * np.float32(kept) if t == 0 else total + value * np.float32(kept)
            out[i] = total


@kernel
def drop_and_rescale(tau, stream, word_cut, keep_fraction):
    """DARE, in place on one task's flat tensor: tau_i = tau_i * (word_i >= word_cut) / keep_fraction, with
    word_i = fmix32(stream + i * 0x9E3779B9) (murmur3's finalizer over a Weyl sequence, as SplitMix does): a
    counter-based generator, so entry i's word needs no state and no stored random array."""
    for i in range(tau.size):
        word = (stream + i * 0x9E3779B9) & 0xFFFFFFFF
        word ^= word >> 16
        word = (word * 0x85EBCA6B) & 0xFFFFFFFF
        word ^= word >> 13
        word = (word * 0xC2B2AE35) & 0xFFFFFFFF
        word ^= word >> 16
        kept = F1 if word >= word_cut else F0
        tau[i] = tau[i] * kept / keep_fraction
