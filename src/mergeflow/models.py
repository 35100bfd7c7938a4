"""The backbone (any timm model, features only) and the per-task linear heads.

Images travel as uint8 NHWC tensors; the backbone converts them to float and normalises them itself, so every
stage feeds it the same way. The normalisation has no parameters: the backbone's state dict is exactly timm's.
"""

from __future__ import annotations

import json
from pathlib import Path

import timm
import torch
from torch import nn

from mergeflow.config import BackboneConfig
from mergeflow.errors import MergeflowError
from mergeflow.io import StateDict, check_compatible, load_state_dict


class Backbone(nn.Module):
    """uint8 images [N, H, W, 3] -> pooled features [N, D]."""

    def __init__(self, cfg: BackboneConfig, *, pretrained: bool = False):
        super().__init__()
        create_kwargs = dict(cfg.kwargs)
        if pretrained and cfg.pretrained not in (None, "hub"):
            path = Path(cfg.pretrained)
            if not path.is_file():
                raise MergeflowError(f"backbone.pretrained: weights file '{path}' not found")
            create_kwargs["pretrained_cfg_overlay"] = dict(file=str(path))
        try:
            self.net = timm.create_model(cfg.model, pretrained=pretrained, num_classes=0, global_pool=cfg.global_pool, **create_kwargs)
        except (RuntimeError, TypeError, ValueError, KeyError) as err:
            raise MergeflowError(f"backbone: timm could not build '{cfg.model}' ({str(err).splitlines()[0]})") from None
        self.input_norm = cfg.input_norm
        mean, std = self.net.pretrained_cfg.get("mean", (0.5,) * 3), self.net.pretrained_cfg.get("std", (0.5,) * 3)
        self.register_buffer("mean", torch.tensor(mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, 3, 1, 1), persistent=False)

    @property
    def num_features(self) -> int:
        return self.net.num_features

    def normalise(self, images: torch.Tensor) -> torch.Tensor:
        x = images.permute(0, 3, 1, 2).float().div_(255.0)
        if self.input_norm == "per_image":
            # each image and channel to zero mean, unit variance: removes global brightness, contrast and hue
            mu = x.mean(dim=(2, 3), keepdim=True)
            sd = x.std(dim=(2, 3), keepdim=True)
            return (x - mu) / (sd + 1e-3)
        if self.input_norm == "center":
            # each channel centred, one scale per image: keeps the colour of the contrast (the embedded suite's
            # tasks live in distinct palettes), and pretraining learns much faster than with fixed scaling
            mu = x.mean(dim=(2, 3), keepdim=True)
            return (x - mu) / (x.std(dim=(1, 2, 3), keepdim=True) + 0.05)
        if self.input_norm == "pretrained_cfg":
            return (x - self.mean) / self.std
        return x

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(self.normalise(images))


def build_backbone(cfg: BackboneConfig, state: StateDict | None = None, *, source: str = "backbone") -> Backbone:
    """A backbone with random init, or holding ``state`` after checking its keys, shapes and dtypes."""
    model = Backbone(cfg)
    if state is not None:
        check_compatible(model.net.state_dict(), state, reference_name=f"backbone '{cfg.model}'", other_name=source)
        model.net.load_state_dict(state)
    return model


def load_backbone(cfg: BackboneConfig, path: str | Path) -> Backbone:
    return build_backbone(cfg, load_state_dict(path), source=str(path))


def backbone_state(model: Backbone) -> StateDict:
    return {k: v.detach().clone() for k, v in model.net.state_dict().items()}


def backbone_metadata(cfg: BackboneConfig) -> dict[str, str]:
    return {"model": cfg.model, "kwargs": json.dumps(cfg.kwargs, sort_keys=True), "global_pool": cfg.global_pool, "input_norm": cfg.input_norm}


def make_head(num_features: int, num_classes: int) -> nn.Linear:
    return nn.Linear(num_features, num_classes)


def load_head(path: str | Path, num_features: int, num_classes: int | None = None, classes_source: str = "its task") -> nn.Linear:
    """A task's linear head, checked against the backbone's features and (when given) the number of classes
    that ``classes_source``, the task's data file, declares."""
    state = load_state_dict(path)
    if set(state) != {"weight", "bias"} or state["weight"].ndim != 2 or state["bias"].shape != state["weight"].shape[:1]:
        found = ", ".join(f"'{k}' {tuple(v.shape)}" for k, v in sorted(state.items()))
        raise MergeflowError(f"{path}: a head holds exactly 'weight' [C, D] and 'bias' [C], found {found}")
    if state["weight"].shape[1] != num_features:
        raise MergeflowError(f"{path}: tensor 'weight' has {state['weight'].shape[1]} input features, the backbone gives {num_features}")
    if num_classes is not None and state["weight"].shape[0] != num_classes:
        raise MergeflowError(f"{path}: tensor 'weight' has {state['weight'].shape[0]} rows, but {classes_source} declares {num_classes} classes")
    head = make_head(num_features, state["weight"].shape[0])
    head.load_state_dict(state)
    return head


def select_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise MergeflowError("runtime.device: 'cuda' asked for but no CUDA device is available")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)
