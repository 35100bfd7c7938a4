"""The registry of training-time regimes: ways of producing the T task models from theta0.

A regime is one module in this package: a function ``(theta0, tasks, train, *, on_round_end=None, resume=None,
**hyperparameters) -> RegimeResult`` decorated with ``@register``, which records its paper and defaults as data.
Modules are discovered by name, as the merge methods are (mergeflow.ml.merging), so adding a regime means adding one
file. No regime does I/O or knows the model: every fine-tune goes through the caller's ``train``.

The trainer, ``train(task, state, budget, carry) -> (new_state, carry)``, fine-tunes a copy of ``state`` on
``task`` for ``budget`` (a ``Budget``: steps or epochs, and where in which learning-rate schedule they fall) and
returns the new state with its ``carry``: whatever it wants back on that task's next call (optimiser state),
opaque to the regime, None on a first call or a reset. It must be a function of its arguments only (a data order
seeded from the task and ``budget.round``, not from a global generator), so that a resumed run repeats an
uninterrupted one bit for bit. The pipeline builds one on training.train_loop; the tests use tiny exact ones
(``full_batch_gd_trainer``). A trainer may also have ``map(calls) -> [(new_state, carry), ...]``, which runs a
round's independent calls at once (in processes, say) with the same results as calling it on each in turn.

Regimes run in rounds (standard and one_epoch are one round). In round r every task trains from the round's
start state; the regime then combines the T models into the next start (MIMA: their uniform average; ATM:
theta + alpha * sum of the round's task vectors). After each finished round ``on_round_end(checkpoint)`` is
called with a ``Checkpoint`` holding everything a later round needs; ``resume=checkpoint`` continues from it,
so a run killed between rounds restarts from its last finished round. Writing checkpoints (atomically) is the
caller's job: ``save_checkpoint`` / ``load_checkpoint`` (one safetensors file, written atomically).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, ValidationError

from mergeflow.config.fields import first_error
from mergeflow.ml.regimes._types import Budget, Checkpoint, RegimeResult, RoundRecord, Trainer

if TYPE_CHECKING:
    from mergeflow.core.io import StateDict


class RegimeSettings(BaseModel):
    """A regime's settings in params.yaml (``regimes.<name>``): unknown keys, NaN and infinity are refused, values
    are frozen. A regime whose settings list several values (round counts, ranks) makes one set of task vectors
    per value: its variants."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    def variants(self, regime: str, finetune_steps: int) -> dict[str, dict[str, Any]]:
        """Each set of task vectors the regime makes, by name, with the keyword arguments of its function."""
        return {regime: {}}

    def check_budget(self, regime: str, finetune_steps: int) -> None:
        """ValueError, naming the key, when these settings do not fit the fine-tune's budget of steps."""

    def check_backbone(self, regime: str, backbone: Any, selected: bool) -> None:
        """ValueError, naming the key, when these settings do not fit params.yaml's backbone section
        (mergeflow.config.BackboneConfig), such as adapters on layers it does not have: a setting params.yaml
        gives, or any when the regime runs (``selected``; a default may suit one backbone family only)."""

    def training_steps(self, variant_kwargs: Mapping[str, Any], finetune_steps: int, epoch_steps: int) -> int:
        """Optimiser steps a variant takes per task (``epoch_steps``: one epoch's), for `mergeflow plan`'s
        estimate: by default the standard fine-tune's budget, split into rounds or not."""
        return finetune_steps

    def adapter(self, variant_kwargs: Mapping[str, Any]) -> Any:
        """The LoRA adapter (mergeflow.ml.lora.AdapterSpec) a variant trains, whose task vectors are stored as its
        factors; None: the task vectors are whole weights."""
        return None


RegimeFn = Callable[..., RegimeResult]


@dataclass(frozen=True)
class Regime:
    name: str
    fn: RegimeFn  # (theta0, tasks, train, *, on_round_end, resume, **hyperparameters) -> RegimeResult
    paper: str  # citation
    defaults: Mapping[str, Any]  # every hyperparameter, at its default
    # the settings regime@<name> reads from params.yaml (regimes.<name>); None: not a stage of its own (standard
    # is the pipeline's fine-tune)
    settings_model: type[RegimeSettings] | None = None
    methods: tuple[str, ...] = ()  # what its task vectors go to by default (regimes.methods.<name> overrides)
    own_model: bool = False  # it makes a model of its own (MIMA's average, ATM's theta(R)), merged as its own name

    def settings(self, overrides: Mapping[str, Any], *, where: str) -> RegimeSettings:
        """The settings of params.yaml's ``regimes.<name>``, validated; ValueError naming the key."""
        try:
            return self.settings_model.model_validate(dict(overrides))
        except ValidationError as err:
            key, msg = first_error(err)
            raise ValueError(f"{where}{'.' if key else ''}{key}: {msg}") from None

    @property
    def formula(self) -> str:
        """The first line of the module's docstring: what the regime computes."""
        module = importlib.import_module(self.fn.__module__)
        return (module.__doc__ or "").strip().splitlines()[0] if module.__doc__ else ""

    def __call__(self, theta0: StateDict, tasks: Sequence[str], train: Trainer, **kwargs) -> RegimeResult:
        unknown = set(kwargs) - set(self.defaults) - {"on_round_end", "resume"}
        if unknown:
            raise ValueError(
                f"regime {self.name}: unknown hyperparameter(s) {sorted(unknown)} (allowed: "
                f"{', '.join(self.defaults) or 'none'})"
            )
        return self.fn(theta0, list(tasks), train, **{**self.defaults, **kwargs})

    def describe(self) -> str:
        hp = ", ".join(f"{k}={v!r}" for k, v in self.defaults.items())
        return f"{self.name:<12} {hp or '(no hyperparameters)'}  [{self.paper}]"


REGISTRY: dict[str, Regime] = {}


def register(
    name: str,
    *,
    paper: str,
    defaults: Mapping[str, Any] | None = None,
    settings: type[RegimeSettings] | None = None,
    methods: Sequence[str] = (),
    own_model: bool = False,
):
    def wrap(fn: RegimeFn) -> RegimeFn:
        if name in REGISTRY:
            raise RuntimeError(f"regime '{name}' registered twice")
        REGISTRY[name] = Regime(name, fn, paper, dict(defaults or {}), settings, tuple(methods), own_model)
        return fn

    return wrap


def _discover() -> None:
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")


_discover()

# what needs torch, imported when first asked for, so that the registry loads without it (mergeflow check): the
# round loop, checkpoints, the exact trainer for tests, and what the stages and studies use to run a regime on
# the pipeline's data (the fine-tuning trainer loads the models and timm)
_RUNNERS = {
    "run_rounds": "_rounds",
    "difference": "_rounds",
    "uniform_average": "_rounds",
    "load_checkpoint": "_checkpoint",
    "save_checkpoint": "_checkpoint",
    "regime_identity": "_checkpoint",
    "resume_from": "_checkpoint",
    "full_batch_gd_trainer": "_trainers",
    "LazyAnchors": "_finetune",
    "finetune_trainer": "_finetune",
    "PoolTrainer": "_pool",
}


def __getattr__(name: str) -> Any:
    if name in _RUNNERS:
        return getattr(importlib.import_module(f"{__name__}.{_RUNNERS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "REGISTRY",
    "Budget",
    "Checkpoint",
    "Regime",
    "RegimeResult",
    "RegimeSettings",
    "RoundRecord",
    "Trainer",
    "register",
]
