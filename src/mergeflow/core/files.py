"""Files written whole or not at all, and JSON: every writer goes through a temporary file (or directory) in the
destination's folder and an ``os.replace``, so a failing stage never leaves a half-written output behind. No torch
here: `mergeflow check` and the lock file's keeper write through it in well under a second."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from safetensors import SafetensorError

from mergeflow.core.errors import MergeflowError


def _umask() -> int:
    """The process's umask, read without changing it (/proc/self/status, Linux 4.7+): setting it to read it back, the
    usual idiom, would briefly give other threads' new files a wrong mode."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # no /proc: the racy idiom is all there is
    os.umask(mask)
    return mask


# disk full, quota exceeded: the errnos a write fails with when the output does not fit
_NO_SPACE = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}


def _no_space(err: BaseException) -> str | None:
    """What ran out, if ``err`` is a write failing for lack of space (an OSError, or safetensors' own error, which
    carries the errno only in its text: 'I/O error: No space left on device (os error 28)')."""
    if isinstance(err, OSError):
        return _NO_SPACE.get(err.errno)
    if isinstance(err, SafetensorError):
        found = re.search(r"\(os error (\d+)\)", str(err))
        return _NO_SPACE.get(int(found.group(1))) if found else None
    return None


class NoSpaceError(MergeflowError):
    """An output that did not fit on its file system; ``path`` is the output being written."""

    def __init__(self, path: Path, lacking: str, kind: str):
        super().__init__(
            f"{path}: could not be written: {lacking} (the partial {kind} was removed; free space and run again)"
        )
        self.path, self.lacking, self.kind = path, lacking, kind


def default_mode(*, directory: bool = False) -> int:
    """The mode open() or mkdir() would give a new file or directory (0644 / 0755 under umask 022)."""
    return (0o777 if directory else 0o666) & ~_umask()


def temporary_prefix(path: Path) -> str:
    """A hidden sibling's name prefix that names this process: `.<name>.tmp-<pid>-` (.dvcignore'd; swept once the
    process is gone)."""
    return f".{path.name}.tmp-{os.getpid()}-"


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` is running here (a zombie, dead but not yet reaped, is not)."""
    import psutil

    if pid <= 0:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


_TEMPORARY = re.compile(r"^\..+\.(?:tmp-(\d+)-.*|old-(\d+))$")


def sweep_temporaries(roots: list[Path]) -> list[Path]:
    """Remove the temporaries (files or directories) that interrupted atomic writes left under ``roots``: those of
    processes no longer running. A live process's (a concurrent stage's write in progress) are left. Returns what
    was removed."""
    removed = []
    for root in roots:
        if not root.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            for name in [*dirnames, *filenames]:
                match = _TEMPORARY.match(name)
                if match and not process_alive(int(match.group(1) or match.group(2))):
                    target = Path(dirpath) / name
                    if target.is_dir() and not target.is_symlink():
                        shutil.rmtree(target, ignore_errors=True)
                        dirnames.remove(name)
                    else:
                        target.unlink(missing_ok=True)
                    removed.append(target)
    return removed


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, directory: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling path; on success move it onto ``path``, on failure delete it.

    The output gets the permissions of a file made by open() or a directory by mkdir() (0644 / 0755 under umask
    022), not mkstemp's 0600 / mkdtemp's 0700: other users and serving processes read the models. A write that
    runs out of space is one line naming ``path``.
    """
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if directory:
            tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=temporary_prefix(path)))
        else:
            fd, name = tempfile.mkstemp(dir=path.parent, prefix=temporary_prefix(path))
            os.close(fd)
            tmp = Path(name)
        yield tmp
        # set here, not at creation: writers such as safetensors replace the file with one of their own
        os.chmod(tmp, default_mode(directory=directory))
        if directory and path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException as err:
        if tmp is not None and tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp is not None:
            tmp.unlink(missing_ok=True)
        if isinstance(err, NoSpaceError) and tmp is not None and tmp in err.path.parents:
            # a file written inside this temporary directory: name it where it was going, the directory is gone
            raise NoSpaceError(path / err.path.relative_to(tmp), err.lacking, err.kind) from None
        lacking = _no_space(err)
        if lacking:
            raise NoSpaceError(path, lacking, "directory" if directory else "file") from None
        raise


def write_json(path: str | os.PathLike, obj) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def read_json(path: str | os.PathLike):
    path = Path(path)
    if not path.is_file():
        raise MergeflowError(f"{path}: file not found")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise MergeflowError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
