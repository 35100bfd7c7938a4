"""Study continual's measurements: each method run over the arrival order, the merged model scored after each arrival
on every task seen so far (the test split, each task's own head), and what the report reads from those scores."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any

from mergeflow.studies import StudyContext


@dataclass
class Run:
    """One method over the order: ``accuracy[t]`` is {task: test accuracy} of the model after arrival t + 1, on the
    tasks that have arrived."""

    method: str
    hyperparameters: dict[str, Any]
    order: list[str]
    accuracy: list[dict[str, float]]

    def average(self, t: int) -> float:
        """A_t: the mean accuracy over the tasks seen after arrival t + 1."""
        return mean(self.accuracy[t].values())

    def just_after(self, task: str) -> float:
        """a_ii: the task's accuracy right after it arrived."""
        return self.accuracy[self.order.index(task)][task]

    def forgetting(self, task: str) -> float:
        """a_Ti - a_ii: its accuracy after the last arrival minus right after its own."""
        return self.accuracy[-1][task] - self.just_after(task)

    def backward_transfer(self) -> float | None:
        """BWT = 1/(T-1) sum_{i<T} (a_Ti - a_ii) (Lopez-Paz and Ranzato 2017); None with one task."""
        earlier = self.order[:-1]
        return mean(self.forgetting(t) for t in earlier) if earlier else None


class Suite:
    """The pipeline's theta0, task vectors, heads and test data, loaded once; a model scored on a prefix of tasks."""

    def __init__(self, context: StudyContext):
        from mergeflow.ml.data import load_tasks
        from mergeflow.ml.models import build_backbone, load_heads
        from mergeflow.ml.task_vectors import load_task_vectors

        p, layout = context.params, context.layout
        self.params, self.device = p, context.device
        self.tasks = load_tasks(p, layout)
        self.heads = load_heads(p, layout, build_backbone(p.backbone).num_features, self.tasks)
        pretrained, self.vectors = load_task_vectors(p, layout)
        self.pretrained = {k: pretrained[k] for k in pretrained}
        self._evaluators: dict[tuple[str, ...], Any] = {}

    def evaluate(self, state, tasks: tuple[str, ...]) -> dict[str, float]:
        from mergeflow.ml.evaluation import MultiTaskEvaluator

        if tasks not in self._evaluators:
            self._evaluators[tasks] = MultiTaskEvaluator(
                self.params.backbone,
                {t: self.tasks[t] for t in tasks},
                self.heads,
                "test",
                self.device,
                self.params.runtime.eval_batch_size,
            )
        return self._evaluators[tasks](state)

    def run(self, method: str, hyperparameters: dict[str, Any], order: list[str]) -> Run:
        from mergeflow.ml.continual import REGISTRY, arrivals

        spec = REGISTRY[method]
        stream = ((t, {k: self.vectors[t][k] for k in self.vectors[t]}) for t in order)
        accuracy = []
        started = time.perf_counter()
        for t, (_, merged) in enumerate(arrivals(spec, self.pretrained, stream, **hyperparameters)):
            accuracy.append(self.evaluate(merged, tuple(order[: t + 1])))
        print(f"study continual: {method} over {len(order)} arrivals in {time.perf_counter() - started:.1f} s")
        return Run(method, {**spec.defaults, **hyperparameters}, order, accuracy)


def individual_accuracy(context: StudyContext, order: list[str]) -> dict[str, float] | None:
    """Each task's fine-tuned model's test accuracy (metrics/finetune/<task>.json), or None when one is missing."""
    from mergeflow.core.files import read_json

    found = {}
    for t in order:
        path = Path(context.layout.metrics("finetune", t))
        if not path.is_file():
            return None
        found[t] = float(read_json(path)["individual"]["test"])
    return found
