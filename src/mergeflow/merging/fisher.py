"""Fisher merging: theta = sum_t F_t theta_t / sum_t F_t, per entry.

Matena & Raffel, "Merging models with Fisher-weighted averaging", NeurIPS 2022 (arXiv:2111.09832). F_t is the
diagonal Fisher of task t's fine-tuned model with its head, over n examples of its training split (the stage
``statistics``; mergeflow.statistics), floored at ``floor`` so that an entry no task's Fisher sees is averaged.
With theta_t = theta0 + tau_t this is theta0 + sum_t F_t tau_t / sum_t F_t: equal Fishers give weight averaging.
``labels``: "sampled" (y drawn from the model's predictive distribution, the paper's estimate) or "empirical" (the
true labels); both are searched on validation.
"""

from mergeflow.merging import Choice, Range, register


@register(
    "fisher",
    paper="Matena & Raffel 2022, Merging models with Fisher-weighted averaging (arXiv:2111.09832)",
    defaults={"labels": "sampled", "floor": 1e-6},
    grid={"labels": ["sampled", "empirical"]},
    ranges={"labels": Choice(("sampled", "empirical")), "floor": Range("a Fisher floor", 0, low_open=True)},
    reads="train_statistics",
)
def fisher(pretrained, task_vectors, *, data, labels, floor):
    import torch

    from mergeflow.merging._tensors import map_tensors

    fishers = [data.statistics[t][f"fisher_{labels}"] for t in task_vectors]

    def merge(key, theta0, taus):
        weights = torch.stack([f[key].to(taus.dtype) for f in fishers]).clamp_min(floor)
        return theta0 + (weights * taus).sum(0) / weights.sum(0)

    return map_tensors(pretrained, task_vectors, merge)
