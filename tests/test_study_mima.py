"""Study mima (seed 001) on fake pipeline outputs with hand-chosen numbers: each verdict holds, fails or is not
measured as the numbers dictate; N = 1 is the standard fine-tune unless the regime's mima_n1 ran."""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import pytest

from mergeflow.params import parse_params
from mergeflow.pipeline.stages import Layout
from mergeflow.studies import REGISTRY, StudyContext
from mergeflow.studies.mima import report as mima_module  # the study function, and the figures it calls
from mergeflow.studies.mima import MimaSettings, rises, shrinks

TASKS = ["digits", "house_numbers", "count", "texture"]
PAIRS = [(a, b) for i, a in enumerate(TASKS) for b in TASKS[i + 1 :]]


def params(run=("mima",), rounds=(2, 4)):
    return parse_params(
        {
            "suite": {"tasks": TASKS, "n_train": 32, "n_val": 8, "n_test": 8, "pretrain_images": 0},
            "finetune": {"steps": 8, "batch_size": 8, "lr": 0.001, "weight_decay": 0.0, "warmup_steps": 1},
            "merge": {"methods": ["weight_averaging", "task_arithmetic", "ties"]},
            "regimes": {"run": list(run), "mima": {"rounds": list(rounds)}},
        }
    )


def _write(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def _stats(cos: dict) -> dict:
    """cos: {(a, b): value} for the pairs; the rest filled with `base`."""
    m = [[1.0 if i == j else None for j in range(len(TASKS))] for i in range(len(TASKS))]
    for (a, b), v in cos.items():
        i, j = TASKS.index(a), TASKS.index(b)
        m[i][j] = m[j][i] = v
    assert all(v is not None for row in m for v in row)
    return {"tasks": TASKS, "norms": {t: 1.0 for t in TASKS}, "cosine": m, "cosine_per_layer": {}}


def cosines(related: float, others: list[float]) -> dict:
    rest = [p for p in PAIRS if p != ("digits", "house_numbers")]
    return {("digits", "house_numbers"): related, **dict(zip(rest, others))}


def _merges(
    layout: Layout, regime, variant, ua, ta, ties, lam, methods=("weight_averaging", "task_arithmetic", "ties")
):
    values = {
        "weight_averaging": (ua, {}),
        "task_arithmetic": (ta, {"lam": lam}),
        "ties": (ties, {"k": 0.2, "lam": 1.0}),
    }
    for method in methods:
        avg, hp = values[method]
        run = layout.merge_run(method, regime, variant)
        _write(
            run.evaluation,
            {
                "method": method,
                "accuracy": {t: avg for t in TASKS},
                "average": avg,
                "hyperparameters": hp,
                "searched": hp,
            },
        )
        _write(run.choice, {"method": method, "hyperparameters": hp, "val_average": avg})


def write_standard(
    layout: Layout, *, cos, individual, ua, ta, ties, lam, methods=("weight_averaging", "task_arithmetic", "ties")
):
    _write(layout.vectors / "stats.json", _stats(cos))
    for t in TASKS:
        _write(
            layout.metrics("finetune", t),
            {"task": t, "individual": {"val": individual, "test": individual}, "probe": {"val": 0.3, "test": 0.3}},
        )
    _merges(layout, None, None, ua, ta, ties, lam, methods)


def variant_record(n, *, individual, ua, rounds=None):
    return {
        "hyperparameters": {"rounds": n, "total_steps": 8},
        "individual": {t: {"val": individual, "test": individual} for t in TASKS},
        "individual_average": {"val": individual, "test": individual},
        "model": {
            "accuracy": {"val": {t: ua for t in TASKS}, "test": {t: ua for t in TASKS}},
            "average": {"val": ua, "test": ua},
        },
        "rounds": rounds or [],
        "wall_time_s": 1.0,
    }


def round_records(update_cos: list[float], tv_cos: list[float]):
    return [
        {
            "round": i + 1,
            "update_norms": {t: 1.0 for t in TASKS},
            "update_cosines": {f"{a}|{b}": u + 0.01 * k for k, (a, b) in enumerate(PAIRS)},
            "task_vector_norms": {t: 1.0 + i for t in TASKS},
            "task_vector_cosines": {f"{a}|{b}": v + 0.01 * k for k, (a, b) in enumerate(PAIRS)},
            "wall_time_s": 0.1,
        }
        for i, (u, v) in enumerate(zip(update_cos, tv_cos))
    ]


def write_variant(layout: Layout, variants: dict, n, *, cos, individual, ua, ta, ties, lam, rounds=None, merges=True):
    name = f"mima_n{n}"
    variants[name] = variant_record(n, individual=individual, ua=ua, rounds=rounds)
    _write(layout.metrics("regime", "mima"), {"regime": "mima", "variants": variants})
    _write(layout.regime_vectors("mima", name) / "stats.json", _stats(cos))
    if merges:
        _merges(layout, "mima", name, ua, ta, ties, lam)


def run_study(tmp_path: Path, p, figures=False, **settings):
    """The study's function as stage study@mima calls it; figures=False skips drawing (the tests that check the
    figures draw them; the others stay fast)."""
    layout = Layout(root=tmp_path)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    context = StudyContext(params=p, layout=layout, settings=MimaSettings(**settings), out_dir=out, device=None)
    plots = ("plot_cosines", "plot_accuracy", "plot_rounds")
    no_plot = {name: getattr(mima_module, name) if figures else (lambda *a, **k: False) for name in plots}
    with mock.patch.multiple(mima_module, **no_plot):
        result = REGISTRY["mima"].fn(context)
    return {c.id: c for c in result.claims}, result, out


def seed_like(tmp_path: Path) -> Layout:
    """Numbers shaped as the seed's: orthogonal at N = 1 with the related pair highest, alignment and UA rising,
    individual steady, gaps shrinking, TA's lambda falling toward 1/T = 0.25, updates orthogonal per round."""
    layout = Layout(root=tmp_path)
    write_standard(
        layout, cos=cosines(0.15, [0.02, 0.03, 0.01, 0.04, 0.05]), individual=0.90, ua=0.60, ta=0.70, ties=0.72, lam=0.5
    )
    variants: dict = {}
    write_variant(
        layout,
        variants,
        2,
        cos=cosines(0.45, [0.30, 0.32, 0.31, 0.33, 0.35]),
        individual=0.89,
        ua=0.75,
        ta=0.78,
        ties=0.80,
        lam=0.4,
        rounds=round_records([0.02, 0.01], [0.02, 0.35]),
    )
    write_variant(
        layout,
        variants,
        4,
        cos=cosines(0.75, [0.60, 0.62, 0.61, 0.63, 0.65]),
        individual=0.88,
        ua=0.85,
        ta=0.86,
        ties=0.87,
        lam=0.3,
        rounds=round_records([0.02, 0.0, -0.01, 0.01], [0.02, 0.3, 0.5, 0.62]),
    )
    return layout


def test_seed_shaped_numbers_hold_and_figures_are_written(tmp_path):
    seed_like(tmp_path)
    claims, result, out = run_study(tmp_path, params(), figures=True)
    assert {cid: c.verdict for cid, c in claims.items()} == {
        cid: "holds" for cid in ["001.1", "001.2", "001.3", "001.4a", "001.4b", "001.4c", "001.4d", "001.5"]
    }
    assert claims["001.1"].numbers["n"] == [1, 2, 4]
    assert claims["001.1"].numbers["median_cosine"][0] == pytest.approx(0.035)
    assert claims["001.2"].numbers["pair_cosine"] == 0.15 and claims["001.2"].numbers["others_median"] == pytest.approx(
        0.03
    )
    assert claims["001.4a"].numbers["gap"] == pytest.approx([0.30, 0.14, 0.03])
    assert claims["001.5"].numbers["n"] == 4 and claims["001.5"].numbers["round"] == [1, 2, 3, 4]
    assert set(result.figures) == {"cosine_by_n.png", "accuracy_by_n.png", "rounds_n4.png"}
    for f in result.figures:
        assert (out / f).stat().st_size > 5000 and f"]({f})" in result.body
    # ours beside the seed's Table 1 (ViT-B/32): N = 1 UA 60.0 vs 65.8, N = 8 only the seed's row
    assert (
        "| 1 | standard fine-tune | 60.0 | 65.8 | 70.0 | 70.6 | 72.0 | 73.6 | 90.0 | 90.2 | 0.5 | 0.25 |" in result.body
    )
    assert "| 8 | not run | — | 85.8 | — | 85.9 |" in result.body
    assert "| 20 | not run | — | 88.0 |" in result.body and "88.1" in result.body
    for c in claims.values():
        json.dumps(c.record())  # the stage writes the claims as JSON


def test_contrary_numbers_fail(tmp_path):
    layout = Layout(root=tmp_path)
    # N = 1: median 0.3 (not near 0), related pair below the others' median
    write_standard(
        layout, cos=cosines(0.10, [0.30, 0.31, 0.29, 0.32, 0.28]), individual=0.90, ua=0.60, ta=0.62, ties=0.70, lam=0.3
    )
    variants: dict = {}
    # UA dips at N = 2; individual drifts 5 points; TA's advantage grows; TIES' shrinks; lambda rises away from 1/T
    write_variant(
        layout,
        variants,
        2,
        cos=cosines(0.5, [0.4] * 5),
        individual=0.87,
        ua=0.55,
        ta=0.63,
        ties=0.64,
        lam=0.5,
        rounds=round_records([0.0, 0.0], [0.1, 0.3]),
    )
    # updates not orthogonal in round 2 (median 0.33 > 0.1) though task vectors align
    write_variant(
        layout,
        variants,
        4,
        cos=cosines(0.6, [0.5] * 5),
        individual=0.85,
        ua=0.70,
        ta=0.80,
        ties=0.72,
        lam=0.6,
        rounds=round_records([0.0, 0.3, 0.0, 0.0], [0.1, 0.3, 0.5, 0.7]),
    )
    claims, _, _ = run_study(tmp_path, params())
    assert (
        claims["001.1"].verdict == "fails"
        and claims["001.1"].numbers["n1_near_zero"] is False
        and claims["001.1"].numbers["median_rises"] is True
    )
    assert claims["001.2"].verdict == "fails"
    assert claims["001.3"].verdict == "fails" and claims["001.3"].numbers["ua_rises"] is False
    assert (
        claims["001.3"].numbers["individual_span"] == pytest.approx(0.05)
        and claims["001.3"].numbers["individual_little_change"] is False
    )
    assert claims["001.4a"].verdict == "fails" and claims["001.4a"].numbers["gap"] == pytest.approx([0.30, 0.32, 0.15])
    assert claims["001.4b"].verdict == "fails"  # TA - UA: 0.02, 0.08, 0.10
    assert claims["001.4c"].verdict == "holds" and claims["001.4c"].numbers["advantage"] == pytest.approx(
        [0.10, 0.09, 0.02]
    )
    assert claims["001.4d"].verdict == "fails"  # lambda 0.3, 0.5, 0.6 with 1/T = 0.25
    assert (
        claims["001.5"].verdict == "fails"
        and claims["001.5"].numbers["updates_orthogonal"] is False
        and claims["001.5"].numbers["task_vectors_rise"] is True
    )


def test_gap_that_widens_fails(tmp_path):
    layout = seed_like(tmp_path)
    variants = json.loads(layout.metrics("regime", "mima").read_text())["variants"]
    write_variant(
        layout, variants, 4, cos=cosines(0.75, [0.6] * 5), individual=0.88, ua=0.55, ta=0.70, ties=0.72, lam=0.3
    )
    claims, _, _ = run_study(tmp_path, params())
    assert claims["001.4a"].numbers["gap"] == pytest.approx([0.30, 0.14, 0.33])
    assert claims["001.4a"].verdict == "fails" and claims["001.3"].verdict == "fails"


def test_slack_settings_change_the_rule(tmp_path):
    layout = seed_like(tmp_path)
    variants = json.loads(layout.metrics("regime", "mima").read_text())["variants"]
    # UA 0.60, 0.75, 0.745: one step down by half a point
    write_variant(
        layout, variants, 4, cos=cosines(0.75, [0.6] * 5), individual=0.88, ua=0.745, ta=0.80, ties=0.81, lam=0.3
    )
    strict, _, _ = run_study(tmp_path, params())
    loose, _, _ = run_study(tmp_path, params(), accuracy_slack=0.01)
    assert strict["001.3"].verdict == "fails" and loose["001.3"].verdict == "holds"
    tight, _, _ = run_study(tmp_path, params(), individual_tolerance=0.01)
    assert tight["001.3"].verdict == "fails"  # individual spans 2 points


def test_without_mima_only_n1_is_measured(tmp_path):
    layout = Layout(root=tmp_path)
    write_standard(
        layout, cos=cosines(0.15, [0.02, 0.03, 0.01, 0.04, 0.05]), individual=0.90, ua=0.60, ta=0.70, ties=0.72, lam=0.5
    )
    claims, result, out = run_study(tmp_path, params(run=()), figures=True)
    verdicts = {cid: c.verdict for cid, c in claims.items()}
    assert verdicts.pop("001.2") == "holds"
    assert set(verdicts.values()) == {"not measured"}
    assert "0.035 in [-0.05, 0.1]" in claims["001.1"].detail and "dvc exp run" in claims["001.1"].detail
    assert "regimes.run" in result.body
    assert (
        (out / "cosine_by_n.png").is_file()
        and (out / "accuracy_by_n.png").is_file()
        and not (out / "rounds_n4.png").exists()
    )


def test_missing_regime_outputs_are_not_measured(tmp_path):
    layout = Layout(root=tmp_path)
    write_standard(
        layout, cos=cosines(0.15, [0.02, 0.03, 0.01, 0.04, 0.05]), individual=0.90, ua=0.60, ta=0.70, ties=0.72, lam=0.5
    )
    claims, result, _ = run_study(tmp_path, params())  # mima configured, nothing ran
    assert claims["001.3"].verdict == "not measured" and claims["001.5"].verdict == "not measured"
    assert "metrics/regime/mima.json is missing" in result.body and "dvc repro regime@mima" in result.body


def test_one_variant_present_other_missing(tmp_path):
    layout = seed_like(tmp_path)
    regime = layout.metrics("regime", "mima")
    doc = json.loads(regime.read_text())
    del doc["variants"]["mima_n4"]
    regime.write_text(json.dumps(doc))
    claims, result, _ = run_study(tmp_path, params())
    assert claims["001.3"].numbers["n"] == [1, 2] and claims["001.3"].verdict == "holds"
    assert claims["001.5"].numbers["n"] == 2
    assert "mima_n4 is missing" in result.body


def test_n1_falls_back_to_standard_and_prefers_mima_n1(tmp_path):
    layout = seed_like(tmp_path)
    claims, result, _ = run_study(
        tmp_path, params(rounds=(1, 2, 4))
    )  # mima_n1 configured but absent: the standard fine-tune
    assert claims["001.2"].numbers["pair_cosine"] == 0.15 and "| 1 | standard fine-tune | 60.0 |" in result.body
    variants = json.loads(layout.metrics("regime", "mima").read_text())["variants"]
    write_variant(
        layout,
        variants,
        1,
        cos=cosines(0.01, [0.02, 0.03, 0.04, 0.05, 0.06]),
        individual=0.91,
        ua=0.61,
        ta=0.71,
        ties=0.73,
        lam=0.5,
    )
    claims, result, _ = run_study(tmp_path, params(rounds=(1, 2, 4)))
    assert claims["001.2"].numbers["pair_cosine"] == 0.01 and claims["001.2"].verdict == "fails"
    assert claims["001.3"].numbers["ua"][0] == 0.61 and "| 1 | mima_n1 | 61.0 |" in result.body


def test_ua_from_regime_model_when_weight_averaging_not_merged(tmp_path):
    layout = seed_like(tmp_path)
    layout.merge_run("weight_averaging", "mima", "mima_n4").evaluation.unlink()
    variants = json.loads(layout.metrics("regime", "mima").read_text())["variants"]
    variants["mima_n4"]["model"]["average"]["test"] = 0.84
    _write(layout.metrics("regime", "mima"), {"regime": "mima", "variants": variants})
    claims, _, _ = run_study(tmp_path, params())
    assert claims["001.3"].numbers["ua"] == pytest.approx([0.60, 0.75, 0.84])


def test_ties_not_run_is_not_measured(tmp_path):
    layout = seed_like(tmp_path)
    for variant in (None, "mima_n2", "mima_n4"):
        layout.merge_run("ties", "mima" if variant else None, variant).evaluation.unlink()
    claims, result, _ = run_study(tmp_path, params())
    assert claims["001.4c"].verdict == "not measured" and claims["001.4b"].verdict == "holds"
    assert "metrics/evaluate/ties.json" in result.body


def test_related_pair_not_in_suite(tmp_path):
    seed_like(tmp_path)
    claims, _, _ = run_study(tmp_path, params(), related_pair=("digits", "signs"))
    assert claims["001.2"].verdict == "not measured" and "'signs'" in claims["001.2"].detail


def test_rules_and_settings():
    assert rises([0.1, 0.2, 0.3]) and not rises([0.1, 0.3, 0.2]) and not rises([0.2, 0.2]) and not rises([0.1])
    assert rises([0.1, 0.3, 0.29], slack=0.02) and shrinks([0.3, 0.1, 0.0]) and not shrinks([0.3, 0.4, 0.0])
    with pytest.raises(ValueError):
        MimaSettings(n1_cosine_range=(0.2, 0.1))
    with pytest.raises(ValueError):
        REGISTRY["mima"].settings({"related_pair": ["digits", "digits"]}, where="studies.mima")
    with pytest.raises(ValueError):
        REGISTRY["mima"].settings({"no_such": 1}, where="studies.mima")
    assert REGISTRY["mima"].settings({"related_pair": ["a", "b"]}, where="studies.mima").related_pair == ("a", "b")


def test_lambda_that_rises_on_the_way_fails(tmp_path):
    layout = seed_like(tmp_path)  # lambda 0.5, 0.4, 0.3 holds; now 0.5, 0.6, 0.3: ends closer to 1/T but rises at N = 2
    variants = json.loads(layout.metrics("regime", "mima").read_text())["variants"]
    write_variant(
        layout, variants, 2, cos=cosines(0.45, [0.3] * 5), individual=0.89, ua=0.75, ta=0.78, ties=0.80, lam=0.6
    )
    claims, _, _ = run_study(tmp_path, params())
    assert claims["001.4d"].numbers["lam"] == [0.5, 0.6, 0.3]
    assert claims["001.4d"].numbers["closer_to_one_over_t"] is True and claims["001.4d"].verdict == "fails"
