"""Study ``gradients``' settings and the types its measurements share."""

from __future__ import annotations

from typing import TYPE_CHECKING

from collections.abc import Callable, Mapping

from pydantic import Field, PositiveInt, field_validator

from mergeflow.studies import StudySettings

if TYPE_CHECKING:
    import torch

PAPER = "Zhou, Solombrino, Crisostomi, Bucarelli, Silvestri, Rodolà: On Task Vectors and Gradients (seed 000)"


State = dict[str, "torch.Tensor"]


GradFn = Callable[[Mapping[str, "torch.Tensor"]], State]  # state -> grad of the task's mean loss at that state


class GradientsSettings(StudySettings):
    """Every cost is bounded here: the defaults take about a minute on 2 CPU cores with the default suite."""

    examples: int = Field(512, ge=1)  # training examples per task (the split's first n) for claims 1-4
    gd_lr: float = Field(
        1e-4, gt=0
    )  # eta of the full-batch GD runs of claims 1-2 (alpha * eta * sharpness well under 2: GD stays stable)
    alpha: float | None = Field(None, gt=0)  # task-arithmetic / ATM scaling in claims 1-3; empty (null): 1/T
    tasks: list[str] | None = Field(
        None, min_length=1
    )  # tasks of claims 2-5 (the costly parts); empty (null): the first four of suite.tasks
    atm_rounds: int = Field(3, ge=1)  # R of claim 2: ATM rounds of one full-batch GD step per task
    identity_ulps: float = Field(
        4.0, gt=0
    )  # claims 1-2 hold when each error norm is at most this many float32 floors ‖ulp(theta)/2‖ (claim 2: per round)
    gap_examples: int = Field(
        256, ge=1
    )  # examples per task in claim 3 (float64 GD: each step size costs (k - 1) x 2T gradients)
    gap_epochs: int = Field(2, ge=2)  # k of claim 3: full-batch GD epochs per task before comparing TA with MT
    gap_lrs: list[float] = Field(
        default_factory=lambda: [1e-4, 1e-5, 1e-6], min_length=2
    )  # eta values of claim 3 (the log-slope is fitted over them)
    slope_range: tuple[float, float] = (1.7, 2.3)  # claim 3 holds when the fitted log-slope of the gap in eta is inside
    batch_sizes: list[PositiveInt] = Field(
        default_factory=lambda: [512, 128, 32, 8], min_length=2
    )  # claim 4: AdamW batch sizes, one epoch each
    trajectory_examples: int = Field(1024, ge=1)  # claim 5: examples per task of the multi-epoch fine-tune
    trajectory_epochs: int = Field(6, ge=2)  # claim 5: epochs of the pipeline's fine-tune settings
    cosine_threshold: float = Field(0.8, ge=-1, le=1)  # claim 5: cos(g1, g_k) must exceed this for k <= cosine_epochs
    cosine_epochs: int = Field(5, ge=2)  # claim 5: the epochs k the cosine bound is checked for
    merge_tolerance: float = Field(
        0.03, ge=0
    )  # claim 6: one-epoch TA may be at most this far (accuracy fraction) below converged TA
    chunk: int = Field(256, ge=1)  # examples per autograd chunk of the independent gradients

    @field_validator("slope_range")
    @classmethod
    def _ordered(cls, v: tuple[float, float]) -> tuple[float, float]:
        if v[0] >= v[1]:
            raise ValueError(f"{list(v)}: expected [low, high] with low < high")
        return v

    @field_validator("gap_lrs")
    @classmethod
    def _two_sizes(cls, v: list[float]) -> list[float]:
        if len(set(v)) < 2 or min(v) <= 0:
            raise ValueError(f"{v}: expected at least two different positive step sizes")
        return v
