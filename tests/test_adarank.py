"""AdaRank (merging/adarank.py): with nothing learned it is the merge it starts from (task arithmetic at λ = init
with every component, CART at λ = init with the top rank_ratio of each centred vector), its masks are hard in the
forward pass with the sigmoid's gradient (straight-through, checked against the formula), and learning moves
both the masks and λ, recording the components each task keeps."""

import copy

import torch

from mergeflow.merging import REGISTRY, MergeData
from mergeflow.merging.adarank import parametrisation

from .test_data_aware import _tiny_setup


def test_with_nothing_learned_it_is_task_arithmetic_or_cart_at_its_init():
    theta0, taus, objective = _tiny_setup(torch.float64)
    adarank = REGISTRY["adarank"]
    ta = adarank.with_data(MergeData(objective=copy.copy(objective)))(theta0, taus, base="ta", lr=0.0, steps=2, init=0.3, rank_ratio=1.0)
    expected = REGISTRY["task_arithmetic"](theta0, taus, lam=0.3)
    for k in theta0:
        torch.testing.assert_close(ta[k], expected[k])
    data = MergeData(objective=copy.copy(objective))
    cart = adarank.with_data(data)(theta0, taus, base="cart", lr=0.0, steps=2, init=1.5, rank_ratio=0.25)  # 16-wide matrices: 4 components
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


def test_learning_moves_the_masks_and_lambda():
    theta0, taus, objective = _tiny_setup()
    data = MergeData(objective=objective)
    merged = REGISTRY["adarank"].with_data(data)(theta0, taus, base="ta", lr=0.05, steps=5, init=0.3, rank_ratio=0.5, temperature=1.0)
    learned = data.learned[0]
    assert any(v != 0.3 for per_task in learned["coefficients"].values() for v in per_task.values())
    assert any(n != 8 for per_task in learned["kept"].values() for n in per_task.values())  # 16-wide: 8 at the start
    assert all(torch.isfinite(v).all() for v in merged.values()) and merged.keys() == theta0.keys()
