"""Study ``lora``: merging LoRA task vectors against full ones, and the KnOTS paper's claims, per rank.

It reads the pipeline's outputs only: regime@lora's variants ``lora_rank<r>`` (one per rank in
``regimes.lora.ranks``: individual accuracies, factor files, their storage and time) and regime_merge@lora's merges
(``regimes.methods.lora``); the full task vectors are the standard fine-tune's (vectors/, merge@<method>). Accuracy
is normalised by each regime's own individual models (the KnOTS paper's measure): mean_t acc_merged(t) / acc_t(t).

Alignment of two tasks' updates on one adapted matrix: ||U_a^T U_b||_F^2 / r, U the top-r left singular vectors of
each task vector (the column space of a LoRA update of rank r); 1 is one subspace, r / m two random ones. Its median
over the adapted matrices and task pairs, for LoRA at rank r and for the full task vectors at the same r.

Claims (Stoica et al., "Model merging with SVD to tie the KnOTS", ICLR 2025), thresholds set before the numbers:

1. LoRA updates are less aligned across tasks than full fine-tuning updates (their Section 3's alignment
   analysis): at every rank the LoRA median alignment is below the full vectors' by more than ``alignment_margin``.
2. KnOTS recovers more than TA or TIES on LoRA task vectors (their Tables 1-2): at every rank KnOTS' normalised
   accuracy beats the better of TA and TIES by more than ``knots_margin`` points.
3. Merging LoRA task vectors loses more than merging full ones (their motivation): at every rank, TA and TIES on
   LoRA vectors reach a lower normalised accuracy than on full ones, by more than ``loss_margin`` points.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

from pydantic import Field

from mergeflow.studies import Claim, StudyContext, StudyResult, StudySettings, no_grad, register

REGIME = "lora"
METHOD_NAMES = {"task_arithmetic": "TA", "ties": "TIES", "tsv_m": "TSV-M", "knots": "KnOTS"}


class LoraSettings(StudySettings):
    alignment_margin: float = Field(
        0.0, ge=0
    )  # claim 1: LoRA's median alignment below the full one's by more than this
    knots_margin: float = Field(0.0, ge=0)  # claim 2: points of normalised accuracy
    loss_margin: float = Field(0.0, ge=0)  # claim 3: points of normalised accuracy


@dataclass
class Point:
    """One rank's measurements (rank None: the full task vectors)."""

    rank: int | None
    individual: float | None = None  # average test accuracy of the task models
    normalized: dict[str, float] = field(default_factory=dict)  # method -> normalised test accuracy (%)
    alignment: float | None = None  # median pairwise subspace alignment at this rank
    full_alignment: float | None = None  # the full task vectors' at the same rank
    energy: float | None = None  # full vectors: median share of |tau|^2 in the top r singular values
    storage: float | None = None  # bytes of one task vector
    seconds: float | None = None  # the variant's training time (8 fine-tunes)


def _json(path: Path):
    from mergeflow.core.files import read_json

    return read_json(path) if Path(path).is_file() else None


def _normalized(evaluation: dict | None, individual: dict[str, float]) -> float | None:
    if evaluation is None or "accuracy" not in evaluation:
        return None
    return 100 * sum(evaluation["accuracy"][t] / individual[t] for t in individual) / len(individual)


@no_grad
def _spectra(vectors: dict, keys: list[str]) -> dict:
    """{key: {task: (U, s)}}: each task vector's left singular vectors and values, per matrix, computed once."""
    import torch

    out = {}
    for key in keys:
        out[key] = {}
        for t, tv in vectors.items():
            u, s, _ = torch.linalg.svd(tv[key].double(), full_matrices=False)
            out[key][t] = (u, s)
    return out


def _measured(spectra: dict, rank: int) -> tuple[float, float]:
    """(median pairwise alignment of the top-``rank`` left singular subspaces, median share of the energy in them)."""
    aligned, energy = [], []
    for per_task in spectra.values():
        tasks = list(per_task)
        bases = {}
        for t, (u, s) in per_task.items():
            k = min(rank, s.numel())
            bases[t] = u[:, :k]
            total = float((s**2).sum())
            energy.append(float((s[:k] ** 2).sum()) / total if total > 0 else math.nan)
        for i, a in enumerate(tasks):
            for b in tasks[i + 1 :]:
                aligned.append(float((bases[a].T @ bases[b]).square().sum()) / bases[a].shape[1])
    finite = [e for e in energy if math.isfinite(e)]
    return median(aligned), (median(finite) if finite else math.nan)


def _alignments(vectors: dict, keys: list[str], rank: int) -> tuple[float, float]:
    return _measured(_spectra(vectors, keys), rank)


def collect(context: StudyContext) -> tuple[list[Point], Point, list[str]]:
    from mergeflow.core.io import LazyStateDict
    from mergeflow.ml.task_vectors import read_task_vector

    params, layout = context.params, context.layout
    tasks = list(params.suite.tasks)
    methods = (
        [m for m in params.regimes.methods_of(REGIME) if m in METHOD_NAMES] if REGIME in params.regimes.run else []
    )
    notes: list[str] = []
    ft = {t: _json(layout.metrics("finetune", t)) for t in tasks}
    full = Point(None)
    if all(ft.values()):
        individual = {t: ft[t]["individual"]["test"] for t in tasks}
        full.individual = 100 * sum(individual.values()) / len(tasks)
        for m in METHOD_NAMES:
            value = _normalized(_json(layout.merge_run(m).evaluation), individual)
            if value is not None:
                full.normalized[m] = value
    else:
        notes.append("metrics/finetune: the standard fine-tunes' metrics are missing")
    if REGIME not in params.regimes.run:
        return [], full, notes + [f"regimes.run has no '{REGIME}': no LoRA task vectors to study"]
    measured = _json(layout.metrics("regime", REGIME))
    timing = _json(layout.timing("regime", REGIME)) or {}
    if measured is None:
        return [], full, notes + [f"{layout.metrics('regime', REGIME)}: not found (run regime@{REGIME})"]
    pretrained = LazyStateDict(layout.pretrained)
    full_vectors = (
        {t: read_task_vector(layout.vectors / f"{t}.safetensors", pretrained) for t in tasks}
        if layout.vectors.is_dir()
        else None
    )
    points, full_spectra = [], None
    for variant, kwargs in params.regimes.config(REGIME).variants(REGIME, params.finetune.steps).items():
        rank = kwargs["rank"]
        point = Point(rank)
        record = measured["variants"].get(variant)
        if record is None:
            notes.append(f"{variant}: not in {layout.metrics('regime', REGIME)}")
            points.append(point)
            continue
        individual = {t: record["individual"][t]["test"] for t in tasks}
        point.individual = 100 * sum(individual.values()) / len(tasks)
        point.storage = (record.get("storage_bytes") or {}).get("task_vector")
        point.seconds = ((timing.get("variants") or {}).get(variant) or {}).get("wall_time_s")
        for m in methods:
            run = layout.merge_run(m, REGIME, variant)
            value = _normalized(_json(run.evaluation), individual)
            if value is not None:
                point.normalized[m] = value
            notes += _edge_notes(variant, m, _json(run.choice))
        lora_vectors = {
            t: read_task_vector(layout.regime_vectors(REGIME, variant) / f"{t}.safetensors", pretrained) for t in tasks
        }
        keys = next(iter(lora_vectors.values())).adapted
        point.alignment, _ = _alignments(lora_vectors, keys, rank)
        if full_vectors is not None:
            if full_spectra is None:  # the full vectors' SVDs serve every rank
                full_spectra = _spectra(full_vectors, keys)
            point.full_alignment, point.energy = _measured(full_spectra, rank)
        points.append(point)
    return points, full, notes


def _edge_notes(variant: str, method: str, choice: dict | None) -> list[str]:
    """A searched value chosen at its grid's end: the best may lie beyond it (LoRA task vectors are smaller than the
    full ones the grids were set for)."""
    notes = []
    for key, grid in ((choice or {}).get("grid") or {}).items():
        values = [v for v in grid if isinstance(v, (int, float))]
        chosen = (choice.get("searched") or {}).get(key)
        if len(values) > 2 and chosen in (min(values), max(values)):
            end = "largest" if chosen == max(values) else "smallest"
            notes.append(
                f"{variant} {method}: {key} = {chosen:g} is its grid's {end} "
                f"value (widen merge.{method}.{key} to search beyond it)"
            )
    return notes


def _fmt(value: float | None, digits: int = 1) -> str:
    return "–" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def claim_alignment(points: list[Point], s: LoraSettings) -> Claim:
    text = "LoRA updates are less aligned across tasks than full fine-tuning updates"
    usable = [p for p in points if p.alignment is not None and p.full_alignment is not None]
    if not usable:
        return Claim("knots.1", text, None, {}, "needs regime@lora's task vectors and the full ones (vectors/)")
    holds = all(p.alignment < p.full_alignment - s.alignment_margin for p in usable)
    numbers = {f"rank{p.rank}": {"lora": round(p.alignment, 4), "full": round(p.full_alignment, 4)} for p in usable}
    detail = (
        "; ".join(f"r = {p.rank}: {p.alignment:.3f} against {p.full_alignment:.3f}" for p in usable)
        + f" (lower by more than {s.alignment_margin:g} at every rank)"
    )
    return Claim("knots.1", text, holds, numbers, detail)


def claim_knots(points: list[Point], s: LoraSettings) -> Claim:
    text = "KnOTS recovers more of the individual models' accuracy than TA or TIES on LoRA task vectors"
    usable = [p for p in points if {"knots", "task_arithmetic", "ties"} <= set(p.normalized)]
    if not usable:
        return Claim("knots.2", text, None, {}, "needs knots, task_arithmetic and ties in regimes.methods.lora")
    best = {p.rank: max(p.normalized["task_arithmetic"], p.normalized["ties"]) for p in usable}
    holds = all(p.normalized["knots"] > best[p.rank] + s.knots_margin for p in usable)
    numbers = {
        f"rank{p.rank}": {"knots": round(p.normalized["knots"], 2), "best_of_ta_ties": round(best[p.rank], 2)}
        for p in usable
    }
    detail = (
        "; ".join(f"r = {p.rank}: {p.normalized['knots']:.1f} against {best[p.rank]:.1f}" for p in usable)
        + f" (normalised %, ahead by more than {s.knots_margin:g} at every rank)"
    )
    return Claim("knots.2", text, holds, numbers, detail)


def claim_loss(points: list[Point], full: Point, s: LoraSettings) -> Claim:
    text = "TA and TIES keep less of the individual models' accuracy on LoRA task vectors than on full ones"
    usable = [p for p in points if {"task_arithmetic", "ties"} <= set(p.normalized)]
    if not usable or not {"task_arithmetic", "ties"} <= set(full.normalized):
        return Claim(
            "knots.3",
            text,
            None,
            {},
            "needs task_arithmetic and ties both in merge.methods and in regimes.methods.lora",
        )
    holds = all(
        p.normalized[m] < full.normalized[m] - s.loss_margin for p in usable for m in ("task_arithmetic", "ties")
    )
    numbers = {f"rank{p.rank}": {m: round(p.normalized[m], 2) for m in ("task_arithmetic", "ties")} for p in usable} | {
        "full": {m: round(full.normalized[m], 2) for m in ("task_arithmetic", "ties")}
    }
    detail = "; ".join(
        f"r = {p.rank}: TA {p.normalized['task_arithmetic']:.1f}, TIES {p.normalized['ties']:.1f}" for p in usable
    )
    detail += (
        f"; full: TA {full.normalized['task_arithmetic']:.1f}, TIES {full.normalized['ties']:.1f} (normalised %, lower "
        f"by more than {s.loss_margin:g})"
    )
    return Claim("knots.3", text, holds, numbers, detail)


def _table(points: list[Point], full: Point) -> str:
    methods = [m for m in METHOD_NAMES if any(m in p.normalized for p in [*points, full])]
    head = [
        "task vectors",
        "individual (%)",
        *[f"{METHOD_NAMES[m]} (norm. %)" for m in methods],
        "alignment",
        "full's alignment",
        "full's energy in top r",
        "bytes / task",
        "training (s)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in [*points, full]:
        label = f"LoRA r = {p.rank}" if p.rank is not None else "full fine-tune"
        cells = [
            label,
            _fmt(p.individual),
            *[_fmt(p.normalized.get(m)) for m in methods],
            _fmt(p.alignment, 3),
            _fmt(p.full_alignment, 3),
            _fmt(p.energy, 3),
            f"{p.storage / 1e6:.2f} MB" if p.storage else "–",
            _fmt(p.seconds, 0),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(points: list[Point], full: Point, path: Path) -> bool:
    shown = [p for p in points if p.normalized or p.alignment is not None]
    if not shown:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = [p.rank for p in shown]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2), layout="constrained")
    colours = {"task_arithmetic": "#ff7f0e", "ties": "#2ca02c", "tsv_m": "#9467bd", "knots": "#d62728"}
    for m, colour in colours.items():
        ys = [p.normalized.get(m, math.nan) for p in shown]
        if any(math.isfinite(y) for y in ys):
            left.plot(ranks, ys, "o-", color=colour, label=f"{METHOD_NAMES[m]}, LoRA")
        if m in full.normalized:
            left.axhline(full.normalized[m], color=colour, ls="--", lw=1, label=f"{METHOD_NAMES[m]}, full")
    left.set_xscale("log", base=2)
    left.set_xticks(ranks, [str(r) for r in ranks])
    left.set_xlabel("LoRA rank r")
    left.set_ylabel("normalised test accuracy (%)")
    left.set_title("Merged models, by rank")
    left.legend(fontsize=7, ncol=2)
    right.plot(ranks, [p.alignment for p in shown], "o-", color="#d62728", label="LoRA task vectors")
    right.plot(
        ranks,
        [p.full_alignment if p.full_alignment is not None else math.nan for p in shown],
        "s--",
        color="#1f77b4",
        label="full task vectors, top r",
    )
    right.set_xscale("log", base=2)
    right.set_xticks(ranks, [str(r) for r in ranks])
    right.set_xlabel("rank r")
    right.set_ylabel("median ‖U_aᵀU_b‖²_F / r")
    right.set_title("Alignment of the tasks' update subspaces")
    right.legend(fontsize=8)
    fig.savefig(path, dpi=130, format="png")
    plt.close(fig)
    return True


@register(
    "lora",
    paper="Stoica et al. 2025, Model merging with SVD to tie the KnOTS (ICLR 2025, arXiv:2410.19735)",
    title="LoRA task vectors: what merging them costs, and does KnOTS close the gap?",
    settings=LoraSettings,
    claims={
        "knots.1": "lora_less_aligned",
        "knots.2": "knots_beats_ta_ties",
        "knots.3": "lora_loses_more",
    },
)
def lora_study(context: StudyContext) -> StudyResult:
    s: LoraSettings = context.settings
    points, full, notes = collect(context)
    claims = [claim_alignment(points, s), claim_knots(points, s), claim_loss(points, full, s)]
    figures = ["lora_by_rank.png"] if plot(points, full, Path(context.out_dir) / "lora_by_rank.png") else []
    body = [
        "Each rank's task vectors are regime@lora's (`regimes.lora`: "
        "adapters on the attention qkv and projection and the "
        "MLP's fc1 and fc2, the heads frozen, the fine-tune's schedule); the full ones are the standard fine-tune's. "
        "Normalised accuracy divides each task's merged accuracy by that regime's own task model's. Hyperparameters "
        "are chosen on validation as for every merge.",
        "",
    ]
    if notes:
        body += ["Notes:", ""] + [f"- {n}" for n in notes] + [""]
    body += ["## By rank", "", _table(points, full)]
    if figures:
        body += ["![merged accuracy and alignment by rank](lora_by_rank.png)", ""]
    return StudyResult(claims=claims, body="\n".join(body), figures=figures)
