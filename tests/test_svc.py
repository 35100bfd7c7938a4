"""Singular value calibration (merging/svc.py): a direction every task shares is counted once again (task arithmetic
at λ 1 of copies gives the copy back), a direction one task has alone is raised by T / (1 + (T - 1) alpha), both by
hand; on random matrices the calibration equals the paper's loop over subspaces and tasks (FusionBench's original
implementation, written out here); non-matrix tensors keep the base merge's values."""

import torch

from mergeflow.ml.merging import REGISTRY
from mergeflow.ml.merging.svc import calibrate


def _rank_one(i, j, scale=1.0, shape=(4, 3)):
    m = torch.zeros(shape, dtype=torch.float64)
    m[i, j] = scale
    return m


def test_a_shared_direction_is_counted_once():
    tau = _rank_one(0, 0) + 0.5 * _rank_one(1, 2)
    taus = torch.stack([tau, tau, tau])
    torch.testing.assert_close(calibrate(taus.sum(0), taus, alpha=0.1), tau)


def test_a_direction_of_one_task_alone_is_raised():
    taus = torch.stack([_rank_one(0, 0), _rank_one(1, 1, 2.0)])
    alpha = 0.1
    gamma = 2 / (1 + alpha)  # s = 1 for its own task, 0 -> alpha for the other
    torch.testing.assert_close(calibrate(taus.sum(0), taus, alpha), gamma * taus.sum(0))


def test_equals_the_papers_loop_on_random_matrices():
    g = torch.Generator().manual_seed(0)
    taus = torch.randn(3, 6, 5, generator=g, dtype=torch.float64)
    delta = 0.3 * taus.sum(0)
    alpha = 0.1
    u, s, vh = torch.linalg.svd(delta, full_matrices=False)
    gammas = []
    for r in range(len(s)):
        a = u[:, r] @ delta
        coefficients = [float(a @ (u[:, r] @ tau)) / float((u[:, r] @ tau) @ (u[:, r] @ tau)) for tau in taus]
        gammas.append(len(taus) / sum(max(alpha, c) for c in coefficients))
    expected = u @ torch.diag(torch.tensor(gammas, dtype=torch.float64) * s) @ vh
    torch.testing.assert_close(calibrate(delta, taus, alpha), expected)


def test_the_method_calibrates_matrices_and_keeps_the_rest_of_its_base():
    g = torch.Generator().manual_seed(1)
    theta0 = {
        "blocks.0.mlp.fc1.weight": torch.randn(6, 4, generator=g),
        "blocks.0.mlp.fc1.bias": torch.randn(6, generator=g),
    }
    taus = {t: {k: 0.1 * torch.randn(v.shape, generator=g) for k, v in theta0.items()} for t in ("a", "b")}
    out = REGISTRY["svc"](theta0, taus, lam=0.3, alpha=0.1)
    ta = REGISTRY["task_arithmetic"](theta0, taus, lam=0.3)
    key = "blocks.0.mlp.fc1.weight"
    delta = (ta[key] - theta0[key]).double()
    expected = theta0[key].double() + calibrate(delta, torch.stack([taus[t][key].double() for t in taus]), 0.1)
    torch.testing.assert_close(out[key], expected.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["blocks.0.mlp.fc1.bias"], ta["blocks.0.mlp.fc1.bias"])
