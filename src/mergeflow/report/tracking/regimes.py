"""What the training-time regimes record: a run per variant of regime@<r> (its task models, its own model, its
rounds) and a merge run per variant and method of regime_merge@<r>."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping
from pathlib import Path

from mergeflow.config import Params
from mergeflow.ml.evaluation import gap_recovered
from mergeflow.core.files import read_json
from mergeflow.core.layout import Layout
from mergeflow.report.summary import percent
from mergeflow.report.tracking.merges import _val_curve, merge_metrics, merge_params
from mergeflow.report.tracking.registry import _log_merged_model
from mergeflow.report.tracking.runs import _flatten, _Hashes, _notice, _Recorder, _sha256, log_search_plot, stage_times

ROUND_METRICS = (  # (metric, the round record's key, how its values are summarised): one point per round, step = round
    ("update_cosine_median", "update_cosines", statistics.median),
    ("update_cosine_max", "update_cosines", max),
    ("task_vector_cosine_median", "task_vector_cosines", statistics.median),
    ("task_vector_cosine_max", "task_vector_cosines", max),
    ("update_norm_mean", "update_norms", statistics.fmean),
    ("task_vector_norm_mean", "task_vector_norms", statistics.fmean),
)


def regime_metrics(
    record: Mapping, tasks: list[str], probe_avg: float, individual_avg: float, times: Mapping | None = None
) -> tuple[dict[str, float], dict[str, list[tuple[int, float]]]]:
    """One regime variant's metrics (metrics/regime/<regime>.json's record), percent, and its per-round histories
    (step = round; pairwise cosines and norms summarised over the task pairs and tasks); ``times``: the variant's
    entry of logs/timing/regime/<regime>.json (wall_time_s, rounds_wall_time_s)."""
    times = times or {}
    individual = record["individual"]
    metrics = {
        "individual_avg": percent(record["individual_average"]["test"]),
        "individual_val_avg": percent(record["individual_average"]["val"]),
        **{f"individual_acc.{t}": percent(individual[t]["test"]) for t in tasks},
    }
    if "wall_time_s" in times:
        metrics["wall_time_s"] = float(times["wall_time_s"])
    if storage := record.get("storage_bytes"):  # a task vector on disk (LoRA: its factors), and a full one
        metrics |= {
            "task_vector_bytes": float(storage["task_vector"]),
            "full_task_vector_bytes": float(storage["full_task_vector"]),
        }
    if own := record.get("model"):
        test = own["average"]["test"]
        metrics |= {
            "model_test_avg": percent(test),
            "model_val_avg": percent(own["average"]["val"]),
            "model_gap_recovered": percent(gap_recovered(test, probe_avg, individual_avg)),
            **{f"model_test_acc.{t}": percent(own["accuracy"]["test"][t]) for t in tasks},
        }
    history: dict[str, list[tuple[int, float]]] = {}
    walls = list(times.get("rounds_wall_time_s") or [])
    for i, r in enumerate(record.get("rounds", [])):
        for name, key, summary in ROUND_METRICS:
            if values := [float(v) for v in (r.get(key) or {}).values()]:
                history.setdefault(name, []).append((int(r["round"]), round(summary(values), 4)))
        wall = walls[i] if i < len(walls) else None
        if isinstance(wall, (int, float)) and math.isfinite(wall):  # NaN: a round run by a process that was killed
            history.setdefault("round_wall_time_s", []).append((int(r["round"]), round(float(wall), 3)))
    return metrics, history


def _track_regimes(
    params: Params,
    layout: Layout,
    rec: _Recorder,
    hashes: _Hashes,
    tasks: list[str],
    individual: Mapping[str, float],
    probe_avg: float,
    individual_avg: float,
    interval: Callable[[str, str], dict] = lambda v, m: {},
) -> list[tuple[str, str, str]]:
    """The training-time regimes' runs: per variant of regime@<r> one run (its task models' accuracies, its own
    model, per-round cosines and norms), and per variant and method of regime_merge@<r> one merge run under the
    merge convention, with ``interval(variant, method)``'s metrics (the leaderboard's). A regime whose files are missing
    (not run yet) is left out with a notice. Returns (variant, method, run id) of the merge runs, in order."""
    merges: list[tuple[str, str, str]] = []
    for r in params.regimes.run:
        metrics_path, timing = layout.metrics("regime", r), layout.timing("regime", r)
        if not (metrics_path.is_file() and timing.is_file()):
            _notice(
                f"regime {r} not tracked: {metrics_path if not metrics_path.is_file() else timing} "
                f"is missing (regime@{r} has not run)"
            )
            continue
        measured, times = read_json(metrics_path), stage_times(timing)
        variants = [v for v in params.regimes.config(r).variants(r, params.finetune.steps) if v in measured["variants"]]
        if missing := [
            v for v in params.regimes.config(r).variants(r, params.finetune.steps) if v not in measured["variants"]
        ]:
            _notice(
                f"regime {r}: variants {', '.join(missing)} not tracked: "
                f"not in {metrics_path} (regime@{r} ran with other settings)"
            )
        for v in variants:
            _track_variant(params, layout, rec, hashes, r, v, measured, timing, times, tasks, probe_avg, individual_avg)

        merge_timing = layout.timing("regime_merge", r)
        if not merge_timing.is_file():
            _notice(f"regime {r}'s merges not tracked: {merge_timing} is missing (regime_merge@{r} has not run)")
            continue
        times = stage_times(merge_timing)
        for v in variants:
            for method in params.regimes.methods_of(r):
                run_id = _track_regime_merge(
                    params,
                    layout,
                    rec,
                    hashes,
                    r,
                    v,
                    method,
                    measured,
                    times,
                    tasks,
                    individual,
                    probe_avg,
                    individual_avg,
                    interval,
                )
                if run_id is not None:
                    merges.append((v, method, run_id))
    return merges


def _track_variant(
    params: Params,
    layout: Layout,
    rec: _Recorder,
    hashes: _Hashes,
    r: str,
    v: str,
    measured: Mapping,
    timing: Path,
    times: tuple[float, float],
    tasks: list[str],
    probe_avg: float,
    individual_avg: float,
) -> None:
    """The run of variant ``v`` of regime@<r> (``timing``: regime@<r>'s timing file, ``times`` read from it): its
    metrics and per-round history (regime_metrics), its record, its task vectors' statistics and, with
    tracking.log_checkpoints, its own model."""
    record, model, stats = (
        measured["variants"][v],
        layout.regime_model(r, v),
        layout.regime_vectors(r, v) / "stats.json",
    )
    own_model = record.get("model") is not None and model.is_file()
    name = f"regime@{r}/{v}"
    fp = _sha256({"item": name, "record": record, "files": hashes([stats, model] if own_model else [stats])})
    with rec.run(
        name,
        fp,
        times,
        {"mergeflow.stage": "regime", "mergeflow.item": r, "regime": r, "variant": v},
        run_name=f"regime@{v}",
    ) as run_id:
        if run_id:
            metrics, history = regime_metrics(
                record, tasks, probe_avg, individual_avg, read_json(timing).get("variants", {}).get(v)
            )
            rec.log(
                run_id,
                {"regime": r, "variant": v, "paper": measured["paper"]} | _flatten("", record["hyperparameters"]),
                metrics,
                times[1],
                history,
            )
            rec.client.log_dict(run_id, record, f"regime/{v}.json")  # every round's norms and pairwise cosines
            if stats.is_file():
                rec.client.log_artifact(run_id, str(stats), "vectors")
            if params.tracking.log_checkpoints and own_model:
                _log_merged_model(
                    rec, run_id, model, hashes([model])[model.relative_to(layout.root).as_posix()], params
                )


def _track_regime_merge(
    params: Params,
    layout: Layout,
    rec: _Recorder,
    hashes: _Hashes,
    r: str,
    v: str,
    method: str,
    measured: Mapping,
    times: tuple[float, float],
    tasks: list[str],
    individual: Mapping[str, float],
    probe_avg: float,
    individual_avg: float,
    interval: Callable[[str, str], dict],
) -> str | None:
    """The merge run of variant ``v`` of regime_merge@<r> by ``method`` (the regime's own model, evaluated, when
    ``method`` is the regime), under the merge convention; its run id, or None (with a notice) when its files are
    missing or the variant has no model of its own."""
    record = measured["variants"][v]
    run = layout.merge_run(method, r, v)
    own = method == r  # the regime's own model, evaluated (not merged)
    if not run.evaluation.is_file() or not (own or run.choice.is_file()):
        _notice(
            f"regime {r}: {v} merged with {method} not tracked: "
            f"{run.evaluation if not run.evaluation.is_file() else run.choice} is missing"
        )
        return None
    if own and record.get("model") is None:
        _notice(f"regime {r}: {v} has no model of its own to track as method {method}")
        return None
    ev = read_json(run.evaluation)
    if own:
        weights = layout.regime_model(r, v)
        mm = _own_model_choice(method, ev, measured, record)
        files = [run.evaluation, weights]
    else:
        weights, mm = run.merged, read_json(run.choice)
        files = [run.choice, run.evaluation, weights, *[p for p in [run.predictions] if p.is_file()]]
    name = f"regime_merge@{r}/{v}/{method}"
    md5s = hashes(files)
    fp = _sha256({"item": name, "files": md5s, "val_average": mm["val_average"]})
    tags = {
        "mergeflow.stage": "regime_merge",
        "mergeflow.item": r,
        "regime": r,
        "variant": v,
        "mergeflow.ranked": "yes",
    }  # the methods views rank it
    with rec.run(name, fp, times, tags, run_name=f"{v}/{method}") as run_id:
        if run_id:
            rec.log(
                run_id,
                merge_params(mm, ev),
                merge_metrics(mm, ev, tasks, individual, probe_avg, individual_avg) | interval(v, method),
                times[1],
            )
            if not own:
                rec.client.log_dict(run_id, _val_curve(mm), "curves/val_curve.json")
                if "learned" in mm:
                    rec.client.log_dict(run_id, mm["learned"], "learned/coefficients.json")
                log_search_plot(rec.client, run_id, run.search_plot)
            md5 = md5s.get(weights.relative_to(layout.root).as_posix())
            log_ckpt = params.tracking.log_checkpoints
            if log_ckpt and md5 and mm["kind"] in ("model", "regime_model"):
                _log_merged_model(rec, run_id, weights, md5, params)
            elif log_ckpt and md5 and mm["kind"] == "per_task":
                rec.weights(run_id, {weights: md5}, lambda p: "merged")
    return rec.stage_runs[name]


def _own_model_choice(method: str, ev: Mapping, measured: Mapping, record: Mapping) -> dict:
    """A regime's own model in the shape of a merge's choice (no grid searched): what the merge convention reads."""
    return {
        "method": method,
        "kind": ev["kind"],
        "paper": measured["paper"],
        "hyperparameters": ev["hyperparameters"],
        "grid": {},
        "val_average": record["model"]["average"]["val"],
    }
