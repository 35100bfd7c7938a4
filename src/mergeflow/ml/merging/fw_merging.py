"""Frank-Wolfe merging (hard, task arithmetic as the merge function): the fine-tuned models are the vertices of
the feasible set, and each step moves the merged model toward the one its loss's gradient points at.

Chen et al., "FW-Merging: Scaling Model Merging with Frank-Wolfe Optimization", ICCV 2025 (arXiv:2503.12649),
as FusionBench's FrankWolfeHardAlgorithm runs it. Vertices: theta_t = theta0 + tau_t for every task, and the
starting model. Start: theta_0 = theta0 + ``scaling`` sum_t tau_t (``init: merge``) or theta0 (``init: base``).
Step k = 0, 1, ...: g = grad of the mean cross-entropy of each task's head over ``examples`` labelled training
examples per task at theta_k; the linear minimisation oracle picks s_k = argmin over vertices v of <g, v>
(``alignment: inner_product``, the Frank-Wolfe oracle of the paper) or of sum over tensors p of
cos(g_p, v_p) (``alignment: tensor_cosine``, the code's); ``granularity: layer`` picks a vertex per tensor;
theta_k+1 = theta_k + gamma_k (s_k - theta_k), gamma_k = 2 / (k + 2) * ``step_size`` * ``scaling`` (the code's
step: task arithmetic of the one selected model at step_size * scaling). Defaults are FusionBench's (10 steps, step
size 0.1, scaling 0.3, 100 examples per task, or all of a smaller training split). Every vertex is theta0 + sum_t c_t
tau_t, so the merge is carried
as those coefficients c (per task, or per task and tensor) and written with the choice, the cross-entropy per step
beside them; the T fine-tuned models are never held in memory at once. Reads labelled training examples: a
data-aware method (the summary's "data").
"""

from mergeflow.ml.merging import ANY_NUMBER, SEED, Choice, Range, register

INITIAL = "initial"  # the starting model, a vertex too (FusionBench's)


def _cross_entropy_gradient(objective, params, inputs, labels, batch_size):
    """(mean task loss, cross-entropy for a classifier, over every task's examples; its gradient {key: tensor}) at
    ``params``."""
    import torch

    from mergeflow.ml.metrics import task_loss

    leaves = {k: v.detach().requires_grad_(v.is_floating_point()) for k, v in params.items()}
    count = sum(len(y) for y in labels.values())
    total = 0.0
    for t, x in inputs.items():
        for i in range(0, len(x), batch_size):
            features = objective.features(leaves, x[i : i + batch_size].to(objective.device))
            loss = (
                task_loss(
                    objective.heads[t](features), labels[t][i : i + batch_size].to(objective.device), reduction="sum"
                )
                / count
            )
            loss.backward()
            total += float(loss.detach())
    return total, {k: v.grad if v.grad is not None else torch.zeros_like(v) for k, v in leaves.items()}


def _vertex_norms(theta0, task_vectors, corners):
    """[vertex, tensor]: the norm of each vertex's tensor, theta0 + corners @ the task vectors' tensors."""
    import torch

    from mergeflow.ml.merging._tensors import as_compute

    tasks = list(task_vectors)
    norms = torch.zeros(len(corners), len(theta0), dtype=torch.float64)
    for j, k in enumerate(theta0):
        taus = torch.stack([as_compute(task_vectors[t][k]) for t in tasks]).flatten(1)
        points = theta0[k].flatten()[None] + corners.to(taus.dtype) @ taus
        norms[:, j] = points.double().norm(dim=1)
    return norms


def _training_sample(data, tasks, examples, seed):
    """({task: inputs}, {task: labels}): ``examples`` of each task's training examples, drawn in one seeded order."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    inputs, labels = {}, {}
    for t in tasks:
        images, y = data.objective.inputs["train"][t], data.train_labels[t]
        order = torch.randperm(len(y), generator=generator)[:examples]
        inputs[t], labels[t] = images[order], y[order]
    return inputs, labels


def _alignments(grad, theta0, task_vectors, corners, vertex_norms=None):
    """[vertex, tensor]: <g_p, v_p> for every vertex v and tensor p, as <g_p, theta0_p> + corners @ <g_p, tau_t,p>;
    with ``vertex_norms``, the cosines (tensor_cosine) instead."""
    import torch

    from mergeflow.ml.merging._tensors import as_compute

    tasks = list(task_vectors)
    products = torch.zeros(len(corners), len(theta0), dtype=torch.float64)
    grad_norms = torch.zeros(len(theta0), dtype=torch.float64)
    for j, k in enumerate(theta0):
        g = grad[k].detach().cpu().flatten().double()
        grad_norms[j] = g.norm()
        with_tau = torch.stack([as_compute(task_vectors[t][k]).flatten().double() @ g for t in tasks])
        products[:, j] = float(theta0[k].flatten().double() @ g) + corners @ with_tau
    if vertex_norms is None:
        return products
    scale = grad_norms[None] * vertex_norms
    return torch.where(
        scale > 0, products / scale.clamp_min(torch.finfo(torch.float64).tiny), torch.zeros_like(products)
    )


def _learned(coefficients, keys, tasks, layer_wise, losses, chosen, labels) -> dict:
    """The merge's record for ``data.learned``: its coefficients (per tensor, or one per task), the cross-entropy
    and the vertex chosen at each step, the examples read per task."""
    names = keys if layer_wise else ["all"]
    shown = coefficients if layer_wise else coefficients[:, :1]
    return {
        "layer_wise": layer_wise,
        "split": "train",
        "coefficients": {
            t: {n: round(float(shown[i, j]), 6) for j, n in enumerate(names)} for i, t in enumerate(tasks)
        },
        "entropy": losses,  # the plot's objective per step: here the mean cross-entropy
        "objective": "cross-entropy",
        "selected": chosen,
        "examples": {t: len(y) for t, y in labels.items()},
    }


@register(
    "fw_merging",
    paper="Chen et al. 2025, FW-Merging: Scaling Model Merging with "
    "Frank-Wolfe Optimization (ICCV 2025, arXiv:2503.12649)",
    defaults={
        "steps": 10,
        "step_size": 0.1,
        "scaling": 0.3,
        "examples": 100,
        "init": "merge",
        "alignment": "inner_product",
        "granularity": "task",
        "batch_size": 32,
        "seed": 0,
    },
    ranges={
        "steps": Range("a number of steps", 0),
        "step_size": Range("a step size", 0),
        "scaling": ANY_NUMBER,
        "examples": Range("a number of examples", 1),
        "init": Choice(("merge", "base")),
        "alignment": Choice(("inner_product", "tensor_cosine")),
        "granularity": Choice(("task", "layer")),
        "batch_size": Range("a batch size", 1),
        "seed": SEED,
    },
    reads="train_examples",
)
def fw_merging(
    pretrained,
    task_vectors,
    *,
    data,
    steps,
    step_size,
    scaling,
    examples,
    init,
    alignment,
    granularity,
    batch_size,
    seed,
):
    import time

    import torch

    from mergeflow.ml.merging._adaptive import record_timing
    from mergeflow.ml.merging._tensors import as_compute

    objective = data.objective
    tasks = list(task_vectors)
    vertices = [*tasks, INITIAL]
    theta0 = {k: as_compute(v) for k, v in pretrained.items()}
    dtype = next(iter(theta0.values())).dtype
    objective.backbone.to(device=objective.device, dtype=dtype).eval()
    for head in objective.heads.values():
        head.to(device=objective.device, dtype=dtype).requires_grad_(False)
    keys = list(theta0)
    start = torch.full((len(tasks),), scaling if init == "merge" else 0.0, dtype=torch.float64)
    # each vertex's coefficients over the task vectors: one-hot for a fine-tuned model, the start for "initial"
    corners = torch.cat([torch.eye(len(tasks), dtype=torch.float64), start[None]])
    coefficients = start[:, None].repeat(1, len(keys))  # [task, tensor]

    def model(c):
        return {
            k: theta0[k] + sum(float(c[i, j]) * as_compute(task_vectors[t][k]) for i, t in enumerate(tasks))
            for j, k in enumerate(keys)
        }

    # each vertex's tensors' norms and the task vectors' tensors, read once per step through the inner products
    vertex_norms = _vertex_norms(theta0, task_vectors, corners)
    inputs, labels = _training_sample(data, tasks, examples, seed)
    losses, chosen = [], []
    began = time.perf_counter()
    for step in range(steps):
        loss, grad = _cross_entropy_gradient(objective, model(coefficients), inputs, labels, batch_size)
        losses.append(round(loss, 6))  # the mean over every task's examples
        products = _alignments(
            grad, theta0, task_vectors, corners, vertex_norms if alignment == "tensor_cosine" else None
        )
        gamma = 2.0 / (step + 2) * step_size * scaling
        if granularity == "task":
            best = int(products.sum(1).argmin())
            target = corners[best][:, None].expand_as(coefficients)
            chosen.append(vertices[best])
        else:
            best = products.argmin(0)  # a vertex per tensor
            target = corners[best].T
            chosen.append({v: int((best == i).sum()) for i, v in enumerate(vertices)})
        coefficients = coefficients + gamma * (target - coefficients)
    seconds = time.perf_counter() - began
    data.learned.append(_learned(coefficients, keys, tasks, granularity == "layer", losses, chosen, labels))
    record_timing(data, steps, seconds, objective.device)
    with torch.no_grad():
        return {k: v.to(pretrained[k].dtype) for k, v in model(coefficients).items()}
