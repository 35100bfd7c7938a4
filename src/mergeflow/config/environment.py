"""Settings of the environment, not of the run (no DVC parameter): downloads allowed, the MLflow UI's address."""

from __future__ import annotations

import os
import urllib.parse

DOWNLOAD_ENV = "MERGEFLOW_DOWNLOAD"  # set by --download
# Where the MLflow UI is served: `mergeflow ui` serves on its port unless given --port, `track` prints its address
# and the Prefect flow's summary artifact links there. Set MERGEFLOW_MLFLOW_UI when the UI runs elsewhere.
MLFLOW_UI_ENV = "MERGEFLOW_MLFLOW_UI"
DEFAULT_MLFLOW_UI = "http://127.0.0.1:5000"


def mlflow_ui_base() -> str:
    """The MLflow UI's address, without a trailing slash: MERGEFLOW_MLFLOW_UI, else ``mergeflow ui``'s default."""
    return (os.environ.get(MLFLOW_UI_ENV) or DEFAULT_MLFLOW_UI).rstrip("/")


def mlflow_ui_port() -> int:
    """The port of that address: the one ``mergeflow ui`` serves on unless given --port."""
    return urllib.parse.urlsplit(mlflow_ui_base()).port or 5000
