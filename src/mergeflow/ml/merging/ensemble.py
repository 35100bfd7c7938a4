"""The ensembles, FusionBench's baselines: every task's fine-tuned model kept and run, their features combined.

Not merges: the store holds the T fine-tuned models theta_t = theta0 + tau_t (storage T models) and every input runs
through each of them, so they are registered ``merged=False``: the report shows them as references beside Pretrained
and Individual and does not rank them among the merges. After FusionBench's fusion_bench/method/ensemble.py and
fusion_bench/models/wrappers/ensemble.py (EnsembleModule, WeightedEnsembleModule, MaxModelPredictor), whose ensembles
stand in for CLIP's vision model: what they combine is its pooled output, before the projection, the normalisation
and the zero-shot head. Here the members' net outputs are combined (what ``Backbone.embed`` reads: the pooled
features; a CLIP backbone's projected embedding), then embedded (CLIP's normalisation) and read by each task's head:

- ``simple_ensemble``: f(x) = (1/T) sum_t f_t(x);
- ``weighted_ensemble``: f(x) = sum_t w_t f_t(x), w_t from ``weights`` (a mapping task -> weight, 1 for a task it
  does not name), divided by their sum (``normalize`` "sum", FusionBench's normalize=True) or as given ("none"); a
  member of weight 0 is neither stored nor run;
- ``max_model_predictor``: f(x) = max_t f_t(x), entry by entry (FusionBench's MaxModelPredictor).

Features or logits: each task's head is affine, h(f) = W f + b, so with weights that sum to 1,
h(sum_t w_t f_t) = sum_t w_t h(f_t): on pooled features, averaging the features (what is done here) is averaging
the logits. It is not so where the average is normalised afterwards (a CLIP embedding: FusionBench's order), for
weights that do not sum to 1 (the head's bias counts once), nor for the max (a max of features is no max of logits).
The ensembles read no data and learn nothing; ``weighted_ensemble``'s weights are given, not searched.
"""

from mergeflow.ml.merging import Choice, PerTask, Range, register


def _members(pretrained, task_vectors, tasks):
    """base/<task>/<key>: each member's whole model, theta0 + tau_t in theta0's dtype."""
    from mergeflow.ml.merging._tensors import BASE_PREFIX, as_compute

    return {
        f"{BASE_PREFIX}{t}/{key}": (as_compute(theta0) + as_compute(task_vectors[t][key])).to(theta0.dtype)
        for t in tasks
        for key, theta0 in pretrained.items()
    }


def _ensemble(store, backbone, combine):
    """The members (copies of ``backbone`` holding each stored model) run side by side; ``combine``: [T, N, D] ->
    [N, D] on their net outputs, embedded as the backbone embeds its own."""
    import copy

    import torch
    from torch import nn

    from mergeflow.ml.merging._networks import prepared
    from mergeflow.ml.merging._tensors import BASE_PREFIX

    tasks = sorted({k.split("/")[1] for k in store if k.startswith(BASE_PREFIX)})
    members = []
    for t in tasks:
        member = copy.deepcopy(backbone)
        prefix = f"{BASE_PREFIX}{t}/"
        member.net.load_state_dict({k.removeprefix(prefix): v for k, v in store.items() if k.startswith(prefix)})
        members.append(member)

    class Ensemble(nn.Module):
        def __init__(self):
            super().__init__()
            self.members = nn.ModuleList(members)

        def forward(self, inputs):
            first = self.members[0]
            x = prepared(first, inputs)
            return first.embed(combine(torch.stack([member.net(x) for member in self.members])))

    return Ensemble()


def _weighted_network(store, backbone):
    weights = store["weights"]

    def weighted_sum(outputs):
        w = weights.to(device=outputs.device, dtype=outputs.dtype)
        return (w.view(-1, *[1] * (outputs.dim() - 1)) * outputs).sum(0)

    return _ensemble(store, backbone, weighted_sum)


def _max_network(store, backbone):
    return _ensemble(store, backbone, lambda outputs: outputs.amax(0))


PAPER = "FusionBench's ensemble baselines (Tang et al. 2024, FusionBench, arXiv:2406.03280)"


@register("simple_ensemble", paper=PAPER, kind="routed", network=_weighted_network, merged=False)
def simple_ensemble(pretrained, task_vectors):
    import torch

    tasks = sorted(task_vectors)
    weights = torch.full((len(tasks),), 1 / len(tasks), dtype=torch.float64)
    return _members(pretrained, task_vectors, tasks) | {"weights": weights}


@register(
    "weighted_ensemble",
    paper=PAPER,
    kind="routed",
    network=_weighted_network,
    merged=False,
    defaults={"weights": {}, "normalize": "sum"},
    ranges={"weights": PerTask(Range("a model's weight", 0)), "normalize": Choice(("sum", "none"))},
)
def weighted_ensemble(pretrained, task_vectors, *, weights, normalize):
    import torch

    if unknown := sorted(set(weights) - set(task_vectors)):
        tasks = ", ".join(task_vectors)
        raise ValueError(f"merge.weighted_ensemble.weights: no task '{unknown[0]}' among the merged tasks ({tasks})")
    given = {t: float(weights.get(t, 1.0)) for t in sorted(task_vectors)}
    kept = [t for t, w in given.items() if w != 0]
    if not kept:
        raise ValueError("merge.weighted_ensemble.weights: every weight is 0, so no model is left to run")
    total = sum(given.values()) if normalize == "sum" else 1.0
    coefficients = torch.tensor([given[t] / total for t in kept], dtype=torch.float64)
    return _members(pretrained, task_vectors, kept) | {"weights": coefficients}


@register("max_model_predictor", paper=PAPER, kind="routed", network=_max_network, merged=False)
def max_model_predictor(pretrained, task_vectors):
    return _members(pretrained, task_vectors, sorted(task_vectors))
