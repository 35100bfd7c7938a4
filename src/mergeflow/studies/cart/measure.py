"""Study ``cart``'s merges and evaluations on the pipeline's models: ``Bench`` loads the suite once, evaluates a merge
on any subset of tasks and chooses lambda on validation; the rank sweep and the subsets of the scaling claim."""

from __future__ import annotations

import math
import random
from pathlib import Path
from statistics import mean

from mergeflow.studies import StudyContext
from mergeflow.studies.cart.claims import _r
from mergeflow.studies.cart.settings import CartSettings


class Bench:
    """Loads the suite once; evaluates a merge on any subset of tasks; chooses lambda on validation."""

    def __init__(self, context: StudyContext):
        from mergeflow.ml.data import load_tasks
        from mergeflow.ml.models import build_backbone, load_heads
        from mergeflow.ml.task_vectors import load_task_vectors

        p, L = context.params, context.layout
        self.params, self.device = p, context.device
        self.tasks = load_tasks(p, L)
        self.heads = load_heads(p, L, build_backbone(p.backbone).num_features, self.tasks)
        self.pretrained, self.vectors = load_task_vectors(p, L)
        self.pretrained = {k: self.pretrained[k] for k in self.pretrained}
        self.vectors = {t: {k: v[k] for k in v} for t, v in self.vectors.items()}
        self._evaluators: dict = {}
        self.evaluations = 0

    def evaluator(self, tasks: tuple[str, ...], split: str):
        from mergeflow.ml.evaluation import MultiTaskEvaluator

        key = (tasks, split)
        if key not in self._evaluators:
            self._evaluators[key] = MultiTaskEvaluator(
                self.params.backbone,
                {t: self.tasks[t] for t in tasks},
                self.heads,
                split,
                self.device,
                self.params.runtime.eval_batch_size,
            )
        return self._evaluators[key]

    def evaluate(self, state, tasks: tuple[str, ...], split: str) -> dict[str, float]:
        self.evaluations += 1
        return self.evaluator(tasks, split)(state)

    def merge(self, method: str, tasks: tuple[str, ...], **hp):
        from mergeflow.ml.merging import REGISTRY

        return REGISTRY[method](self.pretrained, {t: self.vectors[t] for t in tasks}, **hp)

    def best_on_val(
        self, method: str, tasks: tuple[str, ...], base, lambdas: list[float], **hp
    ) -> tuple[float, dict[str, float], list[float]]:
        """The method is affine in lam (base at 0): one merge at lam = 1, lam chosen on validation, then test.
        Returns (lam, test accuracy per task, validation curve)."""
        unit = self.merge(method, tasks, **hp, lam=1.0)
        direction = {k: unit[k].float() - base[k].float() for k in base}
        curve, best = [], None
        for lam in lambdas:
            state = {k: (base[k].float() + lam * direction[k]).to(base[k].dtype) for k in base}
            v = mean(self.evaluate(state, tasks, "val").values())
            curve.append(v)
            if best is None or v > best[1]:
                best = (lam, v, state)
        return best[0], self.evaluate(best[2], tasks, "test"), curve


def _json(path: Path):
    from mergeflow.core.files import read_json

    return read_json(path) if Path(path).is_file() else None


def rank_sweep(bench: Bench, s: CartSettings) -> dict:
    tasks = tuple(bench.params.suite.tasks)
    wa = bench.merge("weight_averaging", tasks)
    wa_test = mean(bench.evaluate(wa, tasks, "test").values())
    out = {"cart": [], "low_rank_ta": [], "cart_lam": [], "low_rank_ta_lam": [], "weight_averaging": wa_test}
    for r in s.ratios:
        lam, acc, _ = bench.best_on_val("cart", tasks, wa, s.cart_lambdas, rank_ratio=r)
        out["cart"].append(mean(acc.values()))
        out["cart_lam"].append(lam)
        lam, acc, _ = bench.best_on_val("low_rank_ta", tasks, bench.pretrained, s.ta_lambdas, rank_ratio=r)
        out["low_rank_ta"].append(mean(acc.values()))
        out["low_rank_ta_lam"].append(lam)
    return out


def draw_subsets(tasks: list[str], sizes: list[int], per_size: int, seed: int) -> dict[int, list[tuple[str, ...]]]:
    out = {}
    for size in sizes:
        if size > len(tasks):
            continue
        rng = random.Random(f"{seed}/{size}")
        n = min(per_size, math.comb(len(tasks), size))
        chosen: list[tuple[str, ...]] = []
        while len(chosen) < n:
            sub = tuple(sorted(rng.sample(tasks, size), key=tasks.index))
            if sub not in chosen:
                chosen.append(sub)
        out[size] = chosen
    return out


def scaling(bench: Bench, individual: dict[str, float], s: CartSettings) -> dict:
    # normalized accuracy divides by the individual model's score: a task whose score is not positive (a text task's
    # correlation can be) has none, and is left out of the subsets
    scored = [t for t in bench.params.suite.tasks if individual[t] > 0]
    subsets = draw_subsets(scored, s.subset_sizes, s.subsets_per_size, s.seed)
    ties_fixed = {
        k: v for k, v in bench.params.merge.overrides("ties").items() if not isinstance(v, list) and k != "lam"
    }
    rows = []
    for size, subs in subsets.items():
        for sub in subs:
            wa = bench.merge("weight_averaging", sub)
            accs = {"weight_averaging": bench.evaluate(wa, sub, "test")}
            accs["task_arithmetic"] = bench.best_on_val("task_arithmetic", sub, bench.pretrained, s.ta_lambdas)[1]
            accs["ties"] = bench.best_on_val("ties", sub, bench.pretrained, s.ties_lambdas, **ties_fixed)[1]
            accs["cart"] = bench.best_on_val("cart", sub, wa, s.cart_lambdas, rank_ratio=s.rank_ratio)[1]
            rows.append(
                {
                    "size": size,
                    "tasks": list(sub),
                    **{m: _r(mean(a[t] / individual[t] for t in sub)) for m, a in accs.items()},
                }
            )
    return {"rows": rows, "sizes": sorted(subsets)}
