"""What the routed methods that build their own network share (SMILE, the ensembles): the backbone's inputs
prepared as its forward prepares them, in its weights' dtype, and a backbone whose modules were swapped made into
the network that evaluation calls (inputs -> the features the heads read)."""


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
