"""Per-task statistics that data-aware merging methods read, computed once per task by the stage ``statistics``
from the task's fine-tuned model and labelled training examples:

- the diagonal Fisher of the model with its head, F[k] = mean_x (d log p(y|x) / d theta[k])^2 (Matena & Raffel
  2022), with y sampled from the model's predictive distribution (``fisher_sampled``, the paper's estimate) or the
  true label (``fisher_empirical``), one backward pass per example;
- the Gram of each linear layer's inputs, G = X^T X summed over every example and token (Jin et al. 2023,
  RegMean), keyed by the layer's weight.
"""

from __future__ import annotations

import torch
from torch import nn

from mergeflow.core.io import StateDict
from mergeflow.ml.models import Backbone

KINDS = ("fisher_sampled", "fisher_empirical", "gram")


def fisher_diagonal(backbone: Backbone, head: nn.Linear, images: torch.Tensor, labels: torch.Tensor | None, *, generator: torch.Generator, device: torch.device) -> StateDict:
    """Mean squared per-example gradient of log p(y|x) for every tensor of the backbone (the head is not merged).
    ``labels`` None: y ~ p(.|x), drawn with ``generator``."""
    backbone.eval().to(device)
    head = head.to(device).eval()
    # trainable tensors only: a frozen one (CLIP's zero projection bias) never moves, its Fisher is zero below
    names = [k for k, p in backbone.net.named_parameters() if p.requires_grad]
    params = [p for _, p in backbone.net.named_parameters() if p.requires_grad]
    total = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    for i in range(len(images)):
        log_probs = torch.log_softmax(head(backbone(images[i : i + 1].to(device))).float(), -1)[0]
        if labels is None:
            y = int(torch.multinomial(log_probs.detach().exp().cpu(), 1, generator=generator))
        else:
            y = int(labels[i])
        grads = torch.autograd.grad(log_probs[y], params)
        for acc, g in zip(total, grads):
            acc += g.float().square()
    state = {k: (acc / max(len(images), 1)).cpu() for k, acc in zip(names, total)}
    # buffers (none in a ViT) and frozen tensors carry no gradient: zero Fisher, so the floor weights them equally
    return {k: state.get(k, torch.zeros(v.shape)) for k, v in backbone.net.state_dict().items()}


def linear_input_grams(module: nn.Module, run) -> dict[str, torch.Tensor]:
    """{<linear>.weight: X^T X} (float64) of every linear layer in ``module`` over all the rows (examples x tokens)
    it sees while ``run()`` runs."""
    grams: dict[str, torch.Tensor] = {}
    hooks = []

    def hook(name):
        def record(_module, inputs, _output):
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).double()
            grams[name] = grams.get(name, 0) + x.T @ x

        return record

    for name, linear in module.named_modules():
        if isinstance(linear, nn.Linear):
            hooks.append(linear.register_forward_hook(hook(f"{name}.weight")))
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return grams


@torch.no_grad()
def input_grams(backbone: Backbone, images: torch.Tensor, *, batch_size: int, device: torch.device) -> StateDict:
    """{<linear>.weight: X^T X} over every row the layer sees (examples x tokens), in float64 then float32."""
    backbone.eval().to(device)

    def run():
        for i in range(0, len(images), batch_size):
            backbone(images[i : i + batch_size].to(device))

    return {k: v.float().cpu() for k, v in linear_input_grams(backbone.net, run).items()}
