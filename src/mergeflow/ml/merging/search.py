"""The validation search, in one place: a method's grid after params.yaml's overrides (``search_space``,
``per_task_space``, ``candidates``), the merged model of every grid point (``merged_candidates``: a method's
coefficient swept by interpolation), the hyperparameters chosen per task (``choose_per_task``), the search itself
(``search``: the best validation average wins) and task negation's (``negation_search``).

The merge stage (mergeflow.pipeline.merge.merge_and_evaluate) calls ``search`` or ``negation_search`` with a scorer, the
validation split's mergeflow.ml.evaluation.MultiTaskEvaluator; this module knows the registry's methods (their
grids, coefficient, per-task hyperparameters) and nothing of models or data, so it imports nothing of the
pipeline (mergeflow.ml.merging.MergeMethod's ``search_space``, ``per_task_space`` and ``candidates`` delegate here).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from mergeflow.core.io import StateDict
    from mergeflow.ml.merging import MergeMethod


class Scorer(Protocol):
    """Accuracy on one split (mergeflow.ml.evaluation.MultiTaskEvaluator is the pipeline's)."""

    def __call__(self, state: StateDict) -> dict[str, float]: ...  # every task, one model

    def task(self, task: str, state: StateDict) -> float: ...  # one task, on its own examples only

    def network(self, build: Callable[[Any], Any]) -> dict[str, float]: ...  # every task through build(backbone)

    # each task with its own model, and its own map on the features before the head where the method has one
    def per_task(
        self, model_of: Callable[[str], StateDict], feature_maps: Callable[[str], Callable] | None = None
    ) -> dict[str, float]: ...


def mean(values) -> float:
    """The same arithmetic as mergeflow.ml.evaluation.mean (a plain sum), so that the recorded averages do not move."""
    values = list(values)
    return sum(values) / len(values)


# ---------------------------------------------------------------- grids
def search_space(
    method: MergeMethod, overrides: Mapping[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """(fixed hyperparameters, grid) after ``overrides``: a list value is a grid, a scalar fixes the value."""
    fixed = dict(method.defaults)
    grid = {k: list(v) for k, v in method.grid.items()}
    for key, value in (overrides or {}).items():
        if key in method.per_task_grid:
            if not isinstance(value, list):
                fixed[key] = value
            continue
        if isinstance(value, list):
            grid[key] = list(value)
        else:
            fixed[key] = value
            grid.pop(key, None)
    for key in grid:
        fixed.pop(key, None)
    return fixed, grid


def per_task_space(method: MergeMethod, overrides: Mapping[str, Any] | None = None) -> dict[str, list[Any]]:
    """Hyperparameters chosen per task, with their grids; a scalar override fixes one value for every task."""
    space = {}
    for key, values in method.per_task_grid.items():
        value = (overrides or {}).get(key, list(values))
        if isinstance(value, list):
            space[key] = list(value)
    return space


def candidates(method: MergeMethod, overrides: Mapping[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """Every grid point's hyperparameters, in grid order."""
    fixed, grid = search_space(method, overrides)
    keys = list(grid)
    for values in itertools.product(*(grid[k] for k in keys)):
        yield {**fixed, **dict(zip(keys, values))}


# ---------------------------------------------------------------- the search
def merged_candidates(method: MergeMethod, fixed: Mapping, grid: Mapping, pretrained, task_vectors):
    """(hyperparameters, output) for every grid point; a method's coefficient is swept by interpolation."""
    coef = method.coefficient if method.coefficient in grid else None
    others = [k for k in grid if k != coef]
    for values in itertools.product(*(grid[k] for k in others)):
        hp = {**fixed, **dict(zip(others, values))}
        if coef is None:
            yield hp, method(pretrained, task_vectors, **hp)
            continue
        at = interpolation(method, hp, coef, pretrained, task_vectors)
        for c in grid[coef]:
            yield {**hp, coef: c}, at(c)


def interpolation(
    method: MergeMethod, hp: Mapping, coef: str, pretrained, task_vectors
) -> Callable[[float], StateDict]:
    """c -> the merge at coefficient c, from two merges (c = 0 and c = 1): base + c (unit - base), in each tensor's
    compute dtype (float64 stays float64), cast back to the merged tensor's dtype."""
    from mergeflow.ml.merging._tensors import as_compute

    base = method(pretrained, task_vectors, **hp, **{coef: 0.0})
    unit = method(pretrained, task_vectors, **hp, **{coef: 1.0})
    direction = {k: as_compute(unit[k]) - as_compute(base[k]) for k in base}
    del unit
    return lambda c: {k: (as_compute(base[k]) + c * direction[k]).to(base[k].dtype) for k in base}


def choose_per_task(
    method: MergeMethod, overrides: Mapping, fixed: Mapping, pretrained, task_vectors, evaluate: Scorer
):
    """Per-task hyperparameters (e.g. TALL masks' lambda_t), each chosen on that task's own validation split."""
    chosen, curves = {}, {}
    space = per_task_space(method, overrides)
    if not space:
        return chosen, curves
    # hyperparameters still to be searched sit at their defaults here (e.g. consensus' alpha0)
    model_of = method.task_models(pretrained, task_vectors, **{**method.defaults, **fixed})
    for key, values in space.items():
        chosen[key], curves[key] = {}, {}
        for task in task_vectors:
            accs = [evaluate.task(task, model_of(task, {key: v})) for v in values]
            curves[key][task] = dict(zip(map(str, values), accs))
            chosen[key][task] = values[max(range(len(values)), key=accs.__getitem__)]
    return chosen, curves


# ---------------------------------------------------------------- golden-section search on one key
GOLDEN = (3 - 5**0.5) / 2  # 0.382: the interior points split the bracket in the golden ratio
STRATEGIES = ("grid", "golden")


def golden_section(n: int, score: Callable[[int], float]) -> list[int]:
    """The indices of a sorted n-point grid that a golden-section search scores while narrowing the bracket round
    the maximum of a unimodal curve (``score(i)``, each called once), in grid order. Ties go to the left, so that a
    plateau keeps its first point, as the full grid's choice does. On the default suite's 16 one-dimensional curves
    it scored 66 of 122 points and chose what the full grid chose on every one; a curve with two peaks may keep the
    lower (MIMA's TIES on 2026-11-28: docs/benchmarks.md)."""
    seen: dict[int, float] = {}

    def f(i: int) -> float:
        if i not in seen:
            seen[i] = score(i)
        return seen[i]

    lo, hi = 0, n - 1
    while hi - lo > 2:
        m1 = lo + int(GOLDEN * (hi - lo) + 0.5)
        m2 = max(hi - int(GOLDEN * (hi - lo) + 0.5), m1 + 1)
        if f(m1) >= f(m2):
            hi = m2
        else:
            lo = m1
    for i in range(lo, hi + 1):
        f(i)
    return sorted(seen)


def swept_key(method: MergeMethod, grid: Mapping[str, list]) -> str | None:
    """The key a golden-section search narrows: the method's coefficient when it is searched, else the only key of a
    one-key grid; None when neither is a sorted list of at least 4 numbers, or the method learns at test time (its
    records follow the calls): then every point is scored."""
    if method.reads == "test_inputs":
        return None
    key = method.coefficient if method.coefficient in grid else (next(iter(grid)) if len(grid) == 1 else None)
    values = grid.get(key, [])
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    return key if len(values) >= 4 and numbers and all(a < b for a, b in zip(values, values[1:])) else None


def golden_candidates(
    method: MergeMethod, fixed: Mapping, grid: Mapping, pretrained, task_vectors, score: Callable[[dict, Any], dict]
) -> None:
    """Every combination of the other keys, the swept key narrowed by ``golden_section``; ``score(hp, output)``
    scores one candidate and returns its row. A coefficient is swept by interpolation, as in merged_candidates."""
    key = swept_key(method, grid)
    values = grid[key]
    others = [k for k in grid if k != key]
    for combination in itertools.product(*(grid[k] for k in others)):
        hp = {**fixed, **dict(zip(others, combination))}
        if key == method.coefficient:
            make = interpolation(method, hp, key, pretrained, task_vectors)
        else:

            def make(v, hp=hp):
                return method(pretrained, task_vectors, **hp, **{key: v})

        golden_section(
            len(values), lambda i, hp=hp, make=make: score({**hp, key: values[i]}, make(values[i]))["average"]
        )


def search(
    method: MergeMethod,
    overrides: Mapping,
    pretrained: StateDict,
    task_vectors: Mapping[str, StateDict],
    evaluate: Scorer,
    strategy: str = "grid",
):
    """Search on validation; the best average accuracy wins (first in grid order on ties). ``strategy``: "grid"
    scores every grid point; "golden" narrows the method's coefficient (or a one-key grid's key) by golden-section
    search for each combination of the other keys, assuming a unimodal curve, and scores every point where that
    does not apply (fewer than 4 values, unsorted, not numbers; AdaMerging, whose records follow the calls).

    Returns (best row, its output: a merged model or a per-task store, the validation curve in grid order, per-task
    choices).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"merge.search: '{strategy}' is not a search strategy ({', '.join(STRATEGIES)})")
    fixed, grid = search_space(method, overrides)
    per_task, per_task_curves = choose_per_task(method, overrides, fixed, pretrained, task_vectors, evaluate)
    fixed = {**fixed, **per_task}
    curve, best = [], None

    def score(hp: dict, output) -> dict:
        nonlocal best
        if method.kind == "per_task":
            acc = evaluate.per_task(lambda t: method.reconstruct(output, pretrained, t), method.feature_maps(output))
        elif method.kind == "routed":
            acc = evaluate.network(lambda backbone: method.network(output, backbone))
        else:
            acc = evaluate(output)
        row = {
            "hyperparameters": {k: v for k, v in hp.items() if k not in per_task},
            "accuracy": acc,
            "average": mean(acc.values()),
        }
        curve.append(row)
        if (
            best is None
            or row["average"] > best[0]["average"]
            or (row["average"] == best[0]["average"] and order(row) < order(best[0]))
        ):
            best = (row, output)
        return row

    points = [tuple(hp[k] for k in grid) for hp in candidates(method, overrides)]

    def order(row: dict) -> int:  # the row's place in the full grid's order (its hyperparameters, per-task ones aside)
        return points.index(tuple(row["hyperparameters"][k] for k in grid))

    if strategy == "golden" and swept_key(method, grid) is not None:
        golden_candidates(method, fixed, grid, pretrained, task_vectors, score)
        curve.sort(key=order)
    else:
        for hp, output in merged_candidates(method, fixed, grid, pretrained, task_vectors):
            score(hp, output)
    return best[0], best[1], curve, {"chosen": per_task, "curves": per_task_curves}


def negation_search(
    method: MergeMethod,
    overrides: Mapping,
    pretrained,
    task_vectors,
    evaluate: Scorer,
    pretrained_accuracy: Mapping[str, float],
):
    """For each task t: the lam that lowers t's validation accuracy most while the other tasks' (control) accuracy
    stays at least control_floor x the pretrained model's; lam = 0 (no edit) when none does."""
    fixed, grid = search_space(method, overrides)
    floor = fixed.get("control_floor", 0.95)
    results = {}
    for task, tau in task_vectors.items():
        control_tasks = [t for t in task_vectors if t != task]
        base_control = mean(pretrained_accuracy[t] for t in control_tasks)
        curve, best = [], {"lam": 0.0, "target": pretrained_accuracy[task], "control": base_control}
        for hp in candidates(method, overrides):
            acc = evaluate(method(pretrained, {task: tau}, **hp))
            row = {"lam": hp["lam"], "target": acc[task], "control": mean(acc[t] for t in control_tasks)}
            curve.append(row)
            if row["control"] >= floor * base_control and row["target"] < best["target"]:
                best = row
        results[task] = {"chosen": best, "curve": curve}
    return results
