"""`mergeflow compare`: DVC experiments side by side, one column each, in a table that fits a terminal. `dvc exp
show` gives each metric a column named by its file and key (`metrics/headline/ties.json:test_avg`), and each
method has four; here a row is a parameter or a headline entry (a method, a regime variant's method, a study's
verdicts) and the columns are the experiments, so the width grows with the experiments, not the methods."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from mergeflow.core.errors import MergeflowError, first_line
from mergeflow.report.tables import render

HEADLINE = "metrics/headline/"
VERDICTS = "metrics/verdicts/"
METRICS = ("test_avg", "val_avg", "gap")
CELL = 24  # a value's width at most: a grid or a task list would take a line


def _flatten(tree: Mapping, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out |= _flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def _experiments(shown: list[dict]):
    """(label, commit, data) per experiment of `dvc exp show --json`: the workspace, each baseline commit, its
    experiments."""
    for row in shown:
        yield (
            ("workspace" if row["rev"] == "workspace" else (row.get("name") or row["rev"][:7])),
            row["rev"],
            row.get("data"),
        )
        for exp in row.get("experiments") or []:
            rev = exp["revs"][0]
            yield rev.get("name") or rev["rev"][:7], rev["rev"], rev.get("data")


def _columns(shown: list[dict]) -> list[tuple[str, dict]]:
    """(label, data) per experiment that has data."""
    return [(label, data) for label, _, data in _experiments(shown) if data]


def _cell(value: object, width: int = CELL) -> str:
    """A value as shown: "-" when absent, a long one (a grid, a task list) cut to ``width`` characters."""
    text = "-" if value is None else str(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def comparison(shown: list[dict], metric: str = "test_avg", every_row: bool = False) -> list[list[str]]:
    """The table's rows, a header first: the parameters, then each headline entry's ``metric`` and each study's
    verdict counts, for every experiment; only the rows whose values differ unless ``every_row``."""
    columns = _columns(shown)
    rows: dict[str, list[object]] = {}

    def put(name: str, i: int, value: object) -> None:
        rows.setdefault(name, [None] * len(columns))[i] = value

    for i, (_, data) in enumerate(columns):
        for key, value in _flatten((data.get("params") or {}).get("params.yaml", {}).get("data") or {}).items():
            put(key, i, value)
        for path, record in (data.get("metrics") or {}).items():
            values = record.get("data") or {}
            if path.startswith(HEADLINE):
                put(path[len(HEADLINE) :].removesuffix(".json"), i, values.get(metric))
            elif path.startswith(VERDICTS):
                put(
                    f"{path[len(VERDICTS) :].removesuffix('.json')} (holds/fails)",
                    i,
                    f"{values.get('holds')}/{values.get('fails')}",
                )
    shown_rows = [
        [name, *(_cell(v) for v in values)]
        for name, values in rows.items()
        if every_row or len({json.dumps(v) for v in values}) > 1
    ]
    return [["", *(label for label, _ in columns)], *shown_rows]


def compare(metric: str = "test_avg", every_row: bool = False, markdown: bool = False, root: str = ".") -> str:
    if metric not in METRICS:
        raise MergeflowError(f"--metric {metric}: choose one of {', '.join(METRICS)}")
    table = comparison(_exp_show(root), metric, every_row)
    if len(table) == 1:
        return "no experiment differs from the others (`dvc exp run -S key=value` makes one; --all shows every row)"
    return render(table, markdown)


def _leaderboard(revision: str, root: str, shas: Mapping[str, str]) -> dict:
    """results/leaderboard.json of ``revision`` (a commit, a branch or tag, an experiment's name, or "workspace"),
    read from git and DVC's cache; ``shas``: the commit of each experiment's label in `dvc exp show`."""
    path = Path(root) / "results" / "leaderboard.json"
    if revision == "workspace":
        if not path.is_file():
            raise MergeflowError(f"{path}: no leaderboard in the workspace (run the report stage)")
        return json.loads(path.read_text())
    import dvc.api
    from dvc.exceptions import PathMissingError

    try:
        text = dvc.api.read("results/leaderboard.json", repo=str(root), rev=shas.get(revision, revision))
    except Exception as err:  # DVC's errors are of many kinds: one line, with the revision
        if isinstance(err, PathMissingError):
            raise MergeflowError(
                f"{revision}: no results/leaderboard.json there (its report "
                "stage has not run, or its dvc.lock is not committed)"
            ) from None
        detail = first_line(err, "no detail")[:100]
        raise MergeflowError(
            f"{revision}: results/leaderboard.json cannot be read ({type(err).__name__}: {detail}); revisions: "
            f"{', '.join(list(shas)[:8])}"
        ) from None
    try:
        board = json.loads(text)
    except ValueError:
        board = None
    if not isinstance(board, dict) or not isinstance(board.get("boards"), dict):
        raise MergeflowError(
            f"{revision}: results/leaderboard.json is not a leaderboard (a JSON object of boards, one a regime)"
        )
    return board


def _exp_show(root: str) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "dvc", "exp", "show", "--json"], cwd=root, capture_output=True, text=True
    )  # this environment's DVC, on PATH or not
    if proc.returncode != 0:
        raise MergeflowError(f"dvc exp show: {(proc.stderr.strip().splitlines() or ['failed'])[-1]}")
    return json.loads(proc.stdout)


def compare_leaderboards(before: str, after: str, root: str = ".") -> str:
    """`mergeflow compare A B`: the leaderboard of revision ``after`` against ``before``'s, regime by regime."""
    from mergeflow.report.leaderboard import versus_text

    shas = {label: rev for label, rev, _ in _experiments(_exp_show(root)) if rev != "workspace"}  # read once for both
    boards = _leaderboard(before, root, shas), _leaderboard(after, root, shas)
    try:
        return versus_text(*boards, (before, after), shutil.get_terminal_size((160, 24)).columns)
    except (KeyError, TypeError, ValueError) as err:  # a leaderboard written by another version of mergeflow
        raise MergeflowError(
            f"compare {before} {after}: a leaderboard in another form than this version writes ({type(err).__name__}: "
            f"{str(err)[:60]}); run the report stage there again"
        ) from None
