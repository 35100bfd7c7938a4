"""Study ``ctl``'s settings: the pairs and alphas measured, and the thresholds of its claims."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field, model_validator

from mergeflow.studies import StudySettings

if TYPE_CHECKING:
    import torch

PAPER = (
    "Seed 003: Zhou, Chen, Chen, Zhang, Yan 2024, Cross-Task Linearity "
    "Emerges in the Pretraining-Finetuning Paradigm (arXiv:2402.03660)"
)


State = dict[str, "torch.Tensor"]


class CtlSettings(StudySettings):
    """Every threshold is fixed here, before any number is seen; the defaults run in well under 2 minutes on the
    default suite and 2 CPU cores."""

    examples: int = Field(128, ge=2)  # per task: the first n of its test split (D_i u D_j holds 2n) for claims 1-6
    pairs: int | None = Field(
        8, ge=1
    )  # task pairs measured: n of all pairs, drawn with the pipeline's seed (suite order kept); empty (null): all
    alphas: list[float] = Field(
        default_factory=lambda: [0.25, 0.5, 0.75], min_length=1
    )  # claim 1's alpha (0.5 must be one: claims 6 and 8)
    lam: float = Field(0.3, gt=0)  # claims 4, 5, 7: lambda when metrics/merge/task_arithmetic.json is absent
    average_sizes: list[int] = Field(
        default_factory=lambda: [3, 4, 5], min_length=1
    )  # claim 3: k models averaged (one subset each; k above the task count dropped)
    average_seed: int = 0  # claim 3: seed of the subsets' draw
    stitch_layer: int | None = Field(None, ge=0)  # claim 7: block index; empty: the middle block, depth // 2 - 1
    stitch_examples: int = Field(200, ge=1)  # claim 7: test examples per task, the first n (capped at the split)
    scratch_pair: tuple[str, str] | None = None  # claim 8's pair; empty: the first measured pair
    scratch_steps: int | None = Field(None, ge=1)  # claim 8: steps of both runs; empty: finetune.steps
    # claims 1, 3, 4, 5: "d close to 0 compared with the baseline": the mean d at every layer (and alpha, and k) is at
    # most this fraction of the mean baseline there (the seed's figures show d an order of magnitude below it)
    ctl_ratio: float = Field(0.25, gt=0)
    # claims 2-5: "coef close to 1": the median coef (pooled over pairs and examples) within 1 +- this at every layer
    coef_tolerance: float = Field(0.1, ge=0)
    # claim 6: LMC fails when the barrier at alpha = 0.5 (mean over pairs, nats) exceeds this
    barrier_tolerance: float = Field(0.05, ge=0)
    # claim 7: the stitched average must recover at least this share of the own-task over other-task accuracy gap
    stitch_recovery: float = Field(0.5, ge=0, le=1)
    # claim 8: "much weaker": scratch d (alpha = 0.5, mean over layers) at least this many times the fine-tuned pair's
    weaker_factor: float = Field(2.0, ge=1)

    @model_validator(mode="after")
    def _check(self) -> CtlSettings:
        if (
            any(not 0 < a < 1 for a in self.alphas)
            or 0.5 not in self.alphas
            or sorted(set(self.alphas)) != list(self.alphas)
        ):
            raise ValueError("alphas: ascending, distinct, within (0, 1), and 0.5 among them")
        if sorted(set(self.average_sizes)) != list(self.average_sizes) or min(self.average_sizes) < 2:
            raise ValueError("average_sizes: ascending, distinct, each at least 2")
        if self.scratch_pair is not None and self.scratch_pair[0] == self.scratch_pair[1]:
            raise ValueError("scratch_pair: two different tasks")
        return self
