"""An imported checkpoint file as a DVC dependency of its fine-tune stage, wherever the file lives.

``finetune.checkpoints: {task: /abs/path.safetensors}`` names a file that may lie outside the repository, and
dvc.yaml cannot give a ``foreach`` item a dependency that only some items have. So every task has an entry
``imports/<task>``, and ``finetune@<task>`` depends on it (dvc.yaml): a symbolic link to the imported file, or,
for a task that imports no file (fine-tuned here, or ``hf:`` from the hub, which params.yaml pins), a small
placeholder file (committed, so that a fresh clone's plain ``dvc repro`` finds it). DVC hashes a dependency
through a link, so replacing the file, in place or by a rename, changes the dependency and re-runs the stage,
under plain ``dvc repro`` too (checked: tests/test_imports.py).

Chosen over the alternatives DVC offers: an absolute path in ``deps`` cannot be written per item; copying the
file into the repository (as DVC's import or an output of a stage) doubles gigabytes of checkpoints and would
itself need the file as a dependency to notice a replacement; a hash recorded by ``mergeflow check`` would be
missed by a plain ``dvc repro``. The links are made by ``mergeflow check`` (so by ``mergeflow repro`` and the
flow), by ``prepare`` (which runs first for a new task), and by ``finetune`` itself when it starts, for a path
changed in params.yaml (DVC records a stage's dependencies again after it runs).
"""

from __future__ import annotations

import os
from pathlib import Path

from mergeflow.config import Params

IMPORTS = "imports"
PLACEHOLDER = "no checkpoint file imported for this task (finetune.checkpoints); see mergeflow.pipeline.imports\n"


def entry(root: str | Path, task: str) -> Path:
    return Path(root) / IMPORTS / task


def _target(params: Params, task: str, root: Path) -> str | None:
    """What ``imports/<task>`` links to: the imported file (a path relative to the link inside the repository,
    absolute outside it), or None for a placeholder."""
    spec = params.finetune.checkpoints.get(task)
    if not spec or spec.startswith("hf:"):
        return None
    file = Path(spec) if Path(spec).is_absolute() else root.resolve() / spec
    file = Path(os.path.abspath(file))
    inside = file.is_relative_to(root.resolve())
    return os.path.relpath(file, (root / IMPORTS).resolve()) if inside else str(file)


def sync(params: Params, root: str | Path = ".", tasks: list[str] | None = None) -> list[str]:
    """Make ``imports/<task>`` right for each task (all of suite.tasks by default), each replaced atomically
    (a temporary name, then a rename); returns the tasks whose entry changed."""
    root = Path(root)
    folder = root / IMPORTS
    folder.mkdir(parents=True, exist_ok=True)
    changed = []
    for task in tasks if tasks is not None else params.suite.tasks:
        path, target = entry(root, task), _target(params, task, root)
        if target is None:
            if not path.is_symlink() and path.is_file() and path.read_text(errors="replace") == PLACEHOLDER:
                continue
        elif path.is_symlink() and os.readlink(path) == target:
            continue
        tmp = folder / f".{task}.tmp-{os.getpid()}"
        tmp.unlink(missing_ok=True)
        if target is None:
            tmp.write_text(PLACEHOLDER)
        else:
            os.symlink(target, tmp)
        os.replace(tmp, path)
        changed.append(task)
    return changed
