"""``mergeflow verify``: every output dvc.lock records, hashed again from its bytes, and every file that changed
or is missing named.

DVC trusts its own record of a file's hash while the file's size, mtime and inode stay the same (its state
database), so bytes that rot in place (a failing disk, a stray write that kept the mtime) pass ``dvc status``, and
the next stage reads them. Here nothing is trusted: each file is read in full and hashed as DVC hashes it
(dvc_data's ``hash_file`` with no state, and a folder's ``.dir`` hash from dvc_data's ``Tree``), so the hashes are
DVC's own. A folder that differs is compared file by file against its listing in DVC's cache, so the files at
fault are named, not only the folder. The Prefect flow runs it before its stages and re-runs the stages whose
outputs changed; on the default pipeline that is about 600 MB read, seconds.
"""

from __future__ import annotations

import collections

import json
import os
from dataclasses import dataclass
from pathlib import Path

from mergeflow.core import lockfile
from mergeflow.core.errors import MergeflowError


@dataclass(frozen=True)
class Changed:
    stage: str
    path: str  # the file at fault, relative to the repository root (inside a folder output: the file itself)
    why: str  # "missing", "changed", "added"


def _name(entry: dict) -> str:
    # a dvc.lock of DVC 3 marks its hashes "hash: md5"; one without is DVC 2's (line endings normalised)
    return "md5" if entry.get("hash") == "md5" else "md5-dos2unix"


def _file_md5(path: Path, name: str) -> str:
    from dvc_data.hashfile.hash import hash_file
    from dvc_objects.fs.local import LocalFileSystem

    _, info = hash_file(os.fspath(path), LocalFileSystem(), name, state=None)
    return info.value


def _folder(path: Path, name: str) -> tuple[str, dict[str, str]]:
    """A folder's DVC hash (``<md5>.dir``) and each file's, by path relative to it."""
    from dvc_data.hashfile.hash import hash_file
    from dvc_data.hashfile.tree import Tree
    from dvc_objects.fs.local import LocalFileSystem

    fs, tree, files = LocalFileSystem(), Tree(), {}
    for root, _, names in os.walk(path):
        for fname in names:
            full = os.path.join(root, fname)
            meta, info = hash_file(full, fs, name, state=None)
            rel = os.path.relpath(full, path)
            tree.add(tuple(rel.split(os.sep)), meta, info)
            files[rel.replace(os.sep, "/")] = info.value
    tree.digest()  # as DVC digests a tree: the listing's md5, whatever the files' hash
    return tree.hash_info.value, files


def _recorded_listing(root: Path, md5: str) -> dict[str, str] | None:
    """A folder's files and hashes as DVC's cache lists them (its ``.dir`` object), or None if not in the cache."""
    cache = root / ".dvc" / "cache"
    for candidate in (cache / "files" / "md5" / md5[:2] / md5[2:], cache / md5[:2] / md5[2:]):
        try:
            return {e["relpath"]: e["md5"] for e in json.loads(candidate.read_text())}
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def check_outputs(root: str | Path = ".", skip: set[str] | frozenset[str] = frozenset()) -> tuple[list[Changed], int]:
    """Every file among dvc.lock's outputs that is missing, changed or (in a folder) added, and how many files
    were read; the outputs of the stages in ``skip`` (about to run again) are not read."""
    root = Path(root)
    try:
        lock = lockfile.parse((root / lockfile.LOCKFILE).read_text(encoding="utf-8")) or {}
    except OSError:
        raise MergeflowError(f"{root / lockfile.LOCKFILE}: not found (no stage has run here)") from None
    found: list[Changed] = []
    read = 0
    for stage, entry in (lock.get("stages") or {}).items():
        if stage in skip:
            continue
        for out in entry.get("outs") or []:
            rel, md5 = out.get("path"), out.get("md5")
            if not rel or not md5:
                continue
            path, name = root / rel, _name(out)
            if not path.exists():
                found.append(Changed(stage, rel, "missing"))
            elif md5.endswith(".dir") != path.is_dir():
                found.append(Changed(stage, rel, "changed"))
            elif not path.is_dir():
                read += 1
                if _file_md5(path, name) != md5:
                    found.append(Changed(stage, rel, "changed"))
            else:
                digest, files = _folder(path, name)
                read += len(files)
                if digest == md5:
                    continue
                listing = _recorded_listing(root, md5.removesuffix(".dir") + ".dir")
                if listing is None:  # not in this cache (fetched without it): the folder is what we can name
                    found.append(Changed(stage, rel, "changed"))
                    continue
                for f in sorted(listing.keys() | files.keys()):
                    why = (
                        "missing"
                        if f not in files
                        else "added"
                        if f not in listing
                        else "changed"
                        if files[f] != listing[f]
                        else None
                    )
                    if why:
                        found.append(Changed(stage, f"{rel}/{f}", why))
    return found, read


def verify(root: str | Path = ".", report=None) -> str:
    """``mergeflow verify``: the one-line report when every output matches; else ``report(line)`` for each file
    that does not, and MergeflowError naming them all and the command that makes them again."""
    found, read = check_outputs(root)
    if not found:
        return f"ok: every output dvc.lock records matches its bytes ({read} files hashed)"
    for c in found:
        (report or print)(f"{c.why}: {c.path} (stage {c.stage})")
    for line in machine_lines(root, sorted({c.stage for c in found if c.why != "missing"})):
        (report or print)(line)
    stages = sorted({c.stage for c in found})
    counts = ", ".join(f"{n} {why}" for why, n in collections.Counter(c.why for c in found).most_common())
    command = f"dvc repro --force --single-item {' '.join(stages)}"
    if len(stages) > 3:  # the error stays one short line: the long command goes with the report
        (report or print)(f"to make them again: {command}")
        how = f"the command above (their {len(stages)} stages, or the Prefect flow) makes them again"
    else:
        how = f"`{command}` (or the Prefect flow) makes them again"
    raise MergeflowError(
        f"{len(found)} file{'s' if len(found) > 1 else ''} differ from dvc.lock ({counts}; each named above): {how}"
    )


def machine_lines(root: str | Path, stages: list[str]) -> list[str]:
    """For stages whose bytes differ: the machine that wrote them, this one, and what differs between the two."""
    from mergeflow.core.reproducibility.machine import describe, explain, recorded

    entries, here = recorded(root), describe()
    return [line for stage in stages for line in explain(stage, entries, here)]
