"""WEMoE: weight-ensembling mixture of experts, the MLPs' task vectors mixed per sample by a learned router.

Tang et al., "Merging Multi-Task Models via Weight-Ensembling Mixture of Experts", ICML 2024 (arXiv:2402.00433),
as FusionBench builds it for CLIP. Outside the blocks' MLPs the model is task arithmetic, theta0 + ``init``
sum_t tau_t. Each block l's MLP becomes
    MLP_l(x; theta0_l + sum_t w_t(x) tau_t,l),   w(x) = mean over tokens of R_l(x) in R^T,
R_l(x) = W2 ReLU(W1 x + b1) + b2 on the MLP's input tokens (FusionBench's two-layer router: W1, W2 ~ N(0, 0.01^2),
b1 = 0, b2 = ``init``, so the start is task arithmetic at ``init`` up to the routers' noise). The routers alone
are learned with Adam (lr 1e-4, 1000 steps, batch 16 per task: FusionBench's) by minimising each task's prediction
entropy on its unlabelled test inputs (``split``), AdaMerging's objective: test-time adaptation. Routing is per
sample, as the paper's; FusionBench's default config averages the weights over a batch (``batch_reduce``), which
makes a prediction depend on the other images of its batch, and is not offered. The store keeps the merged model
(``base/``, theta0 in the MLPs), every task's MLP vectors (``experts/``) and the routers (``router/``); its
storage is reported in models, like the per-task methods'. A timm ViT (``blocks.<l>.mlp.fc1``/``fc2``).
"""

import re

from mergeflow.ml.merging import register
from mergeflow.ml.merging.adamerging import ADAPTIVE_RANGES

MLP = re.compile(r"blocks\.(\d+)\.mlp\.(fc1|fc2)\.(weight|bias)$")


def _tasks(store):
    """The tasks in the routers' output order (sorted: the store's file is read back in key order)."""
    return sorted({k.split("/")[1] for k in store if k.startswith("experts/")})


def _routed_mlp(mlp, experts, router):
    """timm's Mlp (fc1, act, drop1, norm, fc2, drop2) with weights base + sum_t w_t(x) expert_t per sample."""
    import torch
    from torch import nn

    class RoutedMlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = mlp.requires_grad_(False)
            self.router = router
            for k, v in experts.items():  # [T, ...] each
                self.register_buffer(k.replace(".", "_"), v, persistent=False)

        def linear(self, x, name, weights):
            """x (W0 + sum_t w_t T_t)^T per sample, as x W0^T + sum_t w_t (x T_t^T): every expert's output in one GEMM,
            then mixed: on 2 CPU cores 1.4-2.7x faster (forward and backward, bench/wemoe_routes.py) than forming each
            sample's weight first, which takes fewer multiply-adds but B small products and B weight-sized tensors."""
            layer = getattr(self.mlp, name)
            experts = getattr(self, f"{name}_weight")  # [T, O, I]
            b, n, _ = x.shape
            t, o, _ = experts.shape
            outputs = (x.reshape(b * n, -1) @ experts.reshape(t * o, -1).T).view(b * n, t, o)
            out = layer(x) + torch.bmm(weights.repeat_interleave(n, 0)[:, None], outputs).view(b, n, o)
            bias = getattr(self, f"{name}_bias", None)
            return out if bias is None else out + (weights @ bias)[:, None]

        def forward(self, x):
            weights = self.router(x).mean(1)  # [B, T]: the tokens' routing averaged, one mix per sample
            h = self.mlp.norm(self.mlp.drop1(self.mlp.act(self.linear(x, "fc1", weights))))
            return self.mlp.drop2(self.linear(h, "fc2", weights))

    return RoutedMlp()


def _router(width, tasks, init, generator, dtype):
    import torch
    from torch import nn

    router = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, tasks)).to(dtype)
    with torch.no_grad():
        for layer in (router[0], router[2]):
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=generator, dtype=dtype) * 0.01)
        router[0].bias.zero_()
        router[2].bias.fill_(init)
    return router


def network(store, backbone):
    """The merged network: ``backbone`` (a mergeflow.ml.models.Backbone, copied) with the store's base weights and each
    block's MLP routed; uint8 images -> features, as the backbone."""
    import copy

    import torch

    from mergeflow.ml.merging._tensors import BASE_PREFIX

    model = copy.deepcopy(backbone)
    model.net.load_state_dict({k.removeprefix(BASE_PREFIX): v for k, v in store.items() if k.startswith(BASE_PREFIX)})
    tasks = _tasks(store)
    for l, block in enumerate(model.net.blocks):
        experts = {
            f"{layer}.{p}": torch.stack([store[f"experts/{t}/blocks.{l}.mlp.{layer}.{p}"] for t in tasks])
            for layer in ("fc1", "fc2")
            for p in ("weight", "bias")
            if f"experts/{tasks[0]}/blocks.{l}.mlp.{layer}.{p}" in store
        }
        width = block.mlp.fc1.in_features
        router = _router(width, len(tasks), 0.0, torch.Generator(), next(iter(experts.values())).dtype)
        router.load_state_dict(
            {k.removeprefix(f"router/{l}/"): v for k, v in store.items() if k.startswith(f"router/{l}/")}
        )
        block.mlp = _routed_mlp(block.mlp, experts, router)
    return _Network(model)


def _Network(backbone):
    """The backbone's forward with its images cast to its weights' dtype (float64 runs)."""
    from torch import nn

    class Network(nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = backbone
            self.net = backbone.net

        def forward(self, images):
            dtype = next(self.net.parameters()).dtype
            return self.backbone.embed(self.net(self.backbone.normalise(images).to(dtype)))

    return Network()


@register(
    "wemoe",
    paper="Tang et al. 2024, Merging Multi-Task Models via Weight-Ensembling "
    "Mixture of Experts (ICML 2024, arXiv:2402.00433)",
    kind="routed",
    network=network,
    defaults={"init": 0.3, "lr": 1e-4, "steps": 1000, "batch_size": 16, "split": "test", "seed": 0},
    ranges=ADAPTIVE_RANGES,
    reads="test_inputs",
)
def wemoe(pretrained, task_vectors, *, data, init, lr, steps, batch_size, split, seed):
    import time

    import torch

    from mergeflow.core.devices import resident
    from mergeflow.ml.merging._adaptive import batch_stream, record_timing
    from mergeflow.ml.merging._tensors import BASE_PREFIX, as_compute

    objective = data.objective
    tasks = sorted(task_vectors)
    if not any(MLP.match(k) for k in pretrained):
        raise ValueError("wemoe: the backbone has no blocks.<l>.mlp.fc1/fc2 (a timm ViT's MLPs) to route")
    store = {}
    for k, theta0 in pretrained.items():
        taus = [as_compute(task_vectors[t][k]) for t in tasks]
        if MLP.match(k):
            store[f"{BASE_PREFIX}{k}"] = theta0
            for t, tau in zip(tasks, taus):
                store[f"experts/{t}/{k}"] = tau.to(theta0.dtype)
        else:
            store[f"{BASE_PREFIX}{k}"] = (as_compute(theta0) + init * sum(taus)).to(theta0.dtype)
    dtype = as_compute(next(iter(pretrained.values()))).dtype
    generator = torch.Generator().manual_seed(seed)
    backbone = objective.backbone.to(dtype=dtype)
    for l, block in enumerate(backbone.net.blocks):
        for name, p in _router(block.mlp.fc1.in_features, len(tasks), init, generator, dtype).state_dict().items():
            store[f"router/{l}/{name}"] = p
    model = network({k: as_compute(v) for k, v in store.items()}, backbone).to(objective.device).eval()
    routers = [p for n, p in model.named_parameters() if ".router." in n]
    model.requires_grad_(False)
    for p in routers:
        p.requires_grad_(True)
    for head in objective.heads.values():
        head.to(device=objective.device, dtype=dtype).requires_grad_(False)
    inputs = {t: resident(objective.inputs[split][t], objective.device) for t in tasks}
    stream = batch_stream(inputs, batch_size, generator, method="wemoe", split=split)
    optimizer = torch.optim.Adam(routers, lr=lr)
    entropy = []
    began = time.perf_counter()
    for _ in range(steps):
        batch = next(stream)
        features = model(torch.cat([batch[t] for t in tasks]).to(objective.device))
        loss = objective.entropy(features, {t: len(batch[t]) for t in tasks})
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        entropy.append(round(float(loss.detach()) / len(tasks), 6))
    seconds = time.perf_counter() - began
    for l, block in enumerate(model.net.blocks):
        for name, p in block.mlp.router.state_dict().items():
            store[f"router/{l}/{name}"] = p.detach().cpu().to(store[f"router/{l}/{name}"].dtype)
    coefficient = "routing weight of its own task vector"  # averaged over blocks and its inputs
    data.learned.append(
        {
            "layer_wise": False,
            "split": split,
            "coefficients": _mean_routing(model, inputs, tasks),
            "coefficient": coefficient,
            "entropy": entropy,
        }
    )
    record_timing(data, steps, seconds, objective.device)
    return store


def _mean_routing(model, inputs, tasks):
    """{task: {"all": its own expert's weight, averaged over blocks and its first 256 inputs}}: what the plot draws."""
    import torch

    weights = {}

    def record(module, args, out):
        weights.setdefault("now", []).append(out.mean(1))

    hooks = [block.mlp.router.register_forward_hook(record) for block in model.net.blocks]
    out = {}
    try:
        with torch.no_grad():
            for i, t in enumerate(tasks):
                weights.clear()
                model(inputs[t][:256])
                out[t] = {"all": round(float(torch.stack(weights["now"])[:, :, i].mean()), 6)}
    finally:
        for h in hooks:
            h.remove()
    return out
