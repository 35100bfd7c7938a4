"""KnOTS: align the tasks' updates in one SVD basis, merge their coefficients there; theta = theta0 + U merged.

Stoica et al., "Model merging with SVD to tie the KnOTS", ICLR 2025 (arXiv:2410.19735). Per weight matrix the
task updates are concatenated column-wise and decomposed once, [tau_1 | ... | tau_T] = U S [V_1^T | ... | V_T^T]
(thin SVD, its null directions dropped), so that tau_t = U (S V_t^T): each task's update becomes coefficients
c_t = S V_t^T in the shared basis U. The c_t are merged by ``base``: ``ties`` (KnOTS-TIES, the paper's main
method: one top-k trim per task over all its coefficients, elected sign, disjoint mean, times lam) or ``ta``
(lam sum_t c_t, which is task arithmetic itself: U U^T tau_t = tau_t); the merged update is U times them.
Tensors that are not matrices (biases, norms, embeddings) are merged by ``base`` directly (the authors' option
``merge_other_params``); for LoRA task vectors they are zero. Written for LoRA task vectors (rank T r at most per
matrix); on full ones the coefficients are as large as the task vectors, all held in memory.

The authors' code keeps singular values above an absolute 1e-5 (in float64); here those above 16 eps s_max,
which does not depend on the vectors' scale: the null directions of a rank-deficient concatenation (T r < m for LoRA
task vectors) are dropped, every weak real one kept. Defaults: their ViT-B/32 rank-16 setting
(top-k 20%, coefficient 0.6).
"""

from __future__ import annotations

from mergeflow.ml.merging import ANY_NUMBER, POSITIVE_FRACTION, Choice, register
from mergeflow.ml.merging.ties import TRIM_RANGES, ties

BASE = Choice(("ties", "ta"))


def aligned(key, taus):
    """(U [m, k], [c_t [k, n] for each task]) of one matrix's stacked updates ``taus`` [T, m, n]; None when they
    are all zero."""
    import torch

    from mergeflow.ml.merging._tensors import svd

    n = taus.shape[2]
    u, s, vh = svd(torch.cat(list(taus), dim=1))
    if s.numel() == 0 or float(s[0]) == 0.0:
        return None
    keep = s > s[0] * 16 * torch.finfo(s.dtype).eps  # above rounding: a weak direction is kept, a null one dropped
    u, coefficients = u[:, keep], s[keep, None] * vh[keep]
    return u.to(taus.device), list(coefficients.to(taus.device).split(n, dim=1))


@register(
    "knots",
    paper="Stoica et al. 2025, Model merging with SVD to tie the KnOTS (ICLR 2025, arXiv:2410.19735)",
    defaults={"base": "ties", "k": 0.2, "trim_scope": "global", "rounding": "ties_original", "lam": 0.6},
    grid={"lam": [0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.5, 2.0, 2.5]},
    coefficient="lam",
    ranges={"base": BASE, "k": POSITIVE_FRACTION, **TRIM_RANGES, "lam": ANY_NUMBER},
)
def knots(pretrained, task_vectors, *, base, k, trim_scope, rounding, lam):
    import torch

    from mergeflow.ml.merging._tensors import as_compute, is_matrix, stack

    tasks = list(task_vectors)
    # the aligned matrices' coefficients and the other tensors are merged apart (as the authors' code does): a global
    # trim over the coefficients alone, not diluted by the zeros a LoRA task vector has everywhere else
    bases, coefficients, others = {}, {t: {} for t in tasks}, {t: {} for t in tasks}
    for key in pretrained:
        taus = stack(task_vectors, key)
        found = aligned(key, taus) if is_matrix(key, pretrained[key]) else None
        if found is None:
            for t, tau in zip(tasks, taus):
                others[t][key] = tau
        else:
            bases[key], blocks = found
            for t, block in zip(tasks, blocks):
                coefficients[t][key] = block.contiguous()

    def merge(parts):
        first = parts[tasks[0]]
        if not first:
            return {}
        if base == "ties":
            return ties(
                {key: torch.zeros_like(c) for key, c in first.items()},
                parts,
                k=k,
                trim_scope=trim_scope,
                rounding=rounding,
                lam=lam,
            )
        return {key: lam * torch.stack([parts[t][key] for t in tasks]).sum(0) for key in first}

    merged = merge(coefficients) | merge(others)
    out = {}
    for key, theta0 in pretrained.items():
        update = bases[key] @ merged[key] if key in bases else merged[key]
        out[key] = (as_compute(theta0) + update.to(as_compute(theta0).dtype)).to(theta0.dtype)
    return out
