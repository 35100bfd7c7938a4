"""WEMoE (merging/wemoe.py): with constant routing it is task arithmetic; its routing is per sample (a sample's
features do not depend on its batch); one sample's features equal those of the plain backbone whose MLPs are set,
block by block, to theta0 + sum_t w_t tau_t with w computed by hand from the routers on that block's input; and
learning the routers lowers the test inputs' entropy."""

import copy

import pytest
import torch

from mergeflow.ml.merging import REGISTRY, MergeData
from mergeflow.ml.merging.wemoe import MLP, network

from .test_data_aware import _tiny_setup


def _store(steps=0, **hp):
    theta0, taus, objective = _tiny_setup(torch.float64)
    data = MergeData(objective=copy.copy(objective))
    store = REGISTRY["wemoe"].with_data(data)(theta0, taus, steps=steps, batch_size=8, **hp)
    return theta0, taus, objective, store, data


def _features(backbone, state, images):
    model = copy.deepcopy(backbone)
    model.net.load_state_dict(state)
    with torch.no_grad():
        return model.embed(model.net(model.normalise(images).double()))


def test_with_constant_routing_it_is_task_arithmetic_at_init():
    theta0, taus, objective, store, _ = _store(init=0.3)
    flat = {
        k: (torch.zeros_like(v) if k.startswith("router/") and k.endswith("weight") else v) for k, v in store.items()
    }  # w(x) = b2 = 0.3
    images = objective.inputs["test"]["a"][:6]
    with torch.no_grad():
        routed = network(flat, objective.backbone)(images)
    ta = REGISTRY["task_arithmetic"](theta0, taus, lam=0.3)
    torch.testing.assert_close(routed, _features(objective.backbone, ta, images))


def test_routing_is_per_sample():
    _, _, objective, store, _ = _store(steps=3, lr=0.05)
    images = torch.cat([objective.inputs["test"][t][:4] for t in ("a", "b", "c")])
    model = network(store, objective.backbone)
    with torch.no_grad():
        together = model(images)
        alone = torch.cat([model(images[i : i + 1]) for i in range(len(images))])
    torch.testing.assert_close(together, alone)


def test_one_sample_is_the_backbone_with_its_own_mix_of_the_mlp_task_vectors():
    theta0, taus, objective, store, _ = _store(steps=3, lr=0.05, init=0.3)
    tasks = sorted(taus)
    image = objective.inputs["test"]["b"][:1]
    with torch.no_grad():
        routed = network(store, objective.backbone)(image)
    plain = copy.deepcopy(objective.backbone)
    plain.net.load_state_dict(
        {k: theta0[k] if MLP.match(k) else theta0[k] + 0.3 * sum(taus[t][k] for t in tasks) for k in theta0}
    )
    weights_seen = []

    def set_weights(block_index):
        def hook(mlp, args):
            (x,) = args
            r = {n: store[f"router/{block_index}/{n}"] for n in ("0.weight", "0.bias", "2.weight", "2.bias")}
            w = (torch.relu(x @ r["0.weight"].T + r["0.bias"]) @ r["2.weight"].T + r["2.bias"]).mean(1)[0]  # [T]
            weights_seen.append(w)
            for name in ("fc1", "fc2"):
                for p in ("weight", "bias"):
                    key = f"blocks.{block_index}.mlp.{name}.{p}"
                    getattr(getattr(mlp, name), p).data = theta0[key] + sum(
                        w[i] * taus[t][key] for i, t in enumerate(tasks)
                    )

        return hook

    for l, block in enumerate(plain.net.blocks):
        block.mlp.register_forward_pre_hook(set_weights(l))
    with torch.no_grad():
        expected = plain.embed(plain.net(plain.normalise(image).double()))
    torch.testing.assert_close(routed, expected)
    assert len(weights_seen) == len(plain.net.blocks) and not torch.allclose(
        weights_seen[0], torch.full((3,), 0.3, dtype=torch.float64)
    )


def test_learning_the_routers_lowers_the_entropy_and_keeps_the_experts():
    theta0, taus, objective, store, data = _store(steps=25, lr=0.01)
    entropy = data.learned[0]["entropy"]
    assert len(entropy) == 25 and sum(entropy[-5:]) < sum(entropy[:5])
    assert set(data.learned[0]["coefficients"]) == set(taus)
    again = _store(steps=25, lr=0.01)[3]
    assert all(torch.equal(store[k], again[k]) for k in store)  # deterministic
    for t in taus:
        for k in theta0:
            if MLP.match(k):
                assert torch.equal(store[f"experts/{t}/{k}"], taus[t][k])


def test_a_backbone_without_vit_mlps_is_refused():
    theta0, taus, objective = _tiny_setup()
    renamed = {k.replace("mlp", "ffn"): v for k, v in theta0.items()}
    with pytest.raises(ValueError, match="wemoe: the backbone has no blocks"):
        REGISTRY["wemoe"].with_data(MergeData(objective=objective))(
            renamed, {t: {k.replace("mlp", "ffn"): v for k, v in tv.items()} for t, tv in taus.items()}, steps=0
        )
