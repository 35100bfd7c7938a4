"""Study ``provable``: the study function, registered as ``provable`` (``_sections`` writes the report's body)."""

from __future__ import annotations

from pathlib import Path

from mergeflow.studies import StudyContext, StudyResult, register
from mergeflow.studies.provable._sections import real_body, synthetic_body
from mergeflow.studies.provable.claims import (
    claim_addition,
    claim_finetune,
    claim_low_rank,
    claim_negation,
    claim_ood,
    claim_real_addition,
    claim_real_alpha,
    claim_real_negation,
    claim_real_ood,
)
from mergeflow.studies.provable.figures import plot_addition, plot_ood, plot_real, plot_real_ood, plot_spectra
from mergeflow.studies.provable.measure import measure
from mergeflow.studies.provable.real import measure_real, real_skip_reason
from mergeflow.studies.provable.settings import PAPER, ProvableSettings


@register(
    "provable",
    paper=PAPER,
    title="When is task vector provably effective? The seed's synthetic setting "
    "and its Colored-MNIST experiment on the real digits, measured",
    settings=ProvableSettings,
    claims={
        "004.1": "finetune_learns_each",
        "004.2": "addition_keeps_both",
        "004.3": "negation_forgets_one",
        "004.4": "ood_condition_predicts",
        "004.5": "updates_low_rank",
        "004.6": "real_alpha_signs",
        "004.7": "real_addition",
        "004.8": "real_negation",
        "004.9": "real_out_of_domain",
    },
)
def provable_study(context: StudyContext) -> StudyResult:
    s: ProvableSettings = context.settings
    seed = int(context.params.seed)
    m = measure(s, seed)
    # the cost goes to the stage's log, not the report: the report's bytes must not change with the machine's load
    t = m.seconds
    print(
        f"study provable: fine-tunes {t['finetune']:.1f} s, addition maps {t['addition_maps']:.1f} s, out-of-domain "
        f"grids {t['out_of_domain']:.1f} s (torch threads: {int(t['threads'])})",
        flush=True,
    )
    reason = real_skip_reason(context.params, context.layout, s)
    rm = None if reason else measure_real(context.params, context.layout, s)
    if rm is not None:
        print(f"study provable: real digits (Colored-MNIST) {rm.seconds:.1f} s", flush=True)
    claims = [
        claim_finetune(m, s),
        claim_addition(m, s),
        claim_negation(m, s),
        claim_ood(m, s),
        claim_low_rank(m, s),
        claim_real_alpha(rm, s, reason or ""),
        claim_real_addition(rm, s, reason or ""),
        claim_real_negation(rm, s, reason or ""),
        claim_real_ood(rm, s, reason or ""),
    ]
    out = Path(context.out_dir)
    figures = ["addition.png", "addition_low_rank.png", "out_of_domain.png", "spectra.png"]
    plot_addition(m, s, out / figures[0])
    plot_addition(m, s, out / figures[1], low_rank=True)
    plot_ood(m, s, out / figures[2])
    plot_spectra(m, s, out / figures[3])
    if rm is not None:
        figures.append("real.png")
        plot_real(rm, s, out / "real.png")
        if rm.ood is not None:
            figures.append("real_ood.png")
            plot_real_ood(rm.ood, out / "real_ood.png")
    body = (
        synthetic_body(m, s, seed, figures)
        + "\n"
        + real_body(rm, s, context.params, reason or "", figures)
        + "\nNot reproduced: the seed's Phi-1.5 / Phi-3 unlearning experiments.\n"
    )
    return StudyResult(claims=claims, body=body, figures=figures)
