"""Representation Surgery: a small per-task module that removes the merged model's representation bias.

Yang et al., "Representation Surgery for Multi-Task Model Merging", ICML 2024 (arXiv:2402.02705). On top of a
merged model (``base``, run at its registered defaults: AdaMerging, the paper's and FusionBench's pairing, task
arithmetic or TIES), each task t gets
    Surgery_t(z) = W_up,t ReLU(W_down,t z),   z_hat = z - Surgery_t(z),
applied to the merged model's features z before task t's head; W_down,t is [rank, D] (kaiming-uniform, as
torch.nn.Linear starts), W_up,t is [D, rank] and starts at zero, so the start is the base merge. Both are learned
with Adam (lr 1e-3, betas (0.9, 0.999)) by minimising, for every task, the L1 distance between z_hat and the features
of task t's own fine-tuned model theta0 + tau_t on unlabelled inputs of task t (``split``: its test split, as the
paper: test-time adaptation). Defaults: rank 16, 1000 steps, batch 16 per task, the authors'. The backbones are
frozen, so each task's merged and individual features are computed once and the steps train on them (exactly the
same steps as recomputing them). A per-task method: the store holds the merged model under ``base/`` and each task's
two matrices; storage is one model plus 2 rank D numbers per task.
"""

from mergeflow.ml.merging import Choice, Range, register
from mergeflow.ml.merging.adamerging import ADAPTIVE_RANGES

BASES = ("adamerging", "task_arithmetic", "ties")
BATCH = 256  # images a forward pass when computing features


def reconstruct(store, pretrained, task):
    """The base merge: every task's backbone is the same; its surgery module acts on the features (``features``)."""
    from mergeflow.ml.merging._tensors import BASE_PREFIX

    return {k: store[f"{BASE_PREFIX}{k}"] for k in pretrained}


def features(store, task):
    """z -> z - W_up ReLU(W_down z), task's module, on a batch of features [N, D]."""
    import torch

    down, up = store[f"surgery/{task}/down"], store[f"surgery/{task}/up"]

    def corrected(z):
        z = z.to(down.dtype)
        return z - torch.relu(z @ down.T) @ up.T

    return corrected


def _features(objective, state, images):
    """The backbone's features of ``images`` at ``state``, BATCH images a forward pass, without gradients."""
    import torch

    params = {k: v.to(objective.device) for k, v in state.items()}
    with torch.no_grad():
        return torch.cat(
            [
                objective.features(params, images[i : i + BATCH].to(objective.device))
                for i in range(0, len(images), BATCH)
            ]
        )


@register(
    "surgery",
    paper="Yang et al. 2024, Representation Surgery for Multi-Task Model Merging (ICML 2024, arXiv:2402.02705)",
    kind="per_task",
    reconstruct=reconstruct,
    features=features,
    defaults={
        "base": "adamerging",
        "rank": 16,
        "lr": 1e-3,
        "steps": 1000,
        "batch_size": 16,
        "split": "test",
        "seed": 0,
    },
    ranges={
        "base": Choice(BASES),
        "rank": Range("a rank", 1),
        **{k: v for k, v in ADAPTIVE_RANGES.items() if k != "init"},
    },
    reads="test_inputs",
)
def surgery(pretrained, task_vectors, *, data, base, rank, lr, steps, batch_size, split, seed):
    import math
    import time

    import torch

    from mergeflow.ml.merging import REGISTRY
    from mergeflow.ml.merging._adaptive import batch_stream, record_timing
    from mergeflow.ml.merging._tensors import BASE_PREFIX, as_compute

    objective = data.objective
    tasks = list(task_vectors)
    method = REGISTRY[base]
    recorded = len(data.learned)
    merged = (method.with_data(data) if method.reads else method)(pretrained, task_vectors)
    base_record = data.learned[recorded] if len(data.learned) > recorded else None
    del data.learned[recorded:]  # one record per call of this method: the base's goes inside it

    theta0 = {k: as_compute(v) for k, v in pretrained.items()}
    dtype = next(iter(theta0.values())).dtype
    objective.backbone.to(device=objective.device, dtype=dtype).eval()
    inputs = objective.inputs[split]
    merged_z, own_z = {}, {}
    for t in tasks:
        merged_z[t] = _features(objective, {k: as_compute(v) for k, v in merged.items()}, inputs[t])
        own_z[t] = _features(objective, {k: theta0[k] + as_compute(task_vectors[t][k]) for k in theta0}, inputs[t])
    width = merged_z[tasks[0]].shape[1]
    generator = torch.Generator().manual_seed(seed)
    down = {
        t: torch.nn.init.kaiming_uniform_(torch.empty(rank, width, dtype=dtype), a=math.sqrt(5), generator=generator)
        .to(objective.device)
        .requires_grad_()
        for t in tasks
    }
    up = {t: torch.zeros(width, rank, dtype=dtype, device=objective.device, requires_grad=True) for t in tasks}
    optimizer = torch.optim.Adam([*down.values(), *up.values()], lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    stream = batch_stream(
        {t: torch.arange(len(z)) for t, z in merged_z.items()}, batch_size, generator, method="surgery", split=split
    )
    losses = []
    began = time.perf_counter()
    for _ in range(steps):
        rows = next(stream)
        loss = sum(
            torch.nn.functional.l1_loss(z - torch.relu(z @ down[t].T) @ up[t].T, own_z[t][rows[t]])
            for t in tasks
            for z in [merged_z[t][rows[t]]]
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(round(float(loss.detach()) / len(tasks), 6))
    seconds = time.perf_counter() - began
    record = base_record or {
        "layer_wise": False,
        "coefficients": {t: {"all": float(method.defaults.get("lam", 1.0))} for t in tasks},
    }
    record = record | {
        "base": base,
        "base_objective": record.get("entropy"),
        "split": split,
        "entropy": losses,
        "objective": "L1 feature distance",
        "unit": "per feature",
    }
    data.learned.append(record)
    record_timing(data, steps, seconds, objective.device)
    store = {f"{BASE_PREFIX}{k}": v for k, v in merged.items()}
    stored = next(iter(pretrained.values())).dtype
    for t in tasks:
        store[f"surgery/{t}/down"] = down[t].detach().cpu().to(stored)
        store[f"surgery/{t}/up"] = up[t].detach().cpu().to(stored)
    return store
