"""merge.search: golden — the validation search narrowing a coefficient by golden-section search, against the full
grid: the same choice on the default suite's recorded curves and on a real method, with fewer candidates scored."""

import pytest
import torch

from mergeflow.ml.merging import REGISTRY
from mergeflow.ml.merging.search import golden_section, search, swept_key

# validation averages along each method's coefficient, as the default pipeline's run of 2026-11-26 recorded them
# (metrics/merge/*.json, rounded to 4 places; cart: one curve per rank_ratio)
DEFAULT_SUITE_CURVES = {
    "breadcrumbs": [0.6694, 0.6712, 0.6787, 0.6837, 0.69, 0.6963, 0.7019],
    "cart@0.08": [0.7, 0.71, 0.7088, 0.7056, 0.7056, 0.7031, 0.6919],
    "cart@0.16": [0.6944, 0.7112, 0.7175, 0.7206, 0.7162, 0.7081, 0.7],
    "cart@0.32": [0.6875, 0.6956, 0.6994, 0.705, 0.7138, 0.7094, 0.7081],
    "consensus_ta": [0.6756, 0.6894, 0.6994, 0.7131, 0.7131, 0.7094, 0.7081],
    "consensus_ties": [0.675, 0.6794, 0.6969, 0.6981, 0.705, 0.705, 0.6962],
    "dare_linear": [0.6669, 0.6775, 0.6825, 0.6881, 0.685, 0.6856, 0.6769, 0.6713, 0.65, 0.62],
    "dare_ties": [0.6569, 0.6375, 0.615, 0.5744, 0.505, 0.4369],
    "iso_c": [0.6812, 0.7006, 0.7144, 0.725, 0.7319, 0.7394, 0.7419, 0.7338, 0.7181],
    "iso_cts": [0.6812, 0.7038, 0.7137, 0.7263, 0.7406, 0.7413, 0.7363, 0.7344, 0.73],
    "low_rank_ta": [0.6687, 0.6787, 0.6812, 0.6875, 0.7019, 0.7075, 0.7113, 0.7106, 0.7044, 0.6863],
    "magmax": [0.6962, 0.7013, 0.7075, 0.7025, 0.6944],
    "regmean": [0.6862, 0.6969, 0.7006, 0.7038, 0.705, 0.7063],
    "task_arithmetic": [0.6681, 0.6769, 0.6844, 0.6894, 0.7025, 0.7119, 0.7144, 0.7144, 0.7069, 0.7056],
    "ties": [0.6988, 0.7006, 0.7031, 0.7006, 0.6881, 0.6562],
    "tsv_m": [0.69, 0.7056, 0.7306, 0.7406, 0.7462, 0.7531, 0.7606, 0.7619, 0.7437],
}


def first_best(curve: list[float], indices) -> int:
    return max(indices, key=lambda i: (curve[i], -i))


def test_golden_section_chooses_the_full_grids_point_on_the_default_suites_curves():
    scored_in_all = 0
    for name, curve in DEFAULT_SUITE_CURVES.items():
        calls = []
        scored = golden_section(len(curve), lambda i, curve=curve: calls.append(i) or curve[i])
        assert len(calls) == len(set(calls)) == len(scored) and scored == sorted(scored), name  # each point once
        assert first_best(curve, scored) == first_best(curve, range(len(curve))), name
        scored_in_all += len(scored)
    assert scored_in_all == 66  # of 122 grid points


@pytest.mark.parametrize("n", [4, 5, 7, 10, 20])
def test_golden_section_finds_the_peak_of_any_unimodal_curve_and_the_first_of_a_plateau(n):
    for peak in range(n):
        curve = [-abs(i - peak) for i in range(n)]
        assert first_best(curve, golden_section(n, curve.__getitem__)) == peak
    plateau = [min(i, 2) for i in range(n)]  # rises to 2 at index 2, then flat: the first 2 wins
    assert first_best(plateau, golden_section(n, plateau.__getitem__)) == 2


class DistanceScorer:
    """A stand-in for the evaluator: each task's 'accuracy' falls with the merged tensor's distance from a target,
    so the average is unimodal in task arithmetic's lambda, peaking at 0.55."""

    def __init__(self, theta0, taus, calls):
        self.target = {k: theta0[k] + 0.55 * sum(t[k] for t in taus.values()) for k in theta0}
        self.tasks, self.calls = list(taus), calls

    def __call__(self, state):
        self.calls.append(1)
        distance = sum((state[k] - self.target[k]).norm().item() for k in state)
        return {t: 1.0 / (1.0 + distance) for t in self.tasks}


def test_golden_search_on_task_arithmetic_chooses_what_the_grid_chooses_with_fewer_candidates():
    g = torch.Generator().manual_seed(0)
    theta0 = {"w": torch.randn(6, 4, generator=g), "b": torch.randn(4, generator=g)}
    taus = {t: {k: 0.1 * torch.randn(v.shape, generator=g) for k, v in theta0.items()} for t in "abc"}
    grid = [0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0]
    results, calls = {}, {}
    for strategy in ("grid", "golden"):
        calls[strategy] = []
        results[strategy] = search(
            REGISTRY["task_arithmetic"],
            {"lam": grid},
            theta0,
            taus,
            DistanceScorer(theta0, taus, calls[strategy]),
            strategy,
        )
    (best_g, out_g, curve_g, _), (best_s, out_s, curve_s, _) = results["grid"], results["golden"]
    assert (
        best_g["hyperparameters"]["lam"] == best_s["hyperparameters"]["lam"] == 0.5
    )  # 0.55 lies between 0.5 and 0.6: 0.5 is nearer
    assert all(torch.equal(out_g[k], out_s[k]) for k in out_g)
    assert len(calls["grid"]) == 10 and len(calls["golden"]) == len(curve_s) < 10
    lams = [r["hyperparameters"]["lam"] for r in curve_s]
    assert lams == sorted(lams) and set(lams) <= set(grid)  # in grid order, each a grid point
    by_lam = {r["hyperparameters"]["lam"]: r["average"] for r in curve_g}
    assert all(
        r["average"] == by_lam[r["hyperparameters"]["lam"]] for r in curve_s
    )  # the same candidates, scored the same


def test_golden_applies_to_sorted_numeric_grids_of_four_or_more_and_otherwise_scores_every_point():
    ta, ties = REGISTRY["task_arithmetic"], REGISTRY["ties"]
    assert swept_key(ta, {"lam": [0.1, 0.2, 0.3, 0.4]}) == "lam"
    assert swept_key(ta, {"lam": [0.1, 0.2, 0.3]}) is None  # too few points to narrow
    assert swept_key(ta, {"lam": [0.4, 0.1, 0.2, 0.3]}) is None  # unsorted: no bracket to narrow
    assert swept_key(ties, {"k": [0.1, 0.2], "lam": [0.8, 1.0, 1.2, 1.5]}) == "lam"  # the coefficient, per k
    with pytest.raises(ValueError, match="merge.search: 'random'"):
        search(ta, {}, {}, {}, None, "random")
