"""What the methods that run the backbone themselves share: the backbone's inputs prepared as its forward prepares
them, in its weights' dtype, and a backbone whose modules were swapped made into the network that evaluation calls
(inputs -> the features the heads read), for the routed methods (SMILE, the ensembles); a timm ViT's tokens before
its first block, for the methods that merge it block by block (RegMean++, AdaSVD)."""


def prepared(backbone, inputs):
    """``backbone.normalise(inputs)`` in the dtype of its weights (float64 runs); token ids stay integers."""
    x = backbone.normalise(inputs)
    return x.to(next(backbone.net.parameters()).dtype) if x.is_floating_point() else x


def as_network(backbone):
    """The backbone's forward, its inputs cast by ``prepared``: images (or token ids) -> features."""
    from torch import nn

    class Network(nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = backbone

        def forward(self, inputs):
            return self.backbone.embed(self.backbone.net(prepared(self.backbone, inputs)))

    return Network()


def vit_embedded(backbone, images, batch: int):
    """A timm ViT's tokens before its first block (forward_features' start) for uint8 ``images``, ``batch`` at a
    time."""
    import torch

    net = backbone.net
    dtype = next(net.parameters()).dtype
    out = []
    for i in range(0, len(images), batch):
        x = net.patch_embed(backbone.normalise(images[i : i + batch]).to(dtype))
        out.append(net.norm_pre(net.patch_drop(net._pos_embed(x))))
    return torch.cat(out)
