"""Study ``ctl``: the study function, registered as ``ctl``, and its steps (``_sections`` writes the report's
body)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TYPE_CHECKING


from mergeflow.core.errors import MergeflowError
from mergeflow.studies import StudyContext, StudyResult, register
from mergeflow.studies.ctl._sections import (
    AverageTerms,
    Design,
    NegationTerms,
    PairTerms,
    ScratchTerms,
    report_body,
)
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
    d: Design,
    device,
) -> ScratchTerms:
    """Claim 8's measurements: the pair (the setting's, else the first pair) trained from a random init and, on the
    same schedule, from theta0; the CTL terms at alpha = 0.5 of those two and of the pipeline's fine-tunes (by name,
    in the plot's order), each model's test accuracy, and each pair's distance relative to its init's norm."""
    import torch

    from mergeflow.ml.models import build_backbone

    pair8 = tuple(s.scratch_pair) if s.scratch_pair is not None else d.pairs[0]
    for t in pair8:
        params.check_task(t)
    train = {t: (data[t].train.inputs, data[t].train.labels) for t in pair8}
    torch.manual_seed(params.seed)
    random_init = {k: v.detach().clone() for k, v in build_backbone(params.backbone).net.state_dict().items()}
    from_scratch = train_pair(params, suite, train, random_init, pair8, s.scratch_steps, device, "scratch")
    from_theta0 = train_pair(params, suite, train, theta0, pair8, s.scratch_steps, device, "from-theta0")
    x8, _ = suite.x(list(pair8), d.n)
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
    scratch, control, pipeline8 = (_by_layer([terms[k]]) for k in ("random init", "from θ0, same schedule", "pipeline"))
    return ScratchTerms(pair8, terms, scratch, control, pipeline8, acc8, rel8)


def _design(params, layout, s: CtlSettings, suite: Suite, probe: Probe) -> Design:
    """The stitching block (checked against the backbone's depth), lambda, the pairs and the examples per task."""
    tasks = list(params.suite.tasks)
    depth = len(probe.layers)
    layer = s.stitch_layer if s.stitch_layer is not None else max(0, depth // 2 - 1)
    if layer >= depth:
        raise MergeflowError(f"studies.ctl.stitch_layer: block {layer} does not exist (the backbone has {depth})")
    lam, lam_source = pipeline_lam(layout, s.lam)
    pairs = choose_pairs(tasks, s.pairs, params.seed)
    n = min(s.examples, *(len(suite.test[t][1]) for t in tasks))
    m_st = min(s.stitch_examples, *(len(suite.test[t][1]) for t in tasks))
    return Design(probe.reading, depth, layer, lam, lam_source, pairs, n, m_st)


def _measure_pairs(probe: Probe, suite: Suite, s: CtlSettings, d: Design) -> PairTerms:
    """Claims 1, 2, 4 and 6: every pair along alpha, its addition and its loss path."""
    measured = {p: measure_pair(probe, suite, *p, s.alphas, d.lam, d.n) for p in d.pairs}
    per_alpha = {a: _by_layer([m["ctl"][a] for m in measured.values()]) for a in s.alphas}
    addition = _by_layer([m["addition"] for m in measured.values()])
    barriers = [loss_barrier(m["losses"][1.0], m["losses"][0.5], m["losses"][0.0]) for m in measured.values()]
    return PairTerms(measured, per_alpha, addition, barriers)


def _measure_negations(probe: Probe, suite: Suite, tasks: list[str], d: Design) -> NegationTerms:
    """Claim 5, per task: eq. 3's terms, and eq. 4 and its first-order form per layer (shown, not judged)."""
    import torch

    neg = {t: measure_negation(probe, suite, t, d.lam, d.n) for t in tasks}
    negation = _by_layer([v["eq3"] for v in neg.values()])
    eq4 = [float(torch.cat([v["eq4"][L] for v in neg.values()]).mean()) for L in range(d.depth)]
    first_order = [float(torch.cat([v["first_order"][L] for v in neg.values()]).mean()) for L in range(d.depth)]
    return NegationTerms(neg, negation, eq4, first_order)


def _measure_averages(probe: Probe, suite: Suite, tasks: list[str], s: CtlSettings, d: Design) -> AverageTerms:
    """Claim 3: the average of each subset size's models (sizes above the suite's are left out)."""
    subsets = {k: choose_subset(tasks, k, s.average_seed) for k in s.average_sizes if k <= len(tasks)}
    avg_terms = {k: measure_average(probe, suite, sub, d.n) for k, sub in subsets.items()}
    return AverageTerms(subsets, avg_terms, {k: _by_layer([v]) for k, v in avg_terms.items()})


def _claims(s: CtlSettings, d: Design, p: PairTerms, neg: NegationTerms, avg: AverageTerms, stitch, sc: ScratchTerms):
    """The eight verdicts, in the claims' order (claim 6 reads claim 1's)."""
    c1 = claim_ctl(p.per_alpha, s)
    return [
        c1,
        claim_coef(p.per_alpha, s),
        claim_average(avg.per_k, s),
        claim_addition(p.addition, s, d.lam),
        claim_negation(neg.negation, s, d.lam),
        claim_barrier(p.barriers, c1.holds, s),
        claim_stitching(stitch, s),
        claim_scratch(sc.pair, sc.scratch, sc.control, sc.acc, s, sc.rel),
    ]


def _plot(
    out: Path, s: CtlSettings, d: Design, p: PairTerms, neg: NegationTerms, avg: AverageTerms, stitch, sc, names
) -> list[str]:
    """The five figures, written into ``out``; their file names in the report's order."""
    figures = ["ctl.png", "arithmetic.png", "barrier.png", "stitching.png", "scratch.png"]
    out.mkdir(parents=True, exist_ok=True)
    plot_ctl(
        p.per_alpha,
        {a: _coefs([m["ctl"][a] for m in p.measured.values()]) for a in s.alphas},
        len(d.pairs),
        out / figures[0],
        names,
    )
    coefs = {
        "average": {k: _coefs([v]) for k, v in avg.terms.items()},
        "addition": _coefs([m["addition"] for m in p.measured.values()]),
        "negation": _coefs([v["eq3"] for v in neg.by_task.values()]),
    }
    plot_arithmetic(avg.per_k, p.addition, neg.negation, coefs, d.lam, out / figures[1], names)
    plot_barrier({f"{i} / {j}": m["losses"] for (i, j), m in p.measured.items()}, out / figures[2])
    plot_stitching(stitch, out / figures[3])
    plot_scratch(
        sc.scratch,
        sc.control,
        sc.pipeline,
        {k: _coefs([v]) for k, v in sc.terms.items()},
        sc.pair,
        out / figures[4],
        names,
    )
    return figures


@register(
    "ctl",
    paper=PAPER,
    title="Cross-task linearity: interpolated weights give interpolated features, layer by layer",
    settings=CtlSettings,
    claims={
        "003.1": "linear_at_every_layer",
        "003.2": "feature_lengths_agree",
        "003.3": "averaging_k_models",
        "003.4": "addition_in_features",
        "003.5": "negation_in_features",
        "003.6": "linear_without_lmc",
        "003.7": "stitching_does_both",
        "003.8": "no_pretraining_weaker",
    },
)
def ctl_study(context: StudyContext) -> StudyResult:
    params, layout, s, device = context.params, context.layout, context.settings, context.device
    started = time.perf_counter()
    timings: dict[str, float] = {}
    tasks = list(params.suite.tasks)
    theta0, data, heads, suite, probe = _load(params, layout, device)
    d = _design(params, layout, s, suite, probe)

    t0 = time.perf_counter()
    pair_terms = _measure_pairs(probe, suite, s, d)  # claims 1, 2, 4, 6
    timings["pairs"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    neg = _measure_negations(probe, suite, tasks, d)  # claim 5
    timings["negation"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    avg = _measure_averages(probe, suite, tasks, s, d)  # claim 3
    timings["averaging"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    stitch = [measure_stitching(probe, suite, i, j, d.lam, d.layer, d.m_st) for i, j in d.pairs]  # claim 7
    timings["stitching"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    sc = _measure_scratch(params, s, suite, probe, data, heads, theta0, d, device)  # claim 8
    timings["scratch"] = time.perf_counter() - t0

    claims = _claims(s, d, pair_terms, neg, avg, stitch, sc)
    figures = _plot(Path(context.out_dir), s, d, pair_terms, neg, avg, stitch, sc, probe.names)
    timings["total"] = time.perf_counter() - started
    # to the stage's log, not the report: the report's bytes must not change with the machine's load
    print("study ctl: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()), flush=True)
    return StudyResult(claims, report_body(params, s, d, pair_terms, neg, avg, stitch, sc), figures)


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
