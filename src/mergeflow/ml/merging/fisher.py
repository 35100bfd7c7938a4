"""Fisher merging: theta = sum_t F_t theta_t / sum_t F_t, per entry.

Matena & Raffel, "Merging models with Fisher-weighted averaging", NeurIPS 2022 (arXiv:2111.09832). F_t is the
diagonal Fisher of task t's fine-tuned model with its head, over n examples of its training split (the stage
``statistics``; mergeflow.ml.statistics), floored at ``floor`` so that an entry no task's Fisher sees is averaged.
With theta_t = theta0 + tau_t this is theta0 + sum_t F_t tau_t / sum_t F_t: equal Fishers give weight averaging.
``labels``: "sampled" (y drawn from the model's predictive distribution, the paper's estimate) or "empirical" (the
true labels); both are searched on validation.

Where the reference codes differ (FusionBench's fisher_merging, after the authors' code): ``normalize``:
``'none'`` (the paper) or ``'global_norm'`` (their default: task t's Fisher weighted by c_t = (1 / (|F_t| + floor)) /
sum_s (1 / (|F_s| + floor)), |F_t| the L2 norm of its whole diagonal, so that no task dominates by scale);
``floor_rule``: ``'max'`` (max(F, floor), the paper's numerical guard) or ``'add'`` (F + floor, FusionBench's).
``weights``: per-model coefficients lambda_t (a mapping task -> weight, 1 for a task it does not name), which
multiply task t's Fisher: theta = theta0 + sum_t lambda_t F_t tau_t / sum_t lambda_t F_t, as FusionBench's
scaling coefficients and the paper's "merging with different weights" (section 2) do; all equal is the plain merge.
"""

from mergeflow.ml.merging import Choice, PerTask, Range, register


@register(
    "fisher",
    paper="Matena & Raffel 2022, Merging models with Fisher-weighted averaging (arXiv:2111.09832)",
    defaults={"labels": "sampled", "floor": 1e-6, "floor_rule": "max", "normalize": "none", "weights": {}},
    grid={"labels": ["sampled", "empirical"]},
    ranges={
        "labels": Choice(("sampled", "empirical")),
        "floor": Range("a Fisher floor", 0, low_open=True),
        "floor_rule": Choice(("max", "add")),
        "normalize": Choice(("none", "global_norm")),
        "weights": PerTask(Range("a model's weight", 0, low_open=True)),
    },
    reads="train_statistics",
)
def fisher(pretrained, task_vectors, *, data, labels, floor, floor_rule, normalize, weights):
    import torch

    from mergeflow.ml.merging._tensors import map_tensors

    if unknown := sorted(set(weights) - set(task_vectors)):
        raise ValueError(
            f"merge.fisher.weights: no task '{unknown[0]}' among the merged tasks ({', '.join(task_vectors)})"
        )
    fishers = [data.statistics[t][f"fisher_{labels}"] for t in task_vectors]
    scales = torch.ones(len(fishers), dtype=torch.float64)
    if normalize == "global_norm":
        norms = torch.tensor(
            [sum(float(f[k].double().pow(2).sum()) for k in pretrained) ** 0.5 for f in fishers], dtype=torch.float64
        )
        scales = 1 / (norms + floor)
        scales = scales / scales.sum()
    scales = scales * torch.tensor([float(weights.get(t, 1.0)) for t in task_vectors], dtype=torch.float64)

    def merge(key, theta0, taus):
        weights = torch.stack([f[key].to(taus.dtype) for f in fishers])
        weights = weights.clamp_min(floor) if floor_rule == "max" else weights + floor
        weights = weights * scales.to(taus.dtype).reshape((-1,) + (1,) * (weights.dim() - 1))
        return theta0 + (weights * taus).sum(0) / weights.sum(0)

    return map_tensors(pretrained, task_vectors, merge)
