"""PCB-merging: weigh each entry of each task vector by how it competes within its task and across tasks, keep
the strongest, and take the weighted mean; theta = theta0 + lam * that.

Du et al., "Parameter Competition Balancing for Model Merging", NeurIPS 2024 (arXiv:2410.02396). As the authors'
code (pcb-merging.py's PCB_merge, which FusionBench's pcb_merging follows), on the task vectors flattened into rows
tau_t of d entries (``scope: 'global'``; ``'tensor'`` does the same on each tensor alone):
1. outliers: |tau_t| clamped to its row's [floor(c d)-th, (floor((1 - c) d) - 1)-th] smallest values (c:
   ``clamp_ratio``), the signs kept: tau'_t;
2. intra-balancing: exp(T norm(|tau'_t|)^2), norm the row's min-max scaling (the paper's softmax over the row, whose
   denominator the last scaling cancels);
3. inter-balancing: tanh(tau_t * sum_s tau_s) (``inter: 'sum'``, the authors' and FusionBench's), or tanh(tau_t *
   sum_s sgn(tau_s) norm(|tau'_s|)) (``'normalized_sum'``, the authors' vision script);
4. beta_t = intra * inter; drop and rescale: beta_t raised to its row's floor((1 - r) d)-th smallest value, then
   min-max scaled: s_t is 0 below that cut and (beta - cut) / (max - cut) above (r: ``ratio``, kept);
5. the merged vector sum_t s_t tau'_t / max(sum_t s_t, 1e-12).
The authors scale every task vector by lambda = 1.2 (or search lambda_t by evolution strategies on validation);
here one lam, searched on validation with the kept ratio. A row that is constant (min = max) scales to zero.
The global scope holds the T flattened task vectors and their weights at once (about 3 times the task vectors).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mergeflow.ml.merging import ANY_NUMBER, POSITIVE_FRACTION, Choice, Range, register

if TYPE_CHECKING:
    import torch

PAPER = "Du et al. 2024, Parameter competition balancing for model merging (arXiv:2410.02396)"
LAMBDA_GRID = [0.8, 1.0, 1.2, 1.5, 2.0]


def _min_max(x: torch.Tensor) -> torch.Tensor:
    """Each row scaled to [0, 1] by its min and max; a constant row to 0."""
    from mergeflow.ml.merging._tensors import divide_or_zero

    low = x.min(dim=1, keepdim=True).values
    high = x.max(dim=1, keepdim=True).values
    return divide_or_zero(x - low, (high - low).expand_as(x))


def _clamp_rows(x: torch.Tensor, low_ratio: float, high_ratio: float) -> torch.Tensor:
    """The authors' clamp: each row to [its int(d low)-th, its (int(d (1 - high)) - 1)-th smallest value]."""
    import torch

    d = x.shape[1]
    low = torch.kthvalue(x, int(d * low_ratio) + 1, dim=1, keepdim=True).values
    high = torch.kthvalue(x, max(int(d * (1 - high_ratio) - 1), 0) + 1, dim=1, keepdim=True).values
    return torch.clamp(x, low, high)


def pcb_vector(rows: torch.Tensor, ratio: float, clamp_ratio: float, inter: str) -> torch.Tensor:
    """The merged vector of task vectors ``rows`` [T, d] (steps 1-5 of the module's docstring)."""
    import torch

    n = rows.shape[0]
    magnitudes = _clamp_rows(rows.abs(), clamp_ratio, clamp_ratio)
    clamped = torch.sign(rows) * magnitudes
    scaled = _min_max(magnitudes)
    total = rows.sum(dim=0) if inter == "sum" else (torch.sign(rows) * scaled).sum(dim=0)
    beta = torch.exp(n * scaled**2) * torch.tanh(rows * total)
    weights = _min_max(_clamp_rows(beta, 1 - ratio, 0.0))
    return (clamped * weights).sum(dim=0) / weights.sum(dim=0).clamp(min=1e-12)


@register(
    "pcb",
    paper=PAPER,
    defaults={"ratio": 0.1, "clamp_ratio": 1e-4, "inter": "sum", "scope": "global", "lam": 1.2},
    grid={"ratio": [0.05, 0.1, 0.2], "lam": LAMBDA_GRID},
    coefficient="lam",
    ranges={
        "ratio": POSITIVE_FRACTION,
        "clamp_ratio": Range("an outlier share", 0, 0.5, high_open=True),
        "inter": Choice(("sum", "normalized_sum")),
        "scope": Choice(("global", "tensor")),
        "lam": ANY_NUMBER,
    },
)
def pcb(pretrained, task_vectors, *, ratio, clamp_ratio, inter, scope, lam):
    import torch

    from mergeflow.ml.merging._tensors import as_compute, map_tensors, stack

    if scope == "tensor":
        return map_tensors(
            pretrained,
            task_vectors,
            lambda key, theta0, taus: (
                theta0
                + lam * pcb_vector(taus.reshape(taus.shape[0], -1), ratio, clamp_ratio, inter).reshape(theta0.shape)
            ),
        )
    keys = list(pretrained)
    pieces = [stack(task_vectors, key) for key in keys]
    dtype = torch.float64 if any(p.dtype == torch.float64 for p in pieces) else torch.float32
    rows = torch.cat([p.reshape(p.shape[0], -1).to(dtype) for p in pieces], dim=1)
    del pieces
    merged = pcb_vector(rows, ratio, clamp_ratio, inter).split([pretrained[k].numel() for k in keys])
    out = {}
    for key, part in zip(keys, merged):
        theta0 = as_compute(pretrained[key])
        out[key] = (theta0 + lam * part.reshape(theta0.shape).to(theta0.dtype)).to(pretrained[key].dtype)
    return out
