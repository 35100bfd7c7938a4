"""RegMean++ (merging/regmean_plusplus.py) on a tiny timm ViT: with task vectors only in the first block its inputs
are the fine-tuned models' own, so it is RegMean on Grams computed by the statistics stage's code (an independent
route); one task gives its own model back; with the embeddings fine-tuned too, the merged embeddings change the
first block's inputs and so its merge."""

import torch

from mergeflow.config import BackboneConfig
from mergeflow.ml.merging import REGISTRY, MergeData
from mergeflow.ml.models import build_backbone
from mergeflow.ml.statistics import input_grams

VIT = BackboneConfig(
    model="vit_tiny_patch16_224", kwargs={"img_size": 16, "patch_size": 8, "embed_dim": 16, "depth": 2, "num_heads": 2}
)
TASKS = ["a", "b", "c"]


def _setup(first_block_only: bool):
    torch.manual_seed(0)
    backbone = build_backbone(VIT)
    theta0 = {k: v.detach().clone() for k, v in backbone.net.state_dict().items()}
    g = torch.Generator().manual_seed(1)

    def tau(key, value):
        moves = key.startswith("blocks.0.") or not first_block_only
        return 0.1 * torch.randn(value.shape, generator=g, dtype=value.dtype) if moves else torch.zeros_like(value)

    taus = {t: {k: tau(k, v) for k, v in theta0.items()} for t in TASKS}
    images = {t: torch.randint(0, 256, (20, 16, 16, 3), generator=g, dtype=torch.uint8) for t in TASKS}
    return backbone, theta0, taus, images


def _plusplus(backbone, theta0, taus, images, alpha=0.9):
    return REGISTRY["regmean_plusplus"].with_data(MergeData(backbone=backbone, train_inputs=images))(
        theta0, taus, alpha=alpha
    )


def _regmean_on_own_grams(backbone, theta0, taus, images, alpha=0.9):
    grams = {}
    for t in TASKS:
        model = build_backbone(VIT)
        model.net.load_state_dict({k: theta0[k] + taus[t][k] for k in theta0})
        grams[t] = {"gram": input_grams(model, images[t], batch_size=8, device=torch.device("cpu"))}
    return REGISTRY["regmean"].with_data(MergeData(statistics=grams))(theta0, taus, alpha=alpha)


def test_with_only_the_first_block_fine_tuned_it_is_regmean():
    backbone, theta0, taus, images = _setup(first_block_only=True)
    plus, plain = _plusplus(backbone, theta0, taus, images), _regmean_on_own_grams(backbone, theta0, taus, images)
    for k in theta0:
        if k.startswith("blocks.0."):
            torch.testing.assert_close(plus[k], plain[k], rtol=1e-5, atol=1e-6)
    # block 1 was not fine-tuned: every task's weights are theta0's, and so is their regression mean
    torch.testing.assert_close(plus["blocks.1.mlp.fc1.weight"], theta0["blocks.1.mlp.fc1.weight"], rtol=1e-5, atol=1e-6)


def test_one_task_gives_its_model_back_and_merged_embeddings_change_the_first_block():
    backbone, theta0, taus, images = _setup(first_block_only=False)
    one = REGISTRY["regmean_plusplus"].with_data(MergeData(backbone=backbone, train_inputs={"a": images["a"]}))(
        theta0, {"a": taus["a"]}, alpha=0.9
    )
    for k in theta0:
        torch.testing.assert_close(one[k], theta0[k] + taus["a"][k], rtol=1e-5, atol=1e-6)
    plus, plain = _plusplus(backbone, theta0, taus, images), _regmean_on_own_grams(backbone, theta0, taus, images)
    key = "blocks.0.attn.qkv.weight"
    assert (plus[key] - plain[key]).abs().max() > 1e-4  # the first block's inputs now come from the merged embeddings
    torch.testing.assert_close(plus["cls_token"], plain["cls_token"])  # outside the blocks: both average
