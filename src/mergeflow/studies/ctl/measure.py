"""Study ``ctl``'s measurements on the pipeline's models: the pairs and subsets, lambda, the suite, the features of
every combination and claim 8's training from a common random init."""

from __future__ import annotations

import copy
import itertools
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TYPE_CHECKING


from mergeflow.config import task_seed
from mergeflow.studies.ctl.metric import (
    Probe,
    addition_terms,
    average_terms,
    combine,
    ctl_terms,
    linearity,
    mix,
    negation_terms,
)
from mergeflow.studies.ctl.settings import State

if TYPE_CHECKING:
    import torch
    from torch import nn


def choose_pairs(tasks: Sequence[str], n: int | None, seed: int) -> list[tuple[str, str]]:
    """All pairs in suite order, or n of them drawn with ``seed`` (kept in suite order)."""
    every = list(itertools.combinations(tasks, 2))
    if n is None or n >= len(every):
        return every
    drawn = set(random.Random(f"{seed}/pairs").sample(range(len(every)), n))
    return [p for i, p in enumerate(every) if i in drawn]


def choose_subset(tasks: Sequence[str], k: int, seed: int) -> list[str]:
    return sorted(random.Random(f"{seed}/average/{k}").sample(list(tasks), k), key=list(tasks).index)


def pipeline_lam(layout, default: float) -> tuple[float, str]:
    """(lam, where it came from): metrics/merge/task_arithmetic.json's chosen lam, else the setting."""
    from mergeflow.core.files import read_json

    path = Path(layout.metrics("merge", "task_arithmetic"))
    if path.is_file():
        lam = (read_json(path).get("hyperparameters") or {}).get("lam")
        if isinstance(lam, (int, float)) and lam > 0:
            return float(lam), "metrics/merge/task_arithmetic.json"
    return default, "the setting studies.ctl.lam (metrics/merge/task_arithmetic.json absent)"


def _head_loss(out: torch.Tensor, head: nn.Linear, y: torch.Tensor) -> float:
    import torch
    from torch import nn

    with torch.no_grad():
        return float(nn.functional.cross_entropy(head(out), y))


def _head_acc(out: torch.Tensor, head: nn.Linear, y: torch.Tensor) -> float:
    import torch

    with torch.no_grad():
        return float((head(out).argmax(1) == y).float().mean())


@dataclass
class Suite:
    """The inputs the study reads once: theta0, the fine-tuned theta_t, the heads and each task's test examples."""

    theta0: State
    thetas: dict[str, State]
    heads: dict[str, nn.Linear]
    test: dict[str, tuple[torch.Tensor, torch.Tensor]]

    def x(self, tasks: Sequence[str], n: int) -> tuple[torch.Tensor, list[tuple[str, slice]]]:
        """The first n test examples of each task, concatenated, and each task's rows."""
        import torch

        xs, rows, at = [], [], 0
        for t in tasks:
            x = self.test[t][0][:n]
            xs.append(x)
            rows.append((t, slice(at, at + len(x))))
            at += len(x)
        return torch.cat(xs), rows

    def loss(self, out: torch.Tensor, rows, n: int) -> float:
        """Mean cross-entropy over the rows, each scored by its own task's head."""
        total = sum(_head_loss(out[sl], self.heads[t], self.test[t][1][:n]) * (sl.stop - sl.start) for t, sl in rows)
        return total / sum(sl.stop - sl.start for _, sl in rows)

    def tau(self, t: str) -> State:
        import torch

        return {
            k: self.thetas[t][k].to(torch.float64) - self.theta0[k].to(torch.float64)
            for k in self.theta0
            if self.theta0[k].is_floating_point()
        }

    def edit(self, parts: Sequence[tuple[float, str]]) -> State:
        """theta0 + sum_k w_k tau_k."""
        import torch

        out = {}
        for k, v in self.theta0.items():
            if v.is_floating_point():
                acc = v.to(torch.float64) + sum(
                    w * (self.thetas[t][k].to(torch.float64) - v.to(torch.float64)) for w, t in parts
                )
                out[k] = acc.to(v.dtype)
            else:
                out[k] = v.clone()
        return out


def measure_pair(
    probe: Probe, suite: Suite, i: str, j: str, alphas: Sequence[float], lam: float, n: int
) -> dict[str, Any]:
    """Claims 1, 2, 4 and 6 on one pair, on D_i u D_j: per layer the terms of CTL at each alpha and of addition, and
    the losses along the path (alpha = 0 is theta_j, 1 is theta_i)."""
    x, rows = suite.x([i, j], n)
    fi, out_i = probe.run(suite.thetas[i], x)
    fj, out_j = probe.run(suite.thetas[j], x)
    ctl, losses = {}, {0.0: suite.loss(out_j, rows, n), 1.0: suite.loss(out_i, rows, n)}
    for a in alphas:
        fa, out_a = probe.run(mix([(a, suite.thetas[i]), (1 - a, suite.thetas[j])]), x)
        ctl[a] = [ctl_terms(fa[L], fi[L], fj[L], a) for L in range(len(fi))]
        losses[a] = suite.loss(out_a, rows, n)
    f_sum, _ = probe.run(suite.edit([(lam, i), (lam, j)]), x)
    f_2i, _ = probe.run(suite.edit([(2 * lam, i)]), x)
    f_2j, _ = probe.run(suite.edit([(2 * lam, j)]), x)
    addition = [addition_terms(f_sum[L], f_2i[L], f_2j[L]) for L in range(len(fi))]
    per_task = {
        t: {
            "theta_i": suite.loss(out_i[sl], [(t, slice(0, sl.stop - sl.start))], n),
            "theta_j": suite.loss(out_j[sl], [(t, slice(0, sl.stop - sl.start))], n),
        }
        for t, sl in rows
    }
    return {"ctl": ctl, "addition": addition, "losses": dict(sorted(losses.items())), "per_task": per_task}


def measure_negation(probe: Probe, suite: Suite, t: str, lam: float, n: int) -> dict[str, Any]:
    """Claim 5 on D_t, with eq. 4 and the first-order reading beside it."""
    x, _ = suite.x([t], n)
    f0, _ = probe.run(suite.theta0, x)
    fp, _ = probe.run(suite.edit([(lam, t)]), x)
    fm, _ = probe.run(suite.edit([(-lam, t)]), x)
    ft, _ = probe.run(suite.thetas[t], x)
    eq3 = [negation_terms(f0[L], fp[L], fm[L]) for L in range(len(f0))]
    eq4 = [
        linearity(fm[L], combine([(2.0, f0[L]), (-1.0, fp[L])]))[0] for L in range(len(f0))
    ]  # f(theta0) - Delta = 2 f(theta0) - f(theta0 + lam tau)
    first = [
        linearity(fm[L], combine([(1.0 + lam, f0[L]), (-lam, ft[L])]))[0] for L in range(len(f0))
    ]  # f(theta0) - lam (f(theta_t) - f(theta0))
    return {"eq3": eq3, "eq4": eq4, "first_order": first}


def measure_average(probe: Probe, suite: Suite, subset: Sequence[str], n: int) -> list[dict[str, torch.Tensor]]:
    x, _ = suite.x(subset, n)
    f_avg, _ = probe.run(mix([(1 / len(subset), suite.thetas[t]) for t in subset]), x)
    fs = [probe.run(suite.thetas[t], x)[0] for t in subset]
    return [average_terms(f_avg[L], [f[L] for f in fs]) for L in range(len(f_avg))]


def measure_stitching(probe: Probe, suite: Suite, i: str, j: str, lam: float, layer: int, n: int) -> dict[str, Any]:
    """Claim 7 on one pair: accuracies on D_i and D_j of theta0 continued after ``layer`` from the averaged, the
    i-edited and the j-edited features, of the pair's task-arithmetic model and of theta0."""
    x, rows = suite.x([i, j], n)
    (fa,), _ = probe.run(suite.edit([(lam, i)]), x, keep=[layer], raw=True)
    (fb,), _ = probe.run(suite.edit([(lam, j)]), x, keep=[layer], raw=True)
    outs = {
        "avg": probe.run(suite.theta0, x, replace=(layer, combine([(0.5, fa), (0.5, fb)]).float()), keep=[])[1],
        "stitch_i": probe.run(suite.theta0, x, replace=(layer, fa), keep=[])[1],
        "stitch_j": probe.run(suite.theta0, x, replace=(layer, fb), keep=[])[1],
        "ta": probe.run(suite.edit([(lam, i), (lam, j)]), x, keep=[])[1],
        "theta0": probe.run(suite.theta0, x, keep=[])[1],
    }
    (ti, si), (tj, sj) = rows
    acc = {
        name: (
            _head_acc(o[si], suite.heads[ti], suite.test[ti][1][:n]),
            _head_acc(o[sj], suite.heads[tj], suite.test[tj][1][:n]),
        )
        for name, o in outs.items()
    }
    return {
        "pair": [i, j],
        "layer": layer,
        "avg_i": acc["avg"][0],
        "avg_j": acc["avg"][1],
        "own_i": acc["stitch_i"][0],
        "own_j": acc["stitch_j"][1],
        "other_i": acc["stitch_j"][0],
        "other_j": acc["stitch_i"][1],
        "ta_i": acc["ta"][0],
        "ta_j": acc["ta"][1],
        "theta0_i": acc["theta0"][0],
        "theta0_j": acc["theta0"][1],
    }


def train_pair(
    params,
    suite: Suite,
    train: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    init: State,
    pair: Sequence[str],
    steps: int | None,
    device,
    label: str,
) -> dict[str, State]:
    """Each task of ``pair`` trained from ``init`` with the pipeline's fine-tune schedule (finetune.*, its steps or
    ``steps``), no feature anchor, the task's head frozen, the task's seed: the same data order for both inits."""
    from mergeflow.ml.models import backbone_state, build_backbone
    from mergeflow.ml.training import finetune as finetune_loop

    update: dict[str, Any] = {"preserve_features": params.finetune.preserve_features.model_copy(update={"weight": 0.0})}
    if steps is not None:
        update |= {"steps": steps, "epochs": None}
    cfg = params.finetune.model_copy(update=update)
    out = {}
    for t in pair:
        model = build_backbone(params.backbone, {k: v.clone() for k, v in init.items()}, source=label)
        x, y = train[t]
        finetune_loop(
            model,
            copy.deepcopy(suite.heads[t]),
            x,
            y,
            cfg,
            seed=task_seed(params.seed, t),
            device=device,
            desc=f"study ctl {label} {t}",
        )
        out[t] = {k: v.cpu() for k, v in backbone_state(model.cpu()).items()}
    return out
