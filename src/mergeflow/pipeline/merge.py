"""The stages that merge, evaluate and report: each merge (its hyperparameters chosen on validation, then tested),
each regime's merges, the replicates with other seeds, the summary report and the studies."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Mapping

import torch


from mergeflow.config import Params
from mergeflow.ml.data import load_tasks as _load_tasks
from mergeflow.core.errors import MergeflowError
from mergeflow.ml.evaluation import MultiTaskEvaluator, mean, normalized, normalized_average
from mergeflow.core.io import load_metadata, load_state_dict, save_state_dict
from mergeflow.core.files import atomic_path, read_json, write_json
from mergeflow.core.layout import Layout, MergeRun
from mergeflow.ml.merging import DATA, REGISTRY
from mergeflow.ml.merging import BASE_PREFIX, store_bytes
from mergeflow.pipeline.binding import bind_data
from mergeflow.ml.merging.search import negation_search, search
from mergeflow.ml.models import build_backbone, load_heads as _load_heads
from mergeflow.core.reproducibility.machine import environment_markdown, recorded
from mergeflow.report.plots import is_reference, plot_accuracy_heatmap, plot_averages, plot_learned_coefficients
from mergeflow.report.leaderboard import board, board_markdown, board_text
from mergeflow.report.search_plots import plot_merge_search
from mergeflow.report.uncertainty import LEVEL, RESAMPLES, resample_indices
from mergeflow.report.summary import (
    SPREAD_SDS,
    headline_metrics,
    headline_name,
    merge_line,
    negation_markdown,
    over_seeds,
    pooled_sd,
    regime_headline,
    seeds_markdown,
    summary_csv,
    summary_legend,
    summary_markdown,
    summary_rows,
    validation_records,
)
from mergeflow.ml.task_vectors import (
    load_task_vectors as _load_task_vectors,
    materialise as _materialise,
    state_bytes as _bytes,
)
from mergeflow.ml.training import Timer


from mergeflow.pipeline.train import EVALUATED, _setup, finetune, statistics, vectors


def regime_merge(params: Params, name: str, layout: Layout = Layout()) -> dict:
    """Stage regime_merge@<name>: each variant of regime <name> merged with each of its methods, the
    hyperparameters chosen on validation as for the standard regime (merge.<method> sets the grids), then tested;
    the regime's own name in its methods evaluates its own model (ATM's theta(R), MIMA's uniform average)."""
    params.check_regime(name)
    cfg = params.regimes.config(name)
    device = _setup(params, params.seed)
    regime_metrics = read_json(layout.metrics("regime", name))
    out: dict[str, dict] = {}
    with Timer() as timer:
        tasks = _load_tasks(params, layout, EVALUATED)
        heads = _load_heads(params, layout, build_backbone(params.backbone).num_features, tasks)
        ft = {t: read_json(layout.metrics("finetune", t)) for t in params.suite.tasks}
        for variant in cfg.variants(name, params.finetune.steps):
            if variant not in regime_metrics["variants"]:
                raise MergeflowError(
                    f"{layout.metrics('regime', name)}: no variant '{variant}' (run regime@{name} again)"
                )
            for method in params.regimes.methods_of(name):
                run = layout.merge_run(method, name, variant)
                if method == name:
                    if regime_metrics["variants"][variant]["model"] is None:
                        raise MergeflowError(
                            f"regimes.{name}.methods: regime {name} has no model of its own to evaluate"
                        )
                    evaluator = MultiTaskEvaluator(
                        params.backbone,
                        tasks,
                        heads,
                        "test",
                        device,
                        params.runtime.eval_batch_size,
                        keep_predictions=True,
                    )
                    acc = evaluator(load_state_dict(layout.regime_model(name, variant)))
                    # its test predictions too: the leaderboard's interval, as every merge's
                    save_state_dict(run.predictions, evaluator.predictions, {"method": method})
                    individual = {t: ft[t]["individual"]["test"] for t in params.suite.tasks}
                    evaluation = {
                        "method": method,
                        "kind": "regime_model",
                        "hyperparameters": regime_metrics["variants"][variant]["hyperparameters"],
                        "searched": {},
                        "accuracy": acc,
                        "average": mean(acc.values()),
                        "normalized": normalized(acc, individual),
                        "normalized_average": normalized_average(acc, individual),
                        "storage_models": 1.0,
                    }
                    write_json(run.evaluation, evaluation)
                else:
                    choice, evaluation = merge_and_evaluate(params, run, layout, tasks, heads, device)
                    print(merge_line(f"{variant}/{method}", choice, evaluation), flush=True)
                out[f"{variant}/{method}"] = evaluation
    write_json(layout.timing("regime_merge", name), timer.record())
    return out


# ---------------------------------------------------------------- merge
def merge(params: Params, method: str, layout: Layout = Layout()) -> dict:
    """Stage merge@<method>: merge the standard regime's task vectors with one method (``merge_and_evaluate``)."""
    params.check_method(method)
    device = _setup(params, params.seed)
    with Timer() as timer:
        tasks = _load_tasks(params, layout, EVALUATED)
        heads = _load_heads(params, layout, build_backbone(params.backbone).num_features, tasks)
        metrics, evaluated = merge_and_evaluate(params, layout.merge_run(method), layout, tasks, heads, device)
        print(merge_line(method, metrics, evaluated), flush=True)
    learning = {"learning": evaluated["learning"]} if "learning" in evaluated else {}
    write_json(
        layout.timing("merge", method),
        timer.record() | {"evaluate_wall_time_s": evaluated["wall_time_s"], "ended": time.time()} | learning,
    )
    return metrics


def merge_and_evaluate(params: Params, run: MergeRun, layout: Layout, tasks, heads, device) -> tuple[dict, dict]:
    """Merge ``run.vectors`` with ``run.method``; every grid point is scored on the validation split and the best
    is kept, then evaluated on test (``evaluate``), in the same process: a stage's start costs more than a small
    model's merge. Returns the choice's metrics and the evaluation's.

    A per-task method's output is its store (each task's model is rebuilt from it); task negation's output is the
    coefficient chosen for each task.
    """
    method = run.method
    spec = REGISTRY[method]
    overrides = params.merge.overrides(method)
    pretrained, tvs = _load_task_vectors(params, layout, run.vectors)
    data = None
    if spec.reads:
        data = bind_data(params, spec, layout, tasks, heads, device)
        spec = spec.with_data(data)
    # the candidates are compared under bf16 autocast on CUDA (float32 on the CPU); the chosen one's test is float32
    on_val = MultiTaskEvaluator(params.backbone, tasks, heads, "val", device, params.runtime.eval_batch_size, bf16=True)
    try:
        if spec.kind == "negation":
            pretrained_acc = on_val(_materialise(pretrained))  # a dict of the tensors already read, when held in memory
            negation = negation_search(spec, overrides, pretrained, tvs, on_val, pretrained_acc)
        else:
            best, output, curve, per_task = search(spec, overrides, pretrained, tvs, on_val, params.merge.search)
    except ValueError as err:
        raise MergeflowError(str(err)) from None
    fixed, grid = spec.search_space(overrides)
    metrics = {"method": method, "kind": spec.kind, "paper": spec.paper, "grid": grid}
    if spec.kind == "negation":
        output = {f"lam/{t}": torch.tensor(float(r["chosen"]["lam"])) for t, r in negation.items()}
        metrics |= {
            "hyperparameters": fixed,
            "searched": {},
            "pretrained_val_accuracy": pretrained_acc,
            "per_task": negation,
        }
    else:
        metrics |= {
            "hyperparameters": best["hyperparameters"] | per_task["chosen"],
            "searched": {k: best["hyperparameters"][k] for k in grid} | per_task["chosen"],
            "val_accuracy": best["accuracy"],
            "val_average": best["average"],
            "val_curve": curve,
            "per_task_curves": per_task["curves"],
        }
        if spec.kind in ("per_task", "routed"):
            uses_theta0 = not any(k.startswith(BASE_PREFIX) for k in output)
            model_bytes = _bytes(pretrained)
            metrics |= {
                "storage_bytes": store_bytes(output) + (model_bytes if uses_theta0 else 0),
                "model_bytes": model_bytes,
            }
    if data is not None:
        metrics["reads"] = spec.reads
    if data is not None and data.learned:  # the chosen candidate's coefficients (one record per candidate, in order)
        metrics["learned"] = data.learned[curve.index(best)]
    save_state_dict(
        run.merged,
        output,
        {"method": method, "kind": spec.kind, "hyperparameters": json.dumps(metrics["hyperparameters"])},
    )
    with atomic_path(run.search_plot) as tmp:
        (plot_learned_coefficients if "learned" in metrics else plot_merge_search)(metrics, tmp)
    write_json(run.choice, metrics)
    write_json(run.search_log, validation_records(metrics, spec.coefficient))
    evaluation = evaluate(params, method, layout, tasks=tasks, heads=heads, run=run)
    if data is not None and data.timing:
        evaluation["learning"] = data.timing
    return metrics, evaluation


# ---------------------------------------------------------------- evaluate
def evaluate(
    params: Params, method: str, layout: Layout = Layout(), *, tasks=None, heads=None, run: MergeRun | None = None
) -> dict:
    """Test accuracy on every task, absolute and normalized by the (standard regime's) individual model
    (per-task methods: each task with its own rebuilt model; task negation: the negated task's accuracy against
    the others'). ``run``: a regime's merge (default: the standard regime's, merge@<method>)."""
    run = run or layout.merge_run(method)
    spec = REGISTRY[method]
    device = _setup(params, params.seed)
    chosen = read_json(run.choice)
    ft = {t: read_json(layout.metrics("finetune", t)) for t in params.suite.tasks}
    with Timer() as timer:
        output = load_state_dict(run.merged)
        tasks = tasks or _load_tasks(params, layout, EVALUATED)
        heads = heads or _load_heads(params, layout, build_backbone(params.backbone).num_features, tasks)
        # the test predictions of the model(s) tested, for the leaderboard's bootstrap (negation: each task's under
        # its own negation)
        evaluator = MultiTaskEvaluator(
            params.backbone, tasks, heads, "test", device, params.runtime.eval_batch_size, keep_predictions=True
        )
        predictions = evaluator.predictions
        if spec.kind == "negation":
            pretrained, tvs = _load_task_vectors(params, layout, run.vectors)
            per_task, negated = {}, {}
            for t in params.suite.tasks:
                lam = round(float(output[f"lam/{t}"]), 6)  # stored as a float32 tensor
                acc = evaluator(spec(pretrained, {t: tvs[t]}, **{**chosen["hyperparameters"], "lam": lam}))
                negated[t] = evaluator.predictions[t]
                others = [o for o in params.suite.tasks if o != t]
                per_task[t] = {
                    "lam": lam,
                    "target": acc[t],
                    "control": mean(acc[o] for o in others),
                    "pretrained_target": ft[t]["probe"]["test"],
                    "pretrained_control": mean(ft[o]["probe"]["test"] for o in others),
                }
        elif spec.kind == "per_task":
            pretrained = load_state_dict(layout.pretrained)
            acc = evaluator.per_task(lambda t: spec.reconstruct(output, pretrained, t), spec.feature_maps(output))
        elif spec.kind == "routed":
            acc = evaluator.network(lambda backbone: spec.network(output, backbone))
        else:
            acc = evaluator(output)
    metrics = {
        "method": method,
        "kind": spec.kind,
        "hyperparameters": chosen["hyperparameters"],
        "searched": chosen["searched"],
    }
    if spec.kind == "negation":
        metrics |= {
            "per_task": per_task,
            "average": {
                k: mean(r[k] for r in per_task.values())
                for k in ("target", "control", "pretrained_target", "pretrained_control")
            },
        }
    else:
        individual = {t: ft[t]["individual"]["test"] for t in params.suite.tasks}
        metrics |= {
            "accuracy": acc,
            "average": mean(acc.values()),
            "normalized": normalized(acc, individual),
            "normalized_average": normalized_average(acc, individual),
            "storage_models": chosen["storage_bytes"] / chosen["model_bytes"] if "storage_bytes" in chosen else 1.0,
        }
    save_state_dict(run.predictions, negated if spec.kind == "negation" else predictions, {"method": method})
    write_json(run.evaluation, metrics)
    return metrics | {"wall_time_s": timer.seconds}


# ---------------------------------------------------------------- report
def regime_evaluations(params: Params, layout: Layout) -> dict[str, dict]:
    """Each regime variant's own task models' test accuracies and its methods' evaluations:
    {variant: {"regime": name, "individual": {task: acc}, "evaluations": {method: metrics/.../evaluate/<m>.json},
    "val_averages": {method: its choice's validation average}}}."""
    out = {}
    for name in params.regimes.run:
        cfg = params.regimes.config(name)
        measured = read_json(layout.metrics("regime", name))["variants"]
        for variant in cfg.variants(name, params.finetune.steps):
            out[variant] = {
                "regime": name,
                "individual": {t: measured[variant]["individual"][t]["test"] for t in params.suite.tasks},
                "evaluations": {
                    m: read_json(layout.merge_run(m, name, variant).evaluation) for m in params.regimes.methods_of(name)
                },
                # the regime's own model is evaluated, not chosen: its validation average is the regime stage's
                "val_averages": {
                    m: measured[variant]["model"]["average"]["val"]
                    if m == name
                    else read_json(layout.merge_run(m, name, variant).choice).get("val_average")
                    for m in params.regimes.methods_of(name)
                },
            }
    return out


def data_labels() -> dict[str, str]:
    """Per method, the summary's "data" column: what it reads besides the weights (merging.DATA)."""
    return {name: DATA[spec.reads] for name, spec in REGISTRY.items()}


def report(params: Params, layout: Layout = Layout()) -> dict:
    """Summary table (Markdown, CSV, JSON), the accuracy heatmap and the sorted averages; the headline metrics
    (metrics/headline/, a small file per method) that `dvc metrics show`, `dvc exp show` and `dvc metrics diff`
    compare. The standard regime's rows come first; each training-time regime's variant adds its individual models
    and its methods (the regime column)."""
    tasks = params.suite.tasks
    ft = {t: read_json(layout.metrics("finetune", t)) for t in tasks}
    ev = {m: read_json(layout.metrics("evaluate", m)) for m in params.merge.methods}
    negations = {m: e for m, e in ev.items() if e["kind"] == "negation"}
    rows = summary_rows(tasks, ft, {m: e for m, e in ev.items() if m not in negations}, data=data_labels())
    headline = headline_metrics(rows, ev, {m: read_json(layout.metrics("merge", m)).get("val_average") for m in ev})
    regimes = regime_evaluations(params, layout)
    for variant, r in regimes.items():
        variant_rows = summary_rows(
            tasks, ft, r["evaluations"], regime=variant, individual_models=r["individual"], data=data_labels()
        )
        rows += variant_rows
        headline |= regime_headline(variant, variant_rows, r["evaluations"], r["val_averages"])
    measure = "accuracy" if params.suite.modality == "image" else "score"  # text: each task's GLUE metric
    spread = seed_spread(params, layout)
    boards, sizes = leaderboards(params, layout, rows, {v: r["regime"] for v, r in regimes.items()}, spread)
    print(board_text(boards, sizes, measure, shutil.get_terminal_size((160, 24)).columns), flush=True)
    labelled = [r if r["regime"] == "standard" else r | {"method": f"{r['method']} ({r['regime']})"} for r in rows]
    for name, entry in spread.items():  # with more seeds: each name's mean and spread beside the run's own
        headline[name] |= {"seeds": entry["seeds"], "test_avg_mean": entry["mean"], "test_avg_sd": entry["sd"]}
    with atomic_path(layout.results, directory=True) as tmp:
        seeds_section = seeds_markdown(spread, [params.seed, *params.seeds]) if spread else ""
        # the environments of the stages so far (provenance.json, not a declared dependency: each stage's end,
        # this one's included, rewrites it)
        environments = environment_markdown(
            {a: r for a, r in recorded(layout.root).items() if a not in ("report", "track")}
        )
        board = board_markdown(boards, sizes, measure)
        (tmp / "leaderboard.md").write_text(board)
        write_json(
            tmp / "leaderboard.json",
            {"measure": measure, "resamples": RESAMPLES, "level": LEVEL, "test_examples": sizes, "boards": boards},
        )
        (tmp / "summary.md").write_text(
            f"# {params.suite.name}: merging {len(tasks)} tasks\n\n{board}\n"
            f"{summary_legend(measure, sizes)}{summary_markdown(rows, tasks)}"
            + seeds_section
            + "".join(negation_markdown(m, e, tasks) for m, e in negations.items())
            + environments
        )
        (tmp / "summary.csv").write_text(summary_csv(rows, tasks))
        write_json(
            tmp / "summary.json",
            {"rows": rows, "negation": negations}
            | ({"seeds": spread, "pooled_sd": pooled_sd(spread)} if spread else {}),
        )
        write_json(
            tmp / "averages.json",
            [
                {"method": r["method"], "regime": r["regime"], "test_avg": round(100 * r["average"], 2)}
                for r in labelled
            ],
        )
        plot_accuracy_heatmap(labelled, tasks, tmp / "accuracy.png", measure)
        plot_averages(labelled, tmp / "averages.png", measure)
    with atomic_path(layout.headline, directory=True) as tmp:
        for name, entry in headline.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            write_json(tmp / f"{name}.json", entry)
    return {"rows": rows, "negation": negations, "headline": headline}


def leaderboards(
    params: Params, layout: Layout, rows: list[dict], regime_of: Mapping[str, str], spread: Mapping[str, dict] = {}
) -> tuple[dict[str, list[dict]], dict[str, int]]:
    """Each regime's leaderboard (report.leaderboard.board) from the summary's ``rows`` (``regime_of``: a regime
    variant's regime), the spread over seeds by headline name (seed_spread; {} with one seed) and the test predictions
    the fine-tunes and merges kept, every model on the same resamples of each task's test examples; and each
    task's number of test examples. A model whose predictions are missing has no interval."""
    tasks = params.suite.tasks
    kept = {t: load_state_dict(layout.predictions("finetune", t)) for t in tasks}
    labels = {t: kept[t]["labels"] for t in tasks}
    metrics = {t: load_metadata(layout.predictions("finetune", t))["metric"] for t in tasks}
    indices = resample_indices({t: len(y) for t, y in labels.items()}, RESAMPLES, params.seed)
    boards: dict[str, list[dict]] = {}
    for regime in dict.fromkeys(r["regime"] for r in rows):
        regime_rows = [r for r in rows if r["regime"] == regime]
        predictions = {}
        if regime == "standard":
            predictions = {
                regime_rows[0]["method"]: {t: kept[t]["probe"] for t in tasks},
                "Individual": {t: kept[t]["individual"] for t in tasks},
            }
        for r in regime_rows:
            run = (
                layout.merge_run(r["method"])
                if regime == "standard"
                else layout.merge_run(r["method"], regime_of[regime], regime)
            )
            if not is_reference(r["method"]) and run.predictions.is_file():
                predictions[r["method"]] = load_state_dict(run.predictions)
        boards[regime] = board(
            regime_rows,
            predictions,
            labels,
            metrics,
            indices,
            {
                r["method"]: spread[name]
                for r in regime_rows
                if (name := headline_name(r["regime"], r["method"])) in spread
            },
        )
    return boards, {t: len(y) for t, y in labels.items()}


# ---------------------------------------------------------------- replicate
def replicate(params: Params, seed: int, layout: Layout = Layout()) -> dict:
    """Stage replicate@<seed>: the fine-tunes and merges again with another seed (params.seeds), on the run's data
    and pretrained backbone: every task's probe and fine-tune, the task vectors (and statistics, for the data-aware
    methods), every method of merge.methods, under replicates/<seed>/ (Layout.replicate); then the seed's headline
    (individual, probe, each method's test average) in metrics/replicates/<seed>.json, which the report sets beside
    the run's own."""
    from mergeflow.ml.merging import REGISTRY as METHODS

    params.check_replicate(seed)
    seeded = params.model_copy(update={"seed": seed})
    at = layout.replicate(seed)
    with Timer() as timer:
        for task in params.suite.tasks:
            finetune(seeded, task, at)
        vectors(seeded, at)
        if any(METHODS[m].reads for m in params.merge.methods):
            statistics(seeded, at)
        for method in params.merge.methods:
            merge(seeded, method, at)
    headline = _headline(params, at)
    write_json(layout.replicate_summary(seed), {"seed": seed, "headline": headline})
    write_json(layout.timing("replicate", str(seed)), timer.record())
    return headline


def _headline(params: Params, layout: Layout) -> dict[str, dict]:
    """The standard regime's headline (probe, individual, each method) from the fine-tunes' and merges' metrics."""
    tasks = params.suite.tasks
    ft = {t: read_json(layout.metrics("finetune", t)) for t in tasks}
    ev = {m: read_json(layout.metrics("evaluate", m)) for m in params.merge.methods}
    rows = summary_rows(tasks, ft, {m: e for m, e in ev.items() if e["kind"] != "negation"}, data=data_labels())
    return headline_metrics(rows, ev, {m: read_json(layout.metrics("merge", m)).get("val_average") for m in ev})


def seed_spread(params: Params, layout: Layout) -> dict[str, dict]:
    """Each headline name's test average over seed and params.seeds (summary.over_seeds); {} with one seed."""
    if not params.seeds:
        return {}
    per_seed = {params.seed: _headline(params, layout)} | {
        s: read_json(layout.replicate_summary(s))["headline"] for s in params.seeds
    }
    return over_seeds(per_seed)


# ---------------------------------------------------------------- study
def study(params: Params, name: str, layout: Layout = Layout()) -> dict:
    """Stage study@<name>: one of the papers' analyses (mergeflow.studies) on the pipeline's outputs. Writes
    studies/<name>/report.md (its verdict per claim, tables, figures), metrics/studies/<name>.json (the claims)
    and metrics/verdicts/<name>.json (their counts, in git)."""
    from mergeflow.studies import REGISTRY as STUDIES, StudyContext, against_spread, verdict_table

    params.check_study(name)
    spec = STUDIES[name]
    device = _setup(params, params.seed)
    spread = seed_spread(params, layout)
    with Timer() as timer, atomic_path(layout.study(name), directory=True) as tmp:
        result = spec.fn(StudyContext(params, layout, params.studies.settings(name), tmp, device))
        result.claims = [against_spread(c, pooled_sd(spread), 1 + len(params.seeds), SPREAD_SDS) for c in result.claims]
        (tmp / "report.md").write_text(
            f"# {spec.title}\n\n{spec.paper}\n\n## Verdicts\n\n{verdict_table(result.claims)}\n{result.body}"
        )
    verdicts = [c.verdict for c in result.claims]
    counts = {
        "holds": verdicts.count("holds"),
        "fails": verdicts.count("fails"),
        "not_measured": verdicts.count("not measured"),
    }
    claims = [c.record() | {"name": spec.claim_name(c.id)} for c in result.claims]
    metrics = {"study": name, "paper": spec.paper} | counts | {"claims": claims}
    write_json(layout.metrics("studies", name), metrics)
    write_json(layout.verdicts(name), counts)
    write_json(layout.timing("study", name), timer.record())
    return metrics
