"""What a pipeline run reports beyond its tables: the headline metrics `dvc exp show` and `dvc metrics diff`
compare, the records `dvc plots` draws (one JSON object per point), and the summary table (results/summary.md
and .csv). Accuracies are fractions in the rows, percentages in the metrics."""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping

from mergeflow.ml.evaluation import gap_recovered, mean, normalized_average
from mergeflow.report.plots import INDIVIDUAL, is_pretrained


def percent(fraction: float | None) -> float | None:
    """Two decimals: MLflow's UI shows every digit, and a test split of N images scores in steps of 100/N.
    None (a gap recovered that is not defined) stays None."""
    return None if fraction is None else round(100 * float(fraction), 2)


def choice_label(searched: Mapping) -> str | None:
    """The values chosen on validation as one short string ("rank_ratio=0.16 lam=1.6"): one column in `dvc metrics
    show` whatever the method's hyperparameters are called. A per-task choice (TALL's lambda_t, one value per task)
    is left out: it is in metrics/evaluate. None when nothing was searched."""
    parts = [f"{k}={v}" for k, v in searched.items() if isinstance(v, (int, float, str))]
    return " ".join(parts) or None


def _edges(grid: Mapping[str, list], chosen: Mapping[str, object]) -> list[str]:
    """The choices worth a second look: at the end of a grid of three or more values (the best may lie beyond it),
    or 0 (a coefficient of 0 leaves the pretrained weights as they were)."""
    flags = []
    for name, values in grid.items():
        value = chosen.get(name)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        numeric = sorted(v for v in values if isinstance(v, (int, float)))
        if value == 0:
            flags.append(f"{name}=0 has no effect")
        elif len(numeric) >= 3 and value in (numeric[0], numeric[-1]):
            flags.append(f"{name}={value:g} at the grid's {'top' if value == numeric[-1] else 'bottom'}")
    return flags


def merge_line(label: str, choice: Mapping, evaluation: Mapping) -> str:
    """What a merge found, in one line: the choice on validation, the validation and test averages, and a flag
    for a choice at its grid's edge or without effect. ``choice``, ``evaluation``: the merge's and its test's
    metrics (metrics/merge/, metrics/evaluate/)."""
    if choice["kind"] == "negation":
        flags = [f"{t}: {f}" for t, r in choice["per_task"].items() for f in _edges(choice["grid"], r["chosen"])]
        lams = " ".join(f"{t}={r['chosen']['lam']:g}" for t, r in choice["per_task"].items())
        average = evaluation["average"]
        line = (
            f"{label}: lam per negated task {lams}; test: negated tasks {percent(average['target'])}%, the others "
            f"{percent(average['control'])}%"
        )
    else:
        flags = _edges(choice["grid"], choice["searched"])
        line = (
            f"{label}: chose {choice_label(choice['searched']) or 'its one setting'}; validation "
            f"{percent(choice['val_average'])}%, test {percent(evaluation['average'])}%"
        )
    return line + ("  [check: " + "; ".join(flags) + "]" if flags else "")


def _entry(test_avg: float, gap: float | None, searched: Mapping, val_avg: float | None = None) -> dict:
    entry = {
        "test_avg": percent(test_avg),
        "val_avg": percent(val_avg),
        "gap": percent(gap),
        "choice": choice_label(searched),
    }
    return {k: v for k, v in entry.items() if v is not None or k == "gap"}


def headline_metrics(
    rows: list[dict], evaluations: Mapping[str, dict], val_averages: Mapping[str, float] = {}
) -> dict[str, dict]:
    """The headline, one small entry per name (metrics/headline/<name>.json, a row each in `dvc metrics show`):
    "probe" and "individual" with their test average; per method its test average, the validation average of
    its choice (``val_averages``, fractions), the share of the probe-to-individual gap recovered ("gap") and the
    values chosen on validation ("choice"), all %. ``rows`` are evaluation.summary_rows (Pretrained, Individual,
    then one per merge method); task negation's average is over its targets (each task's accuracy with that task
    negated), with its controls' average beside it, and its gap, by the same formula, is negative when it
    forgets. A gap is None when the individual models do not beat the probe (evaluation.MIN_GAP)."""
    probe, individual = rows[0]["average"], rows[1]["average"]
    by_method = {r["method"]: r for r in rows[2:]}
    headline = {"probe": {"test_avg": percent(probe)}, "individual": {"test_avg": percent(individual)}}
    for method, ev in evaluations.items():
        if ev["kind"] == "negation":
            target = ev["average"]["target"]
            headline[method] = _entry(target, gap_recovered(target, probe, individual), ev["searched"]) | {
                "control_avg": percent(ev["average"]["control"])
            }
        else:
            row = by_method[method]
            headline[method] = _entry(row["average"], row["gap_recovered"], ev["searched"], val_averages.get(method))
    return headline


def headline_name(regime: str, method: str) -> str:
    """A summary row's name in the headline: "probe" and "individual" for the baselines, the method, and
    "<variant>/<name>" in a training-time regime."""
    name = "probe" if is_pretrained(method) else "individual" if method == INDIVIDUAL else method
    return name if regime == "standard" else f"{regime}/{name}"


def regime_headline(
    variant: str, rows: list[dict], evaluations: Mapping[str, dict], val_averages: Mapping[str, float] = {}
) -> dict[str, dict]:
    """One regime variant's headline entries, named "<variant>/<name>": its individual models' test average, then
    per method as in headline_metrics (the gap is of the standard fine-tune's probe-to-individual gap).
    ``rows``: evaluation.summary_rows of the variant (Individual, then one per method)."""
    by_method = {r["method"]: r for r in rows[1:]}
    headline = {f"{variant}/individual": {"test_avg": percent(rows[0]["average"])}}
    for method, ev in evaluations.items():
        row = by_method[method]
        headline[f"{variant}/{method}"] = _entry(
            row["average"], row["gap_recovered"], ev["searched"], val_averages.get(method)
        )
    return headline


def validation_records(merge_metrics: Mapping, coefficient: str | None) -> list[dict]:
    """The validation search as records {hyperparameter, value, val_avg, chosen}: against the method's
    coefficient (or its only searched hyperparameter), the others held at their chosen values; one record for a
    method with a single setting. Task negation: its targets' and controls' average accuracy against lam."""
    if merge_metrics["kind"] == "negation":
        per_task = list(merge_metrics["per_task"].values())
        records = []
        for i, point in enumerate(per_task[0]["curve"]):
            records.append(
                {
                    "hyperparameter": "lam",
                    "value": point["lam"],
                    "val_avg": percent(mean(r["curve"][i]["target"] for r in per_task)),
                    "control_avg": percent(mean(r["curve"][i]["control"] for r in per_task)),
                }
            )
        return records
    grid = list(merge_metrics["grid"])
    x = coefficient if coefficient in grid else (grid[-1] if grid else None)
    chosen = merge_metrics["searched"]
    records = []
    for row in merge_metrics["val_curve"]:
        hp = row["hyperparameters"]
        if any(hp[k] != chosen[k] for k in grid if k != x):
            continue
        records.append(
            {
                "hyperparameter": x or "(one setting)",
                "value": hp[x] if x else 0,
                "val_avg": percent(row["average"]),
                "chosen": all(hp[k] == chosen[k] for k in grid),
            }
        )
    return records


# a margin is inside the seeds' spread when it is smaller than this many pooled standard deviations of a method's
# test average over the seeds (about the 95% band of one run's number)
SPREAD_SDS = 2.0


def over_seeds(per_seed: Mapping[int, Mapping[str, dict]]) -> dict[str, dict]:
    """Each headline name's test average over the seeds (``per_seed``: seed -> its headline entries), for the names
    every seed has: {name: {"seeds": n, "mean", "sd" (sample; None for one seed), "min", "max", "values": {seed: v}}},
    %."""
    import statistics

    names = [
        n
        for n in next(iter(per_seed.values()), {})
        if all(n in h and h[n].get("test_avg") is not None for h in per_seed.values())
    ]
    table = {}
    for name in names:
        values = {seed: float(h[name]["test_avg"]) for seed, h in per_seed.items()}
        v = list(values.values())
        table[name] = {
            "seeds": len(v),
            "mean": round(statistics.fmean(v), 2),
            "sd": round(statistics.stdev(v), 2) if len(v) > 1 else None,
            "min": min(v),
            "max": max(v),
            "values": {str(s): x for s, x in values.items()},
        }
    return table


def pooled_sd(
    table: Mapping[str, dict], exclude: tuple[str, ...] = ("probe", "individual", "task_negation")
) -> float | None:
    """The merge methods' pooled standard deviation over seeds (root mean variance), %; None without two seeds."""
    sds = [e["sd"] for name, e in table.items() if e.get("sd") is not None and name not in exclude]
    return round(mean([s * s for s in sds]) ** 0.5, 2) if sds else None


def seeds_markdown(table: Mapping[str, dict], seeds: list[int]) -> str:
    """The summary's section over seeds: each method's test average, mean ± sd, range and per-seed values."""
    sd = pooled_sd(table)
    lines = [
        f"\n### Over {len(seeds)} seeds ({', '.join(map(str, seeds))}): test accuracy, %\n",
        f"Pooled standard deviation of a method's test average: **{sd if sd is not None else 'n/a'}** points; a "
        "difference between two methods smaller than "
        f"{SPREAD_SDS:g} x that ({'n/a' if sd is None else f'{SPREAD_SDS * sd:.2f}'}) is inside the spread.\n",
        "| method | mean ± sd | min | max | " + " | ".join(f"seed {s}" for s in seeds) + " |",
        "|---|---|---|---|" + "---|" * len(seeds),
    ]
    for name, e in sorted(table.items(), key=lambda kv: -kv[1]["mean"]):
        spread = f"{e['mean']:.2f} ± {e['sd']:.2f}" if e["sd"] is not None else f"{e['mean']:.2f}"
        name = f"{name} (negated tasks' accuracy)" if name == "task_negation" else name
        lines.append(
            f"| {name} | **{spread}** | {e['min']:.1f} | {e['max']:.1f} | "
            + " | ".join(f"{e['values'][str(s)]:.1f}" for s in seeds)
            + " |"
        )
    return "\n".join(lines) + "\n"


def gap_cell(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.0f}%"


# the Pretrained row's name by the head that reads theta0 (finetune.head)
PRETRAINED_BY_HEAD = {
    "probe": "Pretrained (linear probe)",
    "zeroshot": "Pretrained (zero-shot)",
    "verbalizer": "Pretrained (answer words)",
}


def pretrained_name(finetune: Mapping[str, dict]) -> str:
    """The Pretrained row's name by the head that reads theta0 (``finetune``: the tasks' metrics/finetune records)."""
    head = next(iter(finetune.values()))["probe"].get("head", "probe")
    return PRETRAINED_BY_HEAD.get(head, PRETRAINED_BY_HEAD["probe"])


def summary_rows(
    tasks: list[str],
    finetune: Mapping[str, dict],
    evaluations: Mapping[str, dict],
    *,
    regime: str = "standard",
    individual_models: Mapping[str, float] | None = None,
    data: Mapping[str, str] | None = None,
) -> list[dict]:
    """Rows Pretrained (read by the tasks' heads: PRETRAINED_BY_HEAD), Individual and one per method: accuracy per task,
    average, normalized
    accuracy (merged / individual, averaged) and the fraction of the probe-to-individual gap recovered.

    ``data``: per method, what it reads besides the weights (merging.DATA's labels: "none", train statistics, or
    test inputs, test-time adaptation, not comparable with data-free merging); "none" for a method not in it (a
    regime's own model).
    A training-time regime's rows (``regime``: its variant, e.g. mima_n4) are its own task models' test accuracies
    (``individual_models``) in place of Pretrained and Individual, then its methods; they are normalized by the
    standard fine-tune's individual models and its probe-to-individual gap, so that every row compares on one scale."""
    individual = {t: finetune[t]["individual"]["test"] for t in tasks}
    probe = {t: finetune[t]["probe"]["test"] for t in tasks}

    def row(name: str, acc: Mapping[str, float], chosen: str = "", storage: float = 1.0, data: str = "") -> dict:
        avg = mean(acc[t] for t in tasks)
        return {
            "regime": regime,
            "method": name,
            "data": data,
            **{t: acc[t] for t in tasks},
            "average": avg,
            "normalized": normalized_average({t: acc[t] for t in tasks}, individual),
            "gap_recovered": gap_recovered(avg, mean(probe.values()), mean(individual.values())),
            "storage_models": storage,
            "chosen": chosen,
        }

    def shown(v) -> str:
        return "per task" if isinstance(v, Mapping) else str(v)

    if individual_models is None:
        rows = [row(pretrained_name(finetune), probe), row("Individual", individual, storage=float(len(tasks)))]
    else:
        rows = [row("Individual", individual_models, storage=float(len(tasks)))]
    for name, ev in evaluations.items():
        chosen = ", ".join(f"{k}={shown(v)}" for k, v in ev["searched"].items())
        rows.append(row(name, ev["accuracy"], chosen, ev.get("storage_models", 1.0), (data or {}).get(name, "none")))
    return rows


def summary_legend(measure: str, sizes: Mapping[str, int]) -> str:
    """What the full table's columns mean, and each task's number of test examples."""
    counts = ", ".join(f"{t} {n}" for t, n in sizes.items())
    return (
        f"\n## Every score\n\nTest {measure} per task and averaged, %. "
        f"Test examples per task: {counts}. regime: the fine-tune the task "
        "vectors come from (standard, or a training-time regime's "
        "variant). data: what the method reads besides the weights. norm.: "
        f"the average of each task's {measure} divided by its individual "
        "model's. gap rec.: the share of the gap from the pretrained model "
        "to the individual models that the method recovers (0% at the "
        "pretrained model, 100% at the individual models; n/a where the "
        "individual models do not beat the pretrained one). storage: "
        "in models. chosen (val): the hyperparameters the validation "
        "search chose (per task: one value per task).\n\n"
    )


def summary_markdown(rows: list[dict], tasks: list[str]) -> str:
    head = ["regime", "method", "data", *tasks, "avg", "norm.", "gap rec.", "storage (models)", "chosen (val)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            r["regime"],
            r["method"],
            r["data"],
            *(f"{100 * r[t]:.1f}" for t in tasks),
            f"**{100 * r['average']:.1f}**",
            "n/a" if r["normalized"] is None else f"{100 * r['normalized']:.1f}",
            gap_cell(r["gap_recovered"]),
            f"{r['storage_models']:.2f}",
            r["chosen"],
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def summary_csv(rows: list[dict], tasks: list[str]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(
        buf,
        fieldnames=[
            "regime",
            "method",
            "data",
            *tasks,
            "average",
            "normalized",
            "gap_recovered",
            "storage_models",
            "chosen",
        ],
    )
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def negation_markdown(method: str, ev: dict, tasks: list[str]) -> str:
    """Forgetting (accuracy on the negated task) against control (the other tasks), pretrained beside negated."""
    lines = [
        f"\n### {method}: forgetting vs control (test accuracy, %)\n",
        "| negated task | lam | target: pretrained → negated | control: pretrained → negated |",
        "|---|---|---|---|",
    ]
    for t in tasks:
        r = ev["per_task"][t]
        lines.append(
            f"| {t} | {r['lam']:g} | {100 * r['pretrained_target']:.1f} → {100 * r['target']:.1f} | "
            f"{100 * r['pretrained_control']:.1f} → {100 * r['control']:.1f} |"
        )
    a = ev["average"]
    lines.append(
        f"| **average** | | {100 * a['pretrained_target']:.1f} → **{100 * a['target']:.1f}** | "
        f"{100 * a['pretrained_control']:.1f} → **{100 * a['control']:.1f}** |"
    )
    return "\n".join(lines) + "\n"
