"""The sections that choose among registered things: merge (the merging methods), regimes (the training-time
regimes) and studies. Each lists what runs; every other key is a registered name whose settings override its
defaults, which mergeflow.params checks against the registries (and, for regimes and studies, attaches)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from mergeflow.config.fields import unique_names


class MergeConfig(BaseModel):
    """``methods`` lists the methods to run; every other key is a method name whose hyperparameters override its
    defaults.

    A scalar fixes a hyperparameter; a list is a grid searched on the validation split.
    """

    model_config = ConfigDict(extra="allow", frozen=True)
    methods: list[str] = Field(min_length=1)
    # grid: every grid point scored on validation; golden: the coefficient (or a one-key grid) narrowed by
    # golden-section search, assuming a unimodal curve (mergeflow.ml.merging.search)
    search: Literal["grid", "golden"] = "grid"

    @field_validator("methods")
    @classmethod
    def _unique_methods(cls, methods: list[str]) -> list[str]:
        return unique_names(methods, "method")

    def overrides(self, method: str) -> dict[str, Any]:
        return dict((self.model_extra or {}).get(method) or {})


class RegimesConfig(BaseModel):
    """Training-time regimes run beside the standard fine-tune (finetune above): ``run`` lists them, a DVC stage
    regime@<name> each; each makes its own task vectors, merged with ``methods.<name>`` (the regime's own default
    when not given). Every other key is a regime name whose settings override its defaults. The regimes, their
    settings and default methods are mergeflow.ml.regimes' registry: mergeflow.params checks these against it and
    attaches each regime's validated settings (``config``)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    run: list[str] = Field(default_factory=list)
    methods: dict[
        str, Annotated[list[str], Field(min_length=1), AfterValidator(lambda v: unique_names(v, "method"))]
    ] = Field(default_factory=dict)
    _resolved: dict[str, tuple[Any, list[str]]] = PrivateAttr(default_factory=dict)  # name -> (settings, methods)

    @field_validator("run")
    @classmethod
    def _unique_runs(cls, run: list[str]) -> list[str]:
        dup = sorted({r for r in run if run.count(r) > 1})
        if dup:
            raise ValueError(f"regime '{dup[0]}' is listed twice")
        return run

    def overrides(self, regime: str) -> Any:
        """params.yaml's ``regimes.<regime>`` as written (params.py checks that it is a mapping)."""
        return (self.model_extra or {}).get(regime)

    def attach(self, resolved: dict[str, tuple[Any, list[str]]]) -> None:
        """Each regime's validated settings and methods (params.py, which knows the registry)."""
        self._resolved.update(resolved)

    def _entry(self, regime: str) -> tuple[Any, list[str]]:
        if regime not in self._resolved:
            raise KeyError(
                f"regime {regime!r}: params not resolved against the regime registry (load them with mergeflow.params)"
            )
        return self._resolved[regime]

    def config(self, regime: str) -> Any:
        """The regime's validated settings (mergeflow.ml.regimes.RegimeSettings): its variants and their arguments."""
        return self._entry(regime)[0]

    def methods_of(self, regime: str) -> list[str]:
        return self._entry(regime)[1]


class StudiesConfig(BaseModel):
    """``run`` lists the studies to run (mergeflow.studies), a DVC stage study@<name> each; every other key is a
    study name whose settings override its defaults (each study validates its own; mergeflow.params attaches them)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    run: list[str] = Field(default_factory=list)
    _resolved: dict[str, Any] = PrivateAttr(default_factory=dict)  # name -> the study's settings

    @field_validator("run")
    @classmethod
    def _unique_runs(cls, run: list[str]) -> list[str]:
        return unique_names(run, "study")

    def overrides(self, study: str) -> Any:
        return (self.model_extra or {}).get(study)

    def attach(self, resolved: dict[str, Any]) -> None:
        """Each study's validated settings (params.py, which knows the registry)."""
        self._resolved.update(resolved)

    def settings(self, study: str) -> Any:
        if study not in self._resolved:
            raise KeyError(
                f"study {study!r}: params not resolved against the study registry (load them with mergeflow.params)"
            )
        return self._resolved[study]
