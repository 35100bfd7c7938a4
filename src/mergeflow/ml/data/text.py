"""Text task files: the text suite's examples as token ids, in the same one-file-per-task form as images.

A text task file holds int32 token ids [N, seq_len] per split (``<s> a </s>``, or ``<s> a </s></s> b </s>`` for a
pair, as RoBERTa's tokenizer builds them, padded with ``<pad>``) and its labels: int64 classes, or a regression
task's float32 scores. Its metadata names the task's metric (mergeflow.ml.metrics) and ``modality: text``. The
tokenizer is a Hugging Face ``tokenizers`` word-level one over the suite's fixed vocabulary, saved beside the data
(data/tokenizer.json) so that any example can be decoded; the pretraining corpus is single sentences, array
``tokens``.

The text-to-text rendering (``suite.source: text2text``, for an encoder-decoder such as T5) is the same suite's
classification tasks with T5's conventions: the input starts with the task's name and a colon ("sentiment : ..."),
and the answer is a word, the class's name; the vocabulary gains those words at its end (the text suite's ids are
kept), and each task file names its answers' token ids (metadata ``answers``).

Importing this module loads no torch; ``tokenizers`` loads when one is built."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from mergeflow.core.errors import MergeflowError
from mergeflow.ml.data._arrays import SPLITS, check_array_names
from mergeflow.ml.metrics import METRICS, is_regression

if TYPE_CHECKING:
    import torch

    from mergeflow.config import BackboneConfig, SuiteConfig

PAD, MASK = "<pad>", "<mask>"


def text2text_words() -> list[str]:
    """The words the text-to-text rendering adds to the vocabulary: the colon, the tasks' names and their answers."""
    from mergeflow.ml.data import text_suite

    words, known = (
        [":"] + [w for t in text_suite.TASKS.values() if t.kind == "classification" for w in (t.name, *t.classes)],
        set(text_suite.vocabulary()),
    )
    return list(dict.fromkeys(w for w in words if w not in known))


def tokenizer(seq_len: int, text2text: bool = False):
    """A ``tokenizers.Tokenizer``: whitespace-split words of the suite's vocabulary (``text2text``: and
    ``text2text_words``), RoBERTa's special tokens and pair template, padded and truncated to ``seq_len``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from mergeflow.ml.data import text_suite

    vocab = {word: i for i, word in enumerate(text_suite.vocabulary() + (text2text_words() if text2text else []))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.add_special_tokens(list(text_suite.SPECIALS))  # already in the vocabulary: marked special, ids kept
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    specials = [(t, vocab[t]) for t in ("<s>", "</s>")]
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=specials
    )
    tok.enable_padding(pad_id=vocab[PAD], pad_token=PAD, length=seq_len)
    tok.enable_truncation(max_length=seq_len)
    return tok


def encode(tok, first: list[list[str]], second: list[list[str]] | None) -> np.ndarray:
    """int32 token ids [N, seq_len] of sentences (lists of words), or of sentence pairs."""
    joined = [" ".join(words) for words in first]
    inputs = joined if second is None else list(zip(joined, (" ".join(words) for words in second)))
    return np.asarray([e.ids for e in tok.encode_batch(inputs)], dtype=np.int32)


def check_text_task(
    arrays: dict[str, torch.Tensor],
    classes,
    metric: str,
    source: str,
    seq_len: int | None = None,
    vocab_size: int | None = None,
    splits: tuple[str, ...] = SPLITS,
) -> None:
    """One line naming ``source`` and the array at fault, unless ``arrays`` holds exactly ARRAYS: integer token ids
    [N, L] (L = seq_len when given) below ``vocab_size``, and labels [N]: classes in 0 .. len(classes) - 1, or
    finite float scores for a regression metric."""
    import torch

    if metric not in METRICS:
        raise MergeflowError(f"{source}: metadata 'metric' is '{metric}', expected one of {', '.join(METRICS)}")
    if (
        not isinstance(classes, list)
        or len(classes) < (1 if is_regression(metric) else 2)
        or not all(isinstance(c, str) for c in classes)
    ):
        raise MergeflowError(
            f"{source}: metadata 'classes' is {json.dumps(classes)[:60]}, expected a JSON list of class names (one, "
            "'score', for a regression task)"
        )
    check_array_names(arrays, source, splits, "a text task file")
    for split in splits:
        x, y = arrays[f"{split}_x"], arrays[f"{split}_y"]
        expected_x = f"integer token ids [N, {seq_len or 'L'}]"
        if x.dtype not in (torch.int32, torch.int64) or x.ndim != 2 or (seq_len and x.shape[1] != seq_len):
            raise MergeflowError(
                f"{source}: array '{split}_x' has dtype {str(x.dtype).removeprefix('torch.')} and shape "
                f"{tuple(x.shape)}, expected {expected_x}"
            )
        if len(x) == 0 or len(x) != len(y) or y.ndim != 1:
            raise MergeflowError(
                f"{source}: array '{split}_y' has shape {tuple(y.shape)} for {len(x)} examples in '{split}_x', "
                "expected one label each and at least one example"
            )
        if len(x) and (int(x.min()) < 0 or (vocab_size is not None and int(x.max()) >= vocab_size)):
            raise MergeflowError(
                f"{source}: array '{split}_x' has token id {int(x.min()) if int(x.min()) < 0 else int(x.max())}, "
                f"outside the vocabulary (0 .. {vocab_size - 1 if vocab_size else 'V - 1'})"
            )
        if is_regression(metric):
            if not y.is_floating_point() or not bool(torch.isfinite(y).all()):
                raise MergeflowError(
                    f"{source}: array '{split}_y' has dtype {str(y.dtype).removeprefix('torch.')}, expected finite "
                    f"float scores (metric {metric})"
                )
        elif y.is_floating_point() or int(y.min()) < 0 or int(y.max()) >= len(classes):
            raise MergeflowError(
                f"{source}: array '{split}_y' holds labels outside 0 .. "
                f"{len(classes) - 1} (the task declares {len(classes)} classes)"
            )


def build_text_task(
    cfg: SuiteConfig, task: str, seed: int
) -> tuple[dict[str, np.ndarray], list[str], str, list[int] | None]:
    """The generated task's arrays, class names, metric and (text-to-text) its answers' token ids."""
    from mergeflow.ml.data import text_suite

    spec, text2text = text_suite.TASKS[task], cfg.source == "text2text"
    if text2text and spec.kind != "classification":
        raise MergeflowError(
            f"suite.tasks: '{task}' is a regression task; a text-to-text task answers with a word (suite.source: "
            f"text2text takes {', '.join(t for t, s in text_suite.TASKS.items() if s.kind == 'classification')})"
        )
    raw = text_suite.make_task(task, cfg.n_train, cfg.n_val, cfg.n_test, seed)
    tok = tokenizer(cfg.seq_len, text2text)
    arrays = {}
    for split in SPLITS:
        first = [[task, ":", *words] for words in raw[f"{split}_a"]] if text2text else raw[f"{split}_a"]
        arrays[f"{split}_x"] = encode(tok, first, raw[f"{split}_b"])
        arrays[f"{split}_y"] = np.asarray(
            raw[f"{split}_y"], dtype=np.float32 if is_regression(spec.metric) else np.int64
        )
    return arrays, list(spec.classes), spec.metric, [tok.token_to_id(c) for c in spec.classes] if text2text else None


def write_text_task(
    path: Path, cfg: SuiteConfig, task: str, seed: int, backbone: BackboneConfig | None = None, downloads: bool = False
) -> dict[str, int]:
    """Build, check and save (atomically) one text task: the text suite's, or GLUE's (tokenized with ``backbone``'s
    tokenizer); returns the split sizes."""
    import torch

    from mergeflow.core.io import save_state_dict

    if cfg.source == "glue":
        from mergeflow.ml.data.glue import build_glue_task

        arrays, classes, metric = build_glue_task(cfg, backbone, task, seed, downloads)
        answers = None
    else:
        arrays, classes, metric, answers = build_text_task(cfg, task, seed)
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}
    check_text_task(tensors, classes, metric, str(path), cfg.seq_len)
    meta = {"task": task, "classes": json.dumps(classes), "metric": metric, "modality": "text"}
    save_state_dict(path, tensors, meta | ({"answers": json.dumps(answers)} if answers else {}))
    return {s: int(len(arrays[f"{s}_y"])) for s in SPLITS}


def write_text_corpus(path: Path, cfg: SuiteConfig, seed: int, build: bool = True) -> int:
    """The masked-LM corpus (``tokens``, int32 [N, seq_len], one sentence each) and data/tokenizer.json beside it.
    Returns its number of sentences."""
    import torch

    from mergeflow.core.io import save_state_dict

    from mergeflow.core.files import atomic_path
    from mergeflow.ml.data import text_suite

    tok = tokenizer(cfg.seq_len, cfg.source == "text2text")
    tokens = (
        encode(tok, text_suite.make_corpus(cfg.pretrain_images, seed), None)
        if build
        else np.zeros((0, cfg.seq_len), np.int32)
    )
    with atomic_path(Path(path).parent / "tokenizer.json") as tmp:
        tok.save(str(tmp))
    save_state_dict(
        path, {"tokens": torch.from_numpy(tokens)}, {"modality": "text", "vocab_size": str(tok.get_vocab_size())}
    )
    return int(len(tokens))


def special_ids(seq_len: int = 8, text2text: bool = False) -> dict[str, int]:
    """The ids of RoBERTa's special tokens in the suite's tokenizer: what a text backbone's config must agree with."""
    tok = tokenizer(seq_len, text2text)
    return {name: tok.token_to_id(name) for name in ("<s>", PAD, "</s>", "<unk>", MASK)} | {
        "vocab_size": tok.get_vocab_size()
    }
