"""Study ``gradients``: the study function, registered as ``gradients``, and its claims' measurements
(``_sections`` writes the report's body)."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mergeflow.config import task_seed
from mergeflow.core.errors import MergeflowError
from mergeflow.studies import Claim, StudyContext, StudyResult, register
from mergeflow.studies.gradients._sections import _sci, report_body
from mergeflow.studies.gradients.figures import plot_gaps, plot_minibatch, plot_trajectory
from mergeflow.studies.gradients.measure import (
    _flat,
    atm_identity,
    cosine,
    directional_curvature,
    epoch_updates,
    log_slope,
    loss_gradient,
    minibatch_cosines,
    one_epoch_identity,
    ta_mt_gaps,
    trajectory_claim,
)
from mergeflow.studies.gradients.pipeline import _pipeline_claim_6, _pipeline_claim_7, one_epoch_rows
from mergeflow.studies.gradients.settings import PAPER, GradFn, GradientsSettings

if TYPE_CHECKING:
    import torch


@dataclass
class _Setup:
    """What every claim's measurement reads: the settings, theta0 and its backbone, each task's data, head, seed and
    training examples, the full-batch GD trainer, and the tasks of the costlier claims (``subset``)."""

    params: Any
    layout: Any
    s: GradientsSettings
    device: Any
    theta0: dict
    backbone: Any
    tasks: dict
    heads: dict
    seeds: dict
    sets: dict
    subset: list[str]
    all_tasks: list[str]
    gd_trainer: Any

    def train_set(self, t: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tasks[t].train.inputs[:n], self.tasks[t].train.labels[:n]

    def grad_fn(self, t: str, n: int, dtype=None) -> GradFn:
        import torch

        x, y = self.train_set(t, n)
        return lambda state: loss_gradient(
            self.backbone, self.heads[t], x, y, state, chunk=self.s.chunk, dtype=dtype or torch.float32
        )


def _setup(context: StudyContext) -> _Setup:
    import torch

    from mergeflow.core.io import load_state_dict
    from mergeflow.ml import data as data_mod
    from mergeflow.ml.models import build_backbone, load_head
    from mergeflow.ml.regimes import finetune_trainer

    params, layout, s = context.params, context.layout, context.settings
    all_tasks = list(params.suite.tasks)
    subset = list(s.tasks) if s.tasks is not None else all_tasks[:4]
    unknown = [t for t in subset if t not in all_tasks]
    if unknown:
        raise MergeflowError(
            f"studies.gradients.tasks: unknown task '{unknown[0]}' (suite.tasks: {', '.join(all_tasks)})"
        )
    theta0 = load_state_dict(layout.pretrained)
    backbone = build_backbone(params.backbone, theta0, source=str(layout.pretrained))
    tasks = {t: data_mod.load_task(layout.task_data(t), params.suite.image_size) for t in all_tasks}
    heads = {
        t: load_head(
            layout.head(t),
            backbone.num_features,
            num_classes=len(tasks[t].classes),
            classes_source=str(layout.task_data(t)),
        )
        for t in all_tasks
    }
    seeds = {t: task_seed(params.seed, t) for t in all_tasks}
    sets = {t: (tasks[t].train.inputs[: s.examples], tasks[t].train.labels[: s.examples]) for t in all_tasks}
    gd_cfg = params.finetune.model_copy(
        update={
            "optimizer": "gd",
            "lr": s.gd_lr,
            "weight_decay": 0.0,
            "warmup_steps": 0,
            "epochs": 1,
            "momentum": 0.0,
            "preserve_features": params.finetune.preserve_features.model_copy(update={"weight": 0.0}),
        }
    )
    # on the CPU whatever runtime.device is: on CUDA the trainer
    # autocasts to bfloat16, and the identities are float32 ones
    gd_trainer = finetune_trainer(params.backbone, heads, sets, gd_cfg, seeds=seeds, device=torch.device("cpu"))
    return _Setup(
        params, layout, s, context.device, theta0, backbone, tasks, heads, seeds, sets, subset, all_tasks, gd_trainer
    )


def _claim_identities(u: _Setup, grads: dict) -> tuple[Claim, dict, Claim, list]:
    """Claim 1: one epoch of full-batch GD through the pipeline's trainer against the autograd gradient; claim 2:
    ATM with one GD step per task per round against multi-task GD."""
    s = u.s
    alpha_all = s.alpha if s.alpha is not None else 1 / len(u.all_tasks)
    ident = one_epoch_identity(u.theta0, u.all_tasks, u.gd_trainer, grads, eta=s.gd_lr, alpha=alpha_all)
    worst = max(e["ulps"] for e in ident["tasks"].values())
    worst_rel = max(e["relative"] for e in ident["tasks"].values())
    c1_holds = worst <= s.identity_ulps and ident["multitask"]["ulps"] <= s.identity_ulps
    claim1 = Claim(
        "000.1",
        "One epoch of full-batch GD gives tau_t(1) = -eta grad Lbar_t(theta0), and theta0 + alpha sum_t tau_t(1) is "
        "one multi-task GD step at alpha eta",
        c1_holds,
        {
            "eta": s.gd_lr,
            "alpha": alpha_all,
            "examples": s.examples,
            "tasks": ident["tasks"],
            "multitask": ident["multitask"],
            "identity_ulps": s.identity_ulps,
        },
        f"{len(u.all_tasks)} tasks, {s.examples} examples each, float32: worst error {worst:.2f} float32 floors "
        f"(relative {_sci(worst_rel)}), "
        f"multi-task step {ident['multitask']['ulps']:.2f} floors (relative {_sci(ident['multitask']['relative'])}); "
        f"holds at <= {s.identity_ulps:g} floors",
    )
    alpha_sub = s.alpha if s.alpha is not None else 1 / len(u.subset)
    atm_rounds = atm_identity(
        u.theta0,
        u.subset,
        u.gd_trainer,
        {t: u.grad_fn(t, s.examples) for t in u.subset},
        eta=s.gd_lr,
        alpha=alpha_sub,
        rounds=s.atm_rounds,
    )
    c2_holds = all(r["ulps"] <= s.identity_ulps * r["round"] for r in atm_rounds)
    claim2 = Claim(
        "000.2",
        "ATM with one full-batch GD step per task per round equals "
        f"R multi-task GD steps at alpha eta (R = {s.atm_rounds})",
        c2_holds,
        {"eta": s.gd_lr, "alpha": alpha_sub, "tasks": u.subset, "rounds": atm_rounds, "identity_ulps": s.identity_ulps},
        f"{len(u.subset)} tasks, float32: error of theta_ATM(r) per round "
        f"{', '.join(format(r['ulps'], '.2f') for r in atm_rounds)} float32 floors "
        f"(relative {', '.join(_sci(r['relative']) for r in atm_rounds)}); holds at <= {s.identity_ulps:g} x r floors",
    )
    return claim1, ident, claim2, atm_rounds


def _claim_gap(u: _Setup) -> tuple[Claim, dict, float, dict]:
    """Claim 3: the TA - MT gap after k >= 2 epochs scales as eta^2 (float64, constant step size)."""
    import torch

    s = u.s
    alpha_sub = s.alpha if s.alpha is not None else 1 / len(u.subset)
    theta0_64 = {k: v.to(torch.float64) for k, v in u.theta0.items() if v.is_floating_point()}
    fns64 = {t: u.grad_fn(t, s.gap_examples, torch.float64) for t in u.subset}
    grads64 = {t: f(theta0_64) for t, f in fns64.items()}
    sharpness = {t: directional_curvature(fns64[t], theta0_64, grads64[t]) for t in u.subset}
    gaps = {
        eta: ta_mt_gaps(theta0_64, fns64, eta=eta, alpha=alpha_sub, epochs=s.gap_epochs, grads0=grads64)
        for eta in sorted(s.gap_lrs)
    }
    etas = sorted(gaps)
    slope = log_slope(etas, [gaps[e][-1]["gap"] for e in etas])
    # the gap's shrink factor from each step size to the next smaller one (eta^2: the square of the eta ratio)
    ratios = [
        {"eta": [hi, lo], "eta_ratio": hi / lo, "gap_ratio": gaps[hi][-1]["gap"] / gaps[lo][-1]["gap"]}
        for lo, hi in zip(etas, etas[1:])
    ]
    low, high = s.slope_range
    claim3 = Claim(
        "000.3",
        f"After k = {s.gap_epochs} GD epochs, ‖theta_TA(k) - theta_MT(k)‖ scales as eta^2",
        low <= slope <= high,
        {
            "etas": etas,
            "gaps": {str(e): g for e, g in gaps.items()},
            "slope": slope,
            "ratios": ratios,
            "sharpness": sharpness,
            "slope_range": [low, high],
        },
        f"{len(u.subset)} tasks, {s.gap_examples} examples each, float64: the gap shrinks "
        + ", ".join(f"{r['gap_ratio']:.0f}x for eta {r['eta'][0]:g} -> {r['eta'][1]:g}" for r in ratios)
        + f"; log-slope {slope:.2f} (holds in [{low}, {high}])",
    )
    return claim3, gaps, slope, sharpness


def _claim_minibatch(u: _Setup, grads: dict) -> tuple[Claim, dict, dict]:
    """Claim 4: minibatch AdamW, one epoch per batch size: cos(tau_t(1), -grad Lbar_t(theta0))."""
    import torch

    from mergeflow.ml.regimes import finetune_trainer

    s, params = u.s, u.params
    trainers = {}
    for b in sorted(s.batch_sizes, reverse=True):
        cfg = params.finetune.model_copy(update={"optimizer": "adamw", "batch_size": b, "epochs": 1, "warmup_steps": 0})
        trainers[max(1, s.examples // min(b, s.examples))] = finetune_trainer(
            params.backbone, u.heads, {t: u.sets[t] for t in u.subset}, cfg, seeds=u.seeds, device=u.device
        )
    cos4 = minibatch_cosines(u.theta0, u.subset, trainers, grads)
    sign_cos = {t: cosine(torch.sign(_flat(grads[t])), _flat(grads[t])) for t in u.subset}
    steps4 = sorted(cos4)
    means4 = [sum(cos4[k].values()) / len(u.subset) for k in steps4]
    below_one = all(c < 1 - 1e-6 for v in cos4.values() for c in v.values())
    falling = all(b < a for a, b in zip(means4, means4[1:]))
    claim4 = Claim(
        "000.4",
        "Under minibatch AdamW, cos(tau_t(1), -grad Lbar_t(theta0)) < 1 and it falls as the steps per epoch grow",
        below_one and falling,
        {
            "steps_per_epoch": steps4,
            "cosines": {str(k): v for k, v in cos4.items()},
            "mean": means4,
            "sign_cosine": sign_cos,
        },
        f"mean cosine over {len(u.subset)} tasks at {', '.join(map(str, steps4))} steps/epoch: "
        f"{', '.join(f'{m:.3f}' for m in means4)}; all < 1: {'yes' if below_one else 'no'}; strictly falling: "
        f"{'yes' if falling else 'no'}",
    )
    return claim4, cos4, sign_cos


def _claim_trajectory(u: _Setup) -> tuple[Claim, dict, dict, int, int]:
    """Claim 5: per-epoch updates of the pipeline's fine-tune (its optimiser, lr, weight decay, batch, feature
    anchor)."""
    from mergeflow.core.io import LazyStateDict
    from mergeflow.ml.models import backbone_state
    from mergeflow.ml.training import FeatureAnchor, finetune as finetune_loop

    s, params, first = u.s, u.params, u.tasks[u.subset[0]].train.inputs
    n5 = min(s.trajectory_examples, len(first))
    per_epoch = max(1, n5 // min(params.finetune.batch_size, n5))
    full_per_epoch = max(1, len(first) // min(params.finetune.batch_size, len(first)))
    # the warm-up keeps the share of the first epoch it has in the pipeline's fine-tune on the whole training split
    warmup = round(params.finetune.warmup_steps * per_epoch / full_per_epoch)
    cfg5 = params.finetune.model_copy(update={"epochs": s.trajectory_epochs, "warmup_steps": warmup})
    trajectories = {}
    preserve = params.finetune.preserve_features
    # the feature anchor as the finetune stage builds it (pipeline.train._feature_anchor), the corpus read once
    corpus = LazyStateDict(u.layout.pretrain_corpus)["images"] if preserve.weight > 0 else None
    for t in u.subset:
        model = copy.deepcopy(u.backbone)
        anchor = (
            FeatureAnchor.build(
                u.backbone,
                corpus,
                preserve,
                seed=u.seeds[t],
                device=u.device,
                eval_batch_size=params.runtime.eval_batch_size,
            )
            if corpus is not None
            else None
        )
        states = [backbone_state(model)]
        x, y = u.train_set(t, n5)
        finetune_loop(
            model,
            copy.deepcopy(u.heads[t]),
            x,
            y,
            cfg5,
            seed=u.seeds[t],
            device=u.device,
            desc=f"study gradients {t}",
            on_epoch_end=lambda k, m=model: states.append(backbone_state(m)),
            anchor=anchor,
        )
        trajectories[t] = epoch_updates([{k: v.cpu() for k, v in st.items()} for st in states])
    holds5, checks5 = trajectory_claim(trajectories, threshold=s.cosine_threshold, cosine_epochs=s.cosine_epochs)
    failing = {t: [k for k, ok in c.items() if not ok] for t, c in checks5.items() if not all(c.values())}
    shares = [u_["update_norms"][0] / sum(u_["update_norms"]) for u_ in trajectories.values()]
    claim5 = Claim(
        "000.5",
        f"The first epoch's update has the largest norm, cos(g_1, g_k) > {s.cosine_threshold} for k <= "
        f"{s.cosine_epochs}, and ‖tau_t(k)‖ grows with k",
        holds5,
        {
            "epochs": s.trajectory_epochs,
            "examples": n5,
            "warmup_steps": warmup,
            "steps_per_epoch": per_epoch,
            "tasks": trajectories,
            "checks": checks5,
        },
        f"{len(u.subset)} tasks, {s.trajectory_epochs} epochs of {per_epoch} steps: epoch 1's share of sum ‖g_k‖ "
        f"{min(shares):.2f}-{max(shares):.2f}, "
        f"lowest cos(g_1, g_k<={s.cosine_epochs}) "
        f"{min(min(u_['cos_first'][1 : s.cosine_epochs]) for u_ in trajectories.values()):.2f}; "
        + (
            "all three hold for every task"
            if holds5
            else "fails: " + "; ".join(f"{t} ({', '.join(v)})" for t, v in failing.items())
        ),
    )
    return claim5, trajectories, checks5, warmup, per_epoch


@register(
    "gradients",
    paper=PAPER,
    title="On Task Vectors and Gradients: task vectors as (approximate) gradients",
    settings=GradientsSettings,
    claims={
        "000.1": "tau_is_one_gd_step",
        "000.2": "atm_is_multitask_gd",
        "000.3": "ta_gap_scales_eta2",
        "000.4": "adamw_tau_not_gradient",
        "000.5": "first_epoch_dominates",
        "000.6": "one_epoch_merges_close",
        "000.7": "atm_beats_one_shot",
    },
)
def gradients(context: StudyContext) -> StudyResult:
    params, layout, s = context.params, context.layout, context.settings
    started = time.perf_counter()
    u = _setup(context)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    grads = {t: u.grad_fn(t, s.examples)(u.theta0) for t in u.all_tasks}
    claim1, ident, claim2, atm_rounds = _claim_identities(u, grads)
    timings["claims 1-2"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    claim3, gaps, slope, sharpness = _claim_gap(u)
    timings["claim 3"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    claim4, cos4, sign_cos = _claim_minibatch(u, grads)
    timings["claim 4"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    claim5, trajectories, checks5, warmup, per_epoch = _claim_trajectory(u)
    timings["claim 5"] = time.perf_counter() - t0
    # claims 6-7: the pipeline's regime outputs
    claim6 = _pipeline_claim_6(params, layout, s.merge_tolerance)
    claim7 = _pipeline_claim_7(params, layout)

    out = Path(context.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures = ["minibatch_cosine.png", "epoch_updates.png", "eta_scaling.png"]
    plot_minibatch(cos4, sign_cos, out / figures[0])
    plot_trajectory(trajectories, s.cosine_threshold, out / figures[1])
    plot_gaps(gaps, slope, out / figures[2])
    timings["total"] = time.perf_counter() - started
    # to the stage's log, not the report: the report's bytes must not change with the machine's load
    print("study gradients: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()), flush=True)
    body = report_body(
        s,
        u.subset,
        ident,
        atm_rounds,
        gaps,
        slope,
        sharpness,
        cos4,
        sign_cos,
        trajectories,
        checks5,
        claim6,
        claim7,
        figures,
        warmup,
        per_epoch,
        one_epoch_rows(params, layout),
    )
    return StudyResult([claim1, claim2, claim3, claim4, claim5, claim6, claim7], body, figures)
