"""AdaSVD: each linear layer merged with the mean routing weights of a SMILE mixture of its task vectors.

FusionBench's AdaSVD (fusion_bench/method/ada_svd/clip_vision.py, AdaSVDMergingForCLIPVisionModel, "an
experimental implementation"; config/method/ada_svd/clip_vision.yaml), built on SMILE's zero-shot mixture of
experts: Tang et al., "SMILE: Zero-Shot Sparse Mixture of Low-Rank Experts Construction From Pre-Trained Foundation
Models" (arXiv:2408.10174; reference fusion_bench/models/smile_moe/linear_from_module.py, SmileGate, SmileMoELinear).

Every linear layer (W0, b0) of a block becomes a dense mixture: y = W0 x + b0 + sum_t r_t(x) (dW_t x + db_t), with
dW_t = W_t - W0 and the router r(x) = softmax_t(||V_t^T x||_2), V_t the top ``gate_k`` right singular vectors of
dW_t. The training examples (labels unused) pass through the embeddings and then the blocks in order; over every
token of every example reaching a block, the mean routing weights w_t of each of its linear layers are taken, and
that layer becomes W0 + ``scaling`` sum_t w_t dW_t (its bias likewise). The next block's inputs are the mixture
block's outputs, as the reference's. A linear layer no task changes (every dW_t zero) keeps theta0, bias too, as the
reference skips it. Every other tensor (norms, embeddings, anything outside the blocks' linear layers) is theta0's
(``others: 'pretrained'``, the reference's ``average_experts: false``) or the task models' mean (``'average'``).
``scaling`` 1 is the reference's ``scaling_factor: null``. The examples are the first ``statistics.examples`` of each
task's training split (the reference draws 256 at random). A timm ViT's blocks (``blocks.<l>.``), as RegMean++.
(``smile`` keeps the mixture itself, routed per input; AdaSVD reduces it to one model.)
"""

from mergeflow.ml.merging import ANY_NUMBER, Choice, Range, register

BATCH = 64  # examples a forward pass


def _router(deltas, gate_k):
    """The gate's [T * k, n] projection rows (the top k right singular vectors of each dW_t) and k."""
    import torch

    from mergeflow.ml.merging._tensors import svd

    k = min(gate_k, *deltas[0].shape)
    rows = [svd(d)[2][:k].to(d.device, d.dtype) for d in deltas]
    return torch.cat(rows), k


def _mixture(linear, deltas, bias_deltas, gate_k):
    """A module for ``linear`` (theta0's) computing the SMILE mixture, summing its routing weights as it runs."""
    import torch
    from torch import nn

    class SmileMixture(nn.Module):
        def __init__(self):
            super().__init__()
            self.base, self.tasks = linear, len(deltas)
            self.gate, self.k = _router(deltas, gate_k)
            self.deltas = torch.stack(deltas)  # [T, out, in]
            self.bias_deltas = None if bias_deltas is None else torch.stack(bias_deltas)  # [T, out]
            self.routing_sum, self.tokens = torch.zeros(self.tasks, dtype=torch.float64), 0

        def forward(self, x):
            flat = x.reshape(-1, x.shape[-1])
            logits = (flat @ self.gate.T).reshape(len(flat), self.tasks, self.k).norm(dim=2)
            routing = torch.softmax(logits, dim=1)  # the reference's top_k = T: every expert, renormalised to 1
            self.routing_sum += routing.sum(0).double().cpu()
            self.tokens += len(flat)
            mixed = 0
            for t in range(self.tasks):  # one expert at a time: [tokens, out], not [tokens, T, out]
                expert = flat @ self.deltas[t].T
                if self.bias_deltas is not None:
                    expert = expert + self.bias_deltas[t]
                mixed = mixed + routing[:, t : t + 1] * expert
            return self.base(x) + mixed.reshape(*x.shape[:-1], -1)

        def mean_routing(self):
            return self.routing_sum / max(self.tokens, 1)

    return SmileMixture()


def _merge_block(block, prefix, pretrained, taus, merged, hidden, gate_k, scaling):
    """Block ``prefix``'s linear layers as mixtures: ``hidden`` through them; their merged tensors into ``merged``;
    the mixture block's outputs returned."""
    import torch
    from torch import nn

    mixtures = {}
    for name, module in list(block.named_modules()):
        key = f"{prefix}{name}.weight"
        if not isinstance(module, nn.Linear) or key not in pretrained:
            continue
        deltas = [tau[key] for tau in taus]
        if all(not bool(d.any()) for d in deltas):
            continue  # the reference's ExpertNotTrainedError: theta0's layer stays
        bias = f"{prefix}{name}.bias"
        bias_deltas = [tau[bias] for tau in taus] if module.bias is not None and bias in pretrained else None
        mixtures[name] = _mixture(module, deltas, bias_deltas, gate_k)
        parent, _, child = name.rpartition(".")
        setattr(block.get_submodule(parent) if parent else block, child, mixtures[name])
    out = torch.cat([block(hidden[i : i + BATCH]) for i in range(0, len(hidden), BATCH)])
    for name, mixture in mixtures.items():
        weights = mixture.mean_routing().to(out.dtype) * scaling
        key, bias = f"{prefix}{name}.weight", f"{prefix}{name}.bias"
        merged[key] = pretrained[key] + torch.tensordot(weights, mixture.deltas, dims=1)
        if mixture.bias_deltas is not None:
            merged[bias] = pretrained[bias] + weights @ mixture.bias_deltas
    return out


@register(
    "ada_svd",
    paper="FusionBench's AdaSVD, after Tang et al. 2024, SMILE (arXiv:2408.10174)",
    defaults={"gate_k": 16, "scaling": 1.0, "others": "pretrained"},
    grid={"scaling": [0.6, 0.8, 1.0, 1.2]},
    ranges={
        "gate_k": Range("a number of singular vectors", 1),
        "scaling": ANY_NUMBER,
        "others": Choice(("pretrained", "average")),
    },
    reads="train_inputs",
)
def ada_svd(pretrained, task_vectors, *, data, gate_k, scaling, others):
    import copy

    import torch

    from mergeflow.ml.merging._tensors import as_compute

    tasks = list(task_vectors)
    for t in tasks:
        if missing := next((k for k in pretrained if k not in task_vectors[t]), None):
            raise ValueError(f"merge.ada_svd: task vector '{t}' has no tensor '{missing}'")
    base = {k: as_compute(v) for k, v in pretrained.items()}
    taus = [{k: as_compute(task_vectors[t][k]) for k in pretrained} for t in tasks]
    merged = {
        k: v + torch.stack([tau[k] for tau in taus]).mean(0) if others == "average" else v for k, v in base.items()
    }
    backbone = copy.deepcopy(data.backbone)
    net = backbone.net
    if not (hasattr(net, "blocks") and hasattr(net, "patch_embed") and hasattr(net, "_pos_embed")):
        raise ValueError(
            f"merge.ada_svd: merges a timm ViT block by block; {type(net).__name__} has no patch_embed and blocks"
        )
    backbone.to(next(iter(base.values())).dtype).eval()
    # every linear layer at theta0 (a mixture's shared part; outside the blocks it stays so), the rest as merged
    linear = {f"{n}.{p}" for n, m in net.named_modules() if isinstance(m, torch.nn.Linear) for p in ("weight", "bias")}
    merged = {k: base[k] if k in linear else v for k, v in merged.items()}
    net.load_state_dict(merged)
    from mergeflow.ml.merging._networks import vit_embedded

    with torch.no_grad():
        hidden = torch.cat([vit_embedded(backbone, data.train_inputs[t], BATCH) for t in tasks])
        for i, block in enumerate(net.blocks):
            hidden = _merge_block(block, f"blocks.{i}.", base, taus, merged, hidden, gate_k, scaling)
    return {k: merged[k].to(v.dtype) for k, v in pretrained.items()}
