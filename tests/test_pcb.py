"""PCB-merging against the authors' PCB_merge written out in numpy (an independent route: sorting where the
module uses kthvalue), and its identity for one task: the top of |tau| kept, the rest dropped."""

import numpy as np
import pytest
import torch

from mergeflow.ml.merging import REGISTRY
from mergeflow.ml.merging.pcb import pcb_vector


def _authors(rows: np.ndarray, ratio: float, clamp_ratio: float, inter: str) -> np.ndarray:
    """pcb-merging.py's PCB_merge (inter 'sum'; the vision script's normalized sum), in numpy."""

    def normalize(x):
        low, high = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
        return (x - low) / (high - low)

    def clamp(x, min_ratio, max_ratio):
        d = x.shape[1]
        ordered = np.sort(x, axis=1)
        return np.clip(x, ordered[:, int(d * min_ratio)][:, None], ordered[:, int(d * (1 - max_ratio) - 1)][:, None])

    n = rows.shape[0]
    mags = clamp(np.abs(rows), clamp_ratio, clamp_ratio)
    clamped = np.sign(rows) * mags
    intra = np.exp(n * normalize(mags) ** 2)
    total = rows.sum(0) if inter == "sum" else (np.sign(rows) * normalize(mags)).sum(0)
    scale = normalize(clamp(intra * np.tanh(rows * total), 1 - ratio, 0))
    return (clamped * scale).sum(0) / np.maximum(scale.sum(0), 1e-12)


@pytest.mark.parametrize("inter", ["sum", "normalized_sum"])
def test_pcb_is_the_authors_merge(inter):
    rng = np.random.default_rng(3)
    rows = rng.normal(size=(3, 200)) * 0.5  # large enough for tanh to bend
    got = pcb_vector(torch.from_numpy(rows), 0.2, 0.01, inter).numpy()
    np.testing.assert_allclose(got, _authors(rows, 0.2, 0.01, inter), rtol=1e-12, atol=1e-12)
    assert (got != 0).mean() < 0.7  # most entries dropped by some task, not all


def test_one_task_keeps_the_top_of_its_magnitudes():
    torch.manual_seed(0)
    theta0 = {"w": torch.randn(6, 10, dtype=torch.float64), "b": torch.randn(10, dtype=torch.float64)}
    tau = {k: torch.randn_like(v) for k, v in theta0.items()}
    merged = REGISTRY["pcb"](theta0, {"only": tau}, ratio=0.25, clamp_ratio=0.0, inter="sum", scope="global", lam=0.5)
    flat = torch.cat([tau["w"].reshape(-1), tau["b"]])
    cut = flat.abs().sort().values[int(70 * 0.75)]  # the authors' clamp floor: entries at or under it weigh 0
    for k in theta0:
        assert merged[k].dtype == torch.float64
        torch.testing.assert_close(merged[k], theta0[k] + 0.5 * tau[k] * (tau[k].abs() > cut), rtol=0, atol=1e-12)


def test_global_and_tensor_scopes_agree_on_one_tensor():
    torch.manual_seed(1)
    theta0 = {"w": torch.randn(5, 8)}
    tvs = {t: {"w": torch.randn(5, 8) * 0.3} for t in "abc"}
    a = REGISTRY["pcb"](theta0, tvs, ratio=0.3, clamp_ratio=0.05, inter="sum", scope="global", lam=1.2)
    b = REGISTRY["pcb"](theta0, tvs, ratio=0.3, clamp_ratio=0.05, inter="sum", scope="tensor", lam=1.2)
    torch.testing.assert_close(a["w"], b["w"])
