"""The tiny profile the end-to-end tests run: the real params.yaml with small sizes, so every key DVC tracks exists."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

TINY = {
    "suite": {
        "tasks": ["digits", "house_numbers", "count"],
        "n_train": 200,
        "n_val": 60,
        "n_test": 60,
        "pretrain_images": 800,
    },
    "backbone": {"kwargs": {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 1, "num_heads": 2}},
    "pretrain": {"steps": 15, "batch_size": 64, "warmup_steps": 2},
    "probe": {"c_grid": [0.1, 1.0]},
    "finetune": {"steps": 8, "batch_size": 32, "lr": 0.001, "warmup_steps": 2},
    "merge": {
        "methods": [
            "weight_averaging",
            "task_arithmetic",
            "ties",
            "consensus_ta",
            "emr",
            "task_negation",
            "fisher",
            "regmean",
            "adamerging_cart",
        ],
        "task_arithmetic": {"lam": [0.1, 0.3, 0.5]},
        "ties": {"k": 0.2, "trim_scope": "global", "lam": [0.8, 1.0]},
        "consensus_ta": {"tall_lambda": [0.2, 0.6], "alpha": [0.3, 0.6]},
        "emr": {},
        "task_negation": {"lam": [0.5, 1.0]},
        "adamerging_cart": {"steps": 10},
    },
    "statistics": {"examples": 32},
    # one thread a stage: stages this small gain nothing from a second thread, and on 2 cores `mergeflow repro` then
    # runs two at once, with the regimes' fine-tunes in the stage (no worker processes to start): 37 s a run, not 57
    "runtime": {"threads": 1},
    "regimes": {"mima": {"rounds": [2]}},  # run: one_epoch and mima, as params.yaml
    # every study and part, in seconds: provable on coarser grids (its own tests check its claims at full size)
    "studies": {
        "run": ["gradients", "mima", "provable", "cart", "ctl"],
        "provable": {
            "real": True,
            "alphas": [-0.6, 0.0, 0.6],
            "lambda_step": 0.25,
            "ood_lambda_step": 0.5,
            "test_examples": 128,
            "real_lambda_step": 0.5,
            "real_ood_lambda_step": 1.0,
        },
    },
}


def deep_update(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "kwargs":
            out[key] = deep_update(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def tiny_params(repo_params: Path, **override) -> dict:
    return deep_update(deep_update(yaml.safe_load(repo_params.read_text()), TINY), override)


def _set_in(doc, override: dict) -> None:
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(doc.get(key), dict) and key != "kwargs":
            _set_in(doc[key], value)
        else:
            doc[key] = copy.deepcopy(value)


def tiny_params_text(repo_params: Path, **override) -> str:
    """The tiny profile as a params.yaml in the repository's own form (comments kept, as DVC writes it)."""
    import io

    from mergeflow.core.yaml_files import round_trip_yaml

    rt = round_trip_yaml()
    doc = rt.load(repo_params.read_text())
    _set_in(doc, deep_update(TINY, override))
    buffer = io.StringIO()
    rt.dump(doc, buffer)
    return buffer.getvalue()


if __name__ == "__main__":
    import sys

    print(tiny_params_text(Path(sys.argv[1])), end="")


def written_out(raw: dict) -> dict:
    """``raw`` with every top-level key a params file must name: the sections it leaves out empty (their defaults),
    seed 0 and no replicate seeds."""
    from mergeflow.config import MAPPING_SECTIONS

    return {"seed": 0, "seeds": []} | {name: {} for name in MAPPING_SECTIONS} | raw
