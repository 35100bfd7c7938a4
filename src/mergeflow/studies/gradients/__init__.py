"""Seed 000: Zhou, Solombrino, Crisostomi, Bucarelli, Silvestri and Rodolà, "On Task Vectors and Gradients".

Proposition 1 / Remark 1: after one epoch of full-batch gradient descent (GD) at step size eta, a task vector is
tau_t(1) = -eta * grad Lbar_t(theta0), so theta0 + alpha * sum_t tau_t(1) is one multi-task GD step at step size
alpha * eta; Theorem 1: after k >= 2 epochs, theta_TA(k) - theta_MT(k) = O(eta^2). Section 2.1: the first epoch's
update dominates the fine-tuning trajectory in norm and direction (Fig. 3), and merging one-epoch task vectors is
about as good as merging converged ones (Fig. 2). Section 3.1, reading ATM (Zhou et al., arXiv:2411.03055): at a
fixed budget, more rounds of shorter fine-tunes merge better than one-shot task arithmetic, TIES or Breadcrumbs.

Claims 1-5 are measured here, on the suite's own tasks, backbone and heads: the identities through the pipeline's
own trainer (mergeflow.ml.regimes._finetune.finetune_trainer, under the registered regimes one_epoch and atm) against
gradients computed by plain autograd, both on the CPU in float32 (on CUDA the trainer autocasts to bfloat16); the
eta^2 scaling by an exact float64 GD loop on the CPU; the AdamW and per-epoch measurements through the trainer and
training.finetune on ``context.device``. Claims 6-7 read the pipeline's regime outputs
(metrics/regime/<regime>.json and the regimes' merges), and are "not measured" when those regimes did not run.

The measurements are small pure functions (``loss_gradient``, ``gd_steps``, ``one_epoch_identity``,
``atm_identity``, ``ta_mt_gaps``, ``log_slope``, ``minibatch_cosines``, ``epoch_updates``) and the verdicts of
claims 6-7 are pure functions of the metrics dictionaries (``claim_one_epoch_merge``, ``claim_atm_budget``).

The study is a package, a module per part: ``settings``, ``measure`` (claims 1-5's measurements), ``pipeline``
(claims 6-7 from the pipeline's outputs), ``figures``, ``_sections`` (the report's sections) and ``report`` (the
study function, registered as ``gradients``).
"""

from __future__ import annotations

from mergeflow.studies.gradients.figures import plot_gaps, plot_minibatch, plot_trajectory
from mergeflow.studies.gradients.measure import (
    _flat,
    atm_identity,
    cosine,
    directional_curvature,
    epoch_updates,
    errors,
    float32_floor,
    gd_steps,
    log_slope,
    loss_gradient,
    minibatch_cosines,
    one_epoch_identity,
    sub,
    ta_mt_gaps,
    trajectory_claim,
)
from mergeflow.studies.gradients.pipeline import (
    BASELINES,
    _pipeline_claim_6,
    _pipeline_claim_7,
    claim_atm_budget,
    claim_one_epoch_merge,
    one_epoch_rows,
)
from mergeflow.studies.gradients.report import gradients
from mergeflow.studies.gradients.settings import PAPER, GradFn, GradientsSettings, State

__all__ = [
    "BASELINES",
    "GradFn",
    "GradientsSettings",
    "PAPER",
    "State",
    "_flat",
    "_pipeline_claim_6",
    "_pipeline_claim_7",
    "atm_identity",
    "claim_atm_budget",
    "claim_one_epoch_merge",
    "cosine",
    "directional_curvature",
    "epoch_updates",
    "errors",
    "float32_floor",
    "gd_steps",
    "gradients",
    "log_slope",
    "loss_gradient",
    "minibatch_cosines",
    "one_epoch_identity",
    "one_epoch_rows",
    "plot_gaps",
    "plot_minibatch",
    "plot_trajectory",
    "sub",
    "ta_mt_gaps",
    "trajectory_claim",
]
