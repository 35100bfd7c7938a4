"""AdaRank: learn at test time which singular components of each task vector to keep, and the layer-wise λ.

Lee et al., "AdaRank: Adaptive Rank Pruning for Enhanced Model Merging", ICML 2025 (arXiv:2503.22178). Per task
and matrix, the SVD of its direction d_t = U_t diag(s_t) V_t^T (``base: cart``: the centred theta_t - theta_avg
from theta_avg, as CART; ``base: ta``: tau_t from theta0) gets a binary mask b_t over its components:
theta = base + sum_t lam_t,l U_t diag(b_t * s_t) V_t^T on the matrices, base + sum_t lam_t,l d_t elsewhere. The
masks and the λ are learned with Adam by minimising each task's prediction entropy on its unlabelled test inputs
(AdaMerging's objective, merging._adaptive); b_t = [sigmoid(m_t / temperature) > 0.5] in the forward pass, the
gradient taken through the sigmoid (straight-through). The logits m start at +0.1 for the first
floor(``rank_ratio`` r) of each task's components and -0.1 for the rest; λ at ``init``. Every 2-D weight is masked
(the authors': the attention and MLP weights of the blocks). Defaults are the authors' ViT-B/32
8-task CART setting (λ 2.3, rank ratio 0.16, temperature 10, Adam lr 1e-3, batch 16; with ``base: ta`` they use
λ 0.3 and rank ratio 1) but for the steps: AdaMerging's 500, where they run 10,000 (at lr 1e-3 and temperature 10
a mask flips only after about 100 steps of gradients of one sign, so 500 steps move few). Their code picks the best step
by its test accuracy; here the last step is the merge (the
test labels are never read). Test-time adaptation: not comparable with data-free merging (the summary's "data").

``base: iso_cts`` (the paper's tables quote AdaRank on Iso-CTS; the released code has no such base, so this is our
reading): the components are Iso-CTS's own (merging.iso, at ``common_space_fraction``): per matrix the orthonormal
columns u_j, v_j of its common subspace and of each task's subspace, each at the isotropic sigma, every one kept at
the start. theta = theta0 + sum_j lam_{o(j),l} b_j sigma u_j v_j^T on the matrices, where o(j) is the task whose
subspace column j belongs to and a common column takes the mean of the tasks' λ; theta0 + sum_t lam_t,l tau_t / T
elsewhere. With nothing learned it is Iso-CTS at alpha = init (set ``init`` to Iso-CTS's validated alpha, about 1-2;
2.3 is CART's). The masks only prune here: Iso-CTS's columns already span the full rank.
"""

from mergeflow.ml.merging import FRACTION, POSITIVE_FRACTION, Choice, Range, register
from mergeflow.ml.merging.adamerging import ADAPTIVE_DEFAULTS, ADAPTIVE_RANGES

BASE = Choice(("cart", "ta", "iso_cts"))
COMMON = "common subspace"  # ``kept``'s entry for Iso-CTS's shared components


def _components(stack, rank_ratio: float, isotropic_fraction: float | None, device):
    """One matrix's components, its tasks' directions stacked in ``stack``: ((u, s, vh), the task owning each
    component (Iso-CTS's, the common ones as len(stack)) or None, the masks' starting logits)."""
    import torch

    from mergeflow.ml.merging._tensors import svd
    from mergeflow.ml.merging.iso import iso_cts_factors

    if isotropic_fraction is not None:  # one basis for all tasks: the common columns, then each task's
        u, v, sigma, owner = iso_cts_factors(stack, isotropic_fraction)
        factors = (
            u.to(device),
            sigma.to(device) * torch.ones(owner.shape, dtype=u.dtype, device=device),
            v.T.to(device),
        )
        owners = torch.where(owner < 0, len(stack), owner).to(device)
        return factors, owners, torch.full(owner.shape, 0.1, dtype=u.dtype, device=device)
    parts = [svd(d) for d in stack]
    u, s, vh = (torch.stack([p[i] for p in parts]).to(device) for i in range(3))
    kept = int(rank_ratio * s.shape[1] + 1e-9)  # the authors' int(): floor
    start = torch.full(s.shape, -0.1, dtype=s.dtype, device=device)
    start[:, :kept] = 0.1
    return (u, s, vh), None, start


def parametrisation(rank_ratio: float, init: float, temperature: float, isotropic_fraction: float | None = None):
    """``adapt``'s parametrise: the merged tensors as functions of the masks' logits and the layer-wise λ. With
    ``isotropic_fraction`` (``base: iso_cts``) each matrix's components are Iso-CTS's (at that common space fraction),
    all kept at the start; otherwise each direction's own SVD, its first floor(rank_ratio r) kept."""
    import torch
    from torch import nn

    class MaskedComponents(nn.Module):
        def __init__(self, base, directions, device):
            super().__init__()
            from mergeflow.ml.merging._tensors import is_matrix

            self.tasks = list(directions)
            self.keys = [k for k in base if k in directions[self.tasks[0]]]
            self.base = {k: v.to(device) for k, v in base.items()}
            self.factors, self.owners, self.stacked, logits = {}, {}, {}, {}
            for k in self.keys:
                stack = torch.stack([directions[t][k] for t in self.tasks])
                if not is_matrix(k, base[k]):
                    self.stacked[k] = stack.to(device)
                    continue
                self.factors[k], owners, start = _components(stack, rank_ratio, isotropic_fraction, device)
                if owners is not None:
                    self.owners[k] = owners
                logits[k.replace(".", "/")] = nn.Parameter(start)
            self.logits = nn.ParameterDict(logits)
            dtype = next(iter(self.base.values())).dtype
            self.lam = nn.Parameter(
                torch.full((len(self.tasks), len(self.keys)), float(init), dtype=dtype, device=device)
            )

        def masks(self, key):
            soft = torch.sigmoid(self.logits[key.replace(".", "/")] / temperature)
            return soft + ((soft > 0.5).to(soft.dtype) - soft).detach()  # hard forward, sigmoid's gradient

        def forward(self):
            out = dict(self.base)
            for i, k in enumerate(self.keys):
                lam = self.lam[:, i]
                if k in self.owners:  # a task's components by its λ, the common ones by the tasks' mean λ
                    u, s, vh = self.factors[k]
                    lam_of = torch.cat([lam, lam.mean().reshape(1)])[self.owners[k]]
                    out[k] = self.base[k] + (u * (lam_of * self.masks(k) * s)) @ vh
                elif k in self.factors:
                    u, s, vh = self.factors[k]
                    weighted = (lam[:, None] * self.masks(k) * s)[:, None, :]
                    out[k] = self.base[k] + ((u * weighted) @ vh).sum(0)
                else:
                    out[k] = self.base[k] + torch.tensordot(lam, self.stacked[k], dims=1)
            return out

        def coefficients(self):
            lam = self.lam.detach().cpu()
            return {
                t: {k: round(float(lam[i, j]), 6) for j, k in enumerate(self.keys)} for i, t in enumerate(self.tasks)
            }

        def kept(self):
            """{task: {matrix: components kept}} (with Iso-CTS, the common subspace's too, under COMMON)."""
            if self.owners:
                owners = {**dict(enumerate(self.tasks)), len(self.tasks): COMMON}
                return {
                    name: {k: int((self.masks(k)[self.owners[k] == i] > 0.5).sum()) for k in self.factors}
                    for i, name in owners.items()
                }
            return {t: {k: int((self.masks(k)[i] > 0.5).sum()) for k in self.factors} for i, t in enumerate(self.tasks)}

    return MaskedComponents


@register(
    "adarank",
    paper="Lee et al. 2025, AdaRank: Adaptive Rank Pruning for Enhanced Model Merging (ICML 2025, arXiv:2503.22178)",
    defaults={
        **ADAPTIVE_DEFAULTS,
        "base": "cart",
        "init": 2.3,
        "rank_ratio": 0.16,
        "temperature": 10.0,
        "common_space_fraction": 0.8,
    },
    ranges={
        **ADAPTIVE_RANGES,
        "base": BASE,
        "rank_ratio": FRACTION,
        "temperature": Range("a temperature", 0, low_open=True),
        "common_space_fraction": POSITIVE_FRACTION,
    },
    reads="test_inputs",
)
def adarank(
    pretrained,
    task_vectors,
    *,
    data,
    base,
    init,
    lr,
    steps,
    batch_size,
    split,
    seed,
    rank_ratio,
    temperature,
    common_space_fraction,
):
    import torch

    from mergeflow.ml.merging._adaptive import adapt
    from mergeflow.ml.merging._tensors import as_compute, is_matrix
    from mergeflow.ml.merging.cart import centred

    tasks = list(task_vectors)
    origin, directions = {}, {t: {} for t in tasks}
    for key, theta0 in pretrained.items():
        taus = torch.stack([as_compute(task_vectors[t][key]) for t in tasks])
        if base == "cart":
            origin[key] = (as_compute(theta0) + taus.mean(0)).to(theta0.dtype)
            taus = centred(taus)
        else:
            origin[key] = theta0
            if base == "iso_cts" and not is_matrix(key, theta0):
                taus = taus / len(tasks)  # Iso-CTS's mean of tau_t, at λ = init
        for t, d in zip(tasks, taus):
            directions[t][key] = d
    parametrise = parametrisation(rank_ratio, init, temperature, common_space_fraction if base == "iso_cts" else None)
    merged = adapt(
        origin,
        directions,
        data.objective,
        layer_wise=True,
        init=init,
        lr=lr,
        steps=steps,
        batch_size=batch_size,
        split=split,
        seed=seed,
        data=data,
        parametrise=parametrise,
    )
    return merged
