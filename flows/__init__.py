"""The Prefect flows. Prefect reads its home folder when it is imported, so it is made sure of first
(mergeflow.homes): an unwritable HOME gets the repository's .prefect/ and a notice, or one line, not a traceback."""

import sys
from pathlib import Path

from mergeflow.errors import MergeflowError
from mergeflow.homes import ensure_prefect_home


def _root() -> Path:
    """The repository the flow runs: the working directory when it is a DVC project, else this checkout."""
    return Path.cwd() if (Path.cwd() / "dvc.yaml").is_file() else Path(__file__).resolve().parents[1]


try:
    if _notice := ensure_prefect_home(_root()):
        print(f"warning: {_notice}", file=sys.stderr)
except MergeflowError as _err:
    print(f"error: {_err}", file=sys.stderr)
    raise SystemExit(_err.exit_status) from None
