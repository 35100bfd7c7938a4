"""Karcher mean and Multi-SLERP (mergekit's) against their definitions on tiny tensors, and SLERP at 1/2."""

import pytest
import torch

from mergeflow.ml.merging import REGISTRY
from mergeflow.ml.merging.karcher import karcher_mean
from mergeflow.ml.merging.slerp import slerp_pair


def _equal_norm_pair(seed=0):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
    return {"w": torch.randn(5, 4, generator=g)}, {"a": {"w": a}, "b": {"w": b * a.norm() / b.norm()}}


@pytest.mark.parametrize("name", ["karcher", "multislerp"])
def test_of_two_task_vectors_of_equal_norm_is_slerp_at_one_half(name):
    theta0, taus = _equal_norm_pair()
    expected = theta0["w"] + slerp_pair(taus["a"]["w"], taus["b"]["w"], 0.5)
    assert torch.allclose(REGISTRY[name](theta0, taus)["w"], expected, atol=1e-5)
    assert torch.allclose(REGISTRY["slerp"](theta0, taus, t=0.5)["w"], expected, atol=1e-6)


def test_karcher_mean_satisfies_its_first_order_condition():
    """At the Karcher mean m the log map of the directions averages to zero: sum_t theta_t / sin(theta_t) (u_t - cos
    theta_t m) = 0, and |m| = 1 with the result's norm the mean norm."""
    g = torch.Generator().manual_seed(1)
    vectors = torch.randn(4, 12, generator=g) + 2.0  # four directions in one hemisphere, of different norms
    merged = karcher_mean(vectors, max_iter=50, tol=1e-9)
    m = merged / merged.norm()
    assert merged.norm() == pytest.approx(vectors.norm(dim=1).mean().item(), rel=1e-6)
    units = vectors / vectors.norm(dim=1, keepdim=True)
    cos = (units @ m).clamp(-1, 1)
    theta = torch.arccos(cos)
    gradient = ((theta / torch.sin(theta))[:, None] * (units - cos[:, None] * m)).mean(0)
    assert gradient.norm() < 1e-5
    extrinsic = units.mean(0) / units.mean(0).norm()  # the first step's start: not the mean itself for 4 directions
    assert (extrinsic - m).norm() > 10 * gradient.norm()


def test_karcher_in_weight_space_averages_the_fine_tuned_weights_directions():
    theta0, taus = _equal_norm_pair(2)
    weights = torch.stack([(theta0["w"] + t["w"]).flatten() for t in taus.values()])
    expected = karcher_mean(weights, 10, 1e-5).reshape(5, 4)
    assert torch.allclose(REGISTRY["karcher"](theta0, taus, space="weights")["w"], expected, atol=1e-6)


def test_multislerp_is_the_normalised_mean_direction_times_the_mean_norm():
    g = torch.Generator().manual_seed(3)
    taus = {t: {"w": torch.randn(3, 3, generator=g) * (i + 1)} for i, t in enumerate("abc")}
    flat = torch.stack([t["w"].flatten() for t in taus.values()])
    direction = (flat / flat.norm(dim=1, keepdim=True)).mean(0)
    expected = (flat.norm(dim=1).mean() * direction / direction.norm()).reshape(3, 3)
    assert torch.allclose(REGISTRY["multislerp"]({"w": torch.zeros(3, 3)}, taus)["w"], expected, atol=1e-5)


def test_multislerp_of_opposite_directions():
    """Two opposite task vectors: mergekit's fallback to their mean; three whose directions cancel: one line."""
    theta0 = {"w": torch.ones(2)}
    two = {"a": {"w": torch.tensor([1.0, 0.0])}, "b": {"w": torch.tensor([-3.0, 0.0])}}
    assert torch.allclose(REGISTRY["multislerp"](theta0, two)["w"], torch.tensor([0.0, 1.0]))
    e = [torch.tensor([1.0, 0.0]), torch.tensor([-0.5, 3**0.5 / 2]), torch.tensor([-0.5, -(3**0.5) / 2])]
    with pytest.raises(ValueError, match="merge.multislerp: tensor 'w': .* cancel out"):
        REGISTRY["multislerp"](theta0, {t: {"w": v} for t, v in zip("abc", e)})


def _opposite(n: int, dtype, nearly: bool):
    """a and b = -2a (or -2a slightly turned, by 1e-9 of its norm): opposite task vectors of unequal norm."""
    g = torch.Generator().manual_seed(n)
    a = (
        (0.01 * torch.randn(n, generator=g, dtype=torch.float64)).to(dtype)
        if n > 1
        else torch.tensor([0.01], dtype=dtype)
    )
    b = -2 * a
    if nearly:
        b = b + (1e-9 * b.norm() * torch.randn(n, generator=g, dtype=torch.float64)).to(dtype)
    return a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 2, 1000])
@pytest.mark.parametrize("nearly", [False, True])
def test_opposite_task_vectors_merge_to_the_linear_limit(n, dtype, nearly):
    """SLERP and NuSLERP of (nearly) opposite vectors: (1 - t) a + t b, where sin(Omega) ~ 0 blew them up (0.01 and
    -0.02 at t = 0.3 gave 92,540.8 in float32, -6.6e13 in float64; mergekit: 0.001)."""
    from mergeflow.ml.merging.nuslerp import nuslerp_pair

    a, b = _opposite(n, dtype, nearly)
    linear = 0.7 * a + 0.3 * b
    for merged in (slerp_pair(a, b, 0.3), nuslerp_pair(0.3, a.reshape(1, -1), b.reshape(1, -1)).reshape(-1)):
        assert merged.dtype == dtype and torch.allclose(merged, linear, rtol=1e-5, atol=1e-9)
    if n == 1 and not nearly:
        assert slerp_pair(a, b, 0.3).item() == pytest.approx(0.001, rel=1e-5)


def test_nuslerp_by_columns_of_one_entry_each_half_of_them_opposite():
    """A pos_embed-like [1, 17, 8] interpolated by columns: each column is one entry, half of opposite sign; every
    one comes out at its linear limit (it came out at 9.25e4)."""
    theta0 = {"pos_embed": torch.zeros(1, 17, 8)}
    g = torch.Generator().manual_seed(0)
    a = 1e-3 * torch.randn(1, 17, 8, generator=g)
    b = a * torch.where(torch.rand(1, 17, 8, generator=g) < 0.5, -2.0, 3.0)
    merged = REGISTRY["nuslerp"](theta0, {"a": {"pos_embed": a}, "b": {"pos_embed": b}}, t=0.3, vectors="columns")[
        "pos_embed"
    ]
    assert torch.allclose(merged, 0.7 * a + 0.3 * b, rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_multislerp_and_karcher_of_opposite_directions_stay_finite(dtype):
    a, b = _opposite(1000, dtype, nearly=False)
    theta0 = {"w": torch.zeros(1000, dtype=dtype)}
    merged = REGISTRY["multislerp"](theta0, {"a": {"w": a}, "b": {"w": b}})["w"]
    assert torch.allclose(merged, (a + b) / 2, rtol=1e-5, atol=1e-9)  # cancelled directions: the linear mean (mergekit)
    third = (0.01 * torch.randn(1000, generator=torch.Generator().manual_seed(5), dtype=torch.float64)).to(dtype)
    mean = karcher_mean(torch.stack([a, b, third]), max_iter=10, tol=1e-5)
    assert torch.isfinite(mean).all() and mean.norm() <= torch.stack([a, b, third]).norm(dim=1).mean() * (1 + 1e-4)
