"""DVC experiments compare (issue: results a researcher can compare), on a copy of the tiny reference run:
`dvc exp run -S` leaves params.yaml as it was but for the value set, `dvc exp show` and `dvc metrics diff` hold
the headline metrics of each experiment, an experiment's outputs come back after the next one ran, `dvc plots
show` renders every declared plot, a failed stage's outputs come back with `dvc checkout`, and re-running a stage
that gives the same outputs stales nothing downstream."""

import hashlib
import json
import re
from pathlib import Path

import pytest
from mlflow import MlflowClient

from mergeflow.core.files import read_json

from .conftest import copy_project, run
from .profiles import TINY

STUDIES = TINY["studies"]["run"]


def _stdout(cmd, cwd, env) -> str:
    """A command's output, stdout only (DVC may warn on stderr)."""
    proc = run(cmd, cwd, env, check=False)
    assert proc.returncode == 0, f"{cmd}: {proc.stderr[-2000:]}"
    return proc.stdout


def _json(cmd, cwd, env):
    return json.loads(_stdout(cmd, cwd, env))


def _md5(path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def project(tiny_reference, tiny_env, tmp_path_factory):
    root = copy_project(tiny_reference[0], tmp_path_factory.mktemp("experiments"))
    run("git add -A && git commit -qm 'the reference run'", root, tiny_env)
    return root


def _headline(root) -> dict:
    """metrics/headline/ as {name: entry}, a regime variant's names as <variant>/<method>."""
    folder = root / "metrics" / "headline"
    return {str(f.relative_to(folder).with_suffix("")): read_json(f) for f in sorted(folder.rglob("*.json"))}


def _shown(metrics: dict) -> dict:
    """`dvc exp show --json`'s metrics of one revision, in _headline's shape."""
    return {
        path.removeprefix("metrics/headline/").removesuffix(".json"): m["data"]
        for path, m in metrics.items()
        if path.startswith("metrics/headline/")
    }


def test_experiments_keep_and_compare_their_results(project, tiny_env):
    root = project
    before = (root / "params.yaml").read_text().splitlines()
    baseline = _headline(root)
    # the committed run, before any experiment: nothing differs, so `dvc exp show --only-changed` is two columns wide
    # (COLUMNS wide enough that DVC's table elides no column: its full width is measured)
    shown = _stdout(
        ["dvc", "exp", "show", "--only-changed", "--no-pager"], root, tiny_env | {"COLUMNS": "1000"}
    ).splitlines()
    assert [line.split() for line in shown if line.strip() and not line.strip().startswith("─")][0] == [
        "Experiment",
        "Created",
    ] and max(map(len, shown)) <= 160, shown

    out = run(["dvc", "exp", "run", "-n", "ties-k01", "-S", "merge.ties.k=0.1"], root, tiny_env)
    # only what reads merge.ties ran again (every regime merges with TIES; the studies read the merges)
    assert set(re.findall(r"Running stage '([^']+)'", out)) == {
        "merge@ties",
        "regime_merge@mima",
        "regime_merge@one_epoch",
        "report",
        *(f"study@{s}" for s in STUDIES),
        "track",
    }
    after = (root / "params.yaml").read_text().splitlines()
    assert [(a, b) for a, b in zip(before, after) if a != b] == [
        (l, l.replace("k: 0.2", "k: 0.1")) for l in before if "ties: {k: 0.2" in l
    ]
    assert len(before) == len(after)
    first = _headline(root)
    evaluated = read_json(root / "metrics" / "evaluate" / "ties.json")
    chosen = read_json(root / "metrics" / "merge" / "ties.json")
    assert (
        first["ties"]["test_avg"] == round(100 * evaluated["average"], 2)
        and first["ties"]["choice"] == f"lam={evaluated['searched']['lam']}"
    )  # k is set, not searched
    assert first["ties"]["val_avg"] == round(100 * chosen["val_average"], 2)
    first_model = _md5(root / "merged" / "ties.safetensors")

    # the second experiment up to the headline (report) only: the studies and track ran above already
    out = run(["dvc", "exp", "run", "-n", "ties-k05", "-S", "merge.ties.k=0.5", "report"], root, tiny_env)
    assert set(re.findall(r"Running stage '([^']+)'", out)) == {
        "merge@ties",
        "regime_merge@mima",
        "regime_merge@one_epoch",
        "report",
    }
    second = _headline(root)

    # every experiment's headline, and the baseline's, from `dvc exp show`
    shown = _json(["dvc", "exp", "show", "--json"], root, tiny_env)
    head = next(r for r in shown if r["rev"] != "workspace")
    assert _shown(head["data"]["metrics"]) == baseline
    experiments = {e["revs"][0]["name"]: e["revs"][0]["data"] for e in head["experiments"]}
    assert _shown(experiments["ties-k01"]["metrics"]) == first
    assert _shown(experiments["ties-k05"]["metrics"]) == second
    assert experiments["ties-k01"]["params"]["params.yaml"]["data"]["merge"]["ties"]["k"] == 0.1
    # the headline is compact: a few short keys per method, the per-task detail elsewhere; one entry per method,
    # and the regime variants' under their own names
    assert {k for entry in first.values() for k in entry} <= {"test_avg", "val_avg", "gap", "control_avg", "choice"}
    assert {"probe", "individual", "ties", "one_epoch/individual", "mima_n2/ties"} <= set(first)
    # and it fits a terminal: `dvc metrics show` prints one short line per method
    table = _stdout(["dvc", "metrics", "show"], root, tiny_env).splitlines()
    assert len(table) == 1 + len(first) + len(STUDIES) and max(map(len, table)) <= 160, table
    # the studies' verdict counts are metrics too, a row each
    (shown,) = [ws["data"] for ws in _json(["dvc", "metrics", "show", "--json"], root, tiny_env).values()]
    counts = {path: m["data"] for path, m in shown.items() if path.startswith("metrics/verdicts/")}
    assert set(counts) == {f"metrics/verdicts/{s}.json" for s in STUDIES}
    assert all(
        c == {k: read_json(root / "metrics" / "studies" / Path(path).name)[k] for k in c}
        and set(c) == {"holds", "fails", "not_measured"}
        for path, c in counts.items()
    )

    # the experiments side by side in a terminal: a column each, a row per value that differs
    table = _stdout(["mergeflow", "compare"], root, tiny_env).splitlines()
    order = table[0].split()  # the workspace, the commit (its branch's name), its experiments
    assert order[0] == "workspace" and sorted(order[2:]) == ["ties-k01", "ties-k05"], table
    rows = {line.split()[0]: dict(zip(order, line.split()[1:])) for line in table[1:]}
    assert rows["merge.ties.k"] == {"workspace": "0.5", order[1]: "0.2", "ties-k01": "0.1", "ties-k05": "0.5"}
    assert rows["ties"] == {
        "workspace": str(second["ties"]["test_avg"]),
        order[1]: str(baseline["ties"]["test_avg"]),
        "ties-k01": str(first["ties"]["test_avg"]),
        "ties-k05": str(second["ties"]["test_avg"]),
    }
    assert "task_arithmetic" not in rows and max(map(len, table)) <= 160
    # two revisions' leaderboards, read back from DVC's cache: the committed run's against the first experiment's
    versus = _stdout(["mergeflow", "compare", order[1], "ties-k01"], root, tiny_env).splitlines()
    assert (
        versus[0] == f"Standard fine-tune: ties-k01 against {order[1]}, ranked by ties-k01"
        and max(map(len, versus)) <= 160
    )
    ties_row = next(line.split() for line in versus if line.split()[1:2] == ["ties"])  # the standard fine-tune's, first
    change = first["ties"]["test_avg"] - baseline["ties"]["test_avg"]
    # the scores to one decimal of the unrounded averages (the headline's are to two)
    assert (
        abs(float(ties_row[2]) - baseline["ties"]["test_avg"]) <= 0.051
        and abs(float(ties_row[5]) - first["ties"]["test_avg"]) <= 0.051
    )
    assert ties_row[8] == (f"{change:+.1f}" if round(change, 1) != 0 else "0.0")

    diff = _json(["dvc", "metrics", "diff", "HEAD", "--all", "--json"], root, tiny_env)
    assert diff["metrics/headline/ties.json"]["test_avg"]["old"] == baseline["ties"]["test_avg"]
    assert diff["metrics/headline/ties.json"]["test_avg"]["new"] == second["ties"]["test_avg"]

    # the first experiment's track logged its TIES merge again
    # (and nothing that did not change), in the workspace's store
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("mergeflow/embedded").experiment_id], max_results=500)
    merges = sorted((r for r in runs if r.data.tags["mergeflow.stage"] == "merge"), key=lambda r: r.info.start_time)
    assert [r.data.params["k"] for r in merges if r.data.tags["mergeflow.item"] == "ties"] == ["0.2", "0.1"]
    assert len(merges) == len(TINY["merge"]["methods"]) + 1

    # the first experiment's outputs were not lost when the second ran
    run(["dvc", "exp", "apply", "ties-k01"], root, tiny_env)
    assert _md5(root / "merged" / "ties.safetensors") == first_model
    assert _headline(root) == first


def test_every_declared_plot_renders(project, tiny_env):
    shown = _json(["dvc", "plots", "show", "--json"], project, tiny_env)
    plots = shown["data"]
    methods = [r for r in read_json(project / "results" / "summary.json")["rows"][2:] if r["regime"] == "standard"]
    expected = {"results/accuracy.png", "results/averages.png", "average test accuracy by method", "logs/pretrain.json"}
    expected |= {f"logs/finetune/{t}.json" for t in ("digits", "house_numbers", "count")}
    expected |= {
        f"logs/merge/{m}.{ext}" for m in [r["method"] for r in methods] + ["task_negation"] for ext in ("png", "json")
    }
    assert set(plots) == expected and not shown.get("errors")
    for name, [plot] in plots.items():
        if plot["type"] == "image":
            assert (project / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        else:
            values = plot["content"]["data"]["values"]
            assert values, name
    # a search chart marks its chosen value (the search template's second layer), one per revision
    [search] = plots["logs/merge/ties.json"]
    assert search["content"]["layer"][1]["transform"] == [{"filter": "datum.chosen == true"}]
    assert sum(v["chosen"] for v in search["content"]["data"]["values"]) == 1
    bars = plots["average test accuracy by method"][0]["content"]["data"]["values"]
    rows = read_json(project / "results" / "summary.json")["rows"]
    labels = {
        (r["regime"], r["method"]): r["method"] if r["regime"] == "standard" else f"{r['method']} ({r['regime']})"
        for r in rows
    }
    assert {b["method"]: b["test_avg"] for b in bars} == {
        labels[r["regime"], r["method"]]: round(100 * r["average"], 2) for r in rows
    }
    assert {r["regime"] for r in rows} == {"standard", "one_epoch", "mima_n2"}


def test_the_plots_page_draws_offline(project, tiny_env, tmp_path):
    """`dvc plots show` fills .dvc/plots.html (.dvc/config: plots.html_template), which carries Vega, Vega-Lite and
    Vega-Embed itself: the page loads no script from the network, and every chart is drawn by the inlined vegaEmbed."""
    run(["dvc", "plots", "show", "-o", str(tmp_path / "plots")], project, tiny_env)
    page = (tmp_path / "plots" / "index.html").read_text()
    assert "<script src" not in page and "https://cdn" not in page
    charts = [
        name
        for name, [plot] in _json(["dvc", "plots", "show", "--json"], project, tiny_env)["data"].items()
        if plot["type"] != "image"
    ]
    assert "window.vegaEmbed=" in page and page.count("vegaEmbed('#") == len(charts) > 0  # the PNGs are <img>


def test_a_failed_stage_loses_nothing_and_a_rerun_with_the_same_outputs_stales_nothing(project, tiny_env):
    root = project
    run("git checkout -q -- params.yaml dvc.lock && dvc checkout -q", root, tiny_env)
    outs = [
        root / "merged" / "ties.safetensors",
        root / "metrics" / "merge" / "ties.json",
        root / "metrics" / "evaluate" / "ties.json",
        root / "logs" / "merge" / "ties.png",
    ]
    kept = {p: _md5(p) for p in outs}
    params = root / "params.yaml"
    good = params.read_text()
    params.write_text(good.replace("ties: {k: 0.2", "ties: {kk: 0.2"))
    failed = run(["dvc", "repro", "merge@ties"], root, tiny_env, check=False)
    assert failed.returncode != 0 and "merge.ties.kk: unknown hyperparameter" in failed.stderr + failed.stdout
    params.write_text(good)
    run(["dvc", "checkout", "merge@ties"], root, tiny_env)
    assert {p: _md5(p) for p in outs} == kept

    # a fine-tune run again gives the same model and a new wall time: nothing downstream is stale
    run(["dvc", "repro"], root, tiny_env)  # track again, after the experiments' own tracks
    assert _json(["dvc", "status", "--json"], root, tiny_env) == {}
    run(["dvc", "repro", "-f", "-s", "finetune@digits"], root, tiny_env)
    status = _json(["dvc", "status", "--json"], root, tiny_env)
    assert status == {}, status
