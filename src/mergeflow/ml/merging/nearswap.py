"""NearSwap: take a fine-tuned model's weights where they are near the base model's, keep the base's elsewhere.

mergekit's ``nearswap`` (no paper; named for the QuartetAnemoi models merged at t = 0.0001). For the base theta0 and
one fine-tuned model theta_1 = theta0 + tau, per entry w = clamp(t / max(|tau|, 1e-6), 0, 1) and
nearswap(theta0, theta_1) = theta0 + w tau: entries that moved by less than t are taken whole, larger moves are
shrunk to t in magnitude. mergekit merges exactly one model into the base; for T tasks mergeflow averages the T
pairwise merges, theta = theta0 + mean_t w_t tau_t (for T = 1, mergekit's merge; t large, weight averaging).
"""

from __future__ import annotations

from mergeflow.ml.merging import Range, register

FLOOR = 1e-6  # mergekit's clamp of |tau|


@register(
    "nearswap",
    paper="mergekit's nearswap (QuartetAnemoi, 2024)",
    defaults={"t": 1e-4},
    grid={"t": [1e-4, 3e-4, 1e-3, 3e-3, 1e-2]},
    ranges={"t": Range("a distance", 0)},
)
def nearswap(pretrained, task_vectors, *, t):
    from mergeflow.ml.merging._tensors import map_tensors

    def merge(key, theta0, taus):
        weights = (t / taus.abs().clamp(min=FLOOR)).clamp(0, 1)
        return theta0 + (weights * taus).mean(0)

    return map_tensors(pretrained, task_vectors, merge)
