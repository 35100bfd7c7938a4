"""``mergeflow check``: what must hold before any stage or DVC command runs.

``dvc repro`` runs dvc.yaml's commands through a shell, after pasting values from params.yaml into them and into
stage names and paths (``${item}`` of a ``foreach``): to DVC, params.yaml is as much code as dvc.yaml. mergeflow's
own commands take no name from the command line under DVC (a stage reads its task or method from DVC_STAGE), and
this check refuses a params.yaml whose values would reach a command, a stage name or a path unless each is a
plain name. The Makefile's targets, the Prefect flow and CI run it before anything else.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mergeflow import lockfile
from mergeflow.config import Params, check_name, load_params, read_yaml
from mergeflow.errors import MergeflowError

_INTERPOLATION = re.compile(r"\$\{\s*([^}]*?)\s*\}")


def _lookup(raw: dict, dotted: str, source: str) -> Any:
    value: Any = raw
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise MergeflowError(f"{source}: dvc.yaml refers to '{dotted}', which it does not define")
        value = value[part]
    return value


def _plain(value: Any, where: str) -> None:
    if isinstance(value, bool) or isinstance(value, (int, float)):
        return
    try:
        check_name(value, where)
    except ValueError as err:
        raise MergeflowError(str(err)) from None


def check_interpolations(dvc_yaml: dict, raw_params: dict, params_source: str = "params.yaml") -> None:
    """Every value dvc.yaml pastes into a stage name, a path or a command (``foreach`` items, ``${...}`` in
    ``cmd``) is a number or a plain name (config.NAME_PATTERN)."""
    for stage, body in (dvc_yaml.get("stages") or {}).items():
        if not isinstance(body, dict):
            continue
        if "foreach" in body:
            items = body["foreach"]
            if isinstance(items, str) and (m := _INTERPOLATION.fullmatch(items.strip())):
                dotted = m.group(1)
                items = _lookup(raw_params, dotted, params_source)
            else:
                dotted = f"foreach of stage '{stage}'"
            names = list(items) if isinstance(items, (list, dict)) else [items]
            for i, name in enumerate(names):
                _plain(name, f"{params_source}: {dotted}[{i}] (stage name '{stage}@...')")
        cmds = (body.get("do") or body).get("cmd", [])
        for cmd in [cmds] if isinstance(cmds, str) else cmds:
            for expr in _INTERPOLATION.findall(cmd):
                if expr.split(".")[0] in ("item", "key"):
                    continue  # a foreach item: checked above
                _plain(_lookup(raw_params, expr, params_source), f"{params_source}: {expr} (pasted into the command of stage '{stage}')")


def check_project(root: str | Path = ".", params_path: str | Path | None = None) -> tuple[Params, list[str]]:
    """Recover an unreadable dvc.lock, validate params.yaml in full, and check what dvc.yaml pastes into commands,
    stage names and paths. Returns the params and any notices (a restored dvc.lock)."""
    root = Path(root)
    params_path = Path(params_path) if params_path else root / "params.yaml"
    notices = []
    if notice := lockfile.recover(root):
        notices.append(notice)
    params = load_params(params_path)
    dvc_path = root / "dvc.yaml"
    if dvc_path.is_file():
        dvc_yaml = read_yaml(dvc_path) or {}  # one line for bad YAML, bytes that are not UTF-8, a duplicate key
        check_interpolations(dvc_yaml, read_yaml(params_path) or {}, str(params_path))
    check_local_files(params, root, str(params_path))
    return params, notices


def check_local_files(params: Params, root: Path, source: str) -> None:
    """The weights files params names exist (relative paths from the repository root): found now, not in a stage
    after the data is prepared."""
    named = [("backbone.pretrained", params.backbone.pretrained), ("backbone.text", params.backbone.text)]
    named += [(f"finetune.checkpoints.{task}", spec) for task, spec in params.finetune.checkpoints.items() if not spec.startswith("hf:")]
    for key, value in named:
        if value not in (None, "hub", "random") and not (root / value).is_file():
            raise MergeflowError(f"{source}: {key}: weights file '{value}' not found")
