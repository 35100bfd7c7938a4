"""Published fine-tuned CLIP image towers as the pipeline's timm state dicts, read without running their pickles.

Three namings reach the same timm ``VisionTransformer`` (e.g. ``vit_base_patch32_clip_quickgelu_224`` built with
``num_classes`` = CLIP's embedding dim and ``global_pool="token"``, so that timm's ``head`` is CLIP's visual
projection):

- open_clip's (``visual.conv1.weight``, ..., ``visual.proj``), as in the task arithmetic papers' checkpoints
  (github:mlfoundations/task_vectors): ``torch.save`` of a whole ``src.modeling.ImageEncoder`` module. Such a file
  is a pickle that names the authors' classes, open_clip's and torchvision's; ``torch.load`` would import them and
  run whatever the pickle says. Here a restricted unpickler (:class:`_Unpickler`) rebuilds tensors with its own
  functions and turns every other global into an inert :class:`_Pickled` record, from which the module tree's
  parameters and buffers are read back as ``module.state_dict()`` would name them.
- Hugging Face transformers' ``CLIPVisionModel`` / ``CLIPVisionModelWithProjection`` / ``CLIPModel``
  (``vision_model.encoder.layers.{i}.self_attn.q_proj``, ...), as FusionBench publishes its fine-tunes on the hub.
- timm's own, passed through.

FusionBench's fine-tunes are ``CLIPVisionModel`` files without ``visual_projection``: CLIP's projection was not
fine-tuned there, so it is taken from the pretrained backbone (``projection_from``) and its task vector is zero.

A package: ``unpickler`` (the restricted unpickler), ``reader`` (a file's tensors, ``read_tensors``), ``namings``
(CLIP's namings to timm's, ``read_checkpoint``), ``hub`` (``resolve_source``).
"""

from __future__ import annotations

from mergeflow.ml.checkpoints.hub import resolve_source
from mergeflow.ml.checkpoints.namings import read_checkpoint, to_timm_clip
from mergeflow.ml.checkpoints.reader import read_tensors
from mergeflow.ml.checkpoints.unpickler import _ALLOWED

__all__ = [
    "_ALLOWED",
    "read_checkpoint",
    "read_tensors",
    "resolve_source",
    "to_timm_clip",
]
