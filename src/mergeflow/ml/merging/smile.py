"""SMILE: every linear layer upscaled, data-free, to a sparse mixture of low-rank experts routed per token.

Tang et al., "SMILE: Zero-Shot Sparse Mixture of Low-Rank Experts Construction From Pre-Trained Foundation Models"
(arXiv:2408.10174), as FusionBench builds it (fusion_bench/method/smile_upscaling/smile_upscaling.py and
fusion_bench/models/smile_moe/linear_from_module.py: SmileGate, SmileCompressedLinear, SmileMoELinear). A linear
layer (W0, b0) whose task vectors are tau_t = U_t S_t V_t^T (weight) and db_t (bias) becomes, on each input row x,

    y = W0 x + b0 + sum_{t in top_k(r(x))} r_t(x) / sum_{s in top_k} r_s(x) * (U_t^k S_t^k (V_t^k)^T x + db_t),
    r(x) = softmax_t(g_t(x)),   g_t(x) = || (V_t^gate)^T x ||_2,

expert t being tau_t truncated to rank ``k`` (``k`` = 0: the whole tau_t, FusionBench's k < 0), and the router g_t
the norm of the input's projection onto the top ``gate_k`` right singular vectors of tau_t (``gate_on``
"task_vector", FusionBench's routing_use_diff) or of the fine-tuned weight theta0 + tau_t ("finetuned"): an input
lying in task t's input subspace goes to expert t. One task is routed with weight 1 (FusionBench's gate). Routing is
per token (each row of the layer's input), as FusionBench's. Everything that is not a linear layer (norms, the patch
convolution, position embeddings) keeps theta0 (``others`` "pretrained"), or (``others`` "average", FusionBench's
average_experts) takes the fine-tuned models' average theta0 + mean_t tau_t. A 2-D weight that no task moved keeps
theta0 (FusionBench's ExpertNotTrainedError). Defaults: FusionBench's config (k 128, gate_k 1, top_k 1); the grid
adds its documented ViT-B/32 eight-task run (gate_k 16, k 32). FusionBench's ``full_matrices`` and devices change no
value and are not options. The linear layers are the 2-D weights (``_tensors.is_matrix``: no embedding table);
timm's fused qkv is one layer, routed once (HF CLIP's q, k and v are three), and a CLIP backbone's projection
(timm's ``head``) is routed where fine-tuning moved it (FusionBench's sits outside the vision model it upscales).

The store: ``base/`` (the model the layers add to), ``gate/<weight>`` [T gate_k, in], and per task and layer
``experts/<t>/<weight>/up`` [out, k] (U) and ``/down`` [k, in] (S V^T; the whole tau_t, and no ``up``, at k = 0),
``experts/<t>/<bias>`` (db_t); ``top_k``. Storage is reported in models (the experts and gates beside one model).
The network swaps each gated weight's nn.Linear for the routed layer; a gated weight that is not an nn.Linear's in
the backbone (T5's relative attention bias) is refused in one line naming it.
"""

from mergeflow.ml.merging import Choice, Range, register

RANGES = {
    "k": Range("an expert's rank (0: its whole task vector)", 0),
    "gate_k": Range("the router's rank per task", 1),
    "top_k": Range("the experts per token", 1),
    "gate_on": Choice(("task_vector", "finetuned")),
    "others": Choice(("pretrained", "average")),
}


def _bias(weight_key: str) -> str:
    return weight_key[: -len("weight")] + "bias"


def _tasks(store):
    """The experts' tasks in the gate's row order (sorted, as the merge wrote them)."""
    return sorted({k.split("/")[1] for k in store if k.startswith("experts/")})


def _experts_of(key, theta0, taus, tasks, k, gate_k, gate_on):
    """The store's entries for one gated layer: its gate and each task's expert."""
    import torch

    from mergeflow.ml.merging._tensors import as_compute, top_singular

    out, gates = {}, []
    for t, tau in zip(tasks, taus):
        wanted = max(k, gate_k) if gate_on == "task_vector" else k
        u, s, vh = top_singular(tau, wanted) if wanted else (None, None, None)
        if gate_on == "finetuned":
            gates.append(top_singular(as_compute(theta0) + tau, gate_k)[2])
        else:
            gates.append(vh[:gate_k])
        if k:
            out[f"experts/{t}/{key}/up"] = u[:, :k]
            out[f"experts/{t}/{key}/down"] = s[:k, None] * vh[:k]
        else:
            out[f"experts/{t}/{key}/down"] = tau
    out[f"gate/{key}"] = torch.cat(gates)
    return {name: v.to(device=theta0.device, dtype=theta0.dtype) for name, v in out.items()}


def _smile_linear(linear, gate, experts, top_k):
    """``linear`` (W0, b0) with its experts [(down, up or None, bias or None)] routed per input row by ``gate``."""
    import torch
    from torch import nn

    class SmileLinear(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.top_k, self.count = linear, top_k, len(experts)
            self.register_buffer("gate", gate, persistent=False)
            for i, parts in enumerate(experts):
                for name, tensor in zip(("down", "up", "bias"), parts):
                    if tensor is not None:
                        self.register_buffer(f"{name}{i}", tensor, persistent=False)

        def routing(self, x):
            """[N, T]: each row's normalised weights on its top_k experts, 0 on the others."""
            if self.count == 1:
                return torch.ones(len(x), 1, dtype=x.dtype, device=x.device)
            scores = (x @ self.gate.T.to(x.dtype)).view(len(x), self.count, -1).norm(dim=2)
            weights = torch.softmax(scores, dim=1)
            top, chosen = weights.topk(self.top_k, dim=1)
            return torch.zeros_like(weights).scatter(1, chosen, top / top.sum(1, keepdim=True))

        def forward(self, x):
            out = self.linear(x)
            rows = x.reshape(-1, x.shape[-1])
            weights = self.routing(rows)
            added = torch.zeros(len(rows), out.shape[-1], dtype=out.dtype, device=out.device)
            for i in range(self.count):
                picked = weights[:, i].nonzero().squeeze(1)
                if len(picked) == 0:
                    continue
                h = nn.functional.linear(rows[picked], getattr(self, f"down{i}"))
                if hasattr(self, f"up{i}"):
                    h = nn.functional.linear(h, getattr(self, f"up{i}"))
                if hasattr(self, f"bias{i}"):
                    h = h + getattr(self, f"bias{i}")
                added.index_add_(0, picked, (h * weights[picked, i, None]).to(added.dtype))
            return out + added.view(out.shape)

    return SmileLinear()


def network(store, backbone):
    """``backbone`` (copied) with the store's base weights and each gated nn.Linear routed; inputs -> features."""
    import copy

    from torch import nn

    from mergeflow.ml.merging._networks import as_network
    from mergeflow.ml.merging._tensors import BASE_PREFIX

    model = copy.deepcopy(backbone)
    model.net.load_state_dict({k.removeprefix(BASE_PREFIX): v for k, v in store.items() if k.startswith(BASE_PREFIX)})
    tasks = _tasks(store)
    modules = dict(model.net.named_modules())
    for key in [k.removeprefix("gate/") for k in store if k.startswith("gate/")]:
        name = key.removesuffix(".weight")
        if not isinstance(modules.get(name), nn.Linear):
            raise ValueError(f"smile: {key} is not the weight of an nn.Linear in the backbone, and cannot be routed")
        experts = [
            tuple(store.get(f"experts/{t}/{part}") for part in (f"{key}/down", f"{key}/up", _bias(key))) for t in tasks
        ]
        parent, _, attribute = name.rpartition(".")
        routed = _smile_linear(modules[name], store[f"gate/{key}"], experts, int(store["top_k"]))
        setattr(modules[parent] if parent else model.net, attribute, routed)
    return as_network(model)


@register(
    "smile",
    paper="Tang et al. 2024, SMILE: Zero-Shot Sparse Mixture of Low-Rank Experts Construction From Pre-Trained "
    "Foundation Models (arXiv:2408.10174)",
    kind="routed",
    network=network,
    defaults={"k": 128, "gate_k": 1, "top_k": 1, "gate_on": "task_vector", "others": "pretrained"},
    grid={"k": [32, 128], "gate_k": [1, 16]},
    ranges=RANGES,
)
def smile(pretrained, task_vectors, *, k, gate_k, top_k, gate_on, others):
    import torch

    from mergeflow.ml.merging._tensors import BASE_PREFIX, as_compute, is_matrix

    tasks = sorted(task_vectors)
    if top_k > len(tasks):
        raise ValueError(f"merge.smile.top_k: {top_k} experts per token, but only {len(tasks)} tasks are merged")
    store = {"top_k": torch.tensor(top_k)}
    kept = set()  # the gated layers' weights and biases: theta0 in the base
    for key, theta0 in pretrained.items():
        if not is_matrix(key, theta0):
            continue
        taus = [as_compute(task_vectors[t][key]) for t in tasks]
        if not any(bool(tau.any()) for tau in taus):
            kept |= {key, _bias(key)}  # no task moved it: theta0, as FusionBench leaves an untrained linear layer
            continue
        store |= _experts_of(key, theta0, taus, tasks, k, gate_k, gate_on)
        kept |= {key, _bias(key)}
        if _bias(key) in pretrained:
            for t in tasks:
                store[f"experts/{t}/{_bias(key)}"] = task_vectors[t][_bias(key)].to(pretrained[_bias(key)].dtype)
    for key, theta0 in pretrained.items():
        if others == "pretrained" or key in kept:
            store[f"{BASE_PREFIX}{key}"] = theta0
        else:
            mean = sum(as_compute(task_vectors[t][key]) for t in tasks) / len(tasks)
            store[f"{BASE_PREFIX}{key}"] = (as_compute(theta0) + mean).to(theta0.dtype)
    return store
