"""CLIP's zero-shot heads and image embedding, against open_clip's own zero-shot classifier and CLIP model, on
random weights in the hub's architecture (nothing is downloaded)."""

import pytest
import timm
import torch

from mergeflow.config import BackboneConfig
from mergeflow.core.errors import MergeflowError
from mergeflow.ml.models import Backbone
from mergeflow.ml.zeroshot import open_clip_architecture, text_model, zeroshot_head

open_clip = pytest.importorskip("open_clip")

CLIP_B32 = BackboneConfig(
    model="vit_base_patch32_clip_quickgelu_224.openai",
    global_pool="token",
    input_norm="pretrained_cfg",
    embedding="clip",
    text="random",
)
CLASSES = ["annual crop land", "forest", "highway or road"]
TEMPLATES = [
    "a centered satellite photo of {}.",
    "a centered satellite photo of a {}.",
    "a centered satellite photo of the {}.",
]


@pytest.fixture(scope="module")
def clip():
    return text_model(CLIP_B32, seed=0)


def test_the_head_is_open_clips_zero_shot_classifier_times_the_logit_scale(clip):
    head = zeroshot_head(clip, "ViT-B-32", CLASSES, TEMPLATES)
    from open_clip.zero_shot_classifier import build_zero_shot_classifier

    with torch.no_grad():
        reference = build_zero_shot_classifier(
            clip, open_clip.get_tokenizer("ViT-B-32"), CLASSES, TEMPLATES
        )  # [E, C], unit columns
    scale = clip.logit_scale.exp().item()
    assert head.weight.shape == (3, 512) and not head.weight.requires_grad
    torch.testing.assert_close(head.weight / scale, reference.T, atol=1e-5, rtol=1e-5)
    assert torch.equal(head.bias, torch.zeros(3))
    # seeded: the same random text tower twice
    torch.testing.assert_close(
        zeroshot_head(text_model(CLIP_B32, seed=0), "ViT-B-32", CLASSES, TEMPLATES).weight, head.weight
    )


def test_backbone_embedding_and_head_give_clips_own_logits(clip):
    """timm's image tower with CLIP's weights (timm's converter) and the zero-shot head give the logits open_clip's
    CLIP gives for the same images and class texts."""
    backbone = Backbone(CLIP_B32)
    backbone.net.load_state_dict(timm.models.vision_transformer.checkpoint_filter_fn(clip.state_dict(), backbone.net))
    images = torch.randint(0, 256, (2, 224, 224, 3), dtype=torch.uint8)
    head = zeroshot_head(clip, "ViT-B-32", CLASSES, TEMPLATES[:1])
    with torch.no_grad():
        ours = head(backbone(images))
        pixels = backbone.normalise(images)  # CLIP's mean and std (input_norm: pretrained_cfg)
        tokens = open_clip.get_tokenizer("ViT-B-32")([TEMPLATES[0].format(c) for c in CLASSES])
        image_features, text_features, scale = clip(pixels, tokens)
        reference = scale * image_features @ text_features.T
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)


def test_clip_settings_fail_in_one_line(monkeypatch):
    with pytest.raises(
        MergeflowError,
        match="backbone.embedding: clip needs a timm CLIP model .* 'vit_tiny_patch16_224' has no CLIP projection",
    ):
        Backbone(BackboneConfig(model="vit_tiny_patch16_224", embedding="clip"))
    with pytest.raises(MergeflowError, match="backbone.text: no open_clip text tower is known for 'resnet50'"):
        open_clip_architecture("resnet50")
    # the hub's not-cached error whatever this machine's cache holds (and nothing downloaded)
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    def not_cached(*args, **kwargs):
        raise LocalEntryNotFoundError("Cannot find the requested files in the disk cache")

    monkeypatch.setattr(open_clip, "create_model", not_cached)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(
        MergeflowError,
        match=r"^backbone.text: hub: CLIP's text tower \(timm/vit_base_patch32_clip_224.openai on the Hugging Face "
        r"hub\) is not in the local cache.*--download",
    ):
        text_model(CLIP_B32.model_copy(update={"text": "hub"}))


def test_adamergings_objective_reads_the_embedding_the_heads_read():
    """AdaMerging calls the backbone's net through torch.func: its entropy must be that of head(backbone(x)), the
    normalised CLIP embedding (un-normalised features would sharpen the x100 heads' logits tenfold)."""
    from mergeflow.ml.merging._adaptive import EntropyObjective

    cfg = CLIP_B32.model_copy(update={"kwargs": {"depth": 1}})
    backbone = Backbone(cfg).eval()
    torch.manual_seed(0)
    head = torch.nn.Linear(512, 3, bias=False)
    torch.nn.init.normal_(head.weight)
    head.weight.data = 100 * torch.nn.functional.normalize(head.weight.data, dim=1)
    images = torch.randint(0, 256, (4, 224, 224, 3), dtype=torch.uint8)
    objective = EntropyObjective(backbone, {"t": head}, {"test": {"t": images}}, torch.device("cpu"))
    with torch.no_grad():
        loss = objective.loss(dict(backbone.net.named_parameters()), {"t": images})
        log_p = torch.log_softmax(head(backbone(images)), -1)
        by_hand = -(log_p.exp() * log_p).sum(-1).mean()
    torch.testing.assert_close(loss, by_hand)
