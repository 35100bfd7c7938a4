"""Study mima: the study function, registered as ``mima``, and its report's tables."""

from __future__ import annotations

from pathlib import Path
from statistics import median

from mergeflow.studies import StudyContext, StudyResult, register
from mergeflow.studies.mima.claims import (
    claim_advantage,
    claim_cosines,
    claim_gap,
    claim_lambda,
    claim_related,
    claim_rounds,
    claim_ua_individual,
    pct,
    quartiles,
)
from mergeflow.studies.mima.figures import plot_accuracy, plot_cosines, plot_rounds
from mergeflow.studies.mima.measure import PAPER_T, PAPER_VIT_B32, MimaSettings, Point, collect


def _accuracy_table(points: list[Point]) -> str:
    ours = {p.n: p for p in points}
    ns = sorted(set(ours) | set(PAPER_VIT_B32))
    head = (
        "| N | source | UA ours | UA seed | TA ours | TA seed | TIES ours | TIES seed | individual ours | individual "
        "seed | TA λ ours | TA λ seed |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for n in ns:
        p, paper = ours.get(n), PAPER_VIT_B32.get(n, {})
        acc = p.accuracy if p else {}
        lam = p.lam.get("ta") if p else None
        cells = [str(n), p.source if p else "not run"]
        for role in ("ua", "ta", "ties"):
            cells += [pct(acc.get(role)), pct(paper.get(role))]
        cells += [
            pct(p.individual_average if p else None),
            pct(paper.get("individual")),
            "—" if lam is None else f"{lam:g}",
            "—" if "ta_lam" not in paper else f"{paper['ta_lam']:g}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cosine_table(points: list[Point], s: MimaSettings) -> str:
    a, b = s.related_pair
    lines = [f"| N | pairs | median | IQR | min | max | cos({a}, {b}) |", "|---|---|---|---|---|---|---|"]
    for p in points:
        pairs = p.pairs()
        if not pairs:
            continue
        q1, med, q3 = quartiles(list(pairs.values()))
        rel = pairs.get((a, b), pairs.get((b, a)))
        lines.append(
            f"| {p.n} | {len(pairs)} | {med:.3f} | {q1:.3f} – {q3:.3f} | {min(pairs.values()):.3f} | "
            f"{max(pairs.values()):.3f} | {'—' if rel is None else f'{rel:.3f}'} |"
        )
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def _rounds_table(point: Point) -> str:
    lines = ["| round | median cos(δ) | median cos(τ) | mean ‖δ‖ | mean ‖τ‖ |", "|---|---|---|---|---|"]
    for r in point.rounds or []:
        u = list((r.get("update_cosines") or {}).values())
        t = list((r.get("task_vector_cosines") or {}).values())
        un = list((r.get("update_norms") or {}).values())
        tn = list((r.get("task_vector_norms") or {}).values())

        def m(v):
            return "—" if not v else f"{median(v):.3f}"

        def mean(v):
            return "—" if not v else f"{sum(v) / len(v):.4g}"

        lines.append(f"| {r.get('round')} | {m(u)} | {m(t)} | {mean(un)} | {mean(tn)} |")
    return "\n".join(lines) + "\n"


@register(
    "mima",
    paper="Seed 001: MIMA, Iterative model averaging and fine-tuning for multi-task learning (under review)",
    title="MIMA: does iterated averaging align task vectors and close the merging gap?",
    settings=MimaSettings,
    claims={
        "001.1": "cosines_rise_with_n",
        "001.2": "related_pair_aligned",
        "001.3": "ua_rises_with_n",
        "001.4a": "gap_shrinks_with_n",
        "001.4b": "ta_advantage_shrinks",
        "001.4c": "ties_advantage_shrinks",
        "001.4d": "ta_lambda_to_1_over_t",
        "001.5": "round_updates_orthogonal",
    },
)
def mima_study(context: StudyContext) -> StudyResult:
    s: MimaSettings = context.settings
    points, notes = collect(context)
    n_tasks = len(context.params.suite.tasks)
    round_claim, round_point = claim_rounds(points, s)
    claims = [
        claim_cosines(points, s),
        claim_related(points, s),
        claim_ua_individual(points, s),
        claim_gap(points, s),
        claim_advantage(points, s, "ta", "001.4b"),
        claim_advantage(points, s, "ties", "001.4c"),
        claim_lambda(points, s, n_tasks),
        round_claim,
    ]
    out = Path(context.out_dir)
    figures = []
    if plot_cosines(points, s, out / "cosine_by_n.png"):
        figures.append("cosine_by_n.png")
    if plot_accuracy(points, out / "accuracy_by_n.png"):
        figures.append("accuracy_by_n.png")
    rounds_name = f"rounds_n{round_point.n}.png" if round_point else None
    if round_point and plot_rounds(round_point, s, out / rounds_name):
        figures.append(rounds_name)

    n1 = points[0]
    standard = "the standard fine-tune (vectors/, metrics/finetune/, metrics/evaluate/)"
    n1_is = "the regime variant `mima_n1`" if n1.source != "standard fine-tune" else standard
    body = [
        f"N = 1 is {n1_is}: "
        "the seed's \"N = 1 corresponds to the standard, independent "
        'fine-tuning baseline". Every N has the same per-task budget '
        f"S = finetune.steps = {context.params.finetune.steps} steps, K "
        "= S/N a round. UA is the uniform average of the task models "
        "(weight_averaging); TA and TIES choose their hyperparameters on validation. Accuracies are test averages over "
        f"our {n_tasks} tasks; the seed's are ViT-B/32 on its {PAPER_T} tasks (Table 1; TA's λ from Table 2).",
        "",
        f"Rules: a sequence over N ascending (or over rounds) *rises* when no step goes down by more than the slack "
        f"(accuracy {100 * s.accuracy_slack:g} points, cosine {s.cosine_slack:g}) and the last value is above the "
        "first; *shrinks* is the mirror. "
        "A claim needs two round counts with its numbers (claim 5: "
        "two rounds of the largest N), else it is *not measured*.",
        "",
    ]
    if notes:
        body += ["Missing inputs:", ""] + [f"- {n}" for n in notes] + [""]
    body += ["## Accuracy against N (%): ours and the seed's", "", _accuracy_table(points)]
    if "accuracy_by_n.png" in figures:
        body += ["![accuracy against N](accuracy_by_n.png)", ""]
    body += ["## Pairwise cosines of the task vectors per N", ""]
    table = _cosine_table(points, s)
    body += [table] if table else ["No task-vector statistics were found.", ""]
    if "cosine_by_n.png" in figures:
        body += ["![pairwise cosines per N](cosine_by_n.png)", ""]
    if round_point is not None:
        body += [
            f"## Per-round updates and task vectors, N = {round_point.n}",
            "",
            "δ_t(i) = θ_t(i) − θ̄(i−1), the round's update; τ_t(i) "
            "= θ_t(i) − θ0 (seed 001, eqs. 5 and 8; Appendix C.2).",
            "",
            _rounds_table(round_point),
        ]
        if rounds_name in figures:
            body += [f"![per-round cosines]({rounds_name})", ""]
    return StudyResult(claims=claims, body="\n".join(body), figures=figures)
