"""``mergeflow check``: what must hold before any stage or DVC command runs.

``dvc repro`` runs dvc.yaml's commands through a shell, after pasting values from params.yaml into them and into
stage names and paths (``${item}`` of a ``foreach``): to DVC, params.yaml is as much code as dvc.yaml. mergeflow's
own commands take no name from the command line under DVC (a stage reads its task or method from DVC_STAGE), and
this check refuses a params.yaml whose values would reach a command, a stage name or a path unless each is a
plain name. The Makefile's targets, the Prefect flow and CI run it before anything else.

It also finds, in a second, what the stages would otherwise find minutes later: the suite's data missing (an
ImageFolder or torchvision root, a task folder without a split, an embedded task that does not exist) and a
published fine-tune that is missing, unreadable or of another shape than the backbone. It reads folder listings
and file headers only, and imports no torch.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mergeflow.core import lockfile
from mergeflow.config import Params
from mergeflow.config.fields import check_name
from mergeflow.params import load_params
from mergeflow.core.yaml_files import read_yaml
from mergeflow.core.errors import MergeflowError

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
    ``cmd``) is a number or a plain name (config.fields.NAME_PATTERN)."""
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
                _plain(
                    _lookup(raw_params, expr, params_source),
                    f"{params_source}: {expr} (pasted into the command of stage '{stage}')",
                )


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
    check_data(params, root, str(params_path))
    from mergeflow.pipeline import imports

    imports.sync(params, root)  # an imported checkpoint file: its fine-tune stage's dependency (imports/<task>)
    return params, notices


def _prepared(params: Params, root: Path) -> bool:
    """Whether the prepare stage's outputs are here for exactly these data settings: its params in dvc.lock equal
    the current ones and every task's file (data/tasks/<task>.safetensors) exists. DVC then does not run it for
    them, and the raw data it read need not be here (a finished run fetched with `dvc pull`)."""
    try:
        recorded = lockfile.read(root)["stages"]["prepare"]["params"]["params.yaml"]
        current = params.model_dump(mode="json")
        for dotted, value in recorded.items():
            node = current
            for part in dotted.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            if node != value:
                return False
    except (MergeflowError, KeyError, TypeError, AttributeError):
        return False
    return all((Path(root) / "data" / "tasks" / f"{task}.safetensors").is_file() for task in params.suite.tasks)


def check_data(params: Params, root: Path, source: str) -> None:
    """Every task's data is where the prepare stage will read it (``mergeflow.ml.data.check_layout``, the check
    prepare itself makes first): an embedded task that exists, an ImageFolder task's train/ and test/ class
    folders, a torchvision dataset's files (unless they will be downloaded). A relative suite.root is taken from
    the repository root, as the stages run there. Not checked when the prepared data is here already for these
    settings (``_prepared``)."""
    from mergeflow.ml.data import check_layout

    if _prepared(params, root):
        return
    suite = params.suite
    if suite.root and not Path(suite.root).is_absolute():
        suite = suite.model_copy(update={"root": str(Path(root) / suite.root)})
    for task in suite.tasks:
        try:
            check_layout(suite, task, download=params.downloads())
        except MergeflowError as err:
            raise MergeflowError(f"{source}: {err}") from None


def check_local_files(params: Params, root: Path, source: str) -> None:
    """The weights files params names exist (relative paths from the repository root): found now, not in a stage
    after the data is prepared."""
    if params.backbone.library == "transformers":
        _check_transformers_source(params, root, source)
    named = [
        ("backbone.pretrained", params.backbone.pretrained if params.backbone.library == "timm" else None),
        ("backbone.text", params.backbone.text),
    ]
    named += [
        (f"finetune.checkpoints.{task}", spec)
        for task, spec in params.finetune.checkpoints.items()
        if not spec.startswith("hf:")
    ]
    for key, value in named:
        if value not in (None, "hub", "random") and not (root / value).is_file():
            raise MergeflowError(f"{source}: {key}: weights file '{value}' not found")
    check_checkpoint_headers(params, root, source)


def _check_transformers_source(params: Params, root: Path, source: str) -> None:
    """A text backbone's weights are there: its save_pretrained folder's config.json, or the hub model's in the local
    cache (unless downloads are on)."""
    pretrained, model = params.backbone.pretrained, params.backbone.model
    if pretrained not in (None, "hub") and not (root / pretrained / "config.json").is_file():
        raise MergeflowError(
            f"{source}: backbone.pretrained: '{pretrained}' is not a transformers "
            "model folder (no config.json; save one with save_pretrained)"
        )
    if pretrained == "hub" and not params.downloads():
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(model, "config.json"), str):
            raise MergeflowError(
                f"{source}: backbone.pretrained: hub: '{model}' is not in the local Hugging Face cache, and downloads "
                "are off; run with --download once (or save it with save_pretrained and name the folder)"
            )


def _shapes(path: Path, key: str, value: str, source: str) -> dict[str, tuple[int, ...]] | None:
    """A local weights file's tensor shapes (safetensors: from its header), None for a PyTorch checkpoint (read
    only by the stage, through mergeflow.ml.checkpoints' restricted unpickler); one line when it cannot be either."""
    from mergeflow.ml import weights_header

    if path.suffix != ".safetensors":  # the stage reads any other file as a PyTorch checkpoint (read_checkpoint)
        if problem := weights_header.pytorch_file_problem(path):
            raise MergeflowError(
                f"{source}: {key}: '{value}' is not a PyTorch checkpoint "
                f"({problem}); name a .safetensors file or a torch.save checkpoint"
            )
        return None
    try:
        return weights_header.safetensors_shapes(path)
    except ValueError as err:
        raise MergeflowError(f"{source}: {key}: '{value}' is not a readable safetensors file ({err})") from None


def check_checkpoint_headers(params: Params, root: Path, source: str) -> None:
    """Each local finetune.checkpoints file is readable (a safetensors header, or a PyTorch checkpoint's first
    bytes) and, for safetensors, of the backbone's shape: its width, patch size, input channels, depth and token
    count (any of open_clip's, Hugging Face's or timm's naming) against backbone.pretrained's file when that is a
    local safetensors file, else against what backbone.model and backbone.kwargs give a plain timm ViT (timm
    itself would need torch), and against the other checkpoints. The full key-by-key check stays the stage's."""
    from mergeflow.ml import weights_header

    local = {task: spec for task, spec in params.finetune.checkpoints.items() if not spec.startswith("hf:")}
    if not local:
        return
    reference, described = None, "the backbone"
    pretrained = params.backbone.pretrained
    if pretrained not in (None, "hub") and pretrained.endswith(".safetensors"):
        try:
            reference = weights_header.architecture(weights_header.safetensors_shapes(root / pretrained))
            described = f"backbone.pretrained '{pretrained}'"
        except (ValueError, OSError):
            reference = None  # the pretrain stage names that file's own fault
    if reference is None:
        reference = weights_header.expected_architecture(params.backbone.model, params.backbone.kwargs)
        described = f"backbone.model {params.backbone.model}"
    first = None
    for task, spec in local.items():
        key = f"finetune.checkpoints.{task}"
        if (
            (root / spec).with_name("adapter_config.json").is_file()
        ):  # a peft LoRA adapter: its modules are checked when applied
            continue
        shapes = _shapes(root / spec, key, spec, source)
        if shapes is None:
            continue
        facts = weights_header.architecture(shapes)
        if facts is None:
            names = ", ".join(f"'{k}'" for k in list(shapes)[:3]) or "none"
            raise MergeflowError(
                f"{source}: {key}: '{spec}' is not a CLIP or ViT image tower: found neither open_clip's "
                "'visual.class_embedding', Hugging Face's '[vision_model.]embeddings.class_embedding' nor timm's "
                f"'cls_token' (first tensors: {names})"
            )
        for other, what in (
            (reference, described),
            (first[1] if first else None, f"{first[0]} '{first[2]}'" if first else ""),
        ):
            if other and (wrong := weights_header.mismatch(facts, other)):
                raise MergeflowError(f"{source}: {key}: '{spec}' does not fit {what}: {wrong}")
        first = first or (key, facts, spec)
