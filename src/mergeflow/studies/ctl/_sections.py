"""Study ``ctl``'s report body: what the measurements gave, and a function per section of the report.

The measurements come in as one dataclass per group of claims (the pairs, the negations, the averages, the
training without pretraining), so that each section reads only what it shows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from statistics import mean
from typing import Any

from mergeflow.studies.ctl.settings import CtlSettings


@dataclass
class Design:
    """What every measurement is taken on: how f_l reads a block, the blocks, the stitching block, lambda and
    where it came from, the pairs, and the test examples per task (``n``) and per stitched task (``m_st``)."""

    reading: str
    depth: int
    layer: int
    lam: float
    lam_source: str
    pairs: list[tuple[str, str]]
    n: int
    m_st: int


@dataclass
class PairTerms:
    """Claims 1, 2, 4 and 6: each pair's measurements, the CTL terms per alpha and the addition's, each pooled
    over the pairs per layer, and each pair's loss barrier."""

    measured: dict[tuple[str, str], dict[str, Any]]
    per_alpha: dict[float, list[dict[str, Any]]]
    addition: list[dict[str, Any]]
    barriers: list[float]


@dataclass
class NegationTerms:
    """Claim 5: each task's measurements, eq. 3's terms pooled over the tasks per layer, and eq. 4 and its first
    order form per layer."""

    by_task: dict[str, dict[str, Any]]
    negation: list[dict[str, Any]]
    eq4: list[float]
    first_order: list[float]


@dataclass
class AverageTerms:
    """Claim 3: the subsets by size k, each one's terms, and those per layer."""

    subsets: dict[int, list[str]]
    terms: dict[int, Any]
    per_k: dict[int, list[dict[str, Any]]]


@dataclass
class ScratchTerms:
    """Claim 8: the pair, the CTL terms at alpha = 0.5 of its three trainings (by name) and per layer, each model's
    test accuracy, and each pair's distance relative to its init's norm."""

    pair: tuple[str, str]
    terms: dict[str, Any]
    scratch: list[dict[str, Any]]
    control: list[dict[str, Any]]
    pipeline: list[dict[str, Any]]
    acc: dict[str, dict[str, float]]
    rel: dict[str, float]


def _row(label: str, values: Sequence[float], fmt: str = ".3g") -> str:
    return f"| {label} | " + " | ".join(format(v, fmt) for v in values) + " |"


def _block_header(depth: int) -> list[str]:
    """A per-block table's header and separator."""
    return ["| | " + " | ".join(f"block {L}" for L in range(depth)) + " |", "|---|" + "---|" * depth]


def _intro(params, s: CtlSettings, d: Design) -> list[str]:
    """The suite, the pairs, D_t and lambda; the thresholds."""
    every_pair = s.pairs is None or len(d.pairs) == len(params.suite.tasks) * (len(params.suite.tasks) - 1) // 2
    drawn = "all" if every_pair else f"drawn with seed {params.seed}"
    return [
        f"Our suite: {len(params.suite.tasks)} tasks, backbone `{params.backbone.model}` {params.backbone.kwargs} "
        f"({d.depth} blocks); f_l is {d.reading}. "
        f"{len(d.pairs)} task pairs ({drawn}): "
        + ", ".join(f"{i}/{j}" for i, j in d.pairs)
        + f". D_t: the first {d.n} test examples of task t (D_i ∪ D_j: {2 * d.n}). λ = {d.lam:g}, from "
        f"{d.lam_source}.",
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
    ]


def _linearity_section(d: Design, p: PairTerms) -> list[str]:
    """Sections 1-2: d_l per alpha against the baseline, and the median coef."""
    b = [
        "## 1–2. Cross-task linearity and its coefficient (seed Sec. 4.1, Figs. 2–3)",
        "",
        "Mean over all pairs' examples of d_l = 1 − cos(f_l(αθi + (1−α)θj), αf_l(θi) + (1−α)f_l(θj)), against the "
        "baseline 1 − cos(f_l(θi), f_l(θj)), and the median coef:",
        "",
        *_block_header(d.depth),
    ]
    for a, Ls in p.per_alpha.items():
        b.append(_row(f"d, α = {a:g}", [L["d"] for L in Ls]))
    b.append(_row("baseline", [L["baseline"] for L in p.per_alpha[0.5]]))
    for a, Ls in p.per_alpha.items():
        b.append(_row(f"median coef, α = {a:g}", [L["coef_median"] for L in Ls], ".3f"))
    return b + ["", "![cross-task linearity](ctl.png)", ""]


def _averaging_section(s: CtlSettings, d: Design, avg: AverageTerms) -> list[str]:
    """Section 3: f_l of the mean of k models against the mean of their f_l, per subset size."""
    b = [
        "## 3. Averaging several models (seed Sec. 4.2, eq. 1, Figs. 5–6)",
        "",
        "f_l(mean θ) against mean f_l(θt) on the union of the k tasks' D_t; baseline mean_t (1 − cos(f_l(mean θ), "
        "f_l(θt))). The seed averages models fine-tuned "
        "on one task with different hyperparameters; ours are fine-tuned on different tasks (its Lemma 2, CTL for "
        "several models). Subsets (seed "
        f"{s.average_seed}): " + "; ".join(f"k = {k}: {', '.join(sub)}" for k, sub in avg.subsets.items()) + ".",
        "",
        *_block_header(d.depth),
    ]
    for k, Ls in avg.per_k.items():
        b += [
            _row(f"d, k = {k}", [L["d"] for L in Ls]),
            _row(f"baseline, k = {k}", [L["baseline"] for L in Ls]),
            _row(f"median coef, k = {k}", [L["coef_median"] for L in Ls], ".3f"),
        ]
    return b + [""]


def _arithmetic_section(d: Design, p: PairTerms, neg: NegationTerms) -> list[str]:
    """Sections 4-5: task addition over the pairs and negation over the tasks, in feature space."""
    addition, negation = p.addition, neg.negation
    return [
        "## 4–5. Task arithmetic in feature space (seed Sec. 4.3, eqs. 2–4, Figs. 7–8)",
        "",
        f"Addition on D_i ∪ D_j of every pair; negation on D_t of every task; λ = {d.lam:g}.",
        "",
        *_block_header(d.depth),
        _row("addition d: f(θ0 + λ(τi+τj)) vs ½f(θ0+2λτi) + ½f(θ0+2λτj)", [L["d"] for L in addition]),
        _row("addition baseline: 1 − cos(f(θ0+2λτi), f(θ0+2λτj))", [L["baseline"] for L in addition]),
        _row("addition median coef", [L["coef_median"] for L in addition], ".3f"),
        _row("negation d (eq. 3): f(θ0) vs ½f(θ0+λτi) + ½f(θ0−λτi)", [L["d"] for L in negation]),
        _row("negation baseline: 1 − cos(f(θ0+λτi), f(θ0−λτi))", [L["baseline"] for L in negation]),
        _row("negation median coef", [L["coef_median"] for L in negation], ".3f"),
        _row("eq. 4 (shown): 1 − cos(f(θ0−λτi), f(θ0) − Δ), Δ = f(θ0+λτi) − f(θ0)", neg.eq4),
        _row("first order (shown): 1 − cos(f(θ0−λτi), f(θ0) − λ(f(θi) − f(θ0)))", neg.first_order),
        "",
        "![task arithmetic in feature space](arithmetic.png)",
        "",
    ]


def _barrier_section(s: CtlSettings, p: PairTerms) -> list[str]:
    """Section 6: the loss along each pair's path, its barrier, and each end model's loss per task."""
    b = [
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
    for ((i, j), m), bar in zip(p.measured.items(), p.barriers):
        L = m["losses"]
        pt = m["per_task"]
        b.append(
            f"| {i} / {j} | {L[0.0]:.4f} | "
            + " | ".join(f"{L[a]:.4f}" for a in s.alphas)
            + f" | {L[1.0]:.4f} | {bar:+.4f} | "
            f"{pt[i]['theta_i']:.3f} | {pt[i]['theta_j']:.3f} | {pt[j]['theta_i']:.3f} | {pt[j]['theta_j']:.3f} |"
        )
    return b + [
        "",
        f"Mean barrier {mean(p.barriers):+.4f} nats. With an exact CTL and equal coefficient, the logits along the "
        "path are the interpolated logits and "
        "cross-entropy is convex in them, so the loss on any dataset lies below the chord (the seed's Lemma 1): a "
        "barrier needs CTL to be inexact.",
        "",
        "![loss along the path](barrier.png)",
        "",
    ]


def _stitching_section(d: Design, stitch: list[dict[str, Any]]) -> list[str]:
    """Section 7: accuracies of theta0's later blocks fed each model's features at the stitching block."""
    keys = ("avg_i", "avg_j", "own_i", "other_j", "other_i", "own_j", "ta_i", "ta_j", "theta0_i", "theta0_j")
    b = [
        f"## 7. Stitching averaged features at block {d.layer} (seed Sec. 4.3, Fig. 9)",
        "",
        f"θ0's blocks after block {d.layer} (then its norm and pooling, then task t's head) fed the features of "
        f"θ0 + λτ; the first {d.m_st} test examples of each task. "
        "Accuracies (%):",
        "",
        "| pair | stitched avg on D_i | on D_j | stitched f(θ0+λτi) on D_i | on D_j | stitched f(θ0+λτj) on D_i | on "
        "D_j | θ0+λ(τi+τj) on D_i | on D_j | θ0 on D_i | on D_j |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in stitch:
        b.append(f"| {r['pair'][0]} / {r['pair'][1]} | " + " | ".join(f"{100 * r[k]:.1f}" for k in keys) + " |")
    return b + ["", "![stitching](stitching.png)", ""]


def _scratch_section(params, s: CtlSettings, d: Design, sc: ScratchTerms) -> list[str]:
    """Section 8: the pair trained from a random init against the same training from theta0."""
    steps8 = s.scratch_steps if s.scratch_steps is not None else params.finetune.steps
    return [
        "## 8. Without pretraining (seed Sec. 5, App. B.3, Fig. 11)",
        "",
        f"The pair {sc.pair[0]} / {sc.pair[1]} trained twice with the pipeline's fine-tune schedule "
        f"({params.finetune.optimizer}, lr {params.finetune.lr:g}, {steps8} steps of "
        f"{params.finetune.batch_size}), with no feature anchor, each task's head from models/heads frozen: once from "
        f"a common random init (seed {params.seed}), once "
        "from θ0. The seed trains its scratch models independently (and then aligns them by permutation); ours share "
        "their init, which favours linearity: "
        "the seed's setting is the harder test, ours isolates "
        "pretraining from the shared init. d_l at α = 0.5 on D_i ∪ D_j:",
        "",
        *_block_header(d.depth),
        _row("d, random init", [L["d"] for L in sc.scratch]),
        _row("d, from θ0 (same schedule)", [L["d"] for L in sc.control]),
        _row("d, the pipeline's models", [L["d"] for L in sc.pipeline]),
        _row("baseline, random init", [L["baseline"] for L in sc.scratch]),
        _row("baseline, from θ0", [L["baseline"] for L in sc.control]),
        _row("median coef, random init", [L["coef_median"] for L in sc.scratch], ".3f"),
        _row("median coef, from θ0", [L["coef_median"] for L in sc.control], ".3f"),
        "",
        "Test accuracy (%): "
        + "; ".join(f"{name}: " + ", ".join(f"{t} {100 * v:.1f}" for t, v in a.items()) for name, a in sc.acc.items())
        + f". ‖θi − θj‖ / ‖init‖: random init {sc.rel['scratch']:.4f}, from θ0 {sc.rel['finetuned']:.4f}.",
        "",
        "![without pretraining](scratch.png)",
        "",
    ]


def report_body(
    params,
    s: CtlSettings,
    d: Design,
    p: PairTerms,
    neg: NegationTerms,
    avg: AverageTerms,
    stitch: list[dict[str, Any]],
    sc: ScratchTerms,
) -> str:
    """The report's body, its sections in order."""
    return "\n".join(
        _intro(params, s, d)
        + _linearity_section(d, p)
        + _averaging_section(s, d, avg)
        + _arithmetic_section(d, p, neg)
        + _barrier_section(s, p)
        + _stitching_section(d, stitch)
        + _scratch_section(params, s, d, sc)
    )
