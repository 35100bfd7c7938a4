"""GLUE's eight tasks from the Hugging Face ``datasets`` on-disk format (``DatasetDict.save_to_disk``), tokenized
with the backbone's own tokenizer: ``suite.source: glue``, ``suite.root`` holding one folder per task.

A task folder is what ``load_dataset("nyu-mll/glue", <task>).save_to_disk(<root>/<task>)`` writes:
``dataset_dict.json`` naming the splits, and per split a folder of Arrow stream files (``state.json`` lists them).
It is read with pyarrow alone (``datasets`` is not needed). GLUE's test labels are hidden (-1), so, as the merging
papers do, a task's test split is GLUE's validation split (MNLI: validation_matched) and the validation split is
drawn from train (``suite.n_val``, seeded). Pairs are tokenized as the tokenizer pairs them (RoBERTa: ``<s> a
</s></s> b </s>``), truncated and padded to ``suite.seq_len``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from mergeflow.core.errors import MergeflowError

if TYPE_CHECKING:
    from mergeflow.config import BackboneConfig, SuiteConfig

# task: (its text columns, metric, classes); the GLUE configs' names, as nyu-mll/glue has them
GLUE = {
    "cola": (("sentence",), "matthews", ["unacceptable", "acceptable"]),
    "sst2": (("sentence",), "accuracy", ["negative", "positive"]),
    "mrpc": (("sentence1", "sentence2"), "accuracy_f1", ["not_equivalent", "equivalent"]),
    "stsb": (("sentence1", "sentence2"), "pearson_spearman", ["score"]),
    "qqp": (("question1", "question2"), "accuracy_f1", ["not_duplicate", "duplicate"]),
    "mnli": (("premise", "hypothesis"), "accuracy", ["entailment", "neutral", "contradiction"]),
    "qnli": (("question", "sentence"), "accuracy", ["entailment", "not_entailment"]),
    "rte": (("sentence1", "sentence2"), "accuracy", ["entailment", "not_entailment"]),
}
TEST_SPLIT = {"mnli": "validation_matched"}
LAYOUT = (
    "<root>/<task>/ as DatasetDict.save_to_disk writes it (dataset_dict.json, <split>/state.json and its .arrow files)"
)


def _split_files(root: str | Path, task: str, split: str) -> list[Path]:
    base = Path(root) / task
    if task not in GLUE:
        raise MergeflowError(f"suite.tasks: '{task}' is not a GLUE task ({', '.join(GLUE)})")
    if not (base / "dataset_dict.json").is_file():
        raise MergeflowError(f"suite.root: '{base}' has no dataset_dict.json (expected {LAYOUT})")
    state = base / split / "state.json"
    if not state.is_file():
        raise MergeflowError(
            f"suite.root: '{base / split}' is missing (GLUE's {task} needs its '{split}' split; expected {LAYOUT})"
        )
    try:
        files = [base / split / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise MergeflowError(
            f"{state}: not a datasets state.json (expected '_data_files', a list of {{'filename': ...}})"
        ) from None
    missing = next((f for f in files if not f.is_file()), None)
    if missing is not None or not files:
        raise MergeflowError(f"{missing or state}: the split's Arrow file is missing")
    return files


def check_glue(root: str | Path, task: str) -> None:
    """Whether GLUE's ``task`` is under ``root``: its train and test (GLUE's validation) splits' files."""
    for split in ("train", TEST_SPLIT.get(task, "validation")):
        _split_files(root, task, split)


def _read_split(root: str | Path, task: str, split: str) -> dict[str, list]:
    import pyarrow as pa

    columns, _, _ = GLUE[task]
    tables = []
    for path in _split_files(root, task, split):
        try:
            tables.append(pa.ipc.open_stream(str(path)).read_all())
        except (pa.ArrowInvalid, OSError) as err:
            raise MergeflowError(f"{path}: not an Arrow stream file ({str(err).splitlines()[0]})") from None
    table = pa.concat_tables(tables)
    missing = [c for c in (*columns, "label") if c not in table.column_names]
    if missing:
        raise MergeflowError(
            f"{path}: column '{missing[0]}' is missing (GLUE's {task} has {', '.join((*columns, 'label'))})"
        )
    return {c: table.column(c).to_pylist() for c in (*columns, "label")}


def tokenizer(backbone: BackboneConfig, downloads: bool = False):
    """The backbone's own tokenizer: its ``save_pretrained`` folder's, or the hub's (``backbone.pretrained: hub``)."""
    from transformers import AutoTokenizer

    from mergeflow.core.hub import hub_access

    source = backbone.model if backbone.pretrained == "hub" else backbone.pretrained
    if source is None:
        raise MergeflowError(
            "backbone.pretrained: GLUE is tokenized with the backbone's "
            "own tokenizer: set a save_pretrained folder or hub"
        )
    try:
        with hub_access(downloads):
            return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise MergeflowError(f"backbone.pretrained: no tokenizer for '{source}' ({str(err).splitlines()[0]})") from None


def build_glue_task(
    cfg: SuiteConfig, backbone: BackboneConfig, task: str, seed: int, downloads: bool = False
) -> tuple[dict[str, np.ndarray], list[str], str]:
    """(arrays, classes, metric) of one GLUE task: train capped at n_train after n_val are drawn off it, test =
    GLUE's validation capped at n_test; token ids int32 [N, seq_len]."""
    columns, metric, classes = GLUE[task]
    tok = tokenizer(backbone, downloads)
    rng = np.random.default_rng(seed)
    train, test = _read_split(cfg.root, task, "train"), _read_split(cfg.root, task, TEST_SPLIT.get(task, "validation"))
    order = rng.permutation(len(train["label"]))
    n_val = min(cfg.n_val, len(order) // 5)
    picks = {
        "val": order[:n_val],
        "train": np.sort(order[n_val:][: cfg.n_train]),
        "test": np.arange(min(cfg.n_test, len(test["label"]))),
    }
    arrays = {}
    for split, rows in picks.items():
        source = test if split == "test" else train
        texts = [[source[c][i] for i in rows] for c in columns]
        encoded = tok(*texts, truncation=True, padding="max_length", max_length=cfg.seq_len)
        arrays[f"{split}_x"] = np.asarray(encoded["input_ids"], dtype=np.int32)
        labels = [source["label"][i] for i in rows]
        arrays[f"{split}_y"] = np.asarray(labels, dtype=np.float32 if metric == "pearson_spearman" else np.int64)
    return arrays, list(classes), metric
