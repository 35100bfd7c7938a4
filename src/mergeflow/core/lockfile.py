"""dvc.lock kept whole: DVC rewrites it in place (open with "w+", then dump), so a process killed during that write
(or a full disk) leaves it empty or cut short, and every later DVC command fails on it. mergeflow's own DVC calls
write it atomically, a copy of the last whole dvc.lock is kept in DVC's tmp folder (by each `mergeflow check`, and
after each stage mergeflow commits), and an unreadable one is restored from that copy (or from git's HEAD) before
anything else runs.

A lock cut short can still parse (a cut at the end of a line): it is recognised (``cut_short``) by what a whole
dump always has: a final newline; every dep and out with its hash, size and (for a folder) file count; the last
stage written with as many deps, params and outs as dvc.yaml gives it (when that entry is new since the good
copy); and no stage of the good copy that dvc.yaml still defines missing from the end. Its entries before the
last are kept, the rest comes from the good copy (``salvage``): only the stages whose records were lost run again.
Not recognised: a cut inside the last params value of a stage with no outputs and nothing after it.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import io
import math
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import yaml

from mergeflow.core.errors import MergeflowError

LOCKFILE = "dvc.lock"
_patch_lock = threading.Lock()
_patch_depth = 0


def parse(text: str):
    """dvc.lock's text as DVC wrote it, read with libyaml (6x faster than PyYAML's own reader on a 120 kB lock)."""
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def good_copy(root: str | Path) -> Path:
    """Where the last readable dvc.lock is kept (DVC's tmp folder: git- and DVC-ignored)."""
    return Path(root) / ".dvc" / "tmp" / "dvc.lock.good"


@functools.lru_cache(maxsize=4)
def _parsed(text: str):
    """``parse`` once per text, for the checks that only read it (`check` parses the lock and its good copy, most
    often the same text, in three of them): never to be modified."""
    return parse(text)


def read(root: str | Path = ".") -> dict:
    """dvc.lock's contents (DVC writes it: libyaml's reader, not params.yaml's duplicate-key checking one); a
    MergeflowError naming it when it is missing or not YAML."""
    path = Path(root) / LOCKFILE
    try:
        data = parse(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise MergeflowError(f"{path}: cannot be read ({type(err).__name__})") from None
    if not isinstance(data, dict):
        raise MergeflowError(f"{path}: not a mapping")
    return data


def readable(text: str) -> bool:
    """A dvc.lock that DVC can load: YAML that DVC's own lock-file schema accepts (an empty file is not)."""
    from dvc.schema import COMPILED_LOCKFILE_SCHEMA
    from voluptuous import Invalid

    try:
        data = _parsed(text)
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


def write_atomically(path: Path, text: str) -> None:
    from mergeflow.core.files import atomic_path

    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


_MD5 = re.compile(r"[0-9a-f]{32}(\.dir)?")
_HASHES = ("md5", "etag", "checksum", "version_id")


def _entry_problem(entry: object) -> str | None:
    """What a lock entry (one stage) lacks that DVC always writes: its cmd, each dep's and out's hash, size and
    a folder's file count (DVC writes them in that order, so a cut after a line loses the last of them)."""
    if not isinstance(entry, dict) or "cmd" not in entry:
        return "no cmd"
    for kind in ("deps", "outs"):
        for item in entry.get(kind) or []:
            if not isinstance(item, dict) or not any(k in item for k in _HASHES):
                return f"{kind} entry {item.get('path') if isinstance(item, dict) else repr(item)} has no hash"
            md5 = item.get("md5")
            if md5 is not None and (
                not _MD5.fullmatch(str(md5))
                or "size" not in item
                or (str(md5).endswith(".dir") and "nfiles" not in item)
            ):
                return f"{kind} entry {item.get('path')} is incomplete"
    return None


def _definition(dvc_yaml: dict, address: str) -> dict | None:
    body = (dvc_yaml.get("stages") or {}).get(address.split("@")[0])
    if not isinstance(body, dict):
        return None
    return body.get("do", body) if ("foreach" in body or "matrix" in body) else body


def _count_problem(entry: dict, body: dict) -> str | None:
    """Fewer deps, outs (outs, metrics and plots) or params than the stage's definition gives it."""
    outs = sum(len(body.get(k) or []) for k in ("outs", "metrics", "plots"))
    if len(entry.get("deps") or []) < len(body.get("deps") or []):
        return "fewer deps than dvc.yaml gives it"
    if len(entry.get("outs") or []) < outs:
        return "fewer outs than dvc.yaml gives it"
    expected: dict[str, int] = {}
    for p in body.get("params") or []:
        if isinstance(p, str):
            expected["params.yaml"] = expected.get("params.yaml", 0) + 1
        elif isinstance(p, dict):
            expected |= {f: len(keys) for f, keys in p.items() if isinstance(keys, list) and keys}
    recorded = entry.get("params") or {}
    if any(len(recorded.get(f) or {}) < n for f, n in expected.items()):
        return "fewer params than dvc.yaml gives it"
    return None


def cut_short(text: str, root: str | Path = ".", good: str | None = None) -> str | None:
    """Why a readable dvc.lock looks cut short (see the module's docstring), or None. ``good``: the last whole
    copy's text, if any."""
    if not text.endswith("\n"):
        return "it does not end with a newline"
    stages = (_parsed(text) or {}).get("stages") or {}
    for address, entry in stages.items():
        if problem := _entry_problem(entry):
            return f"stage {address}: {problem}"
    good_stages = ((_parsed(good) or {}).get("stages") or {}) if good else {}
    try:
        dvc_yaml = parse((Path(root) / "dvc.yaml").read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        dvc_yaml = {}
    if not isinstance(dvc_yaml, dict):
        dvc_yaml = {}
    if stages and good_stages:
        last = list(stages)[-1]
        body = _definition(dvc_yaml, last)
        if (
            body is not None
            and stages[last] != good_stages.get(last)
            and (problem := _count_problem(stages[last], body))
        ):
            return f"stage {last}: {problem}"
    if good_stages and dvc_yaml:
        names = [n for n in stages if n in good_stages]
        missing = [n for n in good_stages if n not in stages and _definition(dvc_yaml, n) is not None]
        if missing and names == list(good_stages)[: len(names)]:
            return (
                f"{len(missing)} stage{'s' if len(missing) > 1 else ''} of "
                f"the last whole copy missing from its end ({missing[0]}, ...)"
            )
    return None


def salvage(text: str, good: str) -> str:
    """A whole dvc.lock from a cut one: its entries before the last (the cut may have fallen between two of the
    last one's lines), the others as the good copy has them, in the good copy's order (DVC's: stages keep their
    place, new ones go last)."""
    from dvc.utils.serialize import dumps_yaml

    stages = (parse(text) or {}).get("stages") or {}
    whole = {
        a: e for a, e in list(stages.items())[:-1] if _entry_problem(e) is None
    }  # the last: maybe cut after a line
    base = parse(good) or {}
    merged = {**(base.get("stages") or {})}
    for address, entry in whole.items():
        merged[address] = entry
    return dumps_yaml({"schema": base.get("schema", "2.0"), "stages": merged})


def _good_text(copy: Path) -> str | None:
    if not copy.is_file():
        return None
    text = copy.read_text(encoding="utf-8", errors="replace")
    return text if readable(text) else None


def keep_good_copy(root: str | Path = ".", check: bool = True) -> None:
    """Keep dvc.lock as the last whole copy, if it is readable and not cut short; ``check=False`` for one that
    mergeflow itself has just written atomically (after each stage it commits: no parsing, milliseconds)."""
    root = Path(root)
    lock, copy = root / LOCKFILE, good_copy(root)
    try:
        text = lock.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return
    if not check:
        copy.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(copy, text)
        return
    good = _good_text(copy)
    if good != text and readable(text) and cut_short(text, root, good) is None:
        copy.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(copy, text)


def recover(root: str | Path = ".") -> str | None:
    """Restore an unreadable dvc.lock from the last good copy, else from git's HEAD; mend one cut short that still
    parses (its whole entries kept, the rest from the good copy or HEAD); keep a copy of a whole one. Returns a
    one-line notice when it restored something, else None; raises when there is nothing to restore from. No
    dvc.lock at all is left as it is."""
    root = Path(root)
    lock, copy = root / LOCKFILE, good_copy(root)
    if not lock.exists():
        return None
    text = lock.read_text(encoding="utf-8", errors="replace")
    good = _good_text(copy)
    if readable(text):
        why = cut_short(text, root, good)
        if why is None:
            if good != text:
                copy.parent.mkdir(parents=True, exist_ok=True)
                write_atomically(copy, text)
            return None
        base, source = (
            (good, str(copy))
            if good is not None and cut_short(good, root) is None
            else (_git_head_lock(root), "git HEAD")
        )
        if base is None:
            raise MergeflowError(
                f"{lock}: cut short ({why}) and no good copy to mend it from: check it out again from git"
            )
        restored = salvage(text, base)
        what = f"was cut short ({why}); its whole entries kept, the rest restored from {source}"
    elif good is not None:
        source, restored = str(copy), good
        what = (
            f"was unreadable ({len(text)} bytes, probably cut short by a "
            f"killed DVC command or a full disk); restored from {source}"
        )
    elif (head := _git_head_lock(root)) is not None:
        source, restored = "git HEAD", head
        what = (
            f"was unreadable ({len(text)} bytes, probably cut short by a "
            f"killed DVC command or a full disk); restored from {source}"
        )
    else:
        raise MergeflowError(
            f"{lock}: unreadable ({len(text)} bytes) and no good copy to restore it from: check it out again from git"
        )
    broken = lock.with_name(f".{LOCKFILE}.broken")
    shutil.copyfile(lock, broken)
    write_atomically(lock, restored)
    keep_good_copy(root, check=False)  # whole: a good copy, HEAD's, or mended
    return f"{lock}: {what} (the broken file is kept as {broken.name}); stages whose records were lost will run again"


# dvc.lock's path -> (the text this process last wrote there, libyaml's reading of it) when that reading is the
# data it was dumped from: then it stands in for DVC's round-trip read of the same text
_written: dict[str, tuple[str, dict]] = {}


# a string of characters that neither emitter quotes or breaks on
_SIMPLE = re.compile(r"[A-Za-z0-9_./@=+-]+( [A-Za-z0-9_./@=+-]+)*")


@functools.cache
def _resolvers():
    """libyaml's (YAML 1.1, PyYAML's resolver) and DVC's ruamel (1.2) implicit resolvers, with ruamel's node type."""
    from ruamel.yaml.nodes import ScalarNode
    from ruamel.yaml.resolver import VersionedResolver

    return yaml.resolver.Resolver(), VersionedResolver(version=(1, 2)), ScalarNode


@functools.lru_cache(maxsize=65536)
def _same_string(value: str) -> bool:
    """A string that libyaml and DVC's ruamel write alike: simple characters, and bare for both or quoted for both
    (libyaml's YAML 1.1 resolver and ruamel's 1.2 one agree whether it would read back as a string: '2.0' is
    quoted by both; yes, on, 1e5 or 0o7 would be bare for one of them)."""
    if len(value) > 60 or not _SIMPLE.fullmatch(value):
        return False
    yaml11, yaml12, ruamel_scalar = _resolvers()
    tag = "tag:yaml.org,2002:str"
    return (yaml11.resolve(yaml.ScalarNode, value, (True, False)) == tag) == (
        yaml12.resolve(ruamel_scalar, value, (True, False)) == tag
    )


def _plain(data, in_list: bool = False) -> bool:
    """Only what libyaml writes as DVC's ruamel does: dicts with such string keys, lists, such strings, ints,
    bools, floats without an exponent, and None as a mapping's value."""
    kind = type(data)
    if kind is dict or kind is collections.OrderedDict:  # DVC's stage entries are OrderedDicts
        return all(type(k) is str and _same_string(k) and _plain(v) for k, v in data.items())
    if kind is list:
        return all(_plain(v, in_list=True) for v in data)
    if kind is str:
        return _same_string(data)
    if kind is float:
        return "e" not in repr(data) and math.isfinite(data)
    if data is None:
        return not in_list
    return kind in (int, bool)


class _LockDumper(yaml.CSafeDumper):
    pass


_LockDumper.add_representer(type(None), lambda dumper, _: dumper.represent_scalar("tag:yaml.org,2002:null", ""))
_LockDumper.add_representer(collections.OrderedDict, yaml.SafeDumper.represent_dict)


def _libyaml_dump(data) -> str | None:
    """dvc.lock's text as DVC's ruamel dumper writes it, by libyaml (0.03 s against 0.4 s for the default run's
    lock); None when ``data`` holds anything the two might write differently (then DVC's own dumper runs)."""
    if not _plain(data):
        return None
    return yaml.dump(data, Dumper=_LockDumper, sort_keys=False, default_flow_style=False, allow_unicode=True)


@contextlib.contextmanager
def _modify_lock(path):
    """DVC's ``modify_yaml`` for dvc.lock, without DVC's round-trip YAML read (0.8 s of each stage's 1.7 s commit
    on the default run's 127 kB lock) when the file still holds what this process last wrote: libyaml's reading of
    that text, taken when it was written and kept only if it gave back exactly the data dumped (so YAML 1.1 against
    1.2 readings cannot differ), stands in. libyaml writes it when the data holds only what it writes as DVC's dumper
    does (``_libyaml_dump``), DVC's dumper otherwise: the bytes are DVC's either way."""
    from dvc.utils.serialize._yaml import _dump, parse_yaml_for_update

    key = os.path.abspath(os.fspath(path))
    try:
        text = Path(key).read_text(encoding="utf-8")
    except FileNotFoundError:
        text = None
    last = _written.pop(key, None)
    data = (
        {} if text is None else last[1] if last is not None and text == last[0] else parse_yaml_for_update(text, path)
    )
    yield data
    text = _libyaml_dump(data)
    if text is None:
        stream = io.StringIO()
        _dump(data, stream)
        text = stream.getvalue()
    write_atomically(Path(key), text)
    if (reading := parse(text)) == data:  # a fresh object: DVC's next update may change it in place
        _written[key] = (text, reading)


@contextlib.contextmanager
def atomic_dvc_writes() -> Iterator[None]:
    """Within this context, DVC's YAML writes in this process (dvc.lock, dvc.yaml) go through a temporary file
    and a rename, so a kill leaves either the old file or the new one, and its updates of dvc.lock skip re-reading
    what they wrote last (``_modify_lock``). Re-entrant and thread-safe."""
    global _patch_depth
    from dvc import dvcfile
    from dvc.utils.serialize import _common, _yaml

    from mergeflow.core.files import atomic_path

    modules = (_common, _yaml)  # _yaml imported _dump_data by name: both bindings are replaced
    with _patch_lock:
        if _patch_depth == 0:
            original, original_modify = _common._dump_data, dvcfile.modify_yaml

            def dump_atomically(path, data, dumper, fs=None, **dumper_args):
                if fs is not None and getattr(fs, "protocol", "local") != "local":
                    return original(path, data, dumper, fs=fs, **dumper_args)
                with atomic_path(os.fspath(path)) as tmp, open(tmp, "w+", encoding="utf-8") as stream:
                    dumper(data, stream, **dumper_args)

            def modify_yaml(path, fs=None):
                if os.path.basename(os.fspath(path)) != LOCKFILE or (
                    fs is not None and getattr(fs, "protocol", "local") != "local"
                ):
                    return original_modify(path, fs=fs)
                return _modify_lock(path)

            for module in modules:
                module._dump_data = dump_atomically
            dvcfile.modify_yaml = modify_yaml
            atomic_dvc_writes.original = original, original_modify  # type: ignore[attr-defined]
        _patch_depth += 1
    try:
        yield
    finally:
        with _patch_lock:
            _patch_depth -= 1
            if _patch_depth == 0:
                original, original_modify = atomic_dvc_writes.original  # type: ignore[attr-defined]
                for module in modules:
                    module._dump_data = original
                dvcfile.modify_yaml = original_modify
                _written.clear()
