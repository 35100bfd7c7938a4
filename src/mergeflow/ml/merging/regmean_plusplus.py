"""RegMean++: RegMean block by block, each block's Grams from the inputs the already merged model gives it.

Nguyen et al., "RegMean++: Enhancing effectiveness and generalization of regression mean for model merging", 2025,
as FusionBench implements it. RegMean (merging.regmean) takes task t's Grams G_t = X_t^T X_t from task t's own
fine-tuned model; RegMean++ merges the transformer blocks in order, and block l's X_t are task t's examples passed
through the merged embeddings and merged blocks < l, then through task t's own block l up to each linear layer.
Each linear weight of the block is then W = (sum_t W_t G~_t)(sum_t G~_t)^-1, G~ = alpha G + (1 - alpha) diag(G)
(merging.regmean.regression_mean), the block's other tensors and everything outside the blocks (embeddings, final
norm, head) averaged. The examples are the first ``statistics.examples`` of each task's training split (labels
unused). A timm ViT's blocks (``blocks.<l>.``); all T models are held in memory.
"""

from mergeflow.ml.merging import FRACTION, register
from mergeflow.ml.merging.regmean import ALPHA_GRID

BATCH = 64  # examples a forward pass


def _grams(block, hidden):
    """{<linear>.weight: X^T X} of every linear layer's inputs in ``block`` over ``hidden``'s rows and tokens."""
    from mergeflow.ml.statistics import linear_input_grams

    return linear_input_grams(block, lambda: _forward(block, hidden))


def _forward(block, hidden):
    import torch

    return torch.cat([block(hidden[i : i + BATCH]) for i in range(0, len(hidden), BATCH)])


@register(
    "regmean_plusplus",
    paper="Nguyen et al. 2025, RegMean++, regression mean on the merged model's layer inputs (as in FusionBench)",
    defaults={"alpha": 0.95},
    grid={"alpha": ALPHA_GRID},
    ranges={"alpha": FRACTION},
    reads="train_inputs",
)
def regmean_plusplus(pretrained, task_vectors, *, data, alpha):
    import copy

    import torch

    from mergeflow.ml.merging._tensors import as_compute
    from mergeflow.ml.merging.regmean import regression_mean

    tasks = list(task_vectors)
    models = {t: {k: as_compute(v) + as_compute(task_vectors[t][k]) for k, v in pretrained.items()} for t in tasks}
    merged = {k: torch.stack([models[t][k] for t in tasks]).mean(0) for k in pretrained}
    backbone = copy.deepcopy(data.backbone)
    net = backbone.net
    if not (hasattr(net, "blocks") and hasattr(net, "patch_embed") and hasattr(net, "_pos_embed")):
        raise ValueError(
            "merge.regmean_plusplus: merges a timm ViT block by "
            f"block; {type(net).__name__} has no patch_embed and blocks"
        )
    dtype = next(iter(merged.values())).dtype
    backbone.to(dtype).eval()
    net.load_state_dict(merged)
    from mergeflow.ml.merging._networks import vit_embedded

    with torch.no_grad():
        hidden = {t: vit_embedded(backbone, data.train_inputs[t], BATCH) for t in tasks}
        for i, block in enumerate(net.blocks):
            prefix = f"blocks.{i}."
            local = {k[len(prefix) :]: k for k in pretrained if k.startswith(prefix)}
            grams = {}
            for t in tasks:
                own = copy.deepcopy(block)
                own.load_state_dict({name: models[t][key] for name, key in local.items()})
                grams[t] = _grams(own, hidden[t])
            for name, key in local.items():
                if name in grams[tasks[0]]:
                    merged[key] = regression_mean(
                        [models[t][key] for t in tasks],
                        [grams[t][name] for t in tasks],
                        alpha,
                        key=key,
                        method="regmean_plusplus",
                    )
            block.load_state_dict({name: merged[key] for name, key in local.items()})
            if i < len(net.blocks) - 1:
                hidden = {t: _forward(block, h) for t, h in hidden.items()}
    return {k: merged[k].to(v.dtype) for k, v in pretrained.items()}
