"""Merged models as MLflow models, and loading them back.

``track`` logs each merged model (methods of kind "model": one set of weights for every task) with
``mlflow.pyfunc.log_model(python_model=<this file>, ...)``, MLflow's "models from code": the model's files are this
file, the weights as safetensors (``weights.safetensors``) and the backbone's configuration (``backbone.json``, the
``backbone`` section of params.yaml). Nothing is pickled. Two ways back:

    from mergeflow.ml.mlflow_model import load_model, load_timm
    net = load_model("runs:/<run_id>/model", "sqlite:///mlflow.db")
    # torch.nn.Module: uint8 images [N, H, W, 3] -> features [N, D]
    timm_net, preprocess = load_timm("runs:/<run_id>/model", "sqlite:///mlflow.db")
    features = timm_net(preprocess(images))   # the timm model takes float [N, 3, H, W], as timm's models do

    import mlflow
    features = mlflow.pyfunc.load_model("runs:/<run_id>/model").predict(images)   # numpy in, numpy out

The model's MLflow signature says so: uint8 images [-1, -1, -1, 3] in, float32 features [-1, D] out (``signature``).

``models:/mergeflow-<suite>/<version>`` (the model registry) works in both. Task heads are not part of the model:
they are the fine-tuning runs' ``heads/<task>.safetensors`` artifacts.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import mlflow
import numpy as np
import torch

WEIGHTS = "weights.safetensors"
BACKBONE = "backbone.json"


def _build(weights: str | Path, backbone: str | Path) -> torch.nn.Module:
    from mergeflow.config import BackboneConfig
    from mergeflow.core.io import load_state_dict
    from mergeflow.ml.models import build_backbone

    cfg = BackboneConfig(**json.loads(Path(backbone).read_text()))
    # the architecture comes from the configuration alone: never timm's or a file's pretrained weights
    model = build_backbone(cfg.model_copy(update={"pretrained": None}), load_state_dict(weights), source=str(weights))
    return model.eval()


def signature(num_features: int):
    """The merged model's MLflow signature: uint8 images [N, H, W, 3] (any size the backbone accepts) in, float32
    features [N, num_features] out."""
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    # unnamed: a named tensor would reach predict as {name: array}
    images = TensorSpec(np.dtype(np.uint8), (-1, -1, -1, 3))
    return ModelSignature(
        inputs=Schema([images]), outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, num_features))])
    )


def load_model(model_uri: str, tracking_uri: str | None = None) -> torch.nn.Module:
    """The backbone of a merged model logged by ``track`` (``runs:/<run_id>/model``, ``models:/<id>`` or
    ``models:/<name>/<version>``), in eval mode, built from its configuration with timm and holding its weights:
    it takes uint8 images [N, H, W, 3] (not a timm-style float tensor: ``load_timm`` gives that) and returns the
    features the task heads read [N, D]. ``tracking_uri``: the store (default: MLflow's current one, e.g.
    MLFLOW_TRACKING_URI, such as sqlite:///mlflow.db). Reads the files only: no code stored with the model runs."""
    import yaml

    previous = mlflow.get_tracking_uri()
    if (
        tracking_uri
    ):  # set for the call: MLflow resolves runs:/<id>/model through the current store, whatever it is passed
        mlflow.set_tracking_uri(tracking_uri)
    store = mlflow.get_tracking_uri()
    # track's artifact locations are relative to the workspace, the folder of its SQLite store: read from there
    workspace = Path(store.removeprefix("sqlite:///")).parent if store.startswith("sqlite:///") else Path.cwd()
    try:
        with contextlib.chdir(workspace):
            local = Path(mlflow.artifacts.download_artifacts(artifact_uri=model_uri, tracking_uri=tracking_uri))
    finally:
        mlflow.set_tracking_uri(previous)
    spec = yaml.safe_load((local / "MLmodel").read_text())
    files = spec.get("flavors", {}).get("python_function", {}).get("artifacts", {})
    if set(files) != {"weights", "backbone"}:
        raise ValueError(
            f"{model_uri}: not a mergeflow merged model (its MLmodel names "
            f"artifacts {sorted(files)}, expected 'weights' and 'backbone')"
        )
    return _build(local / files["weights"]["path"], local / files["backbone"]["path"])


def load_timm(model_uri: str, tracking_uri: str | None = None):
    """(timm model, preprocess) of a merged model: ``preprocess`` turns uint8 images [N, H, W, 3] into the float
    [N, 3, H, W] the timm model takes (the backbone's ``input_norm``), and ``timm_net(preprocess(images))`` are its
    features. For a CLIP embedding (``backbone.embedding: clip``) ``load_model``'s output is those features
    L2-normalised, as the zero-shot heads read them."""
    backbone = load_model(model_uri, tracking_uri)
    return backbone.net, backbone.normalise


class MergedBackbone(mlflow.pyfunc.PythonModel):
    """pyfunc wrapper: ``predict`` takes uint8 images [N, H, W, 3] (a numpy array) and returns features [N, D]."""

    def load_context(self, context) -> None:
        self.net = _build(context.artifacts["weights"], context.artifacts["backbone"])

    # np.ndarray in and out: the type hint MLflow wants (without one it warns on every model logged), one it infers
    # no schema from, so inputs are neither validated nor converted (predict takes what np.asarray reads)
    def predict(self, context, model_input: np.ndarray, params=None) -> np.ndarray:
        with torch.no_grad():
            return self.net(torch.as_tensor(np.asarray(model_input, dtype=np.uint8))).numpy()


if __name__ != "mergeflow.ml.mlflow_model":  # run by MLflow as the model's code (under a name of its own), not imported
    mlflow.models.set_model(MergedBackbone())
