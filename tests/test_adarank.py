"""AdaRank (merging/adarank.py): with nothing learned it is the merge it starts from (task arithmetic at λ = init
with every component, CART at λ = init with the top rank_ratio of each centred vector), its masks are hard in the
forward pass with the sigmoid's gradient (straight-through, checked against the formula), and learning moves
both the masks and λ, recording the components each task keeps. On Iso-CTS (``base: iso_cts``) it starts as Iso-CTS
at alpha = init, and each component is scaled by its owner's λ (the common ones by the mean), by hand."""

import copy

import pytest
import torch

from mergeflow.ml.merging import REGISTRY, MergeData
from mergeflow.ml.merging.adarank import COMMON, parametrisation
from mergeflow.ml.merging.iso import iso_cts_factors, subspace_sizes

from .test_data_aware import _tiny_setup


def test_with_nothing_learned_it_is_task_arithmetic_or_cart_at_its_init():
    theta0, taus, objective = _tiny_setup(torch.float64)
    adarank = REGISTRY["adarank"]
    ta = adarank.with_data(MergeData(objective=copy.copy(objective)))(
        theta0, taus, base="ta", lr=0.0, steps=2, init=0.3, rank_ratio=1.0
    )
    expected = REGISTRY["task_arithmetic"](theta0, taus, lam=0.3)
    for k in theta0:
        torch.testing.assert_close(ta[k], expected[k])
    data = MergeData(objective=copy.copy(objective))
    cart = adarank.with_data(data)(
        theta0, taus, base="cart", lr=0.0, steps=2, init=1.5, rank_ratio=0.25
    )  # 16-wide matrices: 4 components
    expected = REGISTRY["cart"](theta0, taus, lam=1.5, rank_ratio=0.25)
    for k in theta0:
        torch.testing.assert_close(cart[k], expected[k])
    kept = data.learned[0]["kept"]
    assert set(kept) == set(taus) and all(n == 4 for per_task in kept.values() for n in per_task.values())


def test_the_masks_are_hard_with_the_sigmoids_gradient():
    theta0, taus, _ = _tiny_setup(torch.float64)
    temperature = 10.0
    module = parametrisation(1.0, 0.3, temperature)(theta0, taus, torch.device("cpu"))
    key = next(iter(module.factors))
    logits = module.logits[key.replace(".", "/")]
    with torch.no_grad():
        logits[0, 0] = -0.3  # this one pruned
    mask = module.masks(key)
    assert set(mask.detach().unique().tolist()) == {0.0, 1.0} and float(mask.detach()[0, 0]) == 0.0
    (grad,) = torch.autograd.grad(mask.sum(), logits)
    sig = torch.sigmoid(logits.detach() / temperature)
    torch.testing.assert_close(grad, sig * (1 - sig) / temperature)


@pytest.mark.parametrize("base", ["ta", "iso_cts"])
def test_learning_moves_the_masks_and_lambda(base):
    theta0, taus, objective = _tiny_setup()
    data = MergeData(objective=objective)
    merged = REGISTRY["adarank"].with_data(data)(
        theta0, taus, base=base, lr=0.05, steps=5, init=0.3, rank_ratio=0.5, temperature=1.0
    )
    learned = data.learned[0]
    assert any(v != 0.3 for per_task in learned["coefficients"].values() for v in per_task.values())
    at_start = {t: 8 for t in taus} if base == "ta" else {**{t: 1 for t in taus}, COMMON: 13}  # 16-wide matrices
    assert any(n != at_start[t] for t, per_task in learned["kept"].items() for n in per_task.values())
    assert all(torch.isfinite(v).all() for v in merged.values()) and merged.keys() == theta0.keys()


def test_on_iso_cts_with_nothing_learned_it_is_iso_cts_at_its_init():
    theta0, taus, objective = _tiny_setup(torch.float64)
    data = MergeData(objective=objective)
    merged = REGISTRY["adarank"].with_data(data)(
        theta0, taus, base="iso_cts", lr=0.0, steps=2, init=1.4, common_space_fraction=0.8
    )
    expected = REGISTRY["iso_cts"](theta0, taus, alpha=1.4, common_space_fraction=0.8)
    for k in theta0:
        torch.testing.assert_close(merged[k], expected[k])
    common, per_task = subspace_sizes(16, 3, 0.8)  # 16-wide matrices, 3 tasks: 13 common, 1 each
    kept = data.learned[0]["kept"]
    assert set(kept) == {*taus, COMMON} and (common, per_task) == (13, 1)
    assert all(kept[COMMON][k] == common and all(kept[t][k] == per_task for t in taus) for k in kept[COMMON])


def test_on_iso_cts_each_component_takes_its_owners_lambda():
    theta0, taus, _ = _tiny_setup(torch.float64)
    tasks = list(taus)
    module = parametrisation(0.16, 1.0, 10.0, isotropic_fraction=0.8)(theta0, taus, torch.device("cpu"))
    key = next(iter(module.factors))
    column = module.keys.index(key)
    lam = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    with torch.no_grad():
        module.lam[:, column] = lam
        module.logits[key.replace(".", "/")][0] = -0.3  # the first common component pruned
    out = module()[key]
    u, v, sigma, owner = iso_cts_factors(torch.stack([taus[t][key] for t in tasks]), 0.8)
    expected = theta0[key].clone()
    for j in range(1, u.shape[1]):  # column by column, by hand
        scale = lam.mean() if owner[j] < 0 else lam[owner[j]]
        expected += scale * sigma * torch.outer(u[:, j], v[:, j])
    torch.testing.assert_close(out, expected)
    assert owner.tolist() == [-1] * 13 + [0, 1, 2]
