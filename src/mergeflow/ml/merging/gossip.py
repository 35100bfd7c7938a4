"""Gossip merging (per-task models): each task's model repeatedly merged with its neighbours' on a ring.

FusionBench's gossip (Tang et al., "FusionBench: a comprehensive benchmark of deep model fusion", arXiv:2406.03280;
the docs name no paper of its own), built on AdaMerging (Yang et al. 2024, arXiv:2310.02575). Reference code read:
fusion_bench/method/gossip/layer_wise_gossip.py (ModelScheduler, LayerWiseGossipAlgorithm) and
config/method/gossip/layer_wise_clip.yaml.

Task i is a node holding tau_i. In each of ``rounds`` rounds, every node merges its neighbourhood N(i) of the
previous round's vectors (``topology``: ``'ring'`` is [i+1, i, i-1], ``'rotate_K'`` [i, i+1, ..., i+K], indices mod T;
a task counted twice, as in a ring of two, counts twice), all nodes at once:
tau_i <- sum_{j in N(i)} w_ij,l tau_j,l per tensor l. Task i's model is theta0 + tau_i after the last round.
- ``gossip`` (data-free: the reference's ``gossip_skip_adamerging``): every w_ij,l = ``weight`` (its ``init_values``,
  0.3), so tau(R) = (w A)^R tau, A[i, j] = how often j is in N(i): the R rounds are one T x T matrix, applied in one
  pass. weight = 1 / |N(i)| averages (towards the mean task vector); the reference's 0.3 shrinks by 0.9 a round.
- ``gossip_adamerging`` (test-time adaptation, reads the test inputs): each node's w_ij,l are learned as layer-wise
  AdaMerging's (merging._adaptive; init, lr, steps, batch size as adamerging), minimising the entropy on the tasks in
  its reach (``entropy_on: 'reach'``, the reference's ``improve_dataset: true``: after r rounds, the tasks within
  r hops, as its cumulative ``update_datasets``; ``'all'``: every task). A task counted twice in N(i) is one
  direction with one coefficient there.
Not ported: the reference's task-wise variant and its final "average model" (the mean of the nodes' models).
"""

from __future__ import annotations

from mergeflow.ml.merging import ANY_NUMBER, Choice, Range, register
from mergeflow.ml.merging.adamerging import ADAPTIVE_DEFAULTS, ADAPTIVE_RANGES

TOPOLOGY = Choice(("ring",) + tuple(f"rotate_{k}" for k in range(1, 8)))
ROUNDS = Range("a number of gossip rounds", 0)


def neighbours(i: int, n: int, topology: str) -> list[int]:
    """The nodes task i merges in a round, in the reference's order (repeats kept)."""
    if topology == "ring":
        return [(i + 1) % n, i, (i - 1) % n]
    return [i] + [(i + j + 1) % n for j in range(int(topology.split("_")[1]))]


def mixing(n: int, topology: str, weight: float, rounds: int):
    """(w A)^rounds in float64: row i holds task i's final coefficients on the original task vectors."""
    import torch

    step = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j in neighbours(i, n, topology):
            step[i, j] += weight
    return torch.linalg.matrix_power(step, rounds)


def reconstruct(store, pretrained, task):
    """theta0 + tau_task after the last round."""
    from mergeflow.ml.merging._tensors import as_compute

    return {k: (as_compute(p) + store[f"tau/{task}/{k}"]).to(p.dtype) for k, p in pretrained.items()}


def _checked(pretrained, task_vectors, method):
    for t, tv in task_vectors.items():
        for key, p in pretrained.items():
            if key not in tv:
                raise ValueError(f"{method}: task vector '{t}' has no tensor '{key}'")
            if tuple(tv[key].shape) != tuple(p.shape):
                raise ValueError(f"{method}: task vector '{t}' tensor '{key}' has shape {tuple(tv[key].shape)}")


@register(
    "gossip",
    paper="FusionBench's gossip merging (Tang et al., arXiv:2406.03280), after AdaMerging (arXiv:2310.02575)",
    defaults={"topology": "ring", "rounds": 20, "weight": 0.3},
    grid={"weight": [0.2, 0.25, 0.3, 0.33]},
    kind="per_task",
    reconstruct=reconstruct,
    ranges={"topology": TOPOLOGY, "rounds": ROUNDS, "weight": ANY_NUMBER},
)
def gossip(pretrained, task_vectors, *, topology, rounds, weight):
    import torch

    from mergeflow.ml.merging._tensors import stack

    _checked(pretrained, task_vectors, "gossip")
    tasks = list(task_vectors)
    coefficients = mixing(len(tasks), topology, weight, rounds)
    store = {}
    for key in pretrained:
        taus = stack(task_vectors, key)
        final = torch.tensordot(coefficients.to(taus.dtype), taus, dims=1)
        store |= {f"tau/{t}/{key}": final[i] for i, t in enumerate(tasks)}
    return store


def reach(n: int, topology: str, rounds_done: int) -> list[set[int]]:
    """The tasks each node's entropy reads in round ``rounds_done`` + 1: its neighbourhood grown that many + 1
    times (the reference unions the neighbours' sets before every round)."""
    sets = [{i} for i in range(n)]
    for _ in range(rounds_done + 1):
        sets = [set().union(*(sets[j] for j in neighbours(i, n, topology))) for i in range(n)]
    return sets


def _local_merge(data_tasks, init):
    """AdaMerging's layer-wise parametrisation of a node's neighbours, its entropy read on ``data_tasks``."""
    from mergeflow.ml.merging._adaptive import MergedParameters

    class LocalMerge(MergedParameters):
        def __init__(self, base, directions, device):
            super().__init__(base, directions, layer_wise=True, init=init, device=device)
            self.merged_tasks, self.tasks = self.tasks, list(data_tasks)

        def coefficients(self):
            lam = self.lam.detach().cpu()
            return {
                t: {k: round(float(lam[i, j]), 6) for j, k in enumerate(self.keys)}
                for i, t in enumerate(self.merged_tasks)
            }

    return LocalMerge


@register(
    "gossip_adamerging",
    paper="FusionBench's gossip merging (Tang et al., arXiv:2406.03280), after AdaMerging (arXiv:2310.02575)",
    defaults={"topology": "ring", "rounds": 20, "entropy_on": "reach", **ADAPTIVE_DEFAULTS, "steps": 400},
    kind="per_task",
    reconstruct=reconstruct,
    ranges={"topology": TOPOLOGY, "rounds": ROUNDS, "entropy_on": Choice(("reach", "all")), **ADAPTIVE_RANGES},
    reads="test_inputs",
)
def gossip_adamerging(
    pretrained, task_vectors, *, data, topology, rounds, entropy_on, init, lr, steps, batch_size, split, seed
):
    from mergeflow.ml.merging._adaptive import adapt
    from mergeflow.ml.merging._tensors import as_compute

    _checked(pretrained, task_vectors, "gossip_adamerging")
    tasks, n = list(task_vectors), len(task_vectors)
    base = {k: as_compute(v) for k, v in pretrained.items()}
    current = [{k: as_compute(tv[k]) for k in pretrained} for tv in task_vectors.values()]
    for r in range(rounds):
        readable = reach(n, topology, r) if entropy_on == "reach" else [set(range(n))] * n
        following = []
        for i in range(n):
            local = {tasks[j]: current[j] for j in dict.fromkeys(neighbours(i, n, topology))}
            data_tasks = [tasks[j] for j in sorted(readable[i])]
            merged = adapt(
                base,
                local,
                data.objective,
                layer_wise=True,
                init=init,
                lr=lr,
                steps=steps,
                batch_size=batch_size,
                split=split,
                seed=seed,
                data=data,
                parametrise=_local_merge(data_tasks, init),
            )
            following.append({k: as_compute(v) - base[k] for k, v in merged.items()})
        current = following
    return {f"tau/{t}/{k}": current[i][k] for i, t in enumerate(tasks) for k in pretrained}
