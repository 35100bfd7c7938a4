"""`mergeflow compare` on a hand-made `dvc exp show --json`: a column per experiment, a row per parameter or
headline entry that differs."""

import pytest

from mergeflow.runner.compare import comparison, render


def _rev(rev, name, k, ties, ta, holds):
    return {
        "rev": rev,
        "name": name,
        "data": {
            "params": {
                "params.yaml": {
                    "data": {"seed": 0, "merge": {"ties": {"k": k, "lam": [0.8, 1.0, 1.2, 1.5, 2.0, 2.5, 3.0]}}}
                }
            },
            "metrics": {
                "metrics/headline/ties.json": {"data": {"test_avg": ties, "gap": 20.0}},
                "metrics/headline/mima_n4/task_arithmetic.json": {"data": {"test_avg": ta}},
                "metrics/verdicts/mima.json": {"data": {"holds": holds, "fails": 1, "not_measured": 0}},
            },
        },
    }


def test_experiments_side_by_side():
    head = _rev("a1b2c3d4e5", "main", 0.2, 71.7, 74.3, 7)
    head["experiments"] = [{"revs": [_rev("f00", "ties-k01", 0.1, 72.1, 74.3, 6)]}]
    shown = [_rev("workspace", None, 0.1, 72.1, 74.3, 6), head]
    table = comparison(shown)
    # seed and the unchanged entries are left out; the verdicts as holds/fails
    assert table == [
        ["", "workspace", "main", "ties-k01"],
        ["merge.ties.k", "0.1", "0.2", "0.1"],
        ["ties", "72.1", "71.7", "72.1"],
        ["mima (holds/fails)", "6/1", "7/1", "6/1"],
    ]
    # the same gap everywhere: no row for it
    assert [r[0] for r in comparison(shown, "gap")] == ["", "merge.ties.k", "mima (holds/fails)"]
    every_row = comparison(shown, every_row=True)
    assert [r[0] for r in every_row][1:] == [
        "seed",
        "merge.ties.k",
        "merge.ties.lam",
        "ties",
        "mima_n4/task_arithmetic",
        "mima (holds/fails)",
    ]
    assert every_row[3][1] == "[0.8, 1.0, 1.2, 1.5, 2.…"  # a grid cut to 24 characters
    # the names left-aligned (18 wide), the values right-aligned under their experiment, two spaces between
    assert render(table).splitlines()[1] == "merge.ties.k" + " " * 6 + "  " + "0.1".rjust(9) + "  " + "0.2".rjust(
        4
    ) + "  " + "0.1".rjust(8)
    assert render(table, markdown=True).splitlines()[:2] == [
        "|                    | workspace | main | ties-k01 |",
        "|--------------------|----------:|-----:|---------:|",
    ]


@pytest.mark.parametrize(
    "read, message",
    [
        (
            "missing",
            "k01: no results/leaderboard.json there (its report stage has not run, or its dvc.lock is not committed)",
        ),
        ("not json {", "k01: results/leaderboard.json is not a leaderboard (a JSON object of boards, one a regime)"),
        (
            '{"boards": [1, 2]}',
            "k01: results/leaderboard.json is not a leaderboard (a JSON object of boards, one a regime)",
        ),
        (
            '{"boards": {"standard": [{"method": "ties"}]}}',
            "compare k01 k01: a leaderboard in another form than this version writes (KeyError: ",
        ),
    ],
)
def test_a_broken_experiments_leaderboard_is_one_line(monkeypatch, read, message):
    """`mergeflow compare A B` on an experiment without a leaderboard, with a damaged one, or one of another form."""
    import dvc.api

    from mergeflow.core.errors import MergeflowError
    from mergeflow.runner import compare

    from dvc.exceptions import PathMissingError

    def fake_read(path, repo, rev):
        if read == "missing":
            raise PathMissingError(path, repo)
        return read

    monkeypatch.setattr(dvc.api, "read", fake_read)
    monkeypatch.setattr(compare, "_exp_show", lambda root: [])
    with pytest.raises(MergeflowError) as err:
        compare.compare_leaderboards("k01", "k01")
    assert str(err.value).startswith(message) and len(str(err.value)) < 200
