"""Pretraining and fine-tuning: plain loops over uint8 image tensors (the linear probes: ``mergeflow.ml.probes``).

Schedules are linear warm-up then cosine decay to zero (Ilharco et al.'s protocol). Everything is seeded; on
the CPU the runs are deterministic for a given thread count.
"""

from __future__ import annotations

import copy
import itertools
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from mergeflow.config import FinetuneConfig, PreserveFeaturesConfig, ScheduleConfig
from mergeflow.core.devices import resident
from mergeflow.core.errors import MergeflowError
from mergeflow.ml.metrics import predicted, score as metric_score, task_loss
from mergeflow.ml.models import Backbone, make_head


@dataclass
class Curve:
    """Per-step training record, written as one record per step (the form `dvc plots` reads), logged to MLflow by
    step."""

    step: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    optimizer_state: dict[str, Any] | None = None  # the optimiser's state_dict at the end, to continue training from it

    def records(self) -> list[dict[str, float]]:
        return [{"step": s, "loss": loss, "lr": lr} for s, loss, lr in zip(self.step, self.loss, self.lr)]


def seed_everything(seed: int, threads: int | None = None) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    if threads:
        torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=True)


def total_steps(cfg: ScheduleConfig, n_examples: int, full_batch: bool = False) -> int:
    if cfg.epochs is None:
        return cfg.steps
    # an epoch is the full batches of a shuffle (``batches`` drops the last partial one)
    per_epoch = 1 if full_batch else max(1, n_examples // min(cfg.batch_size, n_examples))
    return cfg.epochs * per_epoch


def warmup_cosine(step: int, total: int, warmup: int) -> float:
    """Multiplier of the base learning rate at ``step`` (0-based)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def batches(n: int, batch_size: int, steps: int, generator: torch.Generator):
    """Index batches for ``steps`` steps, reshuffling each epoch; the last partial batch of an epoch is dropped."""
    batch_size = min(batch_size, n)
    per_epoch = n // batch_size
    done = 0
    while done < steps:
        order = torch.randperm(n, generator=generator)
        for i in range(per_epoch):
            if done == steps:
                return
            yield order[i * batch_size : (i + 1) * batch_size]
            done += 1


def _optimizer(
    kind: str, params, cfg: ScheduleConfig, momentum: float = 0.0, device: torch.device | None = None
) -> torch.optim.Optimizer:
    # on CUDA one fused kernel for every tensor's update (a ViT-B's ~150 tensors: ~150 launches a step otherwise);
    # the CPU keeps the default implementation, so CPU runs give the bytes they always gave
    fused = {"fused": True} if device is not None and device.type == "cuda" else {}
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **fused)
    # SGD and full-batch GD: weight decay as plain L2, so one GD step is exactly theta - lr * grad(L + wd/2 |theta|^2)
    return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=momentum, **fused)


# losses read back to the host every this many steps: reading one waits for the device, so a read per step keeps the
# host from queueing the next step's kernels while the GPU runs this one
LOSS_READ_EVERY = 32


def non_finite_loss(desc: str, value: float, step: int, cfg: ScheduleConfig) -> str:
    """The line for a loss that became NaN or infinite at ``step`` of the schedule, naming the keys of params.yaml
    that likely caused it: after updates, a learning rate (or weight decay) too high for the data; before any
    update, not those but the starting weights or the inputs."""
    section = (
        "finetune"
        if isinstance(cfg, FinetuneConfig)
        else "pretrain"
        if type(cfg).__name__ == "PretrainConfig"
        else None
    )
    lr, wd = (f"{section}.lr", f"{section}.weight_decay") if section else ("lr", "weight_decay")
    if step == 0:
        return (
            f"{desc}: loss became {value} at step 0, before any update (so not {lr} or {wd}): the starting weights or "
            "the inputs hold NaN or infinity"
        )
    return (
        f"{desc}: loss became {value} at step {step}: likely {lr} = {cfg.lr:g} is too high (or {wd} = "
        f"{cfg.weight_decay:g}); lower it"
    )


def train_loop(
    model: nn.Module,
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    n_examples: int,
    cfg: ScheduleConfig,
    *,
    optimizer: str,
    seed: int,
    device: torch.device,
    momentum: float = 0.0,
    desc: str = "train",
    on_epoch_end: Callable[[int], None] | None = None,
    start: int = 0,
    schedule_length: int | None = None,
    optimizer_state: Mapping[str, Any] | None = None,
) -> Curve:
    """Run the schedule; ``loss_fn(indices)`` returns the mean loss of the batch with those example indices.

    The defaults run one whole schedule from a fresh optimiser. A part of a longer schedule (the regimes' rounds):
    ``start`` is the first step's position both in a warm-up + cosine schedule ``schedule_length`` steps long (None:
    this call's steps) and in the data order that ``seed`` draws, and ``optimizer_state`` (a ``state_dict``) is
    loaded into the optimiser first; the returned curve holds the optimiser's final state."""
    full_batch = optimizer == "gd"
    steps = total_steps(cfg, n_examples, full_batch)
    length = steps if schedule_length is None else schedule_length
    batch_size = n_examples if full_batch else cfg.batch_size
    params = [p for p in model.parameters() if p.requires_grad]
    opt = _optimizer(optimizer, params, cfg, momentum, device)
    if optimizer_state is not None:
        # a copy: the optimiser updates its state in place, and the caller's may be a checkpoint still to be written
        opt.load_state_dict(copy.deepcopy(dict(optimizer_state)))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(start + s, length, cfg.warmup_steps))
    gen = torch.Generator().manual_seed(seed)
    per_epoch = max(1, n_examples // min(batch_size, n_examples))
    curve = Curve()
    model.train()
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    )
    # the first ``start`` batches of the data order belong to earlier parts of the schedule
    order = itertools.islice(batches(n_examples, batch_size, start + steps, gen), start, None)
    pending: list[torch.Tensor] = []  # this stretch's losses, still on the device

    def read_losses() -> None:
        # the first non-finite loss names its step; the steps after it (at most LOSS_READ_EVERY) are thrown away
        first = len(curve.loss)
        values = torch.stack(pending).float().tolist() if pending else []
        pending.clear()
        for i, value in enumerate(values):
            if not math.isfinite(value):
                raise MergeflowError(non_finite_loss(desc, value, curve.step[first + i], cfg))
        curve.loss.extend(values)

    for step, idx in enumerate(tqdm(order, total=steps, desc=desc, mininterval=5, disable=None)):
        with autocast:
            loss = loss_fn(idx)
        if device.type != "cuda" and not torch.isfinite(loss):  # on the CPU a read costs nothing: stop at once
            raise MergeflowError(non_finite_loss(desc, loss.item(), start + step, cfg))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        curve.step.append(start + step)
        pending.append(loss.detach())
        curve.lr.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        if len(pending) == LOSS_READ_EVERY:
            read_losses()
        if on_epoch_end and (step + 1) % per_epoch == 0:
            read_losses()  # a kept epoch's weights are finite ones
            on_epoch_end((step + 1) // per_epoch)
    read_losses()
    model.eval()
    curve.optimizer_state = opt.state_dict()
    return curve


def _batch(images: torch.Tensor, idx: torch.Tensor, device: torch.device) -> torch.Tensor:
    if images.device != idx.device:  # images resident on the device: index there
        idx = idx.to(images.device, non_blocking=True)
    return images[idx].to(device, non_blocking=True)


def pretrain(
    backbone: Backbone,
    images: torch.Tensor,
    labels: Mapping[str, torch.Tensor],
    cfg: ScheduleConfig,
    *,
    seed: int,
    device: torch.device,
) -> tuple[dict[str, nn.Linear], Curve]:
    """Supervised multi-head pretraining: the loss is the sum of each label head's cross-entropy."""
    heads = nn.ModuleDict({name: make_head(backbone.num_features, int(y.max()) + 1) for name, y in labels.items()})
    model = nn.ModuleDict({"backbone": backbone, "heads": heads}).to(device)
    targets = {name: y.to(device) for name, y in labels.items()}

    def loss_fn(idx: torch.Tensor) -> torch.Tensor:
        feats = backbone(_batch(images, idx, device))
        idx = idx.to(device)
        return sum(nn.functional.cross_entropy(heads[name](feats).float(), y[idx]) for name, y in targets.items())

    curve = train_loop(model, loss_fn, len(images), cfg, optimizer="adamw", seed=seed, device=device, desc="pretrain")
    return dict(heads.items()), curve


@torch.no_grad()
def extract_features(
    backbone: Backbone, images: torch.Tensor, *, batch_size: int, device: torch.device, bf16: bool = False
) -> torch.Tensor:
    """Features of ``images`` in batches, float32 on the CPU. ``bf16``: under bfloat16 autocast on CUDA (the merge
    search's candidates); float32 everywhere else. Images already on the device are sliced there."""
    backbone.eval().to(device)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16 and device.type == "cuda"):
        out = [backbone(images[i : i + batch_size].to(device)).float() for i in range(0, len(images), batch_size)]
    return torch.cat(out).cpu() if out else torch.empty(0, backbone.num_features)


@dataclass
class FeatureAnchor:
    """Out-of-task images and theta0's features on them, for ``finetune``'s feature-preservation term

        beta * mean_i ||f_theta(x_i) - f_theta0(x_i)||^2 / (d * mean per-feature variance of f_theta0),

    over ``batch_size`` of the images per step. It asks a task vector to leave the function unchanged outside its
    task, which is weight disentanglement as Ortiz-Jimenez et al. (NeurIPS 2023, arXiv:2305.12827) define it, and
    which task arithmetic needs; the term itself is feature distillation from the pretrained model, as in
    Li & Hoiem's Learning without Forgetting (2016), here on pretraining images.
    """

    images: torch.Tensor  # uint8 [N, H, W, 3]
    features: torch.Tensor  # theta0's, float32 [N, d]
    weight: float
    batch_size: int

    def __post_init__(self) -> None:
        self.feature_variance = self.features.var(0).mean()  # the penalty's normaliser, fixed for the whole run

    @classmethod
    def build(
        cls,
        backbone: Backbone,
        corpus: torch.Tensor,
        cfg: PreserveFeaturesConfig,
        *,
        seed: int,
        device: torch.device,
        eval_batch_size: int,
    ) -> FeatureAnchor:
        pick = torch.randperm(len(corpus), generator=torch.Generator().manual_seed(seed))[: cfg.images].sort().values
        images = corpus[pick]
        return cls(
            images,
            extract_features(backbone, images, batch_size=eval_batch_size, device=device),
            cfg.weight,
            cfg.batch_size,
        )

    def penalty(self, backbone: Backbone, idx: torch.Tensor, device: torch.device) -> torch.Tensor:
        target = self.features[idx].to(device)
        change = (backbone(_batch(self.images, idx, device)).float() - target).pow(2).mean()
        return self.weight * change / self.feature_variance.to(device)


def finetune(
    backbone: Backbone,
    head: nn.Linear,
    images: torch.Tensor,
    labels: torch.Tensor,
    cfg: FinetuneConfig,
    *,
    seed: int,
    device: torch.device,
    desc: str = "finetune",
    on_epoch_end: Callable[[int], None] | None = None,
    anchor: FeatureAnchor | None = None,
    start: int = 0,
    schedule_length: int | None = None,
    optimizer_state: Mapping[str, Any] | None = None,
    train_head: bool = False,
) -> Curve:
    """Fine-tune the backbone in place with the head frozen (the seeds' protocol; ``train_head``: trained with it, in
    place), plus the anchor's feature-preservation term when one is given. The loss is the task's
    (``metrics.task_loss``: squared error for a regression task's float scores, else cross-entropy). ``start``,
    ``schedule_length`` and ``optimizer_state`` continue a longer schedule, as in ``train_loop``."""
    backbone.to(device)
    head.to(device).requires_grad_(train_head)
    y = labels.to(device)
    images = resident(images, device)
    anchor_draws = torch.Generator().manual_seed(seed + 1)
    if anchor is not None and anchor.weight > 0:
        for _ in range(start):  # the anchor batches of the schedule's earlier steps
            torch.randint(len(anchor.images), (anchor.batch_size,), generator=anchor_draws)

    def loss_fn(idx: torch.Tensor) -> torch.Tensor:
        loss = task_loss(head(backbone(_batch(images, idx, device))), y[idx.to(device)])
        if anchor is not None and anchor.weight > 0:
            loss = loss + anchor.penalty(
                backbone, torch.randint(len(anchor.images), (anchor.batch_size,), generator=anchor_draws), device
            )
        return loss

    trained = nn.ModuleDict({"backbone": backbone, "head": head}) if train_head else backbone
    return train_loop(
        trained,
        loss_fn,
        len(images),
        cfg,
        optimizer=cfg.optimizer,
        momentum=cfg.momentum,
        seed=seed,
        device=device,
        desc=desc,
        on_epoch_end=on_epoch_end,
        start=start,
        schedule_length=schedule_length,
        optimizer_state=optimizer_state,
    )


@torch.no_grad()
def score(
    backbone: Backbone,
    head: nn.Linear,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    *,
    batch_size: int,
    device: torch.device,
    metric: str = "accuracy",
) -> float:
    feats = extract_features(backbone, inputs, batch_size=batch_size, device=device)
    return head_score(head, feats, labels, metric)


@torch.no_grad()
def head_score(head: nn.Linear, features: torch.Tensor, labels: torch.Tensor, metric: str = "accuracy") -> float:
    """The task's metric (mergeflow.ml.metrics) of the head on ``features``; accuracy as images have always had it."""
    head = head.cpu()
    if metric == "accuracy":
        return float((head(features).argmax(1) == labels).float().mean())
    return metric_score(metric, head(features), labels)


@torch.no_grad()
def head_predictions(head: nn.Linear, features: torch.Tensor, metric: str = "accuracy") -> torch.Tensor:
    """What the head predicts from ``features`` (the classes; a regression head's scores): what the leaderboard's
    bootstrap rescores (mergeflow.report.uncertainty)."""
    return predicted(metric, head.cpu()(features))


class Timer:
    """Seconds spent inside (a monotonic clock), and when that was (Unix times, for the stages' real start and end
    in MLflow)."""

    def __enter__(self) -> Timer:
        self.started = time.time()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.start
        self.ended = time.time()

    def record(self) -> dict[str, float]:
        return {"wall_time_s": self.seconds, "started": self.started, "ended": self.ended}
