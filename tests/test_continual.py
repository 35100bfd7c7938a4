"""Continual merging's update rules (mergeflow.ml.continual) on tiny tensors: values computed by hand, or by an
independent route (the one-shot merges of mergeflow.ml.merging, an optimum known in closed form)."""

import math

import pytest
import torch

from mergeflow.ml import continual as C
from mergeflow.ml.continual import REGISTRY, arrivals
from mergeflow.ml.continual.dop import min_norm_pair, projected_loss, subspace
from mergeflow.ml.continual.opcm import project
from mergeflow.ml.merging import REGISTRY as ONE_SHOT


def stream(seed: int, count: int = 4):
    """theta0 and ``count`` task vectors (float64) with a 2-D weight, a bias and an integer buffer."""
    g = torch.Generator().manual_seed(seed)
    theta0 = {"w": torch.randn(5, 3, generator=g, dtype=torch.float64), "b": torch.randn(5, generator=g).double()}
    theta0["n"] = torch.tensor(7)
    taus = [
        {"w": torch.randn(5, 3, generator=g).double(), "b": torch.randn(5, generator=g).double(), "n": torch.tensor(1)}
        for _ in range(count)
    ]
    return theta0, [(f"t{i}", tau) for i, tau in enumerate(taus)]


def run(name: str, theta0, taus, **hp) -> list[dict]:
    return [merged for _, merged in arrivals(REGISTRY[name], theta0, taus, **hp)]


def close(a, b, tol: float = 1e-10) -> bool:
    return set(a) == set(b) and all(torch.allclose(a[k].double(), b[k].double(), atol=tol, rtol=0) for k in a)


def floating(state) -> dict:
    """The floating tensors only: the one-shot merges add an integer buffer's task vector, the continual ones keep
    theta0's."""
    return {k: v for k, v in state.items() if v.is_floating_point()}


def test_the_registry_holds_the_five_methods_with_their_reference_defaults():
    assert sorted(REGISTRY) == ["dop", "magmax", "opcm", "task_arithmetic", "weight_averaging"]
    assert REGISTRY["opcm"].defaults == {"alpha": 0.5} and REGISTRY["task_arithmetic"].defaults == {"lam": 0.3}
    assert REGISTRY["dop"].defaults["svd_epsilon"] == 0.99999 and REGISTRY["dop"].defaults["alpha"] == 0.8


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_the_first_arrival_is_the_first_fine_tuned_model_for_the_averaging_methods(name):
    theta0, taus = stream(0)
    (first,) = run(name, theta0, taus[:1])
    scale = {"task_arithmetic": 0.3}.get(name, 1.0)  # task arithmetic adds lam tau_1 to theta0
    assert close({k: first[k] for k in ("w", "b")}, {k: theta0[k] + scale * taus[0][1][k] for k in ("w", "b")})
    assert torch.equal(first["n"], theta0["n"])  # an integer buffer keeps theta0's value


def test_sequential_averaging_after_t_arrivals_is_weight_averaging_in_any_order():
    theta0, taus = stream(1)
    merged = run("weight_averaging", theta0, taus)
    for t in range(1, 5):
        by_hand = {k: sum(theta0[k] + tau[k] for _, tau in taus[:t]) / t for k in ("w", "b")}
        assert close({k: merged[t - 1][k] for k in ("w", "b")}, by_hand)
    one_shot = ONE_SHOT["weight_averaging"](theta0, {t: tau for t, tau in taus})
    one_shot = floating(one_shot)
    assert close(floating(merged[-1]), one_shot)
    assert close(floating(run("weight_averaging", theta0, taus[::-1])[-1]), one_shot)


def test_sequential_task_arithmetic_is_task_arithmetic():
    theta0, taus = stream(2)
    merged = run("task_arithmetic", theta0, taus, lam=0.3)
    one_shot = ONE_SHOT["task_arithmetic"](theta0, {t: tau for t, tau in taus}, lam=0.3)
    assert close(floating(merged[-1]), floating(one_shot))
    assert close(merged[1], {**{k: theta0[k] + 0.3 * (taus[0][1][k] + taus[1][1][k]) for k in "wb"}, "n": theta0["n"]})


def test_sequential_magmax_is_magmax_of_every_vector_so_far():
    theta0, taus = stream(3)
    for lam in (1.0, 0.5):
        merged = run("magmax", theta0, taus, lam=lam)
        for t in range(1, 5):
            assert close(floating(merged[t - 1]), floating(ONE_SHOT["magmax"](theta0, dict(taus[:t]), lam=lam)))
    a, b = {"w": torch.tensor([[1.0, -3.0]])}, {"w": torch.tensor([[-1.0, 2.0]])}  # a tie keeps the earlier value
    (_, last) = run("magmax", {"w": torch.zeros(1, 2)}, [("a", a), ("b", b)])
    assert last["w"].tolist() == [[1.0, -3.0]]


def test_opcm_projection_removes_the_diagonal_and_the_top_block_by_hand():
    merged_tau = torch.diag(torch.tensor([4.0, 3.0, 2.0, 1.0], dtype=torch.float64))  # U = V = I up to signs
    tau = torch.ones(4, 4, dtype=torch.float64)
    # cumulative energy 0.4, 0.7, 0.9, 1.0: alpha 0.3 -> r = 0; 0.5 -> r = 1; 0.75 -> r = 2 (the diagonal always)
    off_diagonal = tau - torch.eye(4, dtype=torch.float64)
    assert torch.allclose(project(merged_tau, tau, 0.3), off_diagonal)
    assert torch.allclose(project(merged_tau, tau, 0.5), off_diagonal)
    block = off_diagonal.clone()
    block[0, 1] = block[1, 0] = 0
    assert torch.allclose(project(merged_tau, tau, 0.75), block)


def test_opcm_projection_is_orthogonal_to_the_removed_directions():
    g = torch.Generator().manual_seed(4)
    merged_tau, tau = torch.randn(6, 4, generator=g).double(), torch.randn(6, 4, generator=g).double()
    u, s, vh = torch.linalg.svd(merged_tau, full_matrices=True)
    r = int((s.cumsum(0) / s.sum() > 0.5).float().argmax())
    cleaned = project(merged_tau, tau, 0.5)
    in_basis = u.T @ cleaned @ vh.T
    assert r >= 1 and float(in_basis.diagonal().abs().max()) < 1e-12 and float(in_basis[:r, :r].abs().max()) < 1e-12
    removed = tau - cleaned  # what was taken out lies in those directions only, and is orthogonal to what is left
    assert abs(float((removed * cleaned).sum())) < 1e-10
    kept = u.T @ tau @ vh.T  # every other coordinate in the singular basis is the task vector's own
    mask = torch.ones(6, 4, dtype=torch.bool)
    mask[:r, :r] = False
    mask[range(4), range(4)] = False
    assert torch.allclose(in_basis[mask], kept[mask], atol=1e-12)


def test_opcm_second_arrival_by_hand():
    theta0 = {"w": torch.zeros(2, 2, dtype=torch.float64), "b": torch.tensor([1.0, 1.0], dtype=torch.float64)}
    tau1 = {"w": torch.diag(torch.tensor([3.0, 1.0], dtype=torch.float64)), "b": torch.tensor([0.0, 0.0]).double()}
    tau2 = {"w": torch.tensor([[5.0, 2.0], [1.0, 7.0]], dtype=torch.float64), "b": torch.tensor([2.0, 0.0]).double()}
    first, second = run("opcm", theta0, [("a", tau1), ("b", tau2)], alpha=0.5)
    assert close(first, {k: theta0[k] + tau1[k] for k in theta0})
    # r = 0 (energy 0.75 > 0.5 at the first value): the diagonal 5 and 7 go; delta = [[3, 2], [1, 1]], b = [2, 0]
    n = math.sqrt(9 + 4 + 1 + 1 + 4)
    mean_norm = (math.sqrt(10) + math.sqrt(25 + 4 + 1 + 49 + 4)) / 2
    expected_w = torch.tensor([[3.0, 2.0], [1.0, 1.0]], dtype=torch.float64) * mean_norm / n
    assert close(second, {"w": expected_w, "b": theta0["b"] + torch.tensor([2.0, 0.0]).double() * mean_norm / n})
    # the merged task vector keeps the mean norm of the task vectors
    assert abs(math.sqrt(sum(float((second[k] - theta0[k]).pow(2).sum()) for k in theta0)) - mean_norm) < 1e-12


def test_opcm_state_carries_lambda_into_the_third_arrival():
    theta0, taus = stream(5, 3)
    method = REGISTRY["opcm"]
    merged, state = None, None
    for _, tau in taus[:2]:
        merged, state = method(theta0, merged, state, tau)
    lam_2 = state["lambda"]
    third, _ = method(theta0, merged, state, taus[2][1])
    delta = {}
    for k in ("w", "b"):
        merged_tau = merged[k] - theta0[k]
        delta[k] = lam_2 * merged_tau + (project(merged_tau, taus[2][1][k], 0.5) if k == "w" else taus[2][1][k])
    mean_norm = sum(math.sqrt(sum(float(t[k].pow(2).sum()) for k in "wb")) for _, t in taus) / 3
    n = math.sqrt(sum(float(d.pow(2).sum()) for d in delta.values()))
    assert close({k: third[k] for k in "wb"}, {k: theta0[k] + delta[k] * mean_norm / n for k in "wb"})


def test_dop_pieces_by_hand():
    assert min_norm_pair(1.0, 0.0, 1.0) == 0.5 and min_norm_pair(4.0, 0.0, 1.0) == pytest.approx(0.2)
    assert min_norm_pair(1.0, 2.0, 9.0) == 0.999 and min_norm_pair(9.0, 2.0, 1.0) == 0.001
    tau = torch.diag(torch.tensor([3.0, 1.0, 0.0], dtype=torch.float64))
    s, u, v = subspace(tau, 0.99999)  # energy 0.75, 1.0, 1.0: searchsorted(0.99999) = 1 triplet
    assert s.tolist() == [3.0] and u.shape == (3, 1) and v.shape == (3, 1)
    delta = torch.ones(3, 3, dtype=torch.float64)
    # ||3 u1^T delta||^2 = 9 * 3 and ||delta v1 3||^2 = 9 * 3
    assert float(projected_loss(delta, s, u, v, "uv")) == pytest.approx(54.0)
    assert float(projected_loss(delta, s, u, v, "u")) == pytest.approx(27.0)


def test_dop_averages_what_is_not_a_matrix_and_starts_the_matrices_at_the_average():
    theta0, taus = stream(6, 2)
    _, second = run("dop", theta0, taus, num_steps=0)
    average = {k: theta0[k] + (taus[0][1][k] + taus[1][1][k]) / 2 for k in "wb"}
    assert close({k: second[k] for k in "wb"}, average)
    _, optimised = run("dop", theta0, taus)
    assert close({"b": optimised["b"]}, {"b": average["b"]}) and not close({"w": optimised["w"]}, {"w": average["w"]})


@pytest.mark.parametrize("alpha, target", [(1.0, 0), (0.0, 1)])
def test_dop_with_all_weight_on_one_model_reaches_it_in_its_subspace(alpha, target):
    """Without MGDA the loss is alpha L_merged + (1 - alpha) L_new: with alpha = 1 (0) the optimum is every W whose
    difference from the merged (new) weight vanishes on that task vector's kept singular vectors, left and right;
    svd_epsilon's searchsorted keeps 2 of the 3 triplets here, so W is not the weight itself."""
    theta0, taus = stream(7, 2)
    first, second = run("dop", theta0, taus, mgda=False, alpha=alpha, lr=0.02, num_steps=1500)
    wanted = (first["w"], theta0["w"] + taus[1][1]["w"])[target]
    s, u, v = subspace(wanted - theta0["w"], 0.99999)
    delta = second["w"] - wanted
    assert len(s) == 2 and float((u.T @ delta).abs().max()) < 1e-3 and float((delta @ v).abs().max()) < 1e-3
    assert float(delta.abs().max()) > 0.1  # the rest of the difference is left where the average put it


def test_dop_mgda_balances_the_two_losses():
    """MGDA (no EMA) moves both losses down from the average, where neither model is favoured by hand."""
    theta0, taus = stream(8, 2)
    (first,) = run("dop", theta0, taus[:1])
    w0, w_merged, w_new = theta0["w"], first["w"], theta0["w"] + taus[1][1]["w"]
    spaces = [subspace(w - w0, 0.99999) for w in (w_merged, w_new)]
    _, second = run("dop", theta0, taus, ema=False, lr=0.01, num_steps=300)

    def losses(w):
        return [float(projected_loss(w - wi, *sp, "uv")) for wi, sp in zip((w_merged, w_new), spaces)]

    start, end = losses((w_merged + w_new) / 2), losses(second["w"])
    assert sum(end) < sum(start)


@pytest.mark.parametrize(
    "name, hp, message",
    [
        ("opcm", {"alpha": 1.5}, "continual.opcm.alpha: expected a number in [0, 1], got 1.5"),
        ("dop", {"num_steps": 2.5}, "continual.dop.num_steps: expected an integer"),
        ("dop", {"svd_proj_space": "w"}, "continual.dop.svd_proj_space: expected one of"),
        ("magmax", {"beta": 1}, "continual.magmax.beta: unknown hyperparameter (allowed: lam)"),
    ],
)
def test_bad_hyperparameters_are_refused_in_one_line(name, hp, message):
    theta0, taus = stream(9, 1)
    with pytest.raises(ValueError, match=None) as err:
        run(name, theta0, taus, **hp)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda tau: {k: v for k, v in tau.items() if k != "b"}, "task vector of 't0': key 'b' of theta0 is missing"),
        (lambda tau: {**tau, "w": torch.zeros(3, 5)}, "task vector of 't0': 'w' has shape (3, 5), theta0's is (5, 3)"),
        (lambda tau: {**tau, "x": torch.zeros(1)}, "task vector of 't0': key 'x' is not in theta0"),
        (lambda tau: {**tau, "b": torch.full((5,), math.nan)}, "task vector of 't0': 'b' holds a value that is not"),
    ],
)
def test_a_bad_task_vector_is_named_in_one_line(bad, message):
    theta0, taus = stream(10, 1)
    with pytest.raises(ValueError) as err:
        run("opcm", theta0, [("t0", bad(taus[0][1]))])
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_ranges_are_data():
    assert C.Interval(0, 1).admits(0.5) and not C.Interval(0, 1).admits(True) and not C.Interval().admits(math.inf)
    assert C.OneOf((True, False)).admits(False) and not C.OneOf((True, False)).admits(0)
