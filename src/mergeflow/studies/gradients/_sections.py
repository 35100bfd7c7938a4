"""Study ``gradients``'s report body: a function per section of the report, one per group of claims."""

from __future__ import annotations

from mergeflow.studies import Claim
from mergeflow.studies.gradients.settings import GradientsSettings


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _sci(x: float) -> str:
    return f"{x:.1e}"


def _identities_section(s: GradientsSettings, subset: list[str], ident: dict, atm_rounds: list) -> list[str]:
    """Claims 1-2: one GD epoch against the gradient per task, and ATM against multi-task GD per round."""
    lines = [
        "## Task vectors as gradients under full-batch GD (claims 1-2)",
        "",
        f"Each task's backbone is trained through the pipeline's trainer "
        f"(`regimes._finetune.finetune_trainer`, regime `one_epoch`) with "
        f"`optimizer: gd`, lr eta = {s.gd_lr}, no weight decay or warm-up, "
        f"on the first {s.examples} training examples; the gradient is "
        "computed apart, by autograd of the mean cross-entropy under the "
        f"task's frozen head in chunks of {s.chunk}. Float32 throughout, so "
        "the errors are set against the float32 floor ‖ulp(theta)/2‖, the "
        "error of merely storing the exact result: tau_t(1) is a small "
        "difference of two float32 models (relative floor below).",
        "",
        "| task | max abs error | relative error | relative floor | error / floor | norm of tau_t(1) |",
        "|---|---|---|---|---|---|",
    ]
    for t, e in ident["tasks"].items():
        lines.append(
            f"| {t} | {_sci(e['max_abs'])} | {_sci(e['relative'])} | {_sci(e['floor_relative'])} | {e['ulps']:.2f} | "
            f"{ident['tau_norms'][t]:.4g} |"
        )
    mt = ident["multitask"]
    lines += [
        f"| theta0 + alpha sum tau_t vs one multi-task step | {_sci(mt['max_abs'])} | {_sci(mt['relative'])} | "
        f"{_sci(mt['floor_relative'])} | {mt['ulps']:.2f} | |",
        "",
        f"ATM (regime `atm`, steps=1, alpha = 1/{len(subset)}) against {s.atm_rounds} multi-task GD steps (own loop, "
        f"same gradients' route) on {', '.join(subset)}:",
        "",
        "| round | max abs error | relative error of theta(r) - theta0 | relative floor | error / floor |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['round']} | {_sci(r['max_abs'])} | {_sci(r['relative'])} "
        f"| {_sci(r['floor_relative'])} | {r['ulps']:.2f} |"
        for r in atm_rounds
    ]
    return lines + [""]


def _gap_section(
    s: GradientsSettings, subset: list[str], gaps: dict, slope: float, sharpness: dict, figures: list[str]
) -> list[str]:
    """Claim 3: the TA - multi-task gap per step size and epoch, and its fitted log-slope."""
    etas = sorted(gaps)
    lines = [
        "## The TA - multi-task gap is second order in eta (claim 3)",
        "",
        "Float64 full-batch GD at a constant step size (the theorem's "
        f"setting), {s.gap_examples} examples per task on {', '.join(subset)}; "
        f"TA = theta0 + alpha sum_t tau_t(k), MT = k GD steps at alpha eta on sum_t Lbar_t. At k = 1 the gap is the "
        f"identity of claim 1 in float64. "
        "The step sizes are small because the loss is sharp: its curvature along the gradient, u'Hu, is "
        + ", ".join(f"{sharpness[t]:.3g} ({t})" for t in subset)
        + "; the expansion in eta needs eta u'Hu well below 1.",
        "",
        "| eta | "
        + " | ".join(f"gap, k={g['epoch']}" for g in gaps[etas[0]])
        + f" | norm of theta_MT({s.gap_epochs}) - theta0 |",
        "|---|" + "---|" * (len(gaps[etas[0]]) + 1),
    ]
    for e in etas:
        lines.append(f"| {e:g} | " + " | ".join(_sci(g["gap"]) for g in gaps[e]) + f" | {gaps[e][-1]['mt_step']:.3g} |")
    return lines + [
        "",
        f"Fitted log-slope of the gap at k = {s.gap_epochs}: **{slope:.2f}** (2 is eta^2).",
        "",
        f"![eta scaling]({figures[2]})",
        "",
    ]


def _minibatch_section(
    s: GradientsSettings, subset: list[str], cos4: dict, sign_cos: dict, figures: list[str]
) -> list[str]:
    """Claim 4: the cosine of one AdamW epoch with the negative gradient, per steps per epoch."""
    lines = [
        "## Minibatch AdamW: one epoch is no longer the gradient (claim 4)",
        "",
        "One epoch of AdamW (the pipeline's lr and weight decay, no "
        f"warm-up, no feature anchor) on the same {s.examples} examples, "
        f"at batch sizes {', '.join(map(str, sorted(s.batch_sizes, reverse=True)))}; cosine of tau_t(1) with the "
        "full-batch negative gradient. "
        "Adam's first step is about -lr sign(g), so one step already has the cosine of sign(g) with g (last row).",
        "",
        "| steps / epoch | " + " | ".join(subset) + " | mean |",
        "|---|" + "---|" * (len(subset) + 1),
    ]
    for k in sorted(cos4):
        v = cos4[k]
        lines.append(f"| {k} | " + " | ".join(f"{v[t]:.3f}" for t in subset) + f" | {sum(v.values()) / len(v):.3f} |")
    lines.append(
        "| cos(sign g, g) | "
        + " | ".join(f"{sign_cos[t]:.3f}" for t in subset)
        + f" | {sum(sign_cos.values()) / len(sign_cos):.3f} |"
    )
    return lines + ["", f"![cosine vs steps per epoch]({figures[0]})", ""]


def _trajectory_section(
    s: GradientsSettings, trajectories: dict, checks5: dict, warmup: int, per_epoch: int, figures: list[str]
) -> list[str]:
    """Claim 5: each task's per-epoch updates under the pipeline's fine-tune, and the three checks."""
    lines = [
        "## The first epoch dominates the trajectory (claim 5)",
        "",
        "The pipeline's fine-tune settings (optimizer, lr, weight decay, batch size, feature anchor) for "
        f"{s.trajectory_epochs} epochs on the first "
        f"{s.trajectory_examples} training examples ({per_epoch} steps an epoch; warm-up {warmup} steps, the share of "
        "the first epoch it has in the "
        "pipeline's run on the whole split; cosine decay over all epochs, "
        "so later epochs' learning rates are smaller by construction). "
        "g_k = theta(k) - theta(k-1).",
        "",
        "| task | share of sum ‖g_k‖, k = 1.. | cos(g_1, g_k), k = "
        "2.. | ‖tau(k)‖, k = 1.. | first largest | aligned | grows |",
        "|---|---|---|---|---|---|---|",
    ]
    for t, u in trajectories.items():
        total = sum(u["update_norms"])
        c = checks5[t]
        lines.append(
            f"| {t} | {', '.join(f'{n / total:.2f}' for n in u['update_norms'])} | "
            f"{', '.join(f'{x:.2f}' for x in u['cos_first'][1:])} | "
            f"{', '.join(f'{x:.3g}' for x in u['tau_norms'])} | {'yes' if c['first_largest'] else 'no'} | "
            f"{'yes' if c['aligned'] else 'no'} | {'yes' if c['tau_grows'] else 'no'} |"
        )
    return lines + ["", f"![per-epoch updates]({figures[1]})", ""]


def _pipeline_section(claim6: Claim, claim7: Claim, rows6) -> list[str]:
    """Claims 6-7, read from the pipeline's regime outputs, and each merge of the one-epoch task vectors."""
    lines = [
        "## From the pipeline's regimes (claims 6-7)",
        "",
        "| claim | verdict | measured |",
        "|---|---|---|",
    ]
    for c in (claim6, claim7):
        lines.append(f"| {c.id} | {c.verdict} | {c.detail} |")
    if rows6:
        lines += [
            "",
            "Each merge of the one-epoch task vectors (regime `one_epoch`: "
            "one epoch of the pipeline's fine-tune per task) against the same "
            "method on the converged ones (test average, %, hyperparameters chosen on validation for each):",
            "",
            "| method | one epoch | converged | difference |",
            "|---|---|---|---|",
        ]
        for m, one, full in rows6:
            diff = f"{100 * (one - full):+.1f}" if one is not None and full is not None else "-"
            lines.append(
                f"| {m} | {_pct(one) if one is not None else '-'} | "
                f"{_pct(full) if full is not None else '-'} | {diff} |"
            )
    return lines


def report_body(
    s: GradientsSettings,
    subset: list[str],
    ident: dict,
    atm_rounds: list,
    gaps: dict,
    slope: float,
    sharpness: dict,
    cos4: dict,
    sign_cos: dict,
    trajectories: dict,
    checks5: dict,
    claim6: Claim,
    claim7: Claim,
    figures: list[str],
    warmup: int,
    per_epoch: int,
    rows6,
) -> str:
    """The report's body, its sections in the claims' order."""
    lines = (
        _identities_section(s, subset, ident, atm_rounds)
        + _gap_section(s, subset, gaps, slope, sharpness, figures)
        + _minibatch_section(s, subset, cos4, sign_cos, figures)
        + _trajectory_section(s, trajectories, checks5, warmup, per_epoch, figures)
        + _pipeline_section(claim6, claim7, rows6)
    )
    return "\n".join(lines) + "\n"
