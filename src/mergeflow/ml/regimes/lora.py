"""LoRA: theta_t = theta0 + s B_t A_t on the adapted linear layers, everything else frozen; tau_t = s B_t A_t.

Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", ICLR 2022 (arXiv:2106.09685): each task trains a
rank-r adapter (A_t r x in, B_t out x r, scale s = alpha / r) on each target layer for the fine-tune's schedule,
from theta0, under the task's frozen head; the task vector is the adapters' update, stored as its factors
(mergeflow.ml.lora). One round, as ``standard``; ``steps`` None is the fine-tune's own schedule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field

from mergeflow.config.fields import MAX_GRID, MAX_LR
from mergeflow.ml.regimes import Budget, RegimeSettings, register

if TYPE_CHECKING:
    from mergeflow.ml.lora import AdapterSpec

# timm ViT: attention qkv and projection, MLP fc1 and fc2 (mergeflow.ml.lora.DEFAULT_TARGETS, kept here so that the
# registry loads no torch; a test holds them equal)
TARGETS = ("qkv", "proj", "fc1", "fc2")


class Settings(RegimeSettings):
    ranks: list[Annotated[int, Field(ge=1, le=4096)]] = Field(
        default_factory=lambda: [4, 16, 64], min_length=1, max_length=MAX_GRID
    )  # r; one set of task vectors per rank
    alpha: float | None = Field(None, gt=0)  # scale alpha / r; empty (null): alpha = r, a scale of 1 at every rank
    dropout: float = Field(0.0, ge=0, lt=1)  # on the adapter's input
    targets: list[str] = Field(
        default_factory=lambda: list(TARGETS), min_length=1
    )  # linear layers, by the last part of their name
    lr: float | None = Field(None, gt=0, le=MAX_LR)  # the adapters' learning rate; empty (null): finetune.lr

    def variants(self, regime: str, finetune_steps: int) -> dict[str, dict[str, Any]]:
        return {
            f"{regime}_rank{r}": {
                "rank": r,
                "alpha": self.alpha,
                "dropout": self.dropout,
                "targets": list(self.targets),
                "lr": self.lr,
                "steps": None,
            }
            for r in self.ranks
        }

    def check_backbone(self, regime: str, backbone: Any, selected: bool) -> None:
        from mergeflow.config.backbone import linear_layers

        if not (selected or "targets" in self.model_fields_set):  # the default names a ViT's layers
            return
        layers = linear_layers(backbone.library, backbone.model)
        if layers is not None and (missing := [t for t in self.targets if t not in layers]):
            raise ValueError(
                f"regimes.{regime}.targets: {missing[0]!r} names no linear layer "
                f"of {backbone.model} (its layers end in {', '.join(layers)})"
            )

    def adapter(self, variant_kwargs: Mapping[str, Any]) -> AdapterSpec:
        return adapter_spec(**variant_kwargs)


def adapter_spec(*, rank, alpha, dropout, targets, lr, **_) -> AdapterSpec:
    """The adapter of a variant's hyperparameters; alpha None is r (a scale of 1)."""
    from mergeflow.ml.lora import AdapterSpec

    return AdapterSpec(rank, float(rank if alpha is None else alpha), dropout, tuple(targets), lr)


@register(
    "lora",
    paper="Hu et al. 2022, LoRA: Low-Rank Adaptation of Large Language Models (arXiv:2106.09685)",
    defaults={"rank": 16, "alpha": None, "dropout": 0.0, "targets": TARGETS, "lr": None, "steps": None},
    # the KnOTS paper's comparison, and TSV-M, on LoRA task vectors
    settings=Settings,
    methods=("task_arithmetic", "ties", "tsv_m", "knots"),
)
def lora(theta0, tasks, train, *, rank, alpha, dropout, targets, lr, steps, on_round_end=None, resume=None):
    from mergeflow.ml.regimes import run_rounds

    adapter = adapter_spec(rank=rank, alpha=alpha, dropout=dropout, targets=targets, lr=lr)
    budget = replace(Budget() if steps is None else Budget.of_steps(steps), adapter=adapter)
    return run_rounds(
        theta0,
        tasks,
        train,
        n_rounds=1,
        budget=lambda r: budget,
        combine=None,
        on_round_end=on_round_end,
        resume=resume,
    )
