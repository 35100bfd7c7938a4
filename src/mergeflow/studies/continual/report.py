"""Study continual: the study function, registered as ``continual``, and its report's tables."""

from __future__ import annotations

from pathlib import Path

from mergeflow.studies import StudyContext, StudyResult, no_grad, register
from mergeflow.studies.continual.claims import claims
from mergeflow.studies.continual.figures import plot_arrivals
from mergeflow.studies.continual.measure import Run, Suite, individual_accuracy
from mergeflow.studies.continual.settings import ContinualSettings


def _pct(x: float | None, sign: bool = False) -> str:
    return "—" if x is None else f"{100 * x:+.1f}" if sign else f"{100 * x:.1f}"


def accuracy_table(runs: dict[str, Run], individual: dict[str, float] | None) -> str:
    """Methods x arrivals: A_t (%), then the backward transfer (points)."""
    order = next(iter(runs.values())).order
    head = "| method | " + " | ".join(f"{k + 1}. {t}" for k, t in enumerate(order)) + " | BWT |"
    lines = [head, "|---|" + "---|" * (len(order) + 1)]
    for name, run in runs.items():
        cells = [_pct(run.average(t)) for t in range(len(order))]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {_pct(run.backward_transfer(), sign=True)} |")
    if individual is not None:
        seen = [sum(individual[t] for t in order[: k + 1]) / (k + 1) for k in range(len(order))]
        lines.append("| fine-tuned models | " + " | ".join(_pct(v) for v in seen) + " | |")
    return "\n".join(lines) + "\n"


def forgetting_table(runs: dict[str, Run]) -> str:
    """Per task in arrival order and per method: accuracy right after it arrived -> after the last arrival."""
    order = next(iter(runs.values())).order
    lines = ["| task | " + " | ".join(runs) + " |", "|---|" + "---|" * len(runs)]
    for task in order:
        cells = [
            f"{_pct(r.just_after(task))} → {_pct(r.accuracy[-1][task])} ({_pct(r.forgetting(task), sign=True)})"
            for r in runs.values()
        ]
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _record(runs: dict[str, Run]) -> dict:
    return {
        name: {
            "hyperparameters": run.hyperparameters,
            "order": run.order,
            "accuracy": [{t: round(a, 6) for t, a in step.items()} for step in run.accuracy],
            "average": [round(run.average(t), 6) for t in range(len(run.order))],
            "backward_transfer": None if run.backward_transfer() is None else round(run.backward_transfer(), 6),
        }
        for name, run in runs.items()
    }


@register(
    "continual",
    paper="Tang et al. 2025, Merging on the fly without retraining (OPCM, NeurIPS 2025, arXiv:2501.09522); "
    "Continual model merging without data: dual projections (DOP, NeurIPS 2025)",
    title="Continual merging: the task models arrive one at a time; how much does each method keep?",
    settings=ContinualSettings,
    claims={"opcm.1": "opcm_beats_sequential_baselines", "opcm.2": "opcm_forgets_less", "dop.1": "dop_beats_opcm"},
)
@no_grad
def continual_study(context: StudyContext) -> StudyResult:
    from mergeflow.core.files import write_json
    from mergeflow.ml.continual import REGISTRY

    s: ContinualSettings = context.settings
    order = s.order_of(list(context.params.suite.tasks))
    suite = Suite(context)
    runs = {m: suite.run(m, dict(s.hyperparameters.get(m, {})), order) for m in s.methods}
    individual = individual_accuracy(context, order)
    out = Path(context.out_dir)
    plot_arrivals(runs, individual, out / "arrivals.png")
    write_json(out / "accuracy.json", _record(runs))
    described = "; ".join(
        f"`{m}` ({', '.join(f'{k}={v!r}' for k, v in runs[m].hyperparameters.items()) or 'no hyperparameters'}; "
        f"{REGISTRY[m].reference})"
        for m in runs
    )
    body = [
        f"The task models arrive one at a time in the order {', '.join(order)}; after each arrival the merged model "
        "is updated from the previous merged model and the new task vector only (a method keeps at most a bounded "
        "summary: a count, a norm, a running vector). Each merged model is scored on the test split of every task "
        "seen so far, each task with its own head. Methods (mergeflow.ml.continual): " + described + ".",
        "",
        "A_t is the mean test accuracy over the t tasks seen after arrival t. Backward transfer, BWT = 1/(T−1) "
        "Σ_{i<T} (a_T,i − a_i,i): a task's accuracy after the last arrival minus right after its own arrival, "
        "averaged over the tasks before the last (FusionBench's compute_backward_transfer divides the same sum by "
        "T). Verdicts compare the numbers as measured (no threshold); the margins are set against the spread over "
        "seeds where params.yaml's seeds ran.",
        "",
        "## Average accuracy over the tasks seen, after each arrival (%)",
        "",
        accuracy_table(runs, individual),
        "![accuracy after each arrival, and backward transfer](arrivals.png)",
        "",
        "## Each task right after its arrival → after the last (%; forgetting in points)",
        "",
        forgetting_table(runs),
        "Every a_t,i is in accuracy.json beside this report.",
        "",
    ]
    return StudyResult(claims=claims(runs), body="\n".join(body), figures=["arrivals.png"])
