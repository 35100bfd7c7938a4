"""The Hugging Face hub's one switch: whether a stage may download (weights, tokenizers) or reads the local
cache only."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def hub_access(allowed: bool):
    """Downloads are opt-in (--download, suite.download): without them the Hugging Face hub is read from the local
    cache only, whatever HF_HUB_OFFLINE says; with them it may download, even under the Makefile's HF_HUB_OFFLINE=1."""
    from huggingface_hub import constants

    previous = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = not allowed
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = previous
