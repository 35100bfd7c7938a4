"""Every stage of the pipeline, declared once: its name (the CLI subcommand and dvc.yaml's stage), what a foreach
stage runs over, whether its items share the cores, and its help. The CLI builds its stage subcommands from this
table, the stage server forks exactly these commands, ``Params.stage_share`` reads which items share the cores,
`mergeflow plan` has a cost model for each (``plan.work.COSTS``) and ``track`` a record for each
(``tracking.RECORDED``); tests hold those, and dvc.yaml, to this table. The paths a stage reads and writes are
``layout.Layout``'s. A new stage: its function in ``stages.py``, its line here, its entry in dvc.yaml.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Item:
    """What a foreach stage (``<stage>@<item>``) runs over."""

    option: str  # the CLI's option for it (--task) or, positional, its metavar's lower case (name)
    params_list: str  # the list of params.yaml dvc.yaml's foreach reads ("suite.tasks")
    what: str  # "the task", for the option's help
    positional: bool = False


@dataclass(frozen=True)
class Stage:
    name: str
    help: str  # one line in `mergeflow --help`
    description: str  # `mergeflow <stage> --help`
    item: Item | None = None  # None: one stage, not a foreach
    # the items run side by side, sharing the cores (at least MIN_STAGE_THREADS each): a foreach whose items are
    # light enough to run several at once (a regime and a replicate start their own worker processes)
    shares_cores: bool = False


TASK = Item("task", "suite.tasks", "the task")
METHOD = Item("method", "merge.methods", "the method")
REGIME = Item("regime", "regimes.run", "the regime")
STUDY = Item("name", "studies.run", "the study", positional=True)
SEED = Item("seed", "seeds", "the seed")

STAGES: dict[str, Stage] = {
    s.name: s
    for s in (
        Stage(
            "prepare",
            "stage: generate or convert every task's data and the pretraining corpus",
            "Generate or convert every task's data (data/tasks) and the pretraining corpus.",
        ),
        Stage(
            "pretrain",
            "stage: pretrain the backbone on the corpus, or load real pretrained weights",
            "Pretrain the backbone on the corpus, or load the weights backbone.pretrained names.",
        ),
        Stage(
            "finetune",
            "stage: a frozen head (linear probe or CLIP zero-shot), then "
            "fine-tune the backbone on one task (or import a published fine-tune)",
            "The task's frozen head (a linear probe on theta0's features, or CLIP's zero-shot head: finetune.head), "
            "then fine-tune the backbone on "
            "one task under it, or import the fine-tune finetune.checkpoints names.",
            TASK,
            shares_cores=True,
        ),
        Stage(
            "vectors",
            "stage: task vectors (fine-tuned minus pretrained) and their statistics",
            "Task vectors (fine-tuned minus pretrained weights), their norms and cosine similarities.",
        ),
        Stage(
            "statistics",
            "stage: per-task Fisher diagonals and layer-input Grams, for data-aware merging (fisher, regmean)",
            "Per task, the diagonal Fisher of the fine-tuned model with "
            "its head and the Gram of every linear layer's inputs, on "
            "statistics.examples training examples.",
        ),
        Stage(
            "sources",
            "stage: the source files each merge follows from (its method's module and what it imports)",
            "For every registered method, sources/merge/<method>.json: the md5 of each file its merge runs (the "
            "method's module, the merging "
            "modules it imports, the registry, the search and the stage's "
            "binding of data). A merge stage depends on its own file, so that "
            "changing one method re-runs only its merges.",
        ),
        Stage(
            "merge",
            "stage: merge with one method (hyperparameters chosen on validation), then test on every task",
            "Merge the task vectors with one method, its hyperparameters "
            "chosen on the validation splits, then test it on every task.",
            METHOD,
            shares_cores=True,
        ),
        Stage(
            "regime",
            "stage: a training-time regime's task vectors (regimes.run in params.yaml; `mergeflow regimes` lists them)",
            "Make the task vectors of one training-time regime (every variant: MIMA and ATM one per round count), "
            "checkpointed after every round.",
            REGIME,
        ),
        Stage(
            "regime_merge",
            "stage: merge a regime's task vectors with its methods, then test them",
            "Merge each variant of one regime with the methods "
            "regimes.methods.<regime> lists (chosen on validation), then test them.",
            REGIME,
            shares_cores=True,
        ),
        Stage(
            "replicate",
            "stage: the fine-tunes and merges again with another "
            "seed (seeds in params.yaml), for the spread over seeds",
            "Fine-tune every task and merge with every method of merge.methods again with SEED (one of seeds in "
            "params.yaml), on the run's data "
            "and pretrained backbone, under replicates/<seed>/; the "
            "report gives each method's mean and spread over the seeds.",
            SEED,
        ),
        Stage(
            "report",
            "stage: the summary table (results/summary.md) and plots",
            "The summary table of every method (results/summary.md, .csv, .json) and its plots.",
        ),
        Stage(
            "study",
            "stage: one of the papers' studies, a report with a verdict per claim (studies/<name>/report.md)",
            "Run one study (studies.run in params.yaml): studies/<name>/report.md "
            "with a verdict per claim, computed from the measurements.",
            STUDY,
            shares_cores=True,
        ),
        Stage(
            "track",
            "stage: record the pipeline's outputs in MLflow (see `mergeflow ui`)",
            "Record the pipeline's parameters, metrics and models in MLflow; metrics/tracking.json names the run.",
        ),
    )
}


def parse_address(address: str) -> tuple[str, str]:
    """A stage's address as DVC names it ("finetune@digits", "dvc.yaml:merge@ties", "report") as (stage, item);
    item "" for a stage that is not a foreach."""
    stage, _, item = address.rpartition(":")[2].partition("@")
    return stage, item
