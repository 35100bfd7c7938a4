"""Study ``gradients``' claims 6-7, from the pipeline's regime outputs (metrics/regime/<regime>.json and the
regimes' merges): pure functions of the metrics dictionaries, and their reading from the files."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mergeflow.studies import Claim


def _test_average(evaluation: Mapping[str, Any]) -> float:
    """The test average of a metrics/evaluate-format dictionary (``average`` a number, or {val, test})."""
    avg = evaluation["average"]
    return float(avg["test"] if isinstance(avg, Mapping) else avg)


def claim_one_epoch_merge(
    regime_metrics: Mapping[str, Any] | None,
    one_epoch_ta: Mapping[str, Any] | None,
    standard_ta: Mapping[str, Any] | None,
    finetune: Mapping[str, Mapping[str, Any]] | None,
    *,
    tolerance: float,
    missing: Sequence[str] = (),
) -> Claim:
    """Claim 6 from metrics/regime/one_epoch.json, the one-epoch vectors' task_arithmetic evaluation, the standard
    task_arithmetic evaluation and metrics/finetune/<t>.json; ``missing`` lists what was not run (-> not measured)."""
    text = (
        "Task arithmetic on one-epoch task vectors is within a few points of (or above) task arithmetic on converged "
        "ones, while the one-epoch models alone are weaker"
    )
    if missing or regime_metrics is None or one_epoch_ta is None or standard_ta is None or not finetune:
        return Claim("000.6", text, None, {}, "; ".join(missing) or "inputs missing")
    one, full = _test_average(one_epoch_ta), _test_average(standard_ta)
    individual_one = float(regime_metrics["variants"]["one_epoch"]["individual_average"]["test"])
    individual_full = sum(float(m["individual"]["test"]) for m in finetune.values()) / len(finetune)
    merges_close = one >= full - tolerance
    weaker = individual_one < individual_full
    numbers = {
        "ta_one_epoch": one,
        "ta_converged": full,
        "individual_one_epoch": individual_one,
        "individual_converged": individual_full,
        "tolerance": tolerance,
    }
    detail = (
        f"TA test avg {100 * one:.1f}% (1 epoch) vs {100 * full:.1f}% (converged), needs >= "
        f"{100 * (full - tolerance):.1f}%: {'yes' if merges_close else 'no'}; "
        f"individual avg {100 * individual_one:.1f}% vs {100 * individual_full:.1f}%: "
        f"{'weaker' if weaker else 'not weaker'}"
    )
    return Claim("000.6", text, merges_close and weaker, numbers, detail)


BASELINES = ("task_arithmetic", "ties", "breadcrumbs")


def claim_atm_budget(
    atm: Mapping[int, Mapping[str, Any]],
    baselines: Mapping[str, Mapping[str, Any] | None],
    *,
    missing: Sequence[str] = (),
) -> Claim:
    """Claim 7 from ATM's own model's evaluation per round count R (at the standard budget: R * K = finetune.steps)
    and the standard regime's one-shot evaluations of ``BASELINES``: holds when ATM at the largest R beats each
    baseline on the test average and, with two or more R, the average does not fall as R grows."""
    text = (
        "At a fixed fine-tuning budget, ATM with more rounds of shorter "
        "fine-tunes beats one-shot task arithmetic, TIES and Breadcrumbs"
    )
    absent = [m for m in BASELINES if baselines.get(m) is None]
    if missing or not atm or absent:
        reasons = (
            list(missing)
            + ([f"no evaluation of {', '.join(absent)} (add to merge.methods)"] if absent else [])
            + ([] if atm else ["no ATM evaluation"])
        )
        return Claim("000.7", text, None, {}, "; ".join(reasons))
    rounds = sorted(atm)
    atm_avg = {r: _test_average(atm[r]) for r in rounds}
    base = {m: _test_average(baselines[m]) for m in BASELINES}
    best_r = rounds[-1]
    beats = all(atm_avg[best_r] > v for v in base.values())
    trend = (
        all(b >= a for a, b in zip([atm_avg[r] for r in rounds], [atm_avg[r] for r in rounds[1:]]))
        if len(rounds) > 1
        else None
    )
    numbers = {"atm": {str(r): v for r, v in atm_avg.items()}, "baselines": base}
    parts = [f"ATM R={r}: {100 * atm_avg[r]:.1f}%" for r in rounds] + [f"{m}: {100 * v:.1f}%" for m, v in base.items()]
    trend_text = (
        "trend in R not measured (one round count: add more to regimes.atm.rounds)"
        if trend is None
        else f"non-decreasing in R: {'yes' if trend else 'no'}"
    )
    detail = f"test avg {', '.join(parts)}; R={best_r} beats all three: {'yes' if beats else 'no'}; {trend_text}"
    return Claim("000.7", text, beats and (trend is not False), numbers, detail)


def _read(path: Path):
    from mergeflow.core.files import read_json

    return read_json(path) if Path(path).is_file() else None


def _pipeline_claim_6(params, layout, tolerance: float) -> Claim:
    missing = []
    if "one_epoch" not in params.regimes.run:
        missing.append("regime one_epoch did not run (add one_epoch to regimes.run)")
    elif "task_arithmetic" not in params.regimes.methods_of("one_epoch"):
        missing.append("the one-epoch vectors are not merged by task_arithmetic (add it to regimes.methods.one_epoch)")
    if "task_arithmetic" not in params.merge.methods:
        missing.append("task_arithmetic not in merge.methods")
    if missing:
        return claim_one_epoch_merge(None, None, None, None, tolerance=tolerance, missing=missing)
    paths = {
        "regime": layout.metrics("regime", "one_epoch"),
        "one_epoch_ta": layout.merge_run("task_arithmetic", "one_epoch", "one_epoch").evaluation,
        "standard_ta": layout.merge_run("task_arithmetic").evaluation,
        **{f"finetune {t}": layout.metrics("finetune", t) for t in params.suite.tasks},
    }
    found = {k: _read(p) for k, p in paths.items()}
    missing = [f"{paths[k]} missing (run dvc repro)" for k, v in found.items() if v is None]
    finetune = {t: found[f"finetune {t}"] for t in params.suite.tasks}
    return claim_one_epoch_merge(
        found["regime"], found["one_epoch_ta"], found["standard_ta"], finetune, tolerance=tolerance, missing=missing
    )


def one_epoch_rows(params, layout) -> list[tuple[str, float | None, float | None]]:
    """(method, test average on one-epoch vectors, on the converged ones) for each method the one-epoch vectors
    went to; None where that evaluation is absent."""
    if "one_epoch" not in params.regimes.run:
        return []
    rows = []
    for m in params.regimes.methods_of("one_epoch"):
        one = _read(layout.merge_run(m, "one_epoch", "one_epoch").evaluation)
        full = _read(layout.merge_run(m).evaluation) if m in params.merge.methods else None
        rows.append((m, _test_average(one) if one else None, _test_average(full) if full else None))
    return rows


def _pipeline_claim_7(params, layout) -> Claim:
    missing, atm_evals = [], {}
    if "atm" not in params.regimes.run:
        missing.append("regime atm did not run (add atm to regimes.run)")
    elif "atm" not in params.regimes.methods_of("atm"):
        missing.append("ATM's own model is not evaluated (add atm to regimes.methods.atm)")
    else:
        at_budget = {
            v: kw
            for v, kw in params.regimes.config("atm").variants("atm", params.finetune.steps).items()
            if kw["steps"] is not None and kw["rounds"] * kw["steps"] == params.finetune.steps
        }
        if not at_budget:
            missing.append(
                "no ATM variant at the standard budget of finetune.steps = "
                f"{params.finetune.steps} steps (leave regimes.atm.steps empty)"
            )
        for variant, kw in at_budget.items():
            path = layout.merge_run("atm", "atm", variant).evaluation
            atm_evals[kw["rounds"]] = _read(path)
            if atm_evals[kw["rounds"]] is None:
                missing.append(f"{path} missing (run dvc repro)")
    baselines = {}
    for m in BASELINES:
        path = layout.merge_run(m).evaluation
        baselines[m] = _read(path) if m in params.merge.methods else None
        if m in params.merge.methods and baselines[m] is None:
            missing.append(f"{path} missing (run dvc repro)")
    return claim_atm_budget(atm_evals, baselines, missing=missing)
