"""What every task file holds, images or text: the arrays of its splits, and no other."""

from __future__ import annotations

from mergeflow.core.errors import MergeflowError

SPLITS = ("train", "val", "test")
ARRAYS = tuple(f"{split}_{part}" for split in SPLITS for part in ("x", "y"))


def check_array_names(arrays, source: str, splits: tuple[str, ...], kind: str = "a task file") -> None:
    """One line naming ``source`` unless ``arrays`` holds each split's ``<split>_x`` and ``<split>_y`` and nothing
    outside ARRAYS."""
    for name in ARRAYS:
        if name not in arrays and name.split("_")[0] in splits:
            raise MergeflowError(f"{source}: array '{name}' is missing ({kind} holds {', '.join(ARRAYS)})")
    unexpected = sorted(set(arrays) - set(ARRAYS))
    if unexpected:
        raise MergeflowError(f"{source}: unexpected array '{unexpected[0]}' ({kind} holds only {', '.join(ARRAYS)})")
