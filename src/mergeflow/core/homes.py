"""The home folders the tools write, made sure of before they are imported: Prefect's (``PREFECT_HOME``, by
default ~/.prefect) holds its settings profile, the temporary server's database and its logs, and Prefect reads it
when it is imported, so a HOME this user cannot write (a read-only home in a container, a service account's
``/nonexistent``) would end the flow in a traceback from deep inside Prefect. Then the repository's own
``.prefect/`` (git-ignored) serves instead, with a one-line notice; a ``PREFECT_HOME`` the user set is used as it
is, or is one line when it cannot be written.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from mergeflow.core.errors import MergeflowError

PREFECT_HOME_ENV = "PREFECT_HOME"


def writable(folder: Path) -> bool:
    """Whether this process can create ``folder`` (if need be) and a file in it: tried, not asked (os.access
    answers yes to root on a read-only mount)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=folder, prefix=".write-test-")
        os.close(fd)
        os.unlink(name)
        return True
    except OSError:
        return False


def ensure_prefect_home(root: str | Path) -> str | None:
    """A writable Prefect home before Prefect is imported: PREFECT_HOME as set, else ~/.prefect, else
    ``root/.prefect`` (set in PREFECT_HOME for this process and the ones it starts). Returns a one-line notice
    when it chose ``root/.prefect``; raises MergeflowError when no choice can be written."""
    if explicit := os.environ.get(PREFECT_HOME_ENV):
        if not writable(Path(explicit).expanduser()):
            raise MergeflowError(
                f"{PREFECT_HOME_ENV}={explicit}: Prefect's home is not a folder this user can write; set "
                f"{PREFECT_HOME_ENV} to one that is"
            )
        return None
    try:
        default = Path.home() / ".prefect"
    except RuntimeError:  # no HOME and no passwd entry
        default = None
    if default is not None and writable(default):
        return None
    fallback = Path(root).resolve() / ".prefect"
    if not writable(fallback):
        raise MergeflowError(
            f"{default}: Prefect's home cannot be written (HOME={os.environ.get('HOME', 'unset')}), nor {fallback}; "
            f"set {PREFECT_HOME_ENV} to a folder this user can write"
        )
    os.environ[PREFECT_HOME_ENV] = str(fallback)
    return (
        f"{default} cannot be written (HOME={os.environ.get('HOME', 'unset')}): "
        f"Prefect's home for this run is {fallback}"
    )
