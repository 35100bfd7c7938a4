"""Hugging Face hub repositories: ``resolve_source`` finds a fine-tune's weights file (the local cache, or fetched
when downloads are allowed)."""

from __future__ import annotations

from pathlib import Path

from mergeflow.core.errors import MergeflowError


def resolve_source(spec: str, *, download: bool) -> Path:
    """The weights file of ``spec``: ``hf:<owner>/<repo>[@<revision>]`` (the hub's safetensors, from the local
    cache, or fetched when ``download``) or a local path. Only ``*.safetensors`` and ``*.json`` are fetched:
    pickled ``.bin`` weights are never downloaded (a local ``.bin`` goes through :func:`read_tensors`)."""
    if not spec.startswith("hf:"):
        path = Path(spec)
        if not path.is_file():
            raise MergeflowError(f"{spec}: checkpoint not found")
        return path
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo_id, _, revision = spec[3:].partition("@")
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise MergeflowError(f"{spec}: a hub checkpoint is hf:<owner>/<repo>[@<revision>]")
    try:
        folder = Path(
            snapshot_download(
                repo_id,
                revision=revision or None,
                allow_patterns=["*.safetensors", "*.json"],
                local_files_only=not download,
            )
        )
    except LocalEntryNotFoundError:
        if not download:
            raise MergeflowError(
                f"{spec}: not in the local Hugging Face cache; run with "
                f"--download to fetch it (or `hf download {repo_id}`)"
            ) from None
        why = (
            "HF_HUB_OFFLINE=1 forbids downloading (run with --download)"
            if constants.HF_HUB_OFFLINE
            else "the hub could not be reached"
        )
        raise MergeflowError(
            f"{spec}: could not download it: {why} (fetch it once with network access: `hf download {repo_id}`)"
        ) from None
    except RevisionNotFoundError:
        raise MergeflowError(f"{spec}: the hub repository has no revision '{revision}'") from None
    except RepositoryNotFoundError:
        raise MergeflowError(f"{spec}: no such hub repository (or a private or gated one without access)") from None
    except (HfHubHTTPError, OSError) as err:
        raise MergeflowError(
            f"{spec}: could not get it from the hub ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err).strip() else ''})"
        ) from None
    files = sorted(folder.glob("*.safetensors"))
    if (folder / "model.safetensors").is_file():
        return folder / "model.safetensors"
    if len(files) == 1:
        return files[0]
    found = ", ".join(f.name for f in files) or "none"
    raise MergeflowError(
        f"{spec}: expected one safetensors weights file (model.safetensors), found {found} (sharded or pickled .bin "
        "weights are not read from the hub)"
    )
