"""dvc.lock kept whole: DVC rewrites it in place (open with "w+", then dump), so a process killed during that write
leaves it empty or cut short, and every later DVC command fails on it. mergeflow's own DVC calls write it
atomically, a copy of the last readable dvc.lock is kept in DVC's tmp folder, and an unreadable one is restored
from that copy (or from git's HEAD) before anything else runs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import yaml

from mergeflow.errors import MergeflowError

LOCKFILE = "dvc.lock"
_patch_lock = threading.Lock()
_patch_depth = 0


def good_copy(root: str | Path) -> Path:
    """Where the last readable dvc.lock is kept (DVC's tmp folder: git- and DVC-ignored)."""
    return Path(root) / ".dvc" / "tmp" / "dvc.lock.good"


def readable(text: str) -> bool:
    """A dvc.lock that DVC can load: YAML that DVC's own lock-file schema accepts (an empty file is not)."""
    from dvc.schema import COMPILED_LOCKFILE_SCHEMA
    from voluptuous import Invalid

    try:
        data = yaml.safe_load(text)
        COMPILED_LOCKFILE_SCHEMA(data)
    except (yaml.YAMLError, Invalid):
        return False
    return isinstance(data, dict) and "schema" in data


def _git_head_lock(root: Path) -> str | None:
    try:
        proc = subprocess.run(["git", "show", f"HEAD:{LOCKFILE}"], cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 and readable(proc.stdout) else None


def _write_atomically(path: Path, text: str) -> None:
    from mergeflow.io import atomic_path  # here: mergeflow.io imports torch, which `mergeflow check` does not need

    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def recover(root: str | Path = ".") -> str | None:
    """Restore an unreadable dvc.lock from the last good copy, else from git's HEAD, and keep a copy of a readable
    one. Returns a one-line notice when it restored something, else None; raises when there is nothing to restore
    from. No dvc.lock at all is left as it is."""
    root = Path(root)
    lock, copy = root / LOCKFILE, good_copy(root)
    if not lock.exists():
        return None
    text = lock.read_text(encoding="utf-8", errors="replace")
    if readable(text):
        if not copy.is_file() or copy.read_text(encoding="utf-8", errors="replace") != text:
            copy.parent.mkdir(parents=True, exist_ok=True)
            _write_atomically(copy, text)
        return None
    if copy.is_file() and readable(copy.read_text(encoding="utf-8", errors="replace")):
        source, restored = str(copy), copy.read_text(encoding="utf-8")
    elif (head := _git_head_lock(root)) is not None:
        source, restored = "git HEAD", head
    else:
        raise MergeflowError(f"{lock}: unreadable ({len(text)} bytes) and no good copy to restore it from: check it out again from git")
    broken = lock.with_name(f".{LOCKFILE}.broken")
    shutil.copyfile(lock, broken)
    _write_atomically(lock, restored)
    return f"{lock}: was unreadable ({len(text)} bytes, probably cut short by a killed DVC command); restored from {source} (the broken file is kept as {broken.name}); stages run since then will run again"


@contextlib.contextmanager
def atomic_dvc_writes() -> Iterator[None]:
    """Within this context, DVC's YAML writes in this process (dvc.lock, dvc.yaml) go through a temporary file
    and a rename, so a kill leaves either the old file or the new one. Re-entrant and thread-safe."""
    global _patch_depth
    from dvc.utils.serialize import _common, _yaml

    from mergeflow.io import atomic_path

    modules = (_common, _yaml)  # _yaml imported _dump_data by name: both bindings are replaced
    with _patch_lock:
        if _patch_depth == 0:
            original = _common._dump_data

            def dump_atomically(path, data, dumper, fs=None, **dumper_args):
                if fs is not None and getattr(fs, "protocol", "local") != "local":
                    return original(path, data, dumper, fs=fs, **dumper_args)
                with atomic_path(os.fspath(path)) as tmp, open(tmp, "w+", encoding="utf-8") as stream:
                    dumper(data, stream, **dumper_args)

            for module in modules:
                module._dump_data = dump_atomically
            atomic_dvc_writes.original = original  # type: ignore[attr-defined]
        _patch_depth += 1
    try:
        yield
    finally:
        with _patch_lock:
            _patch_depth -= 1
            if _patch_depth == 0:
                for module in modules:
                    module._dump_data = atomic_dvc_writes.original  # type: ignore[attr-defined]
