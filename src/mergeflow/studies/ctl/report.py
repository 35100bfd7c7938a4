"""Study ``ctl``: the study function, registered as ``ctl``, and the report's body."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from statistics import mean
from typing import Any, TYPE_CHECKING


from mergeflow.core.errors import MergeflowError
from mergeflow.studies import StudyContext, StudyResult, register
from mergeflow.studies.ctl.claims import (
    _r,
    claim_addition,
    claim_average,
    claim_barrier,
    claim_coef,
    claim_ctl,
    claim_negation,
    claim_scratch,
    claim_stitching,
    summarise,
)
from mergeflow.studies.ctl.figures import plot_arithmetic, plot_barrier, plot_ctl, plot_scratch, plot_stitching
from mergeflow.studies.ctl.measure import (
    Suite,
    _head_acc,
    choose_pairs,
    choose_subset,
    measure_average,
    measure_negation,
    measure_pair,
    measure_stitching,
    pipeline_lam,
    train_pair,
)
from mergeflow.studies.ctl.metric import Probe, ctl_terms, loss_barrier, mix
from mergeflow.studies.ctl.settings import PAPER, CtlSettings, State

if TYPE_CHECKING:
    import torch


def ctl_at(
    probe: Probe, theta_i: State, theta_j: State, x: torch.Tensor, alpha: float
) -> list[dict[str, torch.Tensor]]:
    fi, _ = probe.run(theta_i, x)
    fj, _ = probe.run(theta_j, x)
    fa, _ = probe.run(mix([(alpha, theta_i), (1 - alpha, theta_j)]), x)
    return [ctl_terms(fa[L], fi[L], fj[L], alpha) for L in range(len(fi))]


def _by_layer(items: Sequence[Sequence[Mapping[str, torch.Tensor]]]) -> list[dict[str, Any]]:
    """[pair][layer] terms -> per layer, pooled over pairs."""
    return [summarise([p[L] for p in items]) for L in range(len(items[0]))]


def _coefs(items: Sequence[Sequence[Mapping[str, torch.Tensor]]]) -> list[torch.Tensor]:
    import torch

    return [torch.cat([p[L]["coef"] for p in items]) for L in range(len(items[0]))]


def _load(params, layout, device) -> tuple[dict, dict, dict, Suite, Probe]:
    """theta0, each task's data and head, the suite (theta0, the fine-tunes, the heads, the test splits) and the
    probe that hooks the backbone's blocks."""
    from mergeflow.core.io import load_state_dict
    from mergeflow.ml import data as data_mod
    from mergeflow.ml.models import build_backbone, load_head

    tasks = list(params.suite.tasks)
    if len(tasks) < 2:
        raise MergeflowError("studies.ctl: needs at least two tasks in suite.tasks")
    theta0 = load_state_dict(layout.pretrained)
    backbone = build_backbone(params.backbone, theta0, source=str(layout.pretrained)).to(device)
    data = {t: data_mod.load_task(layout.task_data(t), params.suite.image_size) for t in tasks}
    heads = {
        t: load_head(
            layout.head(t),
            backbone.num_features,
            num_classes=len(data[t].classes),
            classes_source=str(layout.task_data(t)),
        )
        for t in tasks
    }
    suite = Suite(
        theta0,
        {t: load_state_dict(layout.finetuned(t)) for t in tasks},
        heads,
        {t: (data[t].test.inputs, data[t].test.labels) for t in tasks},
    )
    if hasattr(backbone, "feature_layers"):  # a text model: its blocks and how seed 003 pools their tokens
        blocks, pools = map(list, zip(*backbone.feature_layers()))
        text = {"pools": pools, "reading": backbone.feature_reading, "names": getattr(backbone, "feature_names", None)}
    else:
        blocks, text = list(getattr(backbone.net, "blocks", [])), {}
    if not blocks:
        raise MergeflowError(
            f"studies.ctl: backbone '{params.backbone.model}' has no 'blocks' (the study hooks a timm ViT's blocks, or "
            "a text model's feature_layers)"
        )
    return (
        theta0,
        data,
        heads,
        suite,
        Probe(backbone, backbone.net, blocks, params.runtime.eval_batch_size, device, **text),
    )


def _measure_scratch(
    params,
    s: CtlSettings,
    suite: Suite,
    probe: Probe,
    data: dict,
    heads: dict,
    theta0,
    pair8: tuple[str, str],
    n: int,
    device,
) -> tuple[dict, dict, dict]:
    """Claim 8's measurements: the pair trained from a random init and, on the same schedule, from theta0; the
    CTL terms at alpha = 0.5 of those two and of the pipeline's fine-tunes (by name, in the plot's order), each
    model's test accuracy, and each pair's distance relative to its init's norm."""
    import torch

    from mergeflow.ml.models import build_backbone

    train = {t: (data[t].train.inputs, data[t].train.labels) for t in pair8}
    torch.manual_seed(params.seed)
    random_init = {k: v.detach().clone() for k, v in build_backbone(params.backbone).net.state_dict().items()}
    from_scratch = train_pair(params, suite, train, random_init, pair8, s.scratch_steps, device, "scratch")
    from_theta0 = train_pair(params, suite, train, theta0, pair8, s.scratch_steps, device, "from-theta0")
    x8, _ = suite.x(list(pair8), n)
    terms = {
        "random init": ctl_at(probe, from_scratch[pair8[0]], from_scratch[pair8[1]], x8, 0.5),
        "from θ0, same schedule": ctl_at(probe, from_theta0[pair8[0]], from_theta0[pair8[1]], x8, 0.5),
        "pipeline": ctl_at(probe, suite.thetas[pair8[0]], suite.thetas[pair8[1]], x8, 0.5),
    }
    acc8 = {}
    for name, states in (("scratch", from_scratch), ("finetuned", from_theta0)):
        acc8[name] = {}
        for t in pair8:
            _, out = probe.run(states[t], data[t].test.inputs)
            acc8[name][t] = _head_acc(out, heads[t], data[t].test.labels)
    rel8 = {
        name: _r(_distance(states[pair8[0]], states[pair8[1]]) / _norm(init))
        for name, states, init in (("scratch", from_scratch, random_init), ("finetuned", from_theta0, theta0))
    }
    return terms, acc8, rel8


@register(
    "ctl",
    paper=PAPER,
    title="Cross-task linearity: interpolated weights give interpolated features, layer by layer",
    settings=CtlSettings,
)
def ctl_study(context: StudyContext) -> StudyResult:
    import torch

    params, layout, s, device = context.params, context.layout, context.settings, context.device
    started = time.perf_counter()
    timings: dict[str, float] = {}
    tasks = list(params.suite.tasks)
    theta0, data, heads, suite, probe = _load(params, layout, device)
    depth = len(probe.layers)
    layer = s.stitch_layer if s.stitch_layer is not None else max(0, depth // 2 - 1)
    if layer >= depth:
        raise MergeflowError(f"studies.ctl.stitch_layer: block {layer} does not exist (the backbone has {depth})")
    lam, lam_source = pipeline_lam(layout, s.lam)
    pairs = choose_pairs(tasks, s.pairs, params.seed)
    n = min(s.examples, *(len(suite.test[t][1]) for t in tasks))

    # claims 1, 2, 4, 6
    t0 = time.perf_counter()
    measured = {p: measure_pair(probe, suite, *p, s.alphas, lam, n) for p in pairs}
    per_alpha = {a: _by_layer([m["ctl"][a] for m in measured.values()]) for a in s.alphas}
    addition = _by_layer([m["addition"] for m in measured.values()])
    barriers = [loss_barrier(m["losses"][1.0], m["losses"][0.5], m["losses"][0.0]) for m in measured.values()]
    timings["pairs"] = time.perf_counter() - t0

    # claim 5, per task
    t0 = time.perf_counter()
    neg = {t: measure_negation(probe, suite, t, lam, n) for t in tasks}
    negation = _by_layer([v["eq3"] for v in neg.values()])
    eq4 = [float(torch.cat([v["eq4"][L] for v in neg.values()]).mean()) for L in range(depth)]
    first_order = [float(torch.cat([v["first_order"][L] for v in neg.values()]).mean()) for L in range(depth)]
    timings["negation"] = time.perf_counter() - t0

    # claim 3
    t0 = time.perf_counter()
    subsets = {k: choose_subset(tasks, k, s.average_seed) for k in s.average_sizes if k <= len(tasks)}
    avg_terms = {k: measure_average(probe, suite, sub, n) for k, sub in subsets.items()}
    per_k = {k: _by_layer([v]) for k, v in avg_terms.items()}
    timings["averaging"] = time.perf_counter() - t0

    # claim 7
    t0 = time.perf_counter()
    m_st = min(s.stitch_examples, *(len(suite.test[t][1]) for t in tasks))
    stitch = [measure_stitching(probe, suite, i, j, lam, layer, m_st) for i, j in pairs]
    timings["stitching"] = time.perf_counter() - t0

    # claim 8
    t0 = time.perf_counter()
    pair8 = tuple(s.scratch_pair) if s.scratch_pair is not None else pairs[0]
    for t in pair8:
        params.check_task(t)
    terms8, acc8, rel8 = _measure_scratch(params, s, suite, probe, data, heads, theta0, pair8, n, device)
    scratch, control, pipeline8 = (
        _by_layer([terms8[k]]) for k in ("random init", "from θ0, same schedule", "pipeline")
    )
    timings["scratch"] = time.perf_counter() - t0

    c1 = claim_ctl(per_alpha, s)
    claims = [
        c1,
        claim_coef(per_alpha, s),
        claim_average(per_k, s),
        claim_addition(addition, s, lam),
        claim_negation(negation, s, lam),
        claim_barrier(barriers, c1.holds, s),
        claim_stitching(stitch, s),
        claim_scratch(pair8, scratch, control, acc8, s, rel8),
    ]

    figures = ["ctl.png", "arithmetic.png", "barrier.png", "stitching.png", "scratch.png"]
    out = Path(context.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot_ctl(
        per_alpha,
        {a: _coefs([m["ctl"][a] for m in measured.values()]) for a in s.alphas},
        len(pairs),
        out / figures[0],
        probe.names,
    )
    coefs = {
        "average": {k: _coefs([v]) for k, v in avg_terms.items()},
        "addition": _coefs([m["addition"] for m in measured.values()]),
        "negation": _coefs([v["eq3"] for v in neg.values()]),
    }
    plot_arithmetic(per_k, addition, negation, coefs, lam, out / figures[1], probe.names)
    plot_barrier({f"{i} / {j}": m["losses"] for (i, j), m in measured.items()}, out / figures[2])
    plot_stitching(stitch, out / figures[3])
    plot_scratch(
        scratch, control, pipeline8, {k: _coefs([v]) for k, v in terms8.items()}, pair8, out / figures[4], probe.names
    )
    timings["total"] = time.perf_counter() - started
    # to the stage's log, not the report: the report's bytes must not change with the machine's load
    print("study ctl: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()), flush=True)
    body = _body(
        params,
        s,
        probe.reading,
        depth,
        layer,
        lam,
        lam_source,
        pairs,
        n,
        m_st,
        measured,
        per_alpha,
        per_k,
        subsets,
        addition,
        negation,
        eq4,
        first_order,
        barriers,
        stitch,
        pair8,
        scratch,
        control,
        pipeline8,
        acc8,
        rel8,
        claims,
    )
    return StudyResult(claims, body, figures)


def _norm(state: Mapping[str, torch.Tensor]) -> float:
    import torch

    return math.sqrt(sum(float(v.to(torch.float64).pow(2).sum()) for v in state.values() if v.is_floating_point()))


def _distance(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    import torch

    return math.sqrt(
        sum(
            float((a[k].to(torch.float64) - b[k].to(torch.float64)).pow(2).sum()) for k in a if a[k].is_floating_point()
        )
    )


def _row(label: str, values: Sequence[float], fmt: str = ".3g") -> str:
    return f"| {label} | " + " | ".join(format(v, fmt) for v in values) + " |"


def _body(
    params,
    s: CtlSettings,
    reading: str,
    depth,
    layer,
    lam,
    lam_source,
    pairs,
    n,
    m_st,
    measured,
    per_alpha,
    per_k,
    subsets,
    addition,
    negation,
    eq4,
    first_order,
    barriers,
    stitch,
    pair8,
    scratch,
    control,
    pipeline8,
    acc8,
    rel8,
    claims,
) -> str:
    head = "| | " + " | ".join(f"block {L}" for L in range(depth)) + " |"
    sep = "|---|" + "---|" * depth
    steps8 = s.scratch_steps if s.scratch_steps is not None else params.finetune.steps
    every_pair = s.pairs is None or len(pairs) == len(params.suite.tasks) * (len(params.suite.tasks) - 1) // 2
    drawn = "all" if every_pair else f"drawn with seed {params.seed}"
    b = [
        f"Our suite: {len(params.suite.tasks)} tasks, backbone `{params.backbone.model}` {params.backbone.kwargs} "
        f"({depth} blocks); f_l is {reading}. "
        f"{len(pairs)} task pairs ({drawn}): "
        + ", ".join(f"{i}/{j}" for i, j in pairs)
        + f". D_t: the first {n} test examples of task t (D_i ∪ D_j: {2 * n}). λ = {lam:g}, from {lam_source}.",
        "",
        'Thresholds (settings, fixed before the numbers): a d_l is "near 0" when its mean is at most '
        f'{s.ctl_ratio:g} × the mean baseline at every layer (and every α or k); coef is "≈ 1" when its median is '
        f"within 1 ± {s.coef_tolerance:g} at every layer; "
        f"LMC fails when the mean barrier at α = 0.5 exceeds {s.barrier_tolerance:g} nats; stitching holds when the "
        f"averaged features recover ≥ {s.stitch_recovery:g} "
        'of the own-task over other-task accuracy gap; without pretraining CTL is "much weaker" when its mean d_l at '
        f"α = 0.5 is ≥ {s.weaker_factor:g}× the fine-tuned pair's. "
        "The seed gives figures, not thresholds: these are ours. The times are in the stage's log.",
        "",
        "## 1–2. Cross-task linearity and its coefficient (seed Sec. 4.1, Figs. 2–3)",
        "",
        "Mean over all pairs' examples of d_l = 1 − cos(f_l(αθi + (1−α)θj), αf_l(θi) + (1−α)f_l(θj)), against the "
        "baseline 1 − cos(f_l(θi), f_l(θj)), and the median coef:",
        "",
        head,
        sep,
    ]
    for a, Ls in per_alpha.items():
        b.append(_row(f"d, α = {a:g}", [L["d"] for L in Ls]))
    b.append(_row("baseline", [L["baseline"] for L in per_alpha[0.5]]))
    for a, Ls in per_alpha.items():
        b.append(_row(f"median coef, α = {a:g}", [L["coef_median"] for L in Ls], ".3f"))
    b += [
        "",
        "![cross-task linearity](ctl.png)",
        "",
        "## 3. Averaging several models (seed Sec. 4.2, eq. 1, Figs. 5–6)",
        "",
        "f_l(mean θ) against mean f_l(θt) on the union of the k tasks' D_t; baseline mean_t (1 − cos(f_l(mean θ), "
        "f_l(θt))). The seed averages models fine-tuned "
        "on one task with different hyperparameters; ours are fine-tuned on different tasks (its Lemma 2, CTL for "
        "several models). Subsets (seed "
        f"{s.average_seed}): " + "; ".join(f"k = {k}: {', '.join(sub)}" for k, sub in subsets.items()) + ".",
        "",
        head,
        sep,
    ]
    for k, Ls in per_k.items():
        b += [
            _row(f"d, k = {k}", [L["d"] for L in Ls]),
            _row(f"baseline, k = {k}", [L["baseline"] for L in Ls]),
            _row(f"median coef, k = {k}", [L["coef_median"] for L in Ls], ".3f"),
        ]
    b += [
        "",
        "## 4–5. Task arithmetic in feature space (seed Sec. 4.3, eqs. 2–4, Figs. 7–8)",
        "",
        f"Addition on D_i ∪ D_j of every pair; negation on D_t of every task; λ = {lam:g}.",
        "",
        head,
        sep,
        _row("addition d: f(θ0 + λ(τi+τj)) vs ½f(θ0+2λτi) + ½f(θ0+2λτj)", [L["d"] for L in addition]),
        _row("addition baseline: 1 − cos(f(θ0+2λτi), f(θ0+2λτj))", [L["baseline"] for L in addition]),
        _row("addition median coef", [L["coef_median"] for L in addition], ".3f"),
        _row("negation d (eq. 3): f(θ0) vs ½f(θ0+λτi) + ½f(θ0−λτi)", [L["d"] for L in negation]),
        _row("negation baseline: 1 − cos(f(θ0+λτi), f(θ0−λτi))", [L["baseline"] for L in negation]),
        _row("negation median coef", [L["coef_median"] for L in negation], ".3f"),
        _row("eq. 4 (shown): 1 − cos(f(θ0−λτi), f(θ0) − Δ), Δ = f(θ0+λτi) − f(θ0)", eq4),
        _row("first order (shown): 1 − cos(f(θ0−λτi), f(θ0) − λ(f(θi) − f(θ0)))", first_order),
        "",
        "![task arithmetic in feature space](arithmetic.png)",
        "",
        "## 6. The loss barrier: linearity without linear mode connectivity (seed Sec. 4.1)",
        "",
        "Loss on D_i ∪ D_j, each example scored by its own task's head (the "
        "pipeline's frozen heads), along θα = αθi + (1−α)θj; the barrier is "
        "L(θ0.5) − ½(L(θi) + L(θj)). Per task, the loss of each end "
        "model on that task's images shows why the endpoints differ.",
        "",
        "| pair | L(θj) | "
        + " | ".join(f"L(θ{a:g})" for a in s.alphas)
        + " | L(θi) | barrier | L_i(θi) | L_i(θj) | L_j(θi) | L_j(θj) |",
        "|---|---|" + "---|" * len(s.alphas) + "---|---|---|---|---|---|",
    ]
    for ((i, j), m), bar in zip(measured.items(), barriers):
        L = m["losses"]
        pt = m["per_task"]
        b.append(
            f"| {i} / {j} | {L[0.0]:.4f} | "
            + " | ".join(f"{L[a]:.4f}" for a in s.alphas)
            + f" | {L[1.0]:.4f} | {bar:+.4f} | "
            f"{pt[i]['theta_i']:.3f} | {pt[i]['theta_j']:.3f} | {pt[j]['theta_i']:.3f} | {pt[j]['theta_j']:.3f} |"
        )
    b += [
        "",
        f"Mean barrier {mean(barriers):+.4f} nats. With an exact CTL and equal coefficient, the logits along the path "
        "are the interpolated logits and "
        "cross-entropy is convex in them, so the loss on any dataset lies below the chord (the seed's Lemma 1): a "
        "barrier needs CTL to be inexact.",
        "",
        "![loss along the path](barrier.png)",
        "",
        f"## 7. Stitching averaged features at block {layer} (seed Sec. 4.3, Fig. 9)",
        "",
        f"θ0's blocks after block {layer} (then its norm and pooling, then task t's head) fed the features of θ0 + λτ; "
        f"the first {m_st} test examples of each task. "
        "Accuracies (%):",
        "",
        "| pair | stitched avg on D_i | on D_j | stitched f(θ0+λτi) on D_i | on D_j | stitched f(θ0+λτj) on D_i | on "
        "D_j | θ0+λ(τi+τj) on D_i | on D_j | θ0 on D_i | on D_j |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in stitch:
        b.append(
            f"| {r['pair'][0]} / {r['pair'][1]} | "
            + " | ".join(
                f"{100 * r[k]:.1f}"
                for k in (
                    "avg_i",
                    "avg_j",
                    "own_i",
                    "other_j",
                    "other_i",
                    "own_j",
                    "ta_i",
                    "ta_j",
                    "theta0_i",
                    "theta0_j",
                )
            )
            + " |"
        )
    b += [
        "",
        "![stitching](stitching.png)",
        "",
        "## 8. Without pretraining (seed Sec. 5, App. B.3, Fig. 11)",
        "",
        f"The pair {pair8[0]} / {pair8[1]} trained twice with the pipeline's fine-tune schedule "
        f"({params.finetune.optimizer}, lr {params.finetune.lr:g}, {steps8} steps of "
        f"{params.finetune.batch_size}), with no feature anchor, each task's head from models/heads frozen: once from "
        f"a common random init (seed {params.seed}), once "
        "from θ0. The seed trains its scratch models independently (and then aligns them by permutation); ours share "
        "their init, which favours linearity: "
        "the seed's setting is the harder test, ours isolates "
        "pretraining from the shared init. d_l at α = 0.5 on D_i ∪ D_j:",
        "",
        head,
        sep,
        _row("d, random init", [L["d"] for L in scratch]),
        _row("d, from θ0 (same schedule)", [L["d"] for L in control]),
        _row("d, the pipeline's models", [L["d"] for L in pipeline8]),
        _row("baseline, random init", [L["baseline"] for L in scratch]),
        _row("baseline, from θ0", [L["baseline"] for L in control]),
        _row("median coef, random init", [L["coef_median"] for L in scratch], ".3f"),
        _row("median coef, from θ0", [L["coef_median"] for L in control], ".3f"),
        "",
        "Test accuracy (%): "
        + "; ".join(f"{name}: " + ", ".join(f"{t} {100 * v:.1f}" for t, v in a.items()) for name, a in acc8.items())
        + f". ‖θi − θj‖ / ‖init‖: random init {rel8['scratch']:.4f}, from θ0 {rel8['finetuned']:.4f}.",
        "",
        "![without pretraining](scratch.png)",
        "",
    ]
    return "\n".join(b)
