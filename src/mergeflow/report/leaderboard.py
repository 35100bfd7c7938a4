"""The leaderboard: per regime, the methods ranked by their test average with the baselines among them (the
pretrained model read by the tasks' heads, the individual fine-tunes, the ensembles: unranked), each score with its
95% bootstrap interval over the test examples (mergeflow.report.uncertainty), its difference to the best method
and to task arithmetic (paired: both on the same resamples), the hyperparameters chosen on validation, the storage
and what the method reads. A difference whose interval contains 0 is a tie within the test set's noise, marked ≈.

The same entries make results/leaderboard.md (in results/summary.md), the report stage's terminal output, the
MLflow runs' interval metrics and `mergeflow compare`."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mergeflow.report.plots import is_baseline  # the rows that are not merges: pretrained, individual, ensembles
from mergeflow.report.summary import percent
from mergeflow.report.tables import render
from mergeflow.report.uncertainty import LEVEL, interval, resampled_averages

REFERENCE = "task_arithmetic"  # the second difference column: the method most papers compare with
TIE = "≈"
ALIGN = "rlrrrlrl"  # board_table's columns: numbers right, names left (one more number with seeds)


def column_align(table: list[list[str]]) -> str:
    return ALIGN if len(table[0]) == len(ALIGN) else ALIGN[:3] + "r" + ALIGN[3:]


def board(
    rows: list[dict],
    predictions: Mapping[str, Mapping[str, torch.Tensor]],
    labels: Mapping[str, torch.Tensor],
    metrics: Mapping[str, str],
    indices: Mapping[str, torch.Tensor],
    over_seeds: Mapping[str, Mapping] = {},
) -> list[dict]:
    """One regime's entries, best test average first. ``rows``: summary_rows of the regime (fractions);
    ``predictions``: row name -> task -> test predictions, for the rows that kept them (the others get no
    interval); ``indices``: the resamples (uncertainty.resample_indices), shared by every row and regime;
    ``over_seeds``: row name -> its test average over the run's seeds (summary.over_seeds' entry), where the run
    has more than one."""
    samples = resampled_averages(
        {r["method"]: predictions[r["method"]] for r in rows if r["method"] in predictions}, labels, metrics, indices
    )
    ranked = sorted(rows, key=lambda r: -r["average"])
    methods = [r for r in ranked if not is_baseline(r["method"])]
    best = methods[0]["method"] if methods else None
    reference = REFERENCE if any(r["method"] == REFERENCE for r in rows) else None
    by_name = {r["method"]: r for r in rows}

    def difference(name: str, other: str | None) -> dict:
        """name's average minus other's, %, with the paired interval when both kept predictions."""
        if other is None or name == other:
            return {"delta": None, "low": None, "high": None, "tie": False}
        delta = 100 * (by_name[name]["average"] - by_name[other]["average"])
        if name not in samples or other not in samples:
            return {"delta": round(delta, 2), "low": None, "high": None, "tie": False}
        low, high = interval(samples[name] - samples[other])
        return {"delta": round(delta, 2), "low": percent(low), "high": percent(high), "tie": low <= 0 <= high}

    entries, rank = [], 0
    for r in ranked:
        name = r["method"]
        rank += 0 if is_baseline(name) else 1
        low, high = interval(samples[name]) if name in samples else (None, None)
        entries.append(
            {
                "regime": r["regime"],
                "method": name,
                "baseline": is_baseline(name),
                "rank": None if is_baseline(name) else rank,
                "score": percent(r["average"]),
                "average": r["average"],
                "low": percent(low),
                "high": percent(high),
                "vs_best": difference(name, best),
                "vs_reference": difference(name, reference),
                "best": best,
                "reference": reference,
                "chosen": r["chosen"],
                "storage_models": r["storage_models"],
                "data": r["data"],
                "seeds": {k: over_seeds[name][k] for k in ("seeds", "mean", "sd")} if name in over_seeds else None,
            }
        )
    return entries


def _difference_cell(d: Mapping) -> str:
    if d["delta"] is None:
        return ""
    delta = f"{d['delta']:+.1f}" if round(d["delta"], 1) != 0 else "0.0"  # no "-0.0"
    return delta + (f" {TIE}" if d["tie"] else "")


def score_cell(e: Mapping | None) -> str:
    """An entry's score and interval; the score from the unrounded average where the entry has it, as the
    summary's table prints it (83.749.. is 83.7 in both)."""
    if e is None:
        return "-"
    return f"{100 * e['average'] if 'average' in e else e['score']:.1f}" + (
        f" [{e['low']:.1f}, {e['high']:.1f}]" if e["low"] is not None else ""
    )


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def board_table(entries: list[dict], chosen_width: int = 40) -> list[list[str]]:
    """The entries as table rows, a header first: rank, method, score [interval], the two differences, choice,
    storage, what the method reads."""
    seeds = next((e["seeds"]["seeds"] for e in entries if e.get("seeds")), None)
    head = [
        "#",
        "method",
        f"test avg [{LEVEL:.0%} CI]",
        *([f"{seeds} seeds: mean ± sd"] if seeds else []),
        "Δ best",
        "Δ TA",
        "chosen on val",
        "storage",
        "reads",
    ]
    table = [head]
    for e in entries:
        spread = [] if not seeds else [f"{e['seeds']['mean']:.1f} ± {e['seeds']['sd']:.1f}" if e.get("seeds") else ""]
        score = score_cell(e)
        table.append(
            [
                "-" if e["rank"] is None else str(e["rank"]),
                e["method"],
                score,
                *spread,
                _difference_cell(e["vs_best"]),
                _difference_cell(e["vs_reference"]),
                _cut(e["chosen"], chosen_width),
                f"{e['storage_models']:.2f}",
                "" if e["data"] in ("none", "") else e["data"],
            ]
        )
    return table


def legend(sizes: Mapping[str, int], measure: str) -> str:
    """What the columns mean, and the test sets' sizes the intervals come from."""
    counts = sorted(set(sizes.values()))
    examples = (
        f"{counts[0]} test examples per task"
        if len(counts) == 1
        else f"{min(counts)}–{max(counts)} test examples per task"
    )
    return (
        f"Test {measure} averaged over {len(sizes)} task{'s' if len(sizes) > 1 else ''}, %, best first; the baselines "
        "(the pretrained model under the tasks' heads, "
        f"the individual fine-tunes, the ensembles, which run every fine-tune) unranked (-). [CI]: {LEVEL:.0%} "
        f"bootstrap interval over the test examples ({examples}). "
        f"Δ best, Δ TA: the difference to the best method and to task arithmetic "
        f"in points; {TIE} marks a tie, a difference whose paired {LEVEL:.0%} "
        "interval contains 0. chosen on val: the hyperparameters "
        "the validation search chose. storage: in models (1.00 = one "
        "merged model). reads: what the method uses besides the weights."
    )


def title(regime: str, entries: list[dict]) -> str:
    best = entries[0]["best"] if entries else None
    ties = [e["method"] for e in entries if e["vs_best"]["tie"] and not e["baseline"]]
    tied = f"; within its noise: {', '.join(ties)}" if ties else ""
    return f"{'Standard fine-tune' if regime == 'standard' else regime}: best {best or '-'}{tied}"


def board_markdown(boards: Mapping[str, list[dict]], sizes: Mapping[str, int], measure: str) -> str:
    """Every regime's leaderboard, under one legend."""
    parts = ["## Leaderboard\n\n", legend(sizes, measure) + "\n"]
    for regime, entries in boards.items():
        parts.append(
            f"\n### {title(regime, entries)}\n\n"
            f"{render(table := board_table(entries), markdown=True, align=column_align(table))}\n"
        )
    return "".join(parts)


def board_text(boards: Mapping[str, list[dict]], sizes: Mapping[str, int], measure: str, width: int = 160) -> str:
    """The leaderboards for a terminal of ``width`` columns: each regime's table, the choices cut to fit."""
    import textwrap

    parts = []
    for regime, entries in boards.items():
        table = board_table(entries, chosen_width=10)
        spare = width - max(len(line) for line in render(table, align=column_align(table)).splitlines())
        table = board_table(entries, chosen_width=max(10, 10 + spare))
        parts.append(f"{title(regime, entries)}\n{render(table, align=column_align(table))}")
    return "\n\n".join(parts) + "\n\n" + textwrap.fill(legend(sizes, measure), width) + "\n"


def _half_width(e: Mapping) -> float | None:
    return None if e["low"] is None else (e["high"] - e["low"]) / 2


def versus_table(before: list[dict], after: list[dict], labels: tuple[str, str]) -> list[list[str]]:
    """One regime's leaderboard in two runs (``before``, ``after``: their entries; ``labels``: the runs' names),
    ranked by ``after``: each method's score with its interval in both and the change. The two runs' test
    predictions are not paired here, so a change is marked ≈ when it is smaller than the two intervals' half-widths
    combined as independent (sqrt(a² + b²)), which is conservative for models that mostly agree."""
    old = {e["method"]: e for e in before}
    table = [["#", "method", labels[0], labels[1], "change"]]
    names = [e["method"] for e in after] + [
        e["method"] for e in before if e["method"] not in {a["method"] for a in after}
    ]
    new = {e["method"]: e for e in after}

    for name in names:
        a, b = old.get(name), new.get(name)
        change = ""
        if a is not None and b is not None:
            delta = b["score"] - a["score"]
            widths = [_half_width(a), _half_width(b)]
            noise = None if None in widths else (widths[0] ** 2 + widths[1] ** 2) ** 0.5
            change = (f"{delta:+.1f}" if round(delta, 1) != 0 else "0.0") + (
                f" {TIE}" if noise is not None and abs(delta) < noise else ""
            )
        rank = b["rank"] if b is not None else None
        table.append(["-" if rank is None else str(rank), name, score_cell(a), score_cell(b), change])
    return table


def versus_text(before: Mapping, after: Mapping, labels: tuple[str, str], width: int = 160) -> str:
    """Two runs' leaderboards (results/leaderboard.json of each), regime by regime, for a terminal ``width`` wide."""
    import textwrap

    parts = []
    for regime in dict.fromkeys([*after["boards"], *before["boards"]]):
        entries = after["boards"].get(regime, [])
        parts.append(
            f"{'Standard fine-tune' if regime == 'standard' else regime}"
            f": {labels[1]} against {labels[0]}, ranked by {labels[1]}\n"
            + render(versus_table(before["boards"].get(regime, []), entries, labels), align="rlrrr")
        )
    note = (
        f"Test {after.get('measure', 'accuracy')} averaged over the tasks, "
        f"%, with {LEVEL:.0%} bootstrap intervals over the test examples; "
        f"{TIE}: a change within the two runs' noise (their half-widths combined as independent)."
    )
    return "\n\n".join(parts) + "\n\n" + textwrap.fill(note, width) + "\n"
