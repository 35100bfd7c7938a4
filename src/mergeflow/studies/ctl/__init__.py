"""Study ``ctl`` (seed 003, Zhou, Chen, Chen, Zhang, Yan 2024, "Cross-Task Linearity Emerges in the
Pretraining-Finetuning Paradigm", arXiv:2402.03660): do the seed's measurements hold on our suite? It reads the
standard fine-tune's outputs (models/pretrained, models/finetuned, models/heads, data/tasks and, for lambda,
metrics/merge/task_arithmetic.json) and measures features itself; the only training is claim 8's four short runs.

f_l(theta; x) is block l's output (every token: [tokens x width] flattened), hooked on the backbone's
``net.blocks`` (timm ViT). For a model feature F and a target feature G built from other models' features, per x:

    d = 1 - cos(F, G),    coef = ||F|| cos(F, G) / ||G||    (the seed's 1 - cosine and coef; both per example)

Claims (the seed's sections; every "d_l small" reads: mean d_l <= ``ctl_ratio`` x mean baseline_l at every layer):

1. CTL (Sec. 4.1, Fig. 2): F = f_l(alpha theta_i + (1 - alpha) theta_j), G = alpha f_l(theta_i) + (1 - alpha)
   f_l(theta_j), x in D_i u D_j, alpha in {0.25, 0.5, 0.75}; baseline 1 - cos(f_l(theta_i), f_l(theta_j)).
2. The coefficient is about 1 (Fig. 3): median coef within 1 +- ``coef_tolerance`` at every layer and alpha.
3. Averaging k = 3..5 models (Sec. 4.2, eq. 1, Figs. 5-6): F = f_l(mean theta), G = mean f_l(theta_t), x in the
   union of their tasks; baseline mean_t (1 - cos(F, f_l(theta_t))). The seed averages models fine-tuned on one
   task with different hyperparameters; ours are fine-tuned on different tasks (Lemma 2's setting).
4. Addition (Sec. 4.3, eq. 2, Figs. 7-8): F = f_l(theta0 + lam (tau_i + tau_j)), G = (f_l(theta0 + 2 lam tau_i) +
   f_l(theta0 + 2 lam tau_j)) / 2 on D_i u D_j; baseline 1 - cos(f_l(theta0 + 2 lam tau_i), f_l(theta0 + 2 lam tau_j)).
5. Negation (eq. 3): F = f_l(theta0), G = (f_l(theta0 + lam tau_i) + f_l(theta0 - lam tau_i)) / 2 on D_i; baseline
   1 - cos(f_l(theta0 + lam tau_i), f_l(theta0 - lam tau_i)). The report adds eq. 4, f_l(theta0 - lam tau_i) against
   f_l(theta0) - Delta_l with Delta_l = f_l(theta0 + lam tau_i) - f_l(theta0), and the first-order reading
   f_l(theta0) - lam (f_l(theta_i) - f_l(theta0)) (shown, not judged).
6. CTL holds without linear mode connectivity (Sec. 4.1): the loss barrier on D_i u D_j at alpha = 0.5,
   L(theta_0.5) - (L(theta_i) + L(theta_j)) / 2, each example scored by its own task's head (the pipeline's frozen
   heads), exceeds ``barrier_tolerance`` (mean over pairs), and claim 1 holds.
7. Stitching (Sec. 4.3, Fig. 9): theta0's blocks after layer l fed (f_l(theta0 + lam tau_i) + f_l(theta0 + lam
   tau_j)) / 2 do both tasks: over the pairs and both tasks, the stitched average recovers at least
   ``stitch_recovery`` of the gap between the other task's single stitched model and the task's own,
   sum(avg - other) / sum(own - other).
8. Without pretraining CTL is much weaker (Sec. 5, App. B.3, Fig. 11): one pair trained from a common random init
   with the pipeline's fine-tune schedule (no feature anchor: there are no pretrained features to keep), against
   the same pair fine-tuned from theta0 with the same schedule; d_l at alpha = 0.5, mean over layers, must be at
   least ``weaker_factor`` times larger from scratch. Both runs keep each task's head from models/heads frozen,
   the pipeline's protocol, so the init is the only difference.

lam is metrics/merge/task_arithmetic.json's chosen ``hyperparameters.lam`` when that file exists, else ``lam``
(setting). Wall times go to stdout (the stage's log), never into the report or the claims' numbers.

The study is a package, a module per part: ``settings``, ``metric`` (the measure and the forward hooks),
``measure`` (the measurements on the pipeline's models), ``claims`` (the summaries and the verdicts),
``figures``, ``_sections`` (the report's sections) and ``report`` (the study function, registered as ``ctl``).
"""

from __future__ import annotations

from mergeflow.studies.ctl.claims import (
    claim_addition,
    claim_average,
    claim_barrier,
    claim_coef,
    claim_ctl,
    claim_negation,
    claim_scratch,
    claim_stitching,
    quartiles,
    small_against_baseline,
    summarise,
)
from mergeflow.studies.ctl.figures import (
    ALPHA_COLOURS,
    plot_arithmetic,
    plot_barrier,
    plot_ctl,
    plot_scratch,
    plot_stitching,
)
from mergeflow.studies.ctl.measure import (
    Suite,
    choose_pairs,
    choose_subset,
    measure_average,
    measure_negation,
    measure_pair,
    measure_stitching,
    pipeline_lam,
    train_pair,
)
from mergeflow.studies.ctl.metric import (
    Probe,
    addition_terms,
    average_terms,
    combine,
    cosine_rows,
    ctl_terms,
    linearity,
    loss_barrier,
    mix,
    negation_terms,
    recovery,
)
from mergeflow.studies.ctl.report import ctl_at, ctl_study
from mergeflow.studies.ctl.settings import PAPER, CtlSettings, State

__all__ = [
    "ALPHA_COLOURS",
    "CtlSettings",
    "PAPER",
    "Probe",
    "State",
    "Suite",
    "addition_terms",
    "average_terms",
    "choose_pairs",
    "choose_subset",
    "claim_addition",
    "claim_average",
    "claim_barrier",
    "claim_coef",
    "claim_ctl",
    "claim_negation",
    "claim_scratch",
    "claim_stitching",
    "combine",
    "cosine_rows",
    "ctl_at",
    "ctl_study",
    "ctl_terms",
    "linearity",
    "loss_barrier",
    "measure_average",
    "measure_negation",
    "measure_pair",
    "measure_stitching",
    "mix",
    "negation_terms",
    "pipeline_lam",
    "plot_arithmetic",
    "plot_barrier",
    "plot_ctl",
    "plot_scratch",
    "plot_stitching",
    "quartiles",
    "recovery",
    "small_against_baseline",
    "summarise",
    "train_pair",
]
