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
from mergeflow.ml.text_models import trim_padding

KINDS = ("fisher_sampled", "fisher_empirical", "gram")


def _log_likelihood(
    outputs: torch.Tensor, label: torch.Tensor | None, regression: bool, generator: torch.Generator
) -> torch.Tensor:
    """log p(y|x) of one example: a classifier's softmax, or for a regression head a unit-variance Gaussian around its
    output (its Fisher is the squared gradient of the output). ``label`` None: y drawn from the model."""
    if regression:
        mean = outputs.float()[0, 0]
        y = mean.detach().cpu() + torch.randn((), generator=generator) if label is None else label.float()
        return -0.5 * (y.to(mean.device) - mean) ** 2
    log_probs = torch.log_softmax(outputs.float(), -1)[0]
    y = int(torch.multinomial(log_probs.detach().exp().cpu(), 1, generator=generator)) if label is None else int(label)
    return log_probs[y]


def fisher_diagonal(
    backbone: Backbone,
    head: nn.Linear,
    images: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    generator: torch.Generator,
    device: torch.device,
    regression: bool = False,
) -> StateDict:
    """Mean squared per-example gradient of log p(y|x) for every tensor of the backbone (the head is not merged).
    ``labels`` None: y ~ p(.|x), drawn with ``generator``; ``regression``: a one-output head's Gaussian likelihood."""
    backbone.eval().to(device)
    head = head.to(device).eval()
    # trainable tensors only: a frozen one (CLIP's zero projection bias) never moves, its Fisher is zero below
    names = [k for k, p in backbone.net.named_parameters() if p.requires_grad]
    params = [p for _, p in backbone.net.named_parameters() if p.requires_grad]
    total = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    for i in range(len(images)):
        outputs = head(backbone(images[i : i + 1].to(device)))
        grads = torch.autograd.grad(
            _log_likelihood(outputs, None if labels is None else labels[i], regression, generator), params
        )
        for acc, g in zip(total, grads):
            acc += g.float().square()
    state = {k: (acc / max(len(images), 1)).cpu() for k, acc in zip(names, total)}
    # buffers (none in a ViT) and frozen tensors carry no gradient: zero Fisher, so the floor weights them equally
    return {k: state.get(k, torch.zeros(v.shape)) for k, v in backbone.net.state_dict().items()}


def linear_input_grams(module: nn.Module, run, rows=None) -> dict[str, torch.Tensor]:
    """{<linear>.weight: X^T X} (float64) of every linear layer in ``module`` over all the rows (examples x tokens)
    it sees while ``run()`` runs. ``rows()``: the current batch's bool mask [N, L] of the token rows to count (text:
    not padding), applied to every input shaped [N, L, D]; None counts every row."""
    grams: dict[str, torch.Tensor] = {}
    hooks = []

    def hook(name):
        def record(_module, inputs, _output):
            x = inputs[0]
            keep = rows() if rows is not None else None
            x = x[keep] if keep is not None and x.shape[:2] == keep.shape else x
            x = x.reshape(-1, x.shape[-1]).double()
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
    """{<linear>.weight: X^T X} over every row the layer sees (examples x tokens), in float64 then float32; a text
    backbone's padding rows are not counted (``pad_token_id`` in its net's config)."""
    backbone.eval().to(device)
    pad = getattr(getattr(backbone.net, "config", None), "pad_token_id", None)
    current: list[torch.Tensor] = []

    def run():
        for i in range(0, len(images), batch_size):
            batch = images[i : i + batch_size].to(device)
            current[:] = [trim_padding(batch, pad)[1]] if pad is not None else []  # the rows the encoder sees
            backbone(batch)

    return {
        k: v.float().cpu()
        for k, v in linear_input_grams(
            backbone.net, run, rows=(lambda: current[0]) if pad is not None else None
        ).items()
    }
