"""TSV-C (task singular vectors, compression): each task keeps a rank-k piece of its own task vector.

Gargiulo et al., "Task singular vectors: reducing task interference in model merging", CVPR 2025
(arXiv:2412.00081). Task t uses theta0 + U_tk S_tk V_tk^T on matrices (k = floor(r / T), so all tasks together
take the space of one matrix) and theta0 + tau_t elsewhere (non-matrix tensors are small and kept whole).
"""

from mergeflow.ml.merging import register


def reconstruct(store, pretrained, task):
    from mergeflow.ml.merging._tensors import as_compute

    out = {}
    for k, p in pretrained.items():
        piece = (
            store[f"u/{task}/{k}"] @ store[f"vh/{task}/{k}"] if f"u/{task}/{k}" in store else store[f"full/{task}/{k}"]
        )
        out[k] = (as_compute(p) + piece).to(p.dtype)
    return out


@register(
    "tsv_c",
    paper="Gargiulo et al. 2025, Task Singular Vectors (arXiv:2412.00081)",
    kind="per_task",
    reconstruct=reconstruct,
)
def tsv_c(pretrained, task_vectors):
    from mergeflow.ml.merging._tensors import as_compute, is_matrix, svd

    store = {}
    n_tasks = len(task_vectors)
    for key in pretrained:
        theta0 = pretrained[key]
        for t, tv in task_vectors.items():
            tau = as_compute(tv[key])
            if is_matrix(key, theta0):
                k = max(1, min(tau.shape) // n_tasks)
                u, s, vh = svd(tau)
                store[f"u/{t}/{key}"], store[f"vh/{t}/{key}"] = (u[:, :k] * s[:k]).cpu(), vh[:k].cpu()
            else:
                store[f"full/{t}/{key}"] = tau
    return store
