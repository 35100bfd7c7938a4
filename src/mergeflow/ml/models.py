"""The backbone (any timm model, features only) and the per-task linear heads.

Images travel as uint8 NHWC tensors; the backbone converts them to float and normalises them itself, so every
stage feeds it the same way. The normalisation has no parameters: the backbone's state dict is exactly timm's.
"""

from __future__ import annotations

import json
import pickle
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import timm
import torch
from torch import nn

from mergeflow.config import BackboneConfig, Params
from mergeflow.core.errors import MergeflowError
from mergeflow.core.io import StateDict, check_compatible, check_finite, load_state_dict
from mergeflow.core.layout import Layout

if TYPE_CHECKING:
    from mergeflow.ml.data import TaskData


class Backbone(nn.Module):
    """uint8 images [N, H, W, 3] -> pooled features [N, D]."""

    def __init__(self, cfg: BackboneConfig, *, pretrained: bool = False):
        super().__init__()
        create_kwargs = dict(cfg.kwargs, num_classes=embedding_dim(cfg), global_pool=cfg.global_pool)
        if pretrained and cfg.pretrained == "hub":
            self.net = _from_hub(cfg, create_kwargs)
        elif pretrained and cfg.pretrained is not None:
            self.net = _from_file(cfg, Path(cfg.pretrained), create_kwargs)
        else:
            self.net = _create(cfg, pretrained=False, **create_kwargs)
        self.input_norm = cfg.input_norm
        self.embedding = cfg.embedding
        if cfg.embedding == "clip":
            # CLIP's projection has no bias: timm's head keeps one at zero (its CLIP converter writes zeros)
            self.net.head.bias.requires_grad_(False)
        mean, std = self.net.pretrained_cfg.get("mean", (0.5,) * 3), self.net.pretrained_cfg.get("std", (0.5,) * 3)
        self.register_buffer("mean", torch.tensor(mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, 3, 1, 1), persistent=False)

    @property
    def num_features(self) -> int:
        return self.net.num_classes if self.embedding == "clip" else self.net.num_features

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

    def embed(self, features: torch.Tensor) -> torch.Tensor:
        """The net's output as the heads read it: CLIP's image embedding is compared with text embeddings on the
        unit sphere (the papers' heads normalise); pooled features as they are. Every route that calls ``net``
        itself (torch.func.functional_call) ends with this."""
        return nn.functional.normalize(features, dim=-1) if self.embedding == "clip" else features

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.embed(self.net(self.normalise(images)))


def embedding_dim(cfg: BackboneConfig) -> int:
    """The classifier timm builds: none (0) for pooled features; CLIP's projection to its joint embedding (the
    size timm's CLIP configurations give their head, e.g. 512 for ViT-B, 768 for ViT-L) for clip."""
    if cfg.embedding == "pooled":
        return 0
    clip = "clip" in cfg.model and timm.models.is_model(cfg.model)
    dim = getattr(timm.models.get_pretrained_cfg(cfg.model), "num_classes", None) if clip else None
    if not dim:
        raise MergeflowError(
            "backbone.embedding: clip needs a timm CLIP model (e.g. vit_base_patch32_clip_quickgelu_224.openai); "
            f"'{cfg.model}' has no CLIP projection"
        )
    return int(dim)


def _create(cfg: BackboneConfig, **kwargs) -> nn.Module:
    try:
        return timm.create_model(cfg.model, **kwargs)
    except (RuntimeError, TypeError, ValueError, KeyError) as err:
        raise MergeflowError(f"backbone: timm could not build '{cfg.model}' ({_first_line(err)})") from None


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def read_weights(path: Path) -> StateDict:
    """``backbone.pretrained``'s local file as a state dict: safetensors, or a PyTorch checkpoint holding only
    tensors. torch.load runs with weights_only=True, so a pickle never runs code; a refused one is one line."""
    where = f"backbone.pretrained: {path}"
    if not path.is_file():
        raise MergeflowError(f"backbone.pretrained: weights file '{path}' not found")
    if path.suffix == ".safetensors":
        try:
            return load_state_dict(path)
        except MergeflowError as err:
            raise MergeflowError(f"backbone.pretrained: {err}") from None
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols on stderr: the error says enough
            warnings.simplefilter("ignore")
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        pickled = re.search(r"GLOBAL ([\w.]+)", str(err))
        if pickled:  # a class or function in the pickle: a whole model, an optimizer, or code to run
            raise MergeflowError(
                f"{where}: holds pickled Python objects, not only tensors (torch.load(weights_only=True) refuses to "
                f"unpickle {pickled.group(1)}); "
                "save the model's state_dict() with safetensors.torch.save_file "
                "and point backbone.pretrained at that file"
            ) from None
        found = re.search(r"WeightsUnpickler error:\s*(.+)", str(err))
        raise MergeflowError(
            f"{where}: not a readable PyTorch checkpoint (torch.load(weights_only=True) refused it: "
            f"{found.group(1).strip() if found else _first_line(err)})"
        ) from None
    # torch.load raises whatever its unpickler or zip reader hit: every one is a bad file
    except Exception as err:  # noqa: BLE001
        raise MergeflowError(
            f"{where}: not a readable PyTorch checkpoint ({type(err).__name__}: {_first_line(err)})"
        ) from None
    if isinstance(checkpoint, dict):
        # the wrappers timm's own loader unwraps (training checkpoints), then its 'module.' prefix clean-up
        for key in ("state_dict_ema", "model_ema", "state_dict", "model"):
            if isinstance(checkpoint.get(key), dict):
                checkpoint = checkpoint[key]
                break
    if not isinstance(checkpoint, dict):
        raise MergeflowError(
            f"{where}: holds {type(checkpoint).__name__}, expected a state dict (tensor name -> tensor)"
        )
    state = timm.models.clean_state_dict(checkpoint)
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise MergeflowError(
                f"{where}: entry '{key}' is not a tensor ({type(value).__name__}), "
                "expected a state dict holding only tensors"
            )
    check_finite(state, where)
    return state


_LOAD_ERRORS = (
    # torch's load_state_dict(strict=True) report, one clause per line: the first key of each kind is named
    (
        re.compile(r'Missing key\(s\) in state_dict: "([^"]+)"'),
        "missing tensor '{0}' that the model expects ({1} missing)",
    ),
    (
        re.compile(r'Unexpected key\(s\) in state_dict: "([^"]+)"'),
        "unexpected tensor '{0}' that the model does not have ({1} unexpected)",
    ),
    (
        re.compile(
            r"size mismatch for ([^:]+): copying a param with shape torch.Size\(\[([^\]]*)\]\) from checkpoint, the "
            r"shape in current model is torch.Size\(\[([^\]]*)\]\)"
        ),
        "tensor '{0}' has shape {1}, the model expects {2}",
    ),
)


def _shape(dims: str) -> str:
    """'96, 32' (inside torch.Size([...])) -> '(96, 32)'; '128' -> '(128,)'."""
    return str(tuple(int(d) for d in dims.split(",") if d.strip()))


def _describe_load_error(err: BaseException) -> str | None:
    """One line for torch's multi-line key and shape mismatch report, or None if ``err`` is not one."""
    for line in str(err).splitlines() if isinstance(err, RuntimeError) else ():
        for pattern, template in _LOAD_ERRORS:
            found = pattern.search(line)
            if found and template.startswith("tensor"):
                return template.format(found.group(1), _shape(found.group(2)), _shape(found.group(3)))
            if found:
                return template.format(found.group(1), len(re.findall(r'"[^"]+"', line)))
    return None


def _load_failure(cfg: BackboneConfig, source: str, err: Exception, create_kwargs: dict) -> MergeflowError:
    """The one line for timm failing to build ``cfg.model`` with ``source``'s weights."""
    _create(cfg, pretrained=False, **create_kwargs)  # the architecture itself failing: that line, not the weights'
    described = (
        _describe_load_error(err)
        or f"timm could not load them into '{cfg.model}' ({type(err).__name__}: {_first_line(err)})"
    )
    if described.startswith("missing tensor 'fc_norm."):
        # timm ViTs: average pooling normalises after pooling (fc_norm), class-token pooling before it (norm)
        described += (
            f"; weights trained with class-token pooling need backbone.global_pool: token (not '{cfg.global_pool}')"
        )
    return MergeflowError(f"backbone.pretrained: {source}: {described}")


def _from_file(cfg: BackboneConfig, path: Path, create_kwargs: dict) -> nn.Module:
    """timm's model with ``path``'s weights, through timm's own loading (its checkpoint filter adapts position
    embeddings and patch sizes) but reading the file here, with one-line errors.

    Loading is strict: timm drops the classifier when the model has none (num_classes=0) and then loads leniently,
    so a checkpoint of another depth or model would leave layers at their random init without a word. Here the
    classifier is dropped from the file's tensors first, and every other tensor must fit.
    """
    if cfg.embedding == "clip":
        from mergeflow.ml.checkpoints import read_checkpoint

        # CLIP's image tower in any naming (timm, open_clip, Hugging Face), pickled modules read without unpickling
        if not path.is_file():
            raise MergeflowError(f"backbone.pretrained: weights file '{path}' not found")
        state = read_checkpoint(path, source=f"backbone.pretrained: {path}")
    else:
        state = read_weights(path)
    if cfg.embedding == "pooled":  # CLIP's head is its projection, part of the model
        classifier = getattr(timm.models.get_pretrained_cfg(cfg.model), "classifier", None) or ()
        for name in (classifier,) if isinstance(classifier, str) else classifier:
            state.pop(f"{name}.weight", None)
            state.pop(f"{name}.bias", None)
    try:
        # the model's own num_classes in the overlay: timm then sees no classifier to adapt and keeps its load strict
        net = timm.create_model(
            cfg.model,
            pretrained=True,
            pretrained_cfg_overlay=dict(state_dict=state, num_classes=create_kwargs["num_classes"]),
            **create_kwargs,
        )
    except Exception as err:  # noqa: BLE001  timm's checkpoint filters raise anything on a foreign file
        raise _load_failure(cfg, str(path), err, create_kwargs) from None
    net.pretrained_cfg.pop("state_dict", None)  # the overlay would keep a second copy of the weights alive
    return net


def _from_hub(cfg: BackboneConfig, create_kwargs: dict) -> nn.Module:
    """timm's model with its Hugging Face hub weights (or the local cache's copy)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return timm.create_model(cfg.model, pretrained=True, **create_kwargs)
    except OSError as err:  # the hub's errors (not cached, no network, HTTP 401/404) are all OSErrors
        hub_id = getattr(timm.models.get_pretrained_cfg(cfg.model), "hf_hub_id", None) or cfg.model
        if isinstance(err, LocalEntryNotFoundError) and constants.HF_HUB_OFFLINE:
            raise MergeflowError(
                f"backbone.pretrained: hub: the weights of '{cfg.model}' "
                f"({hub_id} on the Hugging Face hub) are not in the local cache, "
                f"and downloads are off; download them once with network access "
                f"(`mergeflow pretrain --download`, or `hf download {hub_id}`), "
                "or set backbone.pretrained to a local weights file"
            ) from None
        raise MergeflowError(
            f"backbone.pretrained: hub: could not get the weights of '{cfg.model}' ({hub_id} on the Hugging Face hub): "
            f"{type(err).__name__}: {_first_line(err)}"
        ) from None
    except Exception as err:  # noqa: BLE001  as for a file: the hub's weights do not fit backbone.kwargs' model
        raise _load_failure(cfg, "hub", err, create_kwargs) from None


def new_backbone(cfg: BackboneConfig, *, pretrained: bool = False) -> Backbone:
    """The backbone ``cfg`` describes: timm's image model, a transformers text encoder (mergeflow.ml.text_models) or
    encoder-decoder (mergeflow.ml.seq2seq_models: its first generated token's logits), all taking their inputs as
    tensors and giving features; ``pretrained``: with backbone.pretrained's weights."""
    if cfg.library == "transformers":
        from mergeflow.ml.text_models import TextBackbone, model_config

        config = model_config(cfg)
        if getattr(config, "is_encoder_decoder", False):
            from mergeflow.ml.seq2seq_models import Seq2SeqBackbone

            return Seq2SeqBackbone(cfg, pretrained=pretrained, config=config)
        return TextBackbone(cfg, pretrained=pretrained)
    return Backbone(cfg, pretrained=pretrained)


def build_backbone(cfg: BackboneConfig, state: StateDict | None = None, *, source: str = "backbone") -> Backbone:
    """A backbone with random init, or holding ``state`` after checking its keys, shapes and dtypes."""
    model = new_backbone(cfg)
    if state is not None:
        check_compatible(model.net.state_dict(), state, reference_name=f"backbone '{cfg.model}'", other_name=source)
        model.net.load_state_dict(state)
    return model


def load_backbone(cfg: BackboneConfig, path: str | Path) -> Backbone:
    return build_backbone(cfg, load_state_dict(path), source=str(path))


def backbone_state(model: Backbone) -> StateDict:
    return {k: v.detach().clone() for k, v in model.net.state_dict().items()}


def backbone_metadata(cfg: BackboneConfig) -> dict[str, str]:
    if cfg.library == "transformers":
        return {
            "library": cfg.library,
            "model": cfg.model,
            "kwargs": json.dumps(cfg.kwargs, sort_keys=True),
            "global_pool": cfg.global_pool,
        }
    return {
        "model": cfg.model,
        "kwargs": json.dumps(cfg.kwargs, sort_keys=True),
        "global_pool": cfg.global_pool,
        "input_norm": cfg.input_norm,
    }


def make_head(num_features: int, num_classes: int) -> nn.Linear:
    return nn.Linear(num_features, num_classes)


def load_head(
    path: str | Path, num_features: int, num_classes: int | None = None, classes_source: str = "its task"
) -> nn.Linear:
    """A task's linear head, checked against the backbone's features and (when given) the number of classes
    that ``classes_source``, the task's data file, declares."""
    state = load_state_dict(path)
    if (
        set(state) != {"weight", "bias"}
        or state["weight"].ndim != 2
        or state["bias"].shape != state["weight"].shape[:1]
    ):
        found = ", ".join(f"'{k}' {tuple(v.shape)}" for k, v in sorted(state.items()))
        raise MergeflowError(f"{path}: a head holds exactly 'weight' [C, D] and 'bias' [C], found {found}")
    if state["weight"].shape[1] != num_features:
        raise MergeflowError(
            f"{path}: tensor 'weight' has {state['weight'].shape[1]} input features, the backbone gives {num_features}"
        )
    if num_classes is not None and state["weight"].shape[0] != num_classes:
        raise MergeflowError(
            f"{path}: tensor 'weight' has {state['weight'].shape[0]} "
            f"rows, but {classes_source} declares {num_classes} classes"
        )
    head = make_head(num_features, state["weight"].shape[0])
    head.load_state_dict(state)
    return head


def load_heads(
    params: Params, layout: Layout, num_features: int, tasks: Mapping[str, TaskData]
) -> dict[str, nn.Linear]:
    """Each task's head (the finetune stages' outputs), checked against the backbone's features and the task file's
    declared classes."""
    return {
        t: load_head(
            layout.head(t), num_features, num_classes=len(tasks[t].classes), classes_source=str(layout.task_data(t))
        )
        for t in params.suite.tasks
    }


def select_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise MergeflowError("runtime.device: 'cuda' asked for but no CUDA device is available")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)
