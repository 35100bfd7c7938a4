"""The Prefect flows. Prefect reads its home folder when it is imported, so it is made sure of first
(mergeflow.core.homes): an unwritable HOME gets the repository's .prefect/ and a notice, or one line, not a
traceback."""

import os
import sys
from pathlib import Path

from mergeflow.core.errors import MergeflowError
from mergeflow.core.homes import ensure_prefect_home


def _root() -> Path:
    """The repository the flow runs: the working directory when it is a DVC project, else this checkout."""
    return Path.cwd() if (Path.cwd() / "dvc.yaml").is_file() else Path(__file__).resolve().parents[1]


# for every flow (the pipeline, serve, a script that imports them), set before Prefect is imported: the temporary
# server's telemetry write can collide with the flow's first writes to its SQLite database, and its first start
# (fresh PREFECT_HOME: migrations; fresh venv: bytecode; a busy machine) can outlast Prefect's 20 s default
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")

try:
    if _notice := ensure_prefect_home(_root()):
        print(f"warning: {_notice}", file=sys.stderr)
except MergeflowError as _err:
    print(f"error: {_err}", file=sys.stderr)
    raise SystemExit(_err.exit_status) from None
