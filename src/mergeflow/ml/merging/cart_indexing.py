"""CART-Indexing (per-task models): theta_avg plus a rank-k piece of each centred task vector.

Choi et al., "Revisiting weight averaging for model merging" (seed 002, arXiv:2411.12153). Task t uses
theta_avg + SVD_k(theta_t - theta_avg) on matrices (k = ceil(8% of min(m, n)), as CART) and theta_avg elsewhere.
Storage: theta_avg (kept in the store, so theta0 is not needed) plus k (m + n) numbers per matrix and task.
"""

from mergeflow.ml.merging import FRACTION, register


def reconstruct(store, pretrained, task):
    from mergeflow.ml.merging._tensors import BASE_PREFIX

    out = {}
    for k, p in pretrained.items():
        base = store[f"{BASE_PREFIX}{k}"]
        if f"u/{task}/{k}" in store:
            base = base + store[f"u/{task}/{k}"] @ store[f"vh/{task}/{k}"]
        out[k] = base.to(p.dtype)
    return out


@register(
    "cart_indexing",
    paper="Choi et al. 2024, CART-Indexing (arXiv:2411.12153)",
    defaults={"rank_ratio": 0.08},
    kind="per_task",
    reconstruct=reconstruct,
    ranges={"rank_ratio": FRACTION},
)
def cart_indexing(pretrained, task_vectors, *, rank_ratio):
    from mergeflow.ml.merging._tensors import BASE_PREFIX, as_compute, is_matrix, rank_of_ratio, stack, svd

    tasks = list(task_vectors)
    store = {}
    for key in pretrained:
        theta0 = as_compute(pretrained[key])
        taus = stack(task_vectors, key)
        store[f"{BASE_PREFIX}{key}"] = theta0 + taus.mean(0)
        if is_matrix(key, theta0):
            k = rank_of_ratio(theta0, rank_ratio)
            for t, centred in zip(tasks, taus - taus.mean(0, keepdim=True)):
                u, s, vh = svd(centred)
                store[f"u/{t}/{key}"], store[f"vh/{t}/{key}"] = (u[:, :k] * s[:k]).cpu(), vh[:k].cpu()
    return store
