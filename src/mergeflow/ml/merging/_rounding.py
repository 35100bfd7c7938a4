"""How many entries a top-k trim keeps, and which ranks a magnitude band holds: the reference tools round k n
differently, and on short rows and 1-D tensors the choice moves the result. Each method's ``rounding``
hyperparameter picks one convention by name; its default is the method's own paper's code.

Top-k (TIES' trim: ``ties``, ``consensus_ties``, ``tall_ties``), n entries, keep fraction k:
    ties_original  min(n, floor(k n) + 1): TIES' own code (prateeky2806/ties-merging, topk_values_mask) takes the
                   kthvalue at d - int(d K) and keeps the entries >= it, one more than int(d K);
    floor          floor(k n): PEFT (merge_utils.magnitude_based_pruning) and mergekit (sparsify.magnitude) keep
                   int(density n) (0 keeps nothing, as in PEFT; mergekit refuses it);
    round          max(1, round(k n)), Python's round (half to even): mergeflow's earlier rule.
Band (Breadcrumbs: ``breadcrumbs``), n entries per row (or per tensor) ranked by |tau| from the largest, rank 0:
    floor          ranks [floor(gamma n), floor(gamma n) + floor(beta n)): the authors' code (rezazzr/breadcrumbs,
                   TaskVectorMiddleKeep zeroes the top int(n gamma), then keeps the top int(n beta) of the rest) and
                   mergekit (sparsify.magnitude_outliers, with n the whole tensor);
    round          ranks [round(gamma n), round((gamma + beta) n)): mergeflow's earlier rule.
floor is int(k * n) on Python floats, as those tools compute it, float noise included (int(0.29 * 100) = 28).
Not reproduced: mergekit's magnitude_outliers keeps nothing when int(gamma n) = 0 (its slice [n_bot:-0] is empty)
and returns the tensor whole when density >= 1, whatever gamma.

Entries tied in magnitude at a cut all fall on the same side of it, where topk/argsort in those tools break ties by
position; real-valued task vectors seldom tie.
"""

from __future__ import annotations

from mergeflow.ml.merging import Choice

TOP_K = Choice(("ties_original", "floor", "round"))
BAND = Choice(("floor", "round"))


def top_k_count(n: int, k: float, rounding: str) -> int:
    """How many of n entries a top-k fraction keeps under ``rounding`` (one of TOP_K)."""
    if rounding == "ties_original":
        count = int(n * k) + 1
    elif rounding == "floor":
        count = int(k * n)
    elif rounding == "round":
        count = max(1, round(k * n))
    else:
        raise ValueError(f"rounding: expected {TOP_K}, got {rounding!r}")
    return min(n, count)


def band_ranks(n: int, gamma: float, beta: float, rounding: str) -> tuple[int, int]:
    """(lo, hi): the band of ranks [lo, hi) (0 = the largest |tau|) that Breadcrumbs keeps of n entries."""
    if rounding == "floor":
        lo = int(n * gamma)
        hi = lo + int(n * beta)
    elif rounding == "round":
        lo, hi = round(gamma * n), round((gamma + beta) * n)
    else:
        raise ValueError(f"rounding: expected {BAND}, got {rounding!r}")
    return min(lo, n), min(hi, n)
