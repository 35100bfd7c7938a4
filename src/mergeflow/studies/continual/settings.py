"""Study continual: its settings (the methods run, the arrival order, each method's hyperparameters)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from mergeflow.studies import StudySettings

METHODS = ["weight_averaging", "task_arithmetic", "magmax", "opcm", "dop"]


class ContinualSettings(StudySettings):
    # the continual methods run (mergeflow.ml.continual's registry), in the report's order
    methods: list[str] = Field(default_factory=lambda: list(METHODS), min_length=1)
    # the arrival order: distinct tasks of suite.tasks; empty: suite.tasks as params.yaml gives them
    order: list[str] | None = Field(None, min_length=1)
    # per method, hyperparameters over its defaults (FusionBench's; the report lists the values used), e.g.
    # {opcm: {alpha: 0.6}, dop: {num_steps: 100}}
    hyperparameters: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> ContinualSettings:
        from mergeflow.ml.continual import REGISTRY

        for name in self.methods:
            if name not in REGISTRY:
                raise ValueError(f"methods: unknown continual method {name!r} (known: {', '.join(sorted(REGISTRY))})")
        if len(set(self.methods)) != len(self.methods):
            raise ValueError("methods: a method named twice")
        if self.order is not None and len(set(self.order)) != len(self.order):
            raise ValueError("order: a task named twice")
        for name, hp in self.hyperparameters.items():
            if name not in self.methods:
                raise ValueError(f"hyperparameters.{name}: not among methods")
            REGISTRY[name].check(hp, f"hyperparameters.{name}")
        return self

    def order_of(self, tasks: list[str]) -> list[str]:
        """The arrival order over the suite's ``tasks``; ValueError naming a task that is not one of them."""
        if self.order is None:
            return list(tasks)
        for task in self.order:
            if task not in tasks:
                raise ValueError(f"studies.continual.order: {task!r} is not in suite.tasks ({', '.join(tasks)})")
        return list(self.order)
