"""What a merge run records, the same for every method and regime (the convention in mergeflow.report.tracking's
docstring): its metrics, its parameters and its validation curve."""

from __future__ import annotations

from collections.abc import Mapping

from mergeflow.ml.evaluation import gap_recovered, mean, normalized_average
from mergeflow.report.summary import percent
from mergeflow.report.tracking.runs import _flatten

MERGE_METRICS = (
    "test_avg",
    "val_avg",
    "normalized_avg",
    "gap_recovered",
    "storage_models",
    "wall_time_s",
)  # and test_acc.<task>


def merge_metrics(
    mm: Mapping, ev: Mapping, tasks: list[str], individual: Mapping[str, float], probe_avg: float, individual_avg: float
) -> dict[str, float]:
    """The convention's metrics (module docstring) of one merge, from metrics/merge/<m>.json and
    metrics/evaluate/<m>.json; fractions become percent."""
    if ev["kind"] == "negation":
        per_task = ev["per_task"]
        target = {t: per_task[t]["target"] for t in tasks}
        extra = {f"control_acc.{t}": percent(per_task[t]["control"]) for t in tasks} | {
            "control_avg": percent(ev["average"]["control"])
        }
        test_avg, val_avg = ev["average"]["target"], mean(mm["per_task"][t]["chosen"]["target"] for t in tasks)
        normalized, storage = normalized_average(target, individual), float(len(tasks))
    else:
        target, extra = ev["accuracy"], {}
        test_avg, val_avg, normalized, storage = (
            ev["average"],
            mm["val_average"],
            ev["normalized_average"],
            ev["storage_models"],
        )
    return {
        "test_avg": percent(test_avg),
        "val_avg": percent(val_avg),
        "normalized_avg": percent(normalized),
        "gap_recovered": percent(gap_recovered(test_avg, probe_avg, individual_avg)),
        "storage_models": round(float(storage), 2),
        **{f"test_acc.{t}": percent(target[t]) for t in tasks},
        **extra,
    }


def merge_params(mm: Mapping, ev: Mapping) -> dict[str, str]:
    """method, kind, paper, each hyperparameter under its own name (per-task choices as <key>.<task>), and the
    searched grids as grid.<key>."""
    chosen = dict(mm["hyperparameters"])
    if ev["kind"] == "negation":
        chosen["lam"] = {t: r["lam"] for t, r in ev["per_task"].items()}
    from mergeflow.ml.merging import DATA

    return (
        {"method": mm["method"], "kind": mm["kind"], "paper": mm["paper"], "data": DATA[mm.get("reads")]}
        | _flatten("", chosen)
        | {f"grid.{k}": ", ".join(map(str, v)) for k, v in mm["grid"].items()}
    )  # not JSON: the UI spreads a JSON list over lines


def _val_curve(mm: Mapping) -> dict:
    """The validation search as a table against the hyperparameter values (not the grid index), percent."""
    keys = list(mm["grid"])
    if mm["kind"] == "negation":
        rows = [
            {"task": t, "lam": p["lam"], "target": percent(p["target"]), "control": percent(p["control"])}
            for t, r in mm["per_task"].items()
            for p in r["curve"]
        ]
        return {"x": ["lam"], "rows": rows, "chosen": {t: r["chosen"]["lam"] for t, r in mm["per_task"].items()}}
    rows = [
        {k: r["hyperparameters"].get(k) for k in keys} | {"val_avg": percent(r["average"])}
        for r in mm.get("val_curve", [])
    ]
    per_task = [
        {"key": key, "task": t, "value": float(v), "val_acc": percent(acc)}
        for key, by_task in (mm.get("per_task_curves") or {}).items()
        for t, curve in by_task.items()
        for v, acc in curve.items()
    ]
    return {"x": keys, "rows": rows, "per_task": per_task, "chosen": mm["searched"]}
