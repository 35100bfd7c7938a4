"""Study ``provable``'s report body: the synthetic setting's sections (claims 1-5) and the real digits' (claims
6-9), a function per section."""

from __future__ import annotations

import math
from typing import Any

from mergeflow.studies.provable.claims import (
    SEED_ALPHA,
    SEED_TABLE1,
    SEED_TABLE2,
    _g,
    addition_rows,
    low_rank_agreement,
    negation_rows,
    ood_rows,
    real_ood_row,
    real_rows,
)
from mergeflow.studies.provable.measure import Measurements
from mergeflow.studies.provable.real import RealMeasurements
from mergeflow.studies.provable.settings import RESERVED, ProvableSettings


def _f(v: float | None, digits: int = 3) -> str:
    return "—" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.{digits}f}"


def _setting_section(m: Measurements, s: ProvableSettings, seed: int) -> list[str]:
    """The seed's synthetic setting as run here, and the thresholds."""
    M = s.d - RESERVED
    return [
        "## Setting",
        "",
        f"The seed's synthetic setting (Section 3.2, Definition 2) on a "
        f"model of our own, trained here (no pipeline outputs are read), "
        f"on the CPU in float32, seed {seed}. Tokens in R^{s.d}: per sample "
        f"{s.relevant} tokens yμ, {s.confusion} confusion tokens −yμ and "
        f"{s.tokens - s.relevant - s.confusion} tokens drawn from M = {M} "
        f"orthonormal irrelevant directions (e3 … e{s.d - 1}), shuffled. "
        "Model (eq. 4, W = W_Kᵀ W_Q, V = W_O W_V): one single-head attention layer, then a two-layer ReLU MLP of "
        f"width m = {s.m} whose output "
        "layer a is frozen at ±1/√m (one a for every position). Ψ0 is the random initialisation (entries N(0, "
        f"{s.init_std:g}²)). Each fine-tune: "
        f"hinge loss, SGD of step {s.lr:g} on {s.steps} fresh batches "
        f"of {s.batch}; a task vector is (ΔW, ΔV). μ1 = e0 and "
        f"μ2 = α e0 + √(1−α²) e1, α ∈ {{{', '.join(f'{a:g}' for a in m.alphas)}}}; losses and accuracies on "
        f"{s.test_examples} fresh test samples per task.",
        "",
        "Thresholds, fixed before the numbers: a loss is *small* at most "
        f"{s.small_loss:g} (a tenth of Ψ0's ≈ 1) and *large* (forgotten) "
        f"at least {s.large_loss:g}; claim 2's onset λ* must be within "
        f"{s.lambda_tolerance:g} of 1 − α; claim 3 judges aligned tasks from α ≥ {s.negation_aligned_min:g} (Theorem 2 "
        "(C) allows unlearning for small α > 0); "
        f"claim 4 uses the seed's β = {s.ood_beta:g}, c = {s.ood_c:g} with "
        "the hinge margin 1 in (7), and judges (7) as a sufficient condition "
        f"(precision ≥ {s.ood_precision:g}; recall reported); claim 5: top energy > {s.energy_min:g}, |cos| > "
        f"{s.alignment_min:g}, rank {s.low_rank}, "
        f"agreement ≥ {100 * s.low_rank_agreement:g}%.",
        "",
    ]


def _finetunes_section(m: Measurements, s: ProvableSettings, figures: list[str]) -> list[str]:
    """Claims 1 and 5: each fine-tune's accuracy and loss, and its updates' spectra and alignment."""
    lines = [
        "## Fine-tunes and their updates (claims 1 and 5)",
        "",
        "| task | test acc % | test loss | Ψ0 loss | top energy ΔW | top energy ΔV | R(1) ΔW | R(1) ΔV | \\|cos(u1, "
        f"μ)\\| ΔW | \\|cos(v1, μ)\\| ΔW | \\|cos(v1, μ)\\| ΔV | rank-{s.low_rank} loss | rank-{s.low_rank} acc % |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for ft in m.finetunes:
        sp = ft.spectrum()
        lines.append(
            f"| {ft.name} | {100 * ft.accuracy:.1f} | {ft.loss:.3f} | {ft.pretrained_loss:.3f} | {sp['energy_W']:.3f} "
            f"| {sp['energy_V']:.3f} | {sp['residual1_W']:.3f} | "
            f"{sp['residual1_V']:.3f} | {sp['align_W_left']:.4f} | {sp['align_W_right']:.4f} | "
            f"{sp['align_V_right']:.4f} | {ft.low_rank_loss:.3f} | {100 * ft.low_rank_accuracy:.1f} |"
        )
    lines += [
        "",
        "R(r) = ‖Δ − rank-r truncation‖_F / ‖Δ‖_F. u1, v1: the top left and right singular vectors.",
        "",
        "ΔV's second singular direction, against the mean irrelevant "
        "direction v̄ = Σ v_j / ‖Σ v_j‖ (every sample's irrelevant tokens "
        "average to it, so it acts as a bias the neurons learn): |cos(v2, v̄)| per task "
        + ", ".join(f"{ft.name} {ft.spectrum()['second_V_irrelevant_mean']:.4f}" for ft in m.finetunes)
        + "; R(2) of ΔV at most "
        + f"{max(ft.spectrum()['residual2_V'] for ft in m.finetunes):.4f}.",
        "",
    ]
    if "spectra.png" in figures:
        lines += ["![spectra of the updates](spectra.png)", ""]
    return lines


def _addition_section(m: Measurements, s: ProvableSettings, figures: list[str]) -> list[str]:
    """Claims 2 and 3: the onset of addition and the negation's lambdas per alpha, with the maps."""
    lines = [
        "## Addition and negation over (α, λ) (claims 2 and 3)",
        "",
        "Why 1 − α (as in the seed's proofs, e.g. its bound (65) on task 2's loss): a fine-tune stops moving once its "
        "hinge margin reaches 1, and ΔΨ2 acts on task 1's "
        "pattern through μ1ᵀμ2 = α, so on task 2 the merged model's margin "
        "is about α + λ and on task 1 about 1 + λα, each in units of one "
        "fine-tune's margin. Both small needs λ ≳ 1 − α (task 2) and, for "
        "α < 0, λ|α| small (task 1): the two meet only when |α| is small.",
        "",
        "Ψ = Ψ0 + ΔΨ1 + λ ΔΨ2, λ from "
        f"{s.lambda_min:g} to {s.lambda_max:g} by {s.lambda_step:g}. λ*: the smallest λ from which both losses are "
        "small at every larger λ of the grid. "
        "Negation: the λ < 0 with task 1's loss small and task 2's large.",
        "",
        f"| α | relation | λ* (full) | 1 − α | λ* (rank {s.low_rank}) | min over λ of max(L1, L2) | claim 2 | "
        "negation: λ < 0 that forget task 2 and keep task 1 | best (λ, L1, L2) | claim 3 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    add, neg = addition_rows(m, s), negation_rows(m, s)
    add_lr = addition_rows(m, s, m.low_rank_loss1, m.low_rank_loss2)
    for a, n, lr in zip(add, neg, add_lr):
        rel = "irrelevant" if a["alpha"] == 0 else "aligned" if a["alpha"] > 0 else "contradictory"
        lams = "none" if not n["lambdas"] else f"[{min(n['lambdas']):g}, {max(n['lambdas']):g}] ({len(n['lambdas'])})"
        best = (
            "—"
            if n["best"] is None
            else f"({n['best']['lambda']:g}, {n['best']['loss1']:.3f}, {n['best']['loss2']:.3f})"
        )
        c3 = "not judged" if n["ok"] is None else ("ok" if n["ok"] else "off")
        lines.append(
            f"| {a['alpha']:g} | {rel} | {_g(a['onset'])} | {a['bound']:g} | {_g(lr['onset'])} | "
            f"{a['min_max_loss']:.3f} | {'ok' if a['ok'] else 'off'} | {lams} | {best} | {c3} |"
        )
    lines.append("")
    if "addition.png" in figures:
        lines += ["![losses over (alpha, lambda)](addition.png)", ""]
    if "addition_low_rank.png" in figures:
        lines += [
            f"The same map with rank-{s.low_rank} task vectors (claim 5's agreement: "
            f"{100 * low_rank_agreement(m, s):.1f}% of the cells):",
            "",
            "![losses over (alpha, lambda), low rank](addition_low_rank.png)",
            "",
        ]
    return lines


def _ood_section(m: Measurements, s: ProvableSettings, figures: list[str]) -> list[str]:
    """Claim 4: condition (7) against the measured losses per target, and the seed's closed form."""
    lines = [
        "## Out of domain (claim 4)",
        "",
        "μ1 = e0 and μ2 = e1 (the α = 0 pair's task vectors), target "
        "μ' = γ1 μ1 + γ2 μ2 + κ e2; Ψ = Ψ0 + λ1 ΔΨ1 + λ2 ΔΨ2 over "
        f"[{s.ood_lambda_min:g}, {s.ood_lambda_max:g}]² by {s.ood_lambda_step:g}. "
        "(7): Σ λi γi ≥ 1 + c, Σ λi γi² ≥ 1 + c, |λi| β ≤ c. "
        "Closed form: the seed's (75)-(76) as printed.",
        "",
        "| γ1 | γ2 | κ | cells (7) holds | cells loss small | both | precision | recall | min loss | closed-form (λ1, "
        "λ2) | satisfies (7) | its loss | its acc % | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in ood_rows(m, s):
        g1, g2 = r["gammas"]
        kappa = math.sqrt(max(0.0, 1 - g1 * g1 - g2 * g2))
        cf = "undefined" if r["closed_form"] is None else f"({r['closed_form'][0]:.3f}, {r['closed_form'][1]:.3f})"
        acc = "—" if r["closed_form_accuracy"] is None else f"{100 * r['closed_form_accuracy']:.1f}"
        lines.append(
            f"| {g1:g} | {g2:g} | {kappa:.3f} | {r['predicted']} | {r['succeeded']} | {r['both']} | "
            f"{_f(r['precision'], 2)} | {_f(r['recall'], 2)} | {r['min_loss']:.3f} | {cf} | "
            f"{'yes' if r['closed_form_satisfies_7'] else 'no'} | {_f(r['closed_form_loss'])} | {acc} | "
            f"{'ok' if r['ok'] else 'off'}{' (impossible case)' if r['impossible'] else ''} |"
        )
    lines += [
        "",
        "(76) as printed makes Σ λi γi = 1 + c exactly and Σ λi γi² "
        "= (1 + c)·√(Σγ⁴/Σγ²), which is below 1 + c whenever Σγ² ≤ 1 "
        "(μ' of unit norm), so the closed form need not satisfy (7)'s second "
        "line; the column *satisfies (7)* says where it does not, and "
        "claim 4 judges the closed form by its measured loss.",
        "",
    ]
    if "out_of_domain.png" in figures:
        lines += ["![out-of-domain losses](out_of_domain.png)", ""]
    return lines


def synthetic_body(m: Measurements, s: ProvableSettings, seed: int, figures: list[str]) -> str:
    """The synthetic setting's part of the report (claims 1-5), its sections in order."""
    return "\n".join(
        _setting_section(m, s, seed)
        + _finetunes_section(m, s, figures)
        + _addition_section(m, s, figures)
        + _ood_section(m, s, figures)
    )


def _real_setting(rm: RealMeasurements, s: ProvableSettings, params: Any) -> list[str]:
    """The real digits' tasks, the model and its shared head, alpha-hat, and the thresholds."""
    n = rm.images
    return [
        f"The seed's Section 4.1 on the pipeline's `{rm.task}` task (sklearn's real handwritten digits, upsampled with "
        "a random affine; grey ink on black), "
        f"{n['train']} / {n['val']} / {n['test']} train / validation / test images. A task is parity (odd: class 1, "
        "the seed's +1; even: class 0). Each image's "
        "ink (its channels' mean) goes into the red or the green channel, the others black; in a task with r_o, "
        "exactly round(r_o · n_odd) of the odd digits "
        "and round(r_e · n_even) of the even ones are red, r_e = 1 − r_o as in the seed, drawn uniformly (one fixed "
        "draw per r_o and split, seeded from "
        f"`seed`). Every task colours the same digit images; only the colours differ. T1 has r_o = {s.real_r_t1:g}; "
        "T2's r_o makes the relation.",
        "",
        f"Model: the pipeline's pretrained backbone (`{params.backbone.model}`, {rm.depth} blocks) with its last "
        f"{rm.blocks} block(s) and final norms fine-tuned "
        "and the blocks before them frozen (their tokens are computed once per image and colour). The seed fine-tunes "
        "all of a ViT-Small; here a "
        "full fine-tune costs about four times as much per step, and the tuned block is one attention layer and an "
        "MLP, the shape of the seed's "
        "theoretical model. One binary head shared by every task: the pipeline's probe (logistic regression, C chosen "
        "on validation) on Ψ0's features "
        f"of digits coloured independently of parity (r_o = 0.5), C = {rm.probe['C']:g}, validation accuracy "
        f"{100 * rm.probe['val_accuracy']:.1f} %, frozen "
        f"while fine-tuning as in the pipeline. Each fine-tune: `finetune`'s schedule ({params.finetune.optimizer}, "
        f"{rm.steps} steps of {params.finetune.batch_size}, "
        f"lr {params.finetune.lr:g}, warm-up then cosine), cross-entropy, without the pipeline's feature preservation "
        "(the seed fine-tunes plainly). "
        "A task vector ΔΨ is the change of the tuned block(s).",
        "",
        "α̂ is the seed's (11): the mean over each test set of the cosine between the two fine-tuned models' centred "
        "outputs (the head's two logits), "
        "averaged over both test sets. With one binary head the two logits are ±z/2, so each cosine is the sign "
        "agreement of the centred margins, and "
        "α̂ is the rate at which the two models agree minus the rate at which they disagree.",
        "",
        f"Thresholds, fixed before the numbers and set so that the seed's own Table 1 meets claims 7-8: a task is "
        f"*kept* when its accuracy is within "
        f"{s.real_keep:g} points of its fine-tuned model's, and *forgotten* when it falls by at least "
        f"{s.real_forget:g} points; claim 9 asks for a gain of "
        f"{s.real_ood_gain:g} points, with (λ1, λ2) chosen on T''s validation split (the seed chose on the test set: "
        "that choice is reported too).",
        "",
    ]


def _real_tasks_section(rm: RealMeasurements, s: ProvableSettings) -> list[str]:
    """Claim 6: each relation's construction and alpha-hat beside the seed's; each task's accuracies."""
    lines = [
        "| relation | the seed's construction | T1 r_o | T2 r_o | "
        "T2's red share, odd / even (train) | α̂ | the seed's α̂ |",
        "|---|---|---|---|---|---|---|",
    ]
    how = {
        "irrelevant": "colour tracks parity in T1, is independent of it in T2",
        "aligned": "colour tracks parity the same way in both",
        "contradictory": "the colour-parity correspondence is the opposite in T2",
    }
    for p in rm.pairs:
        sh = rm.tasks[p.r_o].red_share
        lines.append(
            f"| {p.relation} | {how[p.relation]} | {s.real_r_t1:g} | {p.r_o:g} | {sh['odd']:.3f} / {sh['even']:.3f} | "
            f"{p.alpha_hat:.3f} | {SEED_ALPHA[p.relation]:g} |"
        )
    lines += [
        "",
        "| task r_o | Ψ0 test acc % | fine-tuned test acc % | share of the test set a colour-only rule gets right |",
        "|---|---|---|---|",
    ]
    for r, t in sorted(rm.tasks.items(), reverse=True):
        lines.append(
            f"| {r:g} | {100 * t.pretrained_accuracy:.1f} | {100 * t.accuracy:.1f} | {100 * max(r, 1 - r):.0f} % |"
        )
    return lines + [""]


def _real_table1_section(rm: RealMeasurements, s: ProvableSettings, figures: list[str]) -> list[str]:
    """Claims 7-8: the seed's Table 1 beside ours, and the lambdas that keep both tasks or forget T2."""
    lines = [
        "Table 1, ours beside the seed's: test accuracy % of Ψ = Ψ0 + ΔΨ1 + λ ΔΨ2 on T1 and T2, λ ∈ "
        f"{{{s.real_lambda_min:g}, {s.real_lambda_min + s.real_lambda_step:g}, …, {s.real_lambda_max:g}}}, the best λ "
        "by the largest sum (multi-task) or "
        "gap (unlearning) of the two accuracies, in brackets the difference to each fine-tuned model.",
        "",
        "| relation | goal | best λ | T1 acc | T2 acc | the seed's best λ | its T1 acc | its T2 acc |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows = real_rows(rm, s)
    for r in rows:
        for goal, key in (("multi-task", "multi_task"), ("unlearning", "unlearning")):
            o, sd = r[key], SEED_TABLE1[r["relation"]][goal]
            lines.append(
                f"| {r['relation']} | {goal} | {o['lambda']:g} | {o['acc1']:.2f} "
                f"({o['gap1']:+.2f}) | {o['acc2']:.2f} ({o['gap2']:+.2f}) | "
                f"{sd[0]:g} | {sd[1]:.2f} ({sd[2]:+.2f}) | {sd[3]:.2f} ({sd[4]:+.2f}) |"
            )
    lines += [
        "",
        "| relation | λ keeping both tasks (claim 7) | λ < 0 keeping T1 "
        "and forgetting T2 (claim 8) | largest T2 drop at λ < 0, points |",
        "|---|---|---|---|",
    ]
    for r in rows:
        keep = ", ".join(f"{v:g}" for v in r["keep_both"]) or "none"
        forget = ", ".join(f"{v:g}" for v in r["forget"]) or "none"
        lines.append(f"| {r['relation']} | {keep} | {forget} | {r['largest_drop_below_0']:.1f} |")
    lines.append("")
    if "real.png" in figures:
        lines += ["![accuracy over lambda on the real digits](real.png)", ""]
    return lines


def _real_table2_section(rm: RealMeasurements, s: ProvableSettings, figures: list[str]) -> list[str]:
    """Claim 9: the seed's Table 2 beside ours (nothing when the out-of-domain part was not run)."""
    if rm.ood is None:
        return []
    o = real_ood_row(rm.ood)
    st = SEED_TABLE2
    lines = [
        "Table 2, ours beside the seed's: T1, T2 and the target T' with r_o = "
        f"{', '.join(f'{v:g}' for v in rm.ood.r_o)} (the seed's); Ψ = Ψ0 + λ1 ΔΨ1 + λ2 ΔΨ2 over "
        f"[{s.real_ood_lambda_min:g}, {s.real_ood_lambda_max:g}]² by "
        f"{s.real_ood_lambda_step:g} (the seed's step: 0.2). α̂(T1, T2) = {o['alpha12']:.3f} (the seed's "
        f"{st['alpha12']:g}); γ1 = α̂(T1, T') = {o['gammas'][0]:.3f}, "
        f"γ2 = α̂(T2, T') = {o['gammas'][1]:.3f} (the seed's {st['gammas'][0]:g}, {st['gammas'][1]:g}).",
        "",
        "| | fine-tuning on T' | Ψ*_T1 (1, 0) | Ψ*_T2 (0, 1) | (λ1, λ2) chosen on validation | best (λ1, λ2) on test |",
        "|---|---|---|---|---|---|",
        f"| ours, T' test acc % | {o['finetuned']:.2f} | {o['T1']:.2f} | {o['T2']:.2f} | ({o['chosen'][0]:g}, "
        f"{o['chosen'][1]:g}): {o['chosen_test']:.2f} | "
        f"({o['test_best'][0]:g}, {o['test_best'][1]:g}): {o['test_best_acc']:.2f} |",
        f"| the seed's | {st['fine-tuning']:.2f} | {st['T1']:.2f} | {st['T2']:.2f} | — | ({st['search'][0][0]:g}, "
        f"{st['search'][0][1]:g}): {st['search'][1]:.2f} |",
        "",
    ]
    if "real_ood.png" in figures:
        lines += ["![out of domain on the real digits](real_ood.png)", ""]
    return lines


def real_body(rm: RealMeasurements | None, s: ProvableSettings, params: Any, reason: str, figures: list[str]) -> str:
    """The real digits' part of the report (claims 6-9), its sections in order; why not, when not measured."""
    lines = ["## Real digits: the seed's Colored-MNIST experiment (claims 6-9)", ""]
    if rm is None:
        return "\n".join(lines + [f"Not measured: {reason}.", ""])
    return "\n".join(
        lines
        + _real_setting(rm, s, params)
        + _real_tasks_section(rm, s)
        + _real_table1_section(rm, s, figures)
        + _real_table2_section(rm, s, figures)
    )
