"""YAML files read strictly (params.yaml, dvc.yaml, dvc.lock): what PyYAML's safe_load would read wrong or not at
all is one line naming the key (bytes that are not UTF-8, a key written twice, aliases that expand without bound),
and params.yaml rewritten in the form ``dvc exp run -S`` writes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from mergeflow.core.errors import MergeflowError


def _key_at(node: Any, pos: tuple[int, int], path: str = "") -> str:
    """The key path (``finetune.lr``, ``suite.tasks.2``) of the deepest entry of the composed YAML ``node`` that
    spans ``pos`` (0-based line and column), or whose key is on that line (a comment after its value); '' if none."""

    def at(mark) -> tuple[int, int]:
        return (mark.line, mark.column)

    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            name = f"{path}.{key.value}" if path else str(key.value)
            if at(key.start_mark) <= pos < at(value.end_mark):
                return _key_at(value, pos, name)
        return next(
            (f"{path}.{k.value}" if path else str(k.value) for k, _ in node.value if k.start_mark.line == pos[0]), path
        )
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            if at(item.start_mark) <= pos < at(item.end_mark):
                return _key_at(item, pos, f"{path}.{i}")
    return path


def _not_utf8(data: bytes, err: UnicodeDecodeError, source: str) -> str:
    """One line for bytes that are not UTF-8: where they are, and the key they are in (the file read with the bad
    bytes replaced, when that still parses)."""
    line = data.count(b"\n", 0, err.start)
    line_start = data.rfind(b"\n", 0, err.start) + 1
    column = len(data[line_start : err.start].decode("utf-8", errors="replace"))
    try:
        key = _key_at(yaml.compose(data.decode("utf-8", errors="replace"), Loader=yaml.SafeLoader), (line, column))
    except yaml.YAMLError:
        key = ""
    where = f"key '{key}', " if key else ""
    return (
        f"{source}: {where}line {line + 1}, column {column + 1}: byte "
        f"0x{data[err.start]:02x} is not UTF-8 (save the file as UTF-8)"
    )


def duplicate_key(node: Any, path: str = "", seen_nodes: set[int] | None = None) -> str | None:
    """A key written twice in one mapping of the composed YAML ``node`` (YAML loaders keep the later silently)."""
    seen_nodes = set() if seen_nodes is None else seen_nodes
    if id(node) in seen_nodes:  # an alias of a node already walked (or a recursive one)
        return None
    seen_nodes.add(id(node))
    children = []
    if isinstance(node, yaml.MappingNode):
        lines: dict[tuple[str, str], int] = {}
        for key, value in node.value:
            name = f"{path}.{key.value}" if path else str(key.value)
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                if (key.tag, key.value) in lines:
                    first, again = lines[key.tag, key.value] + 1, key.start_mark.line + 1
                    where = f"twice on line {first}" if first == again else f"lines {first} and {again}"
                    return f"duplicate key '{name}' ({where}; the later one would silently win)"
                lines[key.tag, key.value] = key.start_mark.line
            children.append((value, name))
    elif isinstance(node, yaml.SequenceNode):
        children = [(item, f"{path}.{i}") for i, item in enumerate(node.value)]
    for child, name in children:
        if found := duplicate_key(child, name, seen_nodes):
            return found
    return None


# the most values a YAML file may expand to once its aliases are followed: params.yaml holds ~500, a large dvc.lock
# tens of thousands; a "billion laughs" (anchors of anchors) billions, which the loader (and pydantic, and DVC's own
# reader) would build and walk for minutes or until memory runs out
MAX_EXPANDED_NODES = 1_000_000


def _alias_bomb(root: Any, source: str) -> str | None:
    """One line when ``root``, a composed YAML node graph (an alias is the node it names, shared), expands to more
    than MAX_EXPANDED_NODES values: the key and line of the smallest mapping or list that does, and its count."""
    sizes: dict[int, int] = {}
    over: list[Any] = []

    def size(node: Any, depth: int = 0) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        sizes[id(node)] = 1  # a recursive alias: counted once (the loader refuses to build it anyway)
        children = (
            [c for pair in node.value for c in pair]
            if isinstance(node, yaml.MappingNode)
            else node.value
            if isinstance(node, yaml.SequenceNode)
            else []
        )
        total = 1 + sum(size(c, depth + 1) for c in children)
        if total > MAX_EXPANDED_NODES and not any(sizes.get(id(c), 0) > MAX_EXPANDED_NODES for c in children):
            over.append(node)
        sizes[id(node)] = total
        return total

    if size(root) <= MAX_EXPANDED_NODES:
        return None
    node = over[0]
    line = node.start_mark.line
    key = _key_at(root, (line, node.start_mark.column))
    where = f"key '{key}', " if key else ""
    return (
        f"{source}: {where}line {line + 1}: its aliases expand to {sizes[id(node)]:,} values (at most "
        f"{MAX_EXPANDED_NODES:,}): an alias bomb, not a configuration (DVC's own reader would expand it too)"
    )


def parse_yaml(data: bytes | str, source: str) -> Any:
    """YAML as PyYAML's safe_load reads it, but refusing what it would read wrong or not at all, each one line
    naming the key: bytes that are not UTF-8, and a key written twice in one mapping."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise MergeflowError(_not_utf8(data, err, source)) from None
    loader = yaml.SafeLoader(data)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if found := _alias_bomb(node, source):
            raise MergeflowError(found)
        if found := duplicate_key(node):
            raise MergeflowError(f"{source}: {found}")
        return loader.construct_document(node)
    except yaml.YAMLError as err:
        raise MergeflowError(f"{source}: not valid YAML ({str(err).splitlines()[0]})") from None
    finally:
        loader.dispose()


def read_yaml(path: str | os.PathLike) -> Any:
    """A YAML file (params.yaml, dvc.yaml) read by ``parse_yaml``."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise MergeflowError(f"{path}: cannot be read ({err.strerror or type(err).__name__})") from None
    return parse_yaml(data, str(path))


def round_trip_yaml():
    """A YAML reader and writer that keeps comments, set up as DVC's own (``dvc exp run -S``) is: a list it writes
    is one item a line, None is an empty value, lines wrap at 80. params.yaml is kept in that form, so that either
    writer changes only the values it sets."""
    from ruamel.yaml import YAML

    rt = YAML()
    rt.default_flow_style = False
    rt.preserve_quotes = True
    return rt
