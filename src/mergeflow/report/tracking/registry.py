"""Merged models as MLflow models (mergeflow.ml.mlflow_model), logged once per weights file, and the model registry's
best merged model."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path

from mergeflow.config import Params
from mergeflow.report.tracking.runs import _Recorder


class _NoSignatureNotice(logging.Filter):
    """MLflow's notice, once per model logged, that predict's type hints (np.ndarray -> np.ndarray, see
    mergeflow.ml.mlflow_model) give no signature: the signature is given instead (mlflow_model.signature)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "cannot be used to infer model signature" not in record.getMessage()


@functools.lru_cache(maxsize=4)
def _feature_count(backbone_json: str) -> int:
    """D of the features a backbone configuration gives, from its architecture (built once per configuration)."""
    from mergeflow.config import BackboneConfig
    from mergeflow.ml.models import new_backbone

    return new_backbone(
        BackboneConfig(**json.loads(backbone_json)).model_copy(update={"pretrained": None})
    ).num_features


def _log_merged_model(recorder: _Recorder, run_id: str, weights: Path, md5: str, params: Params) -> str:
    """Log a merged model as an MLflow model (mergeflow.ml.mlflow_model) unless one with these weights is stored;
    returns its model URI (also the run's tag mergeflow.model_uri)."""
    import mlflow
    import numpy
    import pydantic
    import safetensors
    import timm
    import torch

    from mergeflow.ml import mlflow_model

    holder = recorder.stored(md5)
    if holder and holder.get("mergeflow.model_uri"):
        uri = holder["mergeflow.model_uri"]
        recorder.client.set_tag(run_id, "mergeflow.weights_in.model", f"runs:/{holder['run_id']}")
    else:
        requirements = [
            f"{m.__name__}=={m.__version__.split('+')[0]}" for m in (torch, timm, safetensors, numpy, pydantic, mlflow)
        ]
        with contextlib.ExitStack() as stack:
            backbone = (
                Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mergeflow-track-")))
                / mlflow_model.BACKBONE
            )
            backbone.write_text(json.dumps(params.backbone.model_dump(mode="json"), indent=2))
            stack.enter_context(mlflow.start_run(run_id=run_id))
            notices, quiet = logging.getLogger("mlflow.pyfunc"), _NoSignatureNotice()
            notices.addFilter(quiet)
            stack.callback(notices.removeFilter, quiet)
            # and its warning that no input example is given: running the model on one would cost a load per model
            stack.enter_context(warnings.catch_warnings())
            warnings.filterwarnings(
                "ignore", message=".*An input example was not provided", category=UserWarning
            )  # after a colour code
            features = _feature_count(backbone.read_text())
            info = mlflow.pyfunc.log_model(
                name="model",
                python_model=mlflow_model.__file__,
                signature=mlflow_model.signature(features),
                artifacts={"weights": str(weights.resolve()), "backbone": str(backbone)},
                pip_requirements=requirements,  # given, so MLflow does not run the model to infer them
            )
        uri = info.model_uri
        recorder.client.set_tag(run_id, "mergeflow.weights_md5", md5)
    recorder.client.set_tag(run_id, "mergeflow.model_uri", uri)
    return uri


def register_best(client, name: str, merge_runs: Mapping[str, str]) -> dict | None:
    """Register the merged model with the highest validation average (val_avg: chosen as its hyperparameters were,
    never on test) among ``merge_runs`` (method -> run id, single-model methods only) as a version of ``name``,
    tagged with its method, hyperparameters and both averages; no new version when the latest one already comes
    from that run. Returns {"name", "version", "run_id", "method"} or None."""
    from mlflow.exceptions import MlflowException

    runs = [client.get_run(r) for r in merge_runs.values()]
    runs = [r for r in runs if "val_avg" in r.data.metrics and r.data.tags.get("mergeflow.model_uri")]
    if not runs:
        return None
    best = max(runs, key=lambda r: r.data.metrics["val_avg"])  # the first of equals: merge.methods' order
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(
            name,
            description="Each pipeline run's best merged model, chosen on validation (the highest val_avg among "
            "single-model methods). Load a version, e.g. the first, with "
            f"`mergeflow.ml.mlflow_model.load_model('models:/{name}/1')`.",
        )
    versions = client.search_model_versions(f"name = '{name}'")
    latest = max(versions, key=lambda v: int(v.version), default=None)
    if latest is not None and latest.run_id == best.info.run_id:
        return {
            "name": name,
            "version": latest.version,
            "run_id": best.info.run_id,
            "method": best.data.params["method"],
        }
    hyperparameters = {
        k: v for k, v in best.data.params.items() if k not in ("method", "kind", "paper") and not k.startswith("grid.")
    }
    tags = {
        "method": best.data.params["method"],
        "val_avg": f"{best.data.metrics['val_avg']:.2f}",
        "test_avg": f"{best.data.metrics['test_avg']:.2f}",
        "run_id": best.info.run_id,
    } | hyperparameters
    version = client.create_model_version(
        name, best.data.tags["mergeflow.model_uri"], run_id=best.info.run_id, tags=tags
    )
    return {"name": name, "version": version.version, "run_id": best.info.run_id, "method": tags["method"]}
