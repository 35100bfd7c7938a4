"""The single source of configuration: ``params.yaml``, validated when loaded.

Every field has a comment saying what it is. An unknown key, a wrong type or an out-of-range value raises
``MergeflowError`` with one line naming the key and what is allowed, before any stage writes anything.
"""

from __future__ import annotations

import functools
import os
import re
import zlib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mergeflow.core.errors import MergeflowError, did_you_mean
from mergeflow.core.stage_table import STAGES, parse_address
from mergeflow.config.environment import DOWNLOAD_ENV
from mergeflow.config.fields import (
    MAX_BATCH,
    MAX_GRID,
    MAX_IMAGES,
    MAX_LR,
    MAX_SEED,
    MAX_STEPS,
    MAX_THREADS,
    NAME_PATTERN,
    at_most,
    check_name,
    non_finite,
    one_line,
)
from mergeflow.config.registered import MergeConfig, RegimesConfig, StudiesConfig  # the registries' sections


DEFAULT_PARAMS = "params.yaml"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


GENERATED = ("embedded", "text", "text2text")  # suites generated in the pipeline, no root


class SuiteConfig(_Strict):
    # names the MLflow experiment (mergeflow/<name>) and registered model; empty (null): "embedded" for the
    # embedded suite, else the last folder of root
    name: str = Field("embedded", pattern=NAME_PATTERN)
    # embedded, text: the generated image or text suite (text: GLUE's eight kinds of task); else images under root
    source: Literal["embedded", "text", "text2text", "imagefolder", "torchvision", "glue"] = (
        "embedded"  # text2text: text's, T5-style; glue: GLUE on disk
    )
    root: str | None = None  # imagefolder: <root>/<task>/{train,val,test}/<class>/*; torchvision: the datasets' root
    download: bool = False  # torchvision: download what is missing under root (also `mergeflow prepare --download`)
    tasks: list[str] = Field(min_length=1)  # downstream tasks, in report order
    image_size: int = Field(32, ge=8, le=1024)  # images are stored square, uint8, at this size
    # how imagefolder and torchvision images become image_size squares (the embedded suite is generated at it):
    # squash: the whole image, aspect lost (the embedded suite, your data); crop: CLIP's eval transform, short side
    # to image_size (bicubic) then the centre
    resize: Literal["squash", "crop"] = "squash"
    n_train: Annotated[int, at_most(MAX_IMAGES, "images")] = Field(
        3000, ge=8, le=MAX_IMAGES
    )  # per task; embedded suite generates exactly this many, real data is capped by it
    n_val: Annotated[int, at_most(MAX_IMAGES, "images")] = Field(300, ge=4, le=MAX_IMAGES)
    n_test: Annotated[int, at_most(MAX_IMAGES, "images")] = Field(800, ge=4, le=MAX_IMAGES)
    pretrain_images: Annotated[int, at_most(MAX_IMAGES, "images")] = Field(
        50000, ge=0, le=MAX_IMAGES
    )  # size of the formula-driven pretraining corpus (embedded source; text: sentences)
    seq_len: int = Field(64, ge=8, le=4096)  # text: tokens per example, "<s> a </s></s> b </s>" padded to it

    modality = property(lambda self: "text" if self.source in ("text", "text2text", "glue") else "image")

    @model_validator(mode="before")
    @classmethod
    def _default_name(cls, raw: Any) -> Any:
        """An empty name: the suite's own (a copied params.yaml pointed at other data must not log as 'embedded')."""
        if isinstance(raw, dict) and raw.get("name") is None:
            root = raw.get("root")
            name = (
                Path(str(root)).resolve().name
                if raw.get("source", "embedded") not in GENERATED and root
                else raw.get("source", "embedded")
            )
            raw = dict(raw, name=re.sub(r"[^A-Za-z0-9_.-]", "-", name).lstrip("_.-") or "suite")
        return raw

    @field_validator("tasks")
    @classmethod
    def _unique(cls, tasks: list[str]) -> list[str]:
        for i, task in enumerate(tasks):
            check_name(task, f"task {i}")
        if dup := sorted({t for t in tasks if tasks.count(t) > 1}):
            raise ValueError(f"task '{dup[0]}' is listed twice")
        return tasks

    @model_validator(mode="after")
    def _root_needed(self) -> SuiteConfig:
        if self.source not in GENERATED and not self.root:
            raise ValueError(f"source '{self.source}' needs 'root' (a directory)")
        return self


class BackboneConfig(_Strict):
    # timm: images; transformers: text, an encoder (model: its model_type, e.g. roberta; a head on the first token's
    # feature, global_pool: token, or the tokens' mean, avg) or an encoder-decoder (t5: read at its first token)
    library: Literal["timm", "transformers"] = "timm"
    model: str = Field(
        "vit_tiny_patch16_224", pattern=NAME_PATTERN
    )  # any timm model name; transformers: its model_type
    kwargs: dict[str, Any] = Field(
        default_factory=dict
    )  # timm.create_model's (img_size, patch_size, embed_dim, ...); transformers: the model config's
    global_pool: str = "avg"
    input_norm: Literal["center", "per_image", "pretrained_cfg", "none"] = (
        "center"  # per-image normalisation, or the weights' own mean/std
    )
    pretrained: str | None = None  # None: pretrain on the corpus; "hub": timm's weights; a path: a local weights file
    # pooled: the pooled features; clip: CLIP's image embedding (timm's head is CLIP's projection, L2-normalised)
    embedding: Literal["pooled", "clip"] = "pooled"
    # the CLIP text tower that builds zero-shot heads (finetune.head: zeroshot), in open_clip: "hub" (the image
    # tower's hub repository), a local open_clip weights file, or "random" (a seeded init: tests)
    text: str | None = None

    @model_validator(mode="after")
    def _settings(self) -> BackboneConfig:
        from mergeflow.config.backbone import check_backbone

        if why := check_backbone(self.library, self.model, self.kwargs, self.global_pool):
            raise ValueError(why)
        return self


class ScheduleConfig(_Strict):
    steps: Annotated[int, at_most(MAX_STEPS, "steps")] = Field(
        1000, ge=0, le=MAX_STEPS
    )  # optimiser steps (overridden by epochs when that is set)
    epochs: Annotated[int, at_most(MAX_STEPS, "epochs")] | None = Field(
        None, ge=1, le=MAX_STEPS
    )  # whole passes over the training split; 1 epoch of full-batch GD is one step
    batch_size: Annotated[int, at_most(MAX_BATCH, "examples")] = Field(128, ge=1, le=MAX_BATCH)
    lr: float = Field(1e-3, gt=0, le=MAX_LR)
    weight_decay: float = Field(0.05, ge=0)
    warmup_steps: Annotated[int, at_most(MAX_STEPS, "steps")] = Field(
        0, ge=0, le=MAX_STEPS
    )  # linear warm-up, then cosine decay to zero


class PretrainConfig(ScheduleConfig): ...


NEWTON_MAX_UNKNOWNS = (
    4096  # more unknowns (features x classes) would build a Hessian of over 130 MB: L-BFGS runs instead
)


class ProbeConfig(_Strict):
    c_grid: list[Annotated[float, Field(gt=0)]] = Field(
        default_factory=lambda: [0.01, 0.1, 1.0, 10.0], min_length=1, max_length=MAX_GRID
    )  # inverse L2 strengths, chosen on val
    # newton-cholesky: Newton's method to the optimum (~10 iterations), which last-bit differences in the features
    # move by ~1e-5; lbfgs, stopped on its path, moved by 1e-2 (training.fit_probe). Above NEWTON_MAX_UNKNOWNS
    # features x classes (its Hessian's side), L-BFGS runs instead
    solver: Literal["newton-cholesky", "lbfgs"] = "newton-cholesky"
    max_iter: Annotated[int, at_most(MAX_STEPS, "iterations")] = Field(500, ge=10, le=MAX_STEPS)


class PreserveFeaturesConfig(_Strict):
    """Keep the backbone's features on out-of-task images (the pretraining corpus) near theta0's while fine-tuning."""

    weight: float = Field(0.0, ge=0)  # beta of the relative squared feature change; 0 turns it off
    images: Annotated[int, at_most(MAX_IMAGES, "images")] = Field(
        2048, ge=1, le=MAX_IMAGES
    )  # corpus images drawn once (seeded); theta0's features on them are computed once
    batch_size: Annotated[int, at_most(MAX_BATCH, "images")] = Field(
        32, ge=1, le=MAX_BATCH
    )  # of them per step, beside the task's own batch


class FinetuneConfig(ScheduleConfig):
    optimizer: Literal["adamw", "sgd", "gd"] = "adamw"  # gd = full-batch gradient descent (batch = whole split)
    # the frozen head: a linear probe fitted on theta0's features, CLIP's zero-shot head from the class names and
    # prompt templates (backbone.embedding: clip, backbone.text), or a text-to-text model's answer words' logits
    head: Literal["probe", "zeroshot", "verbalizer"] = "probe"
    # the head trained with the backbone from the probe (seed 002's language models), or frozen (the vision papers')
    train_head: bool = False
    # per task, a published fine-tuned checkpoint imported instead of fine-tuning: a local file or hf:<owner>/<repo>
    checkpoints: dict[str, str] = Field(default_factory=dict)
    momentum: float = Field(0.0, ge=0, lt=1)  # sgd only
    checkpoint_every_epoch: bool = False  # also keep models/finetuned/<task>.epoch<k>.safetensors
    preserve_features: PreserveFeaturesConfig = PreserveFeaturesConfig()


class StatisticsConfig(_Strict):
    """The per-task statistics data-aware methods read (stage ``statistics``): Fisher diagonals and layer-input
    Grams of each fine-tuned model on the first ``examples`` of its task's training split."""

    examples: Annotated[int, at_most(MAX_IMAGES, "examples")] = Field(256, ge=1, le=MAX_IMAGES)


class RuntimeConfig(_Strict):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # the same bytes on any x86-64 CPU (mergeflow.core.reproducibility): pinned kernels, GEMMs on `threads` threads
    deterministic: bool = True
    # a stage's CPU threads. Deterministic: default 2, whatever the cores (part of what decides the bits); else
    # default the stage's share of the cores (MERGEFLOW_THREADS overrides)
    threads: Annotated[int, at_most(MAX_THREADS, "threads")] | None = Field(None, ge=1, le=MAX_THREADS)
    eval_batch_size: Annotated[int, at_most(MAX_BATCH, "examples")] = Field(512, ge=1, le=MAX_BATCH)


class TrackingConfig(_Strict):
    log_checkpoints: bool = True  # copy checkpoints and merged models into MLflow artifacts


def task_seed(seed: int, task: str) -> int:
    """The seed of one task (its generated data, its probe and fine-tune, the studies' runs on it), from the run's
    seed (params.seed): every task draws its own, whatever the others are."""
    return seed * 1_000_003 + zlib.crc32(task.encode())


# a foreach item's least threads: these models run 1.6x (a fine-tune) to 1.9x (a merge) faster on a second thread
# (2026-11-26, 2 cores), so two items on one core each end no sooner than one after the other on two
MIN_STAGE_THREADS = 2


class Params(_Strict):
    seed: Annotated[int, at_most(MAX_SEED, "(the seed range of numpy and scikit-learn)")] = Field(0, ge=0, le=MAX_SEED)
    # more seeds to repeat the fine-tunes and merges with (a stage replicate@<seed> each, on the same data and
    # backbone): the summary gives each method's mean and spread over seed and these
    seeds: list[
        Annotated[int, at_most(MAX_SEED, "(the seed range of numpy and scikit-learn)"), Field(ge=0, le=MAX_SEED)]
    ] = Field(default_factory=list, max_length=MAX_GRID)
    suite: SuiteConfig
    backbone: BackboneConfig = BackboneConfig()
    pretrain: PretrainConfig = PretrainConfig()
    probe: ProbeConfig = ProbeConfig()
    finetune: FinetuneConfig = FinetuneConfig(steps=250, batch_size=64, lr=3e-4, weight_decay=0.1, warmup_steps=25)
    merge: MergeConfig  # which methods run is the study's first choice: no default
    statistics: StatisticsConfig = StatisticsConfig()
    regimes: RegimesConfig = RegimesConfig()
    studies: StudiesConfig = StudiesConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    tracking: TrackingConfig = TrackingConfig()

    def downloads(self) -> bool:
        """Whether missing datasets and weights may be downloaded: suite.download, or --download on the command
        line (MERGEFLOW_DOWNLOAD=1, which changes no output and so is no DVC parameter)."""
        return self.suite.download or os.environ.get(DOWNLOAD_ENV) == "1"

    def threads(self) -> int | None:
        """A stage's CPU threads. Deterministic mode: runtime.threads, else DETERMINISTIC_THREADS, whatever the
        machine (the count decides the bits, so it comes from params.yaml alone). Otherwise MERGEFLOW_THREADS, else
        runtime.threads, else its share (stage_share); None: torch's default (every core)."""
        if self.runtime.deterministic:
            from mergeflow.core.reproducibility import DETERMINISTIC_THREADS

            return self.runtime.threads or DETERMINISTIC_THREADS
        env = os.environ.get("MERGEFLOW_THREADS")
        if not env:
            return self.runtime.threads or self.stage_share()
        if not env.strip().isdecimal() or not 1 <= int(env) <= MAX_THREADS:
            raise MergeflowError(
                f"MERGEFLOW_THREADS={env[:40]!r}: expected a whole number of threads from 1 to {MAX_THREADS:,} (it "
                "overrides runtime.threads)"
            )
        return int(env)

    def stage_share(self, address: str | None = None, cores: int | None = None, gpus: int | None = None) -> int | None:
        """The threads of the stage at ``address`` (default: DVC_STAGE, as DVC and the runners set it): the items
        of one foreach stage that shares the cores (stage_table: the fine-tunes, the merges, the regime merges, the
        studies) share the cores, at
        least MIN_STAGE_THREADS each, so that on a larger machine `mergeflow repro` and the flow run several side
        by side; None for every other stage, and wherever the share would be every core anyway (torch's default;
        prepare and the regimes start a worker process per core themselves). The thread count decides the last bits
        of what a stage trains, so it follows from params.yaml and the machine alone: plain `dvc repro`,
        `mergeflow repro` and the flow give the same bytes, whatever runs beside a stage. On the GPU path (``gpus``,
        default ``devices.run_gpus``) each stage has a GPU to itself and takes the cores' share of one GPU instead."""
        address = os.environ.get("DVC_STAGE", "") if address is None else address
        stage, item = parse_address(address)
        spec = STAGES.get(stage)
        items = (
            len(functools.reduce(getattr, spec.item.params_list.split("."), self))
            if item and spec and spec.shares_cores
            else None
        )
        cores = cores or os.cpu_count() or 1
        if gpus is None:
            from mergeflow.core.devices import run_gpus  # torch: not at config's import

            gpus = run_gpus(self.runtime.device)
        if gpus and stage not in ("prepare", "pretrain"):  # (those two run alone: every other stage waits for them)
            share = max(
                MIN_STAGE_THREADS, cores // gpus
            )  # each running stage has a GPU to itself: they share the cores
        else:
            share = max(MIN_STAGE_THREADS, cores // min(cores, items)) if items else cores
        return share if share < cores else None

    @model_validator(mode="after")
    def _modality(self) -> Params:  # text data need a text backbone, images an image one
        text_backbone = self.backbone.library == "transformers"
        if (self.suite.modality == "text") != text_backbone:
            raise ValueError(
                f"backbone.library: suite.source '{self.suite.source}' holds {self.suite.modality}s, which need "
                f"backbone.library: {'transformers' if self.suite.modality == 'text' else 'timm'} (not "
                f"'{self.backbone.library}')"
            )
        if (self.finetune.head == "verbalizer") != (self.suite.source == "text2text") or (
            self.finetune.head == "verbalizer" and self.finetune.train_head
        ):
            raise ValueError(
                "finetune.head: a text-to-text suite (suite.source: text2text) is read by its answer words, "
                f"finetune.head: verbalizer with train_head: false, and only it (not head '{self.finetune.head}', "
                f"train_head {str(self.finetune.train_head).lower()}, source '{self.suite.source}')"
            )
        if text_backbone and self.finetune.preserve_features.weight:
            raise ValueError(
                "finetune.preserve_features: the feature anchor reads pretraining-corpus images; for text set "
                "finetune.preserve_features.weight to 0"
            )
        return self

    @model_validator(mode="after")
    def _clip(self) -> Params:
        """CLIP's settings checked together, before any stage runs (a mistake would otherwise surface after hours
        of data preparation, or not at all: another pooling or normalisation is still a model)."""
        if self.finetune.head == "zeroshot" and (self.backbone.embedding != "clip" or self.backbone.text is None):
            raise ValueError(
                "finetune.head: zeroshot needs CLIP's image embedding and text tower (backbone.embedding: clip, "
                "backbone.text: hub, a file or random)"
            )
        if self.backbone.embedding == "clip" and (
            self.backbone.global_pool != "token" or self.backbone.input_norm != "pretrained_cfg"
        ):
            raise ValueError(
                "backbone.embedding: clip embeds CLIP's class token of images normalised by CLIP's mean and std: set "
                "backbone.global_pool: token and backbone.input_norm: pretrained_cfg (not "
                f"'{self.backbone.global_pool}', '{self.backbone.input_norm}')"
            )
        for task, spec in self.finetune.checkpoints.items():
            if task not in self.suite.tasks:
                raise ValueError(
                    f"finetune.checkpoints: '{task}' is not in suite.tasks ({', '.join(self.suite.tasks)})"
                )
            repo = spec.removeprefix("hf:").partition("@")[0]
            if spec.startswith("hf:") and not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", repo):
                raise ValueError(f"finetune.checkpoints.{task}: {spec!r} is not hf:<owner>/<repo>[@<revision>]")
        return self

    def check_task(self, task: str) -> None:
        if task not in self.suite.tasks:
            raise MergeflowError(_not_listed("suite.tasks", "task", task, self.suite.tasks))

    @model_validator(mode="after")
    def _replicate_seeds(self) -> Params:
        if self.seed in self.seeds:
            raise ValueError(
                f"seeds: {self.seed} is the run's own seed (seed); seeds "
                "lists the others to repeat the fine-tunes and merges with"
            )
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds: {next(s for s in self.seeds if self.seeds.count(s) > 1)} is listed twice")
        return self

    def check_replicate(self, seed: int) -> None:
        if seed not in self.seeds:
            raise MergeflowError(_not_listed("seeds", "seed", seed, [str(s) for s in self.seeds]))

    def check_regime(self, regime: str) -> None:
        if regime not in self.regimes.run:
            raise MergeflowError(_not_listed("regimes.run", "regime", regime, self.regimes.run))

    def check_study(self, study: str) -> None:
        if study not in self.studies.run:
            raise MergeflowError(_not_listed("studies.run", "study", study, self.studies.run))

    def check_method(self, method: str) -> None:
        if method not in self.merge.methods:
            raise MergeflowError(_not_listed("merge.methods", "method", method, self.merge.methods))


def _not_listed(key: str, what: str, name: object, listed: list[str]) -> str:
    """One short line for a command's item that params.yaml does not list: the closest listed names, or all of
    them when they are few."""
    shown = (
        f"{did_you_mean(name, listed)}{len(listed)} listed"
        if len(listed) > 8
        else f"listed: {', '.join(listed) or 'none'}"
    )
    return f"params.yaml: {key} has no {what} {name!r} ({shown})"


def check_written_out(raw: Any, source: str) -> None:
    """A params file names every top-level key: a missing section would run on defaults that neither the file nor
    dvc.lock's params show (DVC records a missing key as absent); an empty one (`probe:`) asks for its defaults in
    so many words. (A mapping built in code, as the tests build them, may leave sections out.)"""
    if isinstance(raw, dict) and (missing := [name for name in Params.model_fields if name not in raw]):
        what = (
            f"section '{missing[0]}' is missing (`{missing[0]}:` left empty takes its defaults)"
            if missing[0] in MAPPING_SECTIONS
            else f"'{missing[0]}' is missing"
        )
        raise MergeflowError(f"{source}: {what}: params.yaml writes out every top-level key")


MAPPING_SECTIONS = (
    "suite",
    "backbone",
    "pretrain",
    "probe",
    "finetune",
    "merge",
    "statistics",
    "regimes",
    "studies",
    "runtime",
    "tracking",
)


def parse_schema(raw: Any, source: str = DEFAULT_PARAMS) -> Params:
    """params.yaml's sections, types and ranges validated; the registries' names and settings are not
    (mergeflow.params.parse_params checks those too: what every command loads)."""
    if not isinstance(raw, dict):
        raise MergeflowError(f"{source}: expected a mapping of sections at the top level")
    raw = {key: {} if value is None and key in MAPPING_SECTIONS else value for key, value in raw.items()}  # `probe:`
    if found := non_finite(raw):
        raise MergeflowError(
            f"{source}: {found[0]}: {found[1]} is not a finite number "
            "(NaN and infinity are refused everywhere in the params)"
        )
    try:
        return Params.model_validate(raw)
    except ValidationError as err:
        raise MergeflowError(one_line(err, source, Params)) from None
