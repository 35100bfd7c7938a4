"""Study ``provable`` (seed 004): Li, Zhang, Zhang, Chen, Liu and Wang, "When is task vector *provably* effective
for model editing? A generalization analysis of nonlinear Transformers" (ICLR 2025).

The seed's synthetic setting (its Section 3.2, Definition 2), on a small torch model of its own (no pipeline
outputs are read for it; it runs on the CPU in float32, in seconds):

- data: P tokens in R^d, unit norm. A task has one discriminative pattern mu; a sample's label y = +-1 is drawn with
  equal probability and it holds ``relevant`` tokens y*mu, ``confusion`` tokens -y*mu (fewer) and irrelevant tokens
  drawn uniformly from orthonormal directions v_j orthogonal to every pattern; positions are shuffled. The label
  is the majority sign of the tokens carrying mu, by construction.
- model (the seed's eq. 4 with W = W_K^T W_Q and V = W_O W_V): f(X) = 1/P sum_l a^T ReLU(V sum_s x_s
  softmax_s(x_s^T W x_l)); W (d x d) and V (m x d) start from N(0, init_std^2) -- that random model is the
  "pre-trained" Psi0 --, a (m) is frozen at +-1/sqrt(m) (one a for every position l).
- fine-tuning: hinge loss max(0, 1 - y f), SGD on fresh mini-batches; a task vector is (W - W0, V - V0).
- task relation: alpha = mu1^T mu2 (mu1 = e0, mu2 = alpha e0 + sqrt(1 - alpha^2) e1): 0 irrelevant, > 0 aligned,
  < 0 contradictory.

Claims (each verdict from the numbers; thresholds are settings, stated before the numbers):

1. fine-tuning reaches the accuracy threshold on every task (Theorem 1's first part);
2. addition, Psi0 + dPsi1 + lambda dPsi2 (Theorem 1): for alpha >= 0 both losses are small from about lambda = 1 - alpha
   up, and not below; for alpha < 0 no lambda of the grid makes both small;
3. negation, lambda < 0 (Theorem 2): it forgets task 2 while keeping task 1 for irrelevant and contradictory tasks,
   and no lambda < 0 does so for strongly aligned tasks;
4. out of domain, Psi0 + lambda1 dPsi1 + lambda2 dPsi2 on a target mu' = gamma1 mu1 + gamma2 mu2 + kappa mu_perp
   (Theorem 3, mu1 _|_ mu2): the sufficient condition (7) predicts success over a grid, the closed-form lambdas of
   the seed's (75)-(76) succeed, and the case proved impossible (all gamma_i equal and negative) fails;
5. low rank (Corollary 1): each update's top singular value holds most of its energy, its singular vectors align
   with mu, and rank-r task vectors do what the full ones do.

The seed's Colored-MNIST experiment (its Section 4.1, Tables 1-2), on the pipeline's real handwritten digits (the
``digits`` task, read with the pretrained backbone through ``context.layout``; not measured when ``suite.tasks`` lacks
it): parity tasks (odd = the seed's +1) whose grey ink is moved into the red or the green channel, a proportion r_o
of the odd digits red and r_e = 1 - r_o of the even ones. T1 has r_o = 0.95; T2 has 0.5 (irrelevant: colour
independent of parity), 0.9 (aligned) or 0.05 (contradictory), as in the seed. The backbone's last block is
fine-tuned (the blocks before it frozen, their tokens computed once) under one shared binary probe head; alpha-hat is
the seed's (11) on the fine-tuned models' outputs. Claims:

6. alpha-hat < 0 for the contradictory pair, > 0 for the aligned one, smallest in magnitude for the irrelevant one;
7. addition Psi0 + dPsi1 + lambda dPsi2 keeps both tasks at some lambda for irrelevant and aligned pairs, at none for
   the contradictory pair (Table 1);
8. negation (lambda < 0) forgets T2 while keeping T1 for irrelevant and contradictory pairs, not for aligned (Table 1);
9. out of domain (Table 2: r_o = 0.85, 0.05 and the target 0.9), Psi0 + lambda1 dPsi1 + lambda2 dPsi2 with the
   lambdas chosen on validation beats both fine-tuned models on the target.

The measurements are small pure functions (``make_data``, ``init_model``, ``forward``, ``finetune``, ``evaluate``,
``merge``, ``truncate``, ``top_energy``, ``residual``, ``alignment``, ``ood_condition``, ``closed_form_lambdas``;
``red_mask``, ``colour``, ``alpha_hat``, ``split_backbone``) and each claim's verdict a pure function of them
(``claim_*``). The seed's Phi-1.5 / Phi-3 experiments are not reproduced here.

The study is a package, a module per part: ``settings`` (every setting and threshold), ``model`` (the synthetic
setting: data, model, fine-tuning, low rank, out of domain), ``measure`` (its measurements), ``real`` (the real
digits), ``claims`` (the verdicts), ``figures``, ``_sections`` (the report's sections) and ``report`` (the study
function, registered as ``provable``).
"""

from __future__ import annotations

from mergeflow.studies.provable.claims import (
    SEED_ALPHA,
    SEED_TABLE1,
    SEED_TABLE2,
    addition_rows,
    claim_addition,
    claim_finetune,
    claim_low_rank,
    claim_negation,
    claim_ood,
    claim_real_addition,
    claim_real_alpha,
    claim_real_negation,
    claim_real_ood,
    low_rank_agreement,
    negation_rows,
    onset,
    ood_rows,
    real_ood_row,
    real_rows,
)
from mergeflow.studies.provable.figures import plot_addition, plot_ood, plot_real, plot_real_ood, plot_spectra
from mergeflow.studies.provable.measure import FineTune, Measurements, OodTarget, addition_map, measure
from mergeflow.studies.provable.model import (
    Params,
    alignment,
    closed_form_lambdas,
    delta,
    evaluate,
    finetune,
    forward,
    grid,
    hinge,
    impossible,
    init_model,
    irrelevant_directions,
    majority_sign,
    make_data,
    merge,
    ood_condition,
    patterns,
    residual,
    second_alignment,
    target_pattern,
    top_energy,
    truncate,
    truncate_params,
)
from mergeflow.studies.provable.real import (
    RealMeasurements,
    RealOod,
    RealPair,
    RealTask,
    alpha_hat,
    colour,
    measure_real,
    parity,
    real_skip_reason,
    red_mask,
    split_backbone,
    tail_outputs,
)
from mergeflow.studies.provable.report import provable_study
from mergeflow.studies.provable.settings import PAPER, RELATIONS, RESERVED, ProvableSettings

__all__ = [
    "FineTune",
    "Measurements",
    "OodTarget",
    "PAPER",
    "Params",
    "ProvableSettings",
    "RELATIONS",
    "RESERVED",
    "RealMeasurements",
    "RealOod",
    "RealPair",
    "RealTask",
    "SEED_ALPHA",
    "SEED_TABLE1",
    "SEED_TABLE2",
    "addition_map",
    "addition_rows",
    "alignment",
    "alpha_hat",
    "claim_addition",
    "claim_finetune",
    "claim_low_rank",
    "claim_negation",
    "claim_ood",
    "claim_real_addition",
    "claim_real_alpha",
    "claim_real_negation",
    "claim_real_ood",
    "closed_form_lambdas",
    "colour",
    "delta",
    "evaluate",
    "finetune",
    "forward",
    "grid",
    "hinge",
    "impossible",
    "init_model",
    "irrelevant_directions",
    "low_rank_agreement",
    "majority_sign",
    "make_data",
    "measure",
    "measure_real",
    "merge",
    "negation_rows",
    "onset",
    "ood_condition",
    "ood_rows",
    "parity",
    "patterns",
    "plot_addition",
    "plot_ood",
    "plot_real",
    "plot_real_ood",
    "plot_spectra",
    "provable_study",
    "real_ood_row",
    "real_rows",
    "real_skip_reason",
    "red_mask",
    "residual",
    "second_alignment",
    "split_backbone",
    "tail_outputs",
    "target_pattern",
    "top_energy",
    "truncate",
    "truncate_params",
]
