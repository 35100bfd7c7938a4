"""RanDeS (per-task models): the task vectors superposed under random sign flips, each task's retrieved by its signs.

RanDeS, randomized delta superposition ("random erasure superposition" in FusionBench's docs): Zhou et al.,
"RanDeS: Randomized Delta Superposition for Multi-Model Compression" (arXiv:2505.11204). Reference code read:
FusionBench's fusion_bench/method/randes/task_arithmetic.py (SuperposedTaskArithmeticAlgorithm) and
base_algorithm.py (``_compress_and_retrieve``, mode ``random_binary_diagonal_matrix``, its config
superposed_task_arithmetic.yaml).

Each target tensor W (see ``targets``) of every task is multiplied along its last (input) dimension by that task's
random signs s_t in {-1, +1}^{d_in} (a diagonal +-1 matrix M_t, drawn with p = 1/2 from ``seed``, the task's
position and the key: different across layers, as the reference's default) and the products are summed:
W_sup = sum_t tau_t M_t. Task t is retrieved with M_t^{-1} = M_t: theta_t = theta0 + lam W_sup M_t
= theta0 + lam (tau_t + sum_{i != t} tau_i M_i M_t), the cross terms random-signed noise. Every other tensor is
shared as the reference does without an absorber: sum_t tau_t (task arithmetic at lam). One task is retrieved
exactly (M_t M_t = I). Storage: one model-sized vector plus one bit per input column, target tensor and task.
``targets``: ``'mlp_attn'`` (the reference's ``target_layer: [mlp_w, attn_w]``: a key naming mlp/Dense or
attn/Attention, a weight and no bias) or ``'matrices'`` (every 2-D weight: attention and MLP matrices in any
backbone's naming, e.g. transformers' ``attention``/``intermediate``, which the reference's rule misses).
Not ported: the reference's other modes (rotations, dense and Gaussian diagonal matrices), its layer shifts and
its ``dropout_rate``; the model-soup variant (full weights superposed).
"""

from mergeflow.ml.merging import ANY_NUMBER, SEED, Choice, register

TARGETS = Choice(("mlp_attn", "matrices"))


def is_target(key, tensor, targets):
    """Whether tensor ``key`` is superposed (the rest is shared as the task vectors' sum)."""
    from mergeflow.ml.merging._tensors import is_matrix

    if tensor.ndim == 0:
        return False
    if targets == "matrices":
        return is_matrix(key, tensor)
    named = any(part in key for part in ("mlp", "Dense", "attn", "Attention"))
    return named and "weight" in key and "bias" not in key


def signs_of(seed, position, key, width):
    """Task ``position``'s signs for tensor ``key``: True is +1, False -1, p = 1/2 each (a boolean store: one bit)."""
    import torch

    from mergeflow.ml.merging._tensors import seed_of

    generator = torch.Generator().manual_seed(seed_of(seed, position, key))
    return torch.randint(0, 2, (width,), generator=generator, dtype=torch.uint8).bool()


def as_factor(signs, dtype):
    """+-1 in ``dtype`` from a boolean row of signs."""
    return signs.to(dtype) * 2 - 1


def reconstruct(store, pretrained, task):
    """theta0 + lam (W_sup M_t) on the target tensors, theta0 + lam sum_t tau_t elsewhere."""
    from mergeflow.ml.merging._tensors import as_compute

    out = {}
    for k, p in pretrained.items():
        if f"superposed/{k}" in store:
            superposed = store[f"superposed/{k}"]
            delta = superposed * as_factor(store[f"sign/{task}/{k}"], superposed.dtype)
        else:
            delta = store[f"shared/{k}"]
        out[k] = (as_compute(p) + store["lam"].to(delta.dtype) * delta).to(p.dtype)
    return out


@register(
    "randes",
    paper="Zhou et al. 2025, RanDeS: Randomized Delta Superposition (arXiv:2505.11204)",
    defaults={"targets": "mlp_attn", "seed": 42, "lam": 0.5},
    grid={"lam": [0.3, 0.5, 0.7, 1.0]},
    kind="per_task",
    reconstruct=reconstruct,
    ranges={"targets": TARGETS, "seed": SEED, "lam": ANY_NUMBER},
)
def randes(pretrained, task_vectors, *, targets, seed, lam):
    import torch

    from mergeflow.ml.merging._tensors import as_compute

    tasks = list(task_vectors)
    store = {}
    for key, theta0 in pretrained.items():
        taus = []
        for t in tasks:
            if key not in task_vectors[t]:
                raise ValueError(f"randes: task vector '{t}' has no tensor '{key}'")
            tau = as_compute(task_vectors[t][key])
            if tau.shape != theta0.shape:
                raise ValueError(f"randes: task vector '{t}' tensor '{key}' has shape {tuple(tau.shape)}")
            taus.append(tau)
        if not is_target(key, theta0, targets):
            store[f"shared/{key}"] = torch.stack(taus).sum(0)
            continue
        superposed = torch.zeros_like(taus[0])
        for position, (t, tau) in enumerate(zip(tasks, taus)):
            signs = signs_of(seed, position, key, theta0.shape[-1])
            store[f"sign/{t}/{key}"] = signs
            superposed += tau * as_factor(signs, tau.dtype)
        store[f"superposed/{key}"] = superposed
    store["lam"] = torch.tensor(float(lam), dtype=torch.float64)
    return store
