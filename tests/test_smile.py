"""SMILE (merging/smile.py): an input lying in one task's input subspace is routed to that task's expert; top-k
mixes the experts by the softmax of the projections' norms, computed by hand; the experts are the task vectors'
best rank-k approximations; with one task at full rank the upscaled layers are the fine-tuned ones; routing is per
token, and a sample's features do not depend on its batch; the store's size is the count of its parts."""

import math
from collections import OrderedDict

import pytest
import torch
from torch import nn

from mergeflow.ml.merging import REGISTRY
from mergeflow.ml.merging._tensors import store_bytes
from mergeflow.ml.merging.smile import network

from .test_data_aware import _tiny_setup


class _Toy(nn.Module):
    """A backbone as a routed network reads one: ``net``, ``normalise`` (float inputs as they are), ``embed``."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def normalise(self, x):
        return x

    def embed(self, features):
        return features


def _layer(out=3, inputs=4):
    torch.manual_seed(0)
    net = nn.Sequential(OrderedDict(fc=nn.Linear(inputs, out))).double()
    return _Toy(net), {k: v.detach().clone() for k, v in net.state_dict().items()}


def _rank_one(out_vector, in_index, scale, inputs=4):
    """scale * u e_i^T: a task vector whose input subspace is the i-th axis."""
    e = torch.zeros(inputs, dtype=torch.float64)
    e[in_index] = 1.0
    return scale * torch.outer(torch.tensor(out_vector, dtype=torch.float64), e)


def _two_tasks():
    backbone, theta0 = _layer()
    taus = {
        "a": {"fc.weight": _rank_one([1.0, -2.0, 0.5], 0, 3.0), "fc.bias": torch.tensor([0.1, 0.2, 0.3]).double()},
        "b": {"fc.weight": _rank_one([0.0, 1.0, 1.0], 1, 2.0), "fc.bias": torch.tensor([-0.4, 0.0, 0.6]).double()},
    }
    return backbone, theta0, taus


def _run(store, backbone, x):
    with torch.no_grad():
        return network(store, backbone)(x)


def test_an_input_in_one_tasks_subspace_goes_to_that_tasks_expert():
    backbone, theta0, taus = _two_tasks()
    store = REGISTRY["smile"](theta0, taus)
    w0, b0 = theta0["fc.weight"], theta0["fc.bias"]
    for task, axis in (("a", 0), ("b", 1)):
        x = torch.zeros(1, 4, dtype=torch.float64)
        x[0, axis] = 2.0
        x[0, 3] = 0.7  # outside both subspaces: no task's gate sees it
        tau = taus[task]
        expected = x @ (w0 + tau["fc.weight"]).T + b0 + tau["fc.bias"]
        torch.testing.assert_close(_run(store, backbone, x), expected)


def test_each_token_is_routed_on_its_own():
    backbone, theta0, taus = _two_tasks()
    store = REGISTRY["smile"](theta0, taus)
    tokens = torch.tensor([[[2.0, 0.0, 0.0, 0.5], [0.0, -1.0, 0.0, 0.5]]], dtype=torch.float64)  # [1 sample, 2, 4]
    w0, b0 = theta0["fc.weight"], theta0["fc.bias"]
    expected = torch.stack(
        [x @ (w0 + taus[t]["fc.weight"]).T + b0 + taus[t]["fc.bias"] for x, t in zip(tokens[0], "ab")]
    )[None]
    torch.testing.assert_close(_run(store, backbone, tokens), expected)


def test_top_two_mixes_the_experts_by_the_softmax_of_the_projections_norms():
    backbone, theta0, taus = _two_tasks()
    store = REGISTRY["smile"](theta0, taus, top_k=2)
    x = torch.tensor([[1.0, 2.0, 0.0, -1.0]], dtype=torch.float64)
    g = torch.tensor([1.0, 2.0], dtype=torch.float64)  # |x . e0|, |x . e1|: the gates' norms, by hand
    r = torch.exp(g) / torch.exp(g).sum()
    expected = x @ theta0["fc.weight"].T + theta0["fc.bias"]
    for weight, t in zip(r, ("a", "b")):
        expected = expected + weight * (x @ taus[t]["fc.weight"].T + taus[t]["fc.bias"])
    torch.testing.assert_close(_run(store, backbone, x), expected)


def test_an_expert_is_its_task_vectors_best_rank_k_approximation():
    backbone, theta0 = _layer(out=2, inputs=2)
    taus = {"a": {"fc.weight": torch.diag(torch.tensor([3.0, 1.0])).double(), "fc.bias": torch.zeros(2).double()}}
    x = torch.tensor([[1.0, 1.0]], dtype=torch.float64)
    base = x @ theta0["fc.weight"].T + theta0["fc.bias"]
    rank_one = REGISTRY["smile"](theta0, taus, k=1)
    torch.testing.assert_close(_run(rank_one, backbone, x), base + torch.tensor([[3.0, 0.0]], dtype=torch.float64))
    assert rank_one["experts/a/fc.weight/up"].shape == (2, 1) and rank_one["experts/a/fc.weight/down"].shape == (1, 2)


@pytest.mark.parametrize("k", [0, 128])  # the whole task vector; a rank above the matrix's, cut to it
def test_with_one_task_at_full_rank_the_network_is_the_fine_tuned_model(k):
    theta0, taus, objective = _tiny_setup(torch.float64)
    one = {"b": taus["b"]}
    store = REGISTRY["smile"](theta0, one, k=k, others="average")
    images = objective.inputs["test"]["a"][:4]
    finetuned = objective.backbone
    finetuned.net.load_state_dict({key: theta0[key] + one["b"][key] for key in theta0})
    with torch.no_grad():
        expected = finetuned.embed(finetuned.net(finetuned.normalise(images).double()))
        routed = network(store, objective.backbone)(images)
    torch.testing.assert_close(routed, expected)


def test_a_samples_features_do_not_depend_on_its_batch_and_the_layers_outside_stay_pretrained():
    theta0, taus, objective = _tiny_setup(torch.float64)
    store = REGISTRY["smile"](theta0, taus, top_k=2, gate_k=2)
    for key in ("fc_norm.weight", "blocks.0.norm1.bias", "pos_embed", "patch_embed.proj.weight"):
        assert torch.equal(store[f"base/{key}"], theta0[key])  # others="pretrained"
    averaged = REGISTRY["smile"](theta0, taus, others="average")
    mean = sum(taus[t]["fc_norm.weight"] for t in taus) / 3
    torch.testing.assert_close(averaged["base/fc_norm.weight"], theta0["fc_norm.weight"] + mean)
    assert torch.equal(averaged["base/blocks.0.mlp.fc1.bias"], theta0["blocks.0.mlp.fc1.bias"])  # a routed layer's
    images = torch.cat([objective.inputs["test"][t][:3] for t in ("a", "b", "c")])
    model = network(store, objective.backbone)
    with torch.no_grad():
        together = model(images)
        alone = torch.cat([model(images[i : i + 1]) for i in range(len(images))])
    torch.testing.assert_close(together, alone)


def test_the_store_holds_the_experts_and_gates_beside_one_model():
    _, theta0, taus = _two_tasks()
    store = REGISTRY["smile"](theta0, taus, k=1, gate_k=1)
    model = 3 * 4 + 3  # W0 and b0, in the base
    experts = 2 * (1 * 3 + 1 * 4 + 3)  # per task: U [3, 1], S V^T [1, 4], db [3]
    gates = 2 * 1 * 4
    assert store_bytes(store) == 8 * (model + experts + gates) + 8  # float64; top_k an int64
    assert set(store) == {
        "top_k",
        "base/fc.weight",
        "base/fc.bias",
        "gate/fc.weight",
        *(f"experts/{t}/{part}" for t in "ab" for part in ("fc.weight/up", "fc.weight/down", "fc.bias")),
    }


def test_a_layer_no_task_moved_keeps_theta0_and_no_gate():
    _, theta0, taus = _two_tasks()
    still = {t: {"fc.weight": torch.zeros(3, 4).double(), "fc.bias": tv["fc.bias"]} for t, tv in taus.items()}
    store = REGISTRY["smile"](theta0, still, others="average")
    assert set(store) == {"top_k", "base/fc.weight", "base/fc.bias"}
    assert torch.equal(store["base/fc.bias"], theta0["fc.bias"])


def test_bad_settings_and_backbones_are_refused_in_one_line():
    backbone, theta0, taus = _two_tasks()
    with pytest.raises(ValueError, match=r"^merge\.smile\.top_k: 3 experts per token, but only 2 tasks are merged$"):
        REGISTRY["smile"](theta0, taus, top_k=3)
    with pytest.raises(ValueError, match=r"^merge\.smile\.gate_k: expected the router's rank per task >= 1, got 0$"):
        REGISTRY["smile"](theta0, taus, gate_k=0)
    store = REGISTRY["smile"](theta0, taus)

    class NotLinear(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(theta0["fc.weight"].clone())
            self.bias = nn.Parameter(theta0["fc.bias"].clone())

    odd = _Toy(nn.Sequential(OrderedDict(fc=NotLinear())))
    with pytest.raises(ValueError, match=r"^smile: fc\.weight is not the weight of an nn\.Linear in the backbone"):
        network(store, odd)


def test_defaults_are_fusionbenchs():
    assert REGISTRY["smile"].defaults == {
        "k": 128,
        "gate_k": 1,
        "top_k": 1,
        "gate_on": "task_vector",
        "others": "pretrained",
    }
    assert REGISTRY["smile"].kind == "routed" and REGISTRY["smile"].merged
    assert math.prod(len(v) for v in REGISTRY["smile"].grid.values()) == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_gpus_svd_gives_the_cpus_network(monkeypatch):
    """The SVDs on the GPU (gram_svd) against LAPACK's: every expert kept (top_k = T), so that no rounding can flip
    a discrete choice, and the network's features agree to float32 rounding."""
    from mergeflow.ml.merging import _tensors

    theta0, taus, objective = _tiny_setup()
    images = objective.inputs["test"]["a"][:4]
    on_gpu = REGISTRY["smile"](theta0, taus, k=4, gate_k=2, top_k=3)
    assert all(v.device.type == "cpu" for v in on_gpu.values())
    monkeypatch.setattr(_tensors, "svd_device", lambda: torch.device("cpu"))
    on_cpu = REGISTRY["smile"](theta0, taus, k=4, gate_k=2, top_k=3)
    with torch.no_grad():
        a, b = (network(store, objective.backbone)(images) for store in (on_gpu, on_cpu))
    assert (a - b).norm() <= 1e-4 * b.norm()
