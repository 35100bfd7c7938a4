"""LoRA task vectors (mergeflow.ml.lora, regime ``lora``) and KnOTS (merging/knots.py), on tiny tensors:

- LoRA at full rank reaches the closed-form least-squares solution a full fine-tune reaches, and with an orthogonal
  A and s = 1 its first gradient step is the full model's first step exactly (B starts at zero);
- task arithmetic on the factors (one adapter of rank T r) equals task arithmetic on the dense s B A;
- the factor file round-trips, densifies per tensor, and reads peft's adapter layout;
- KnOTS-TA is task arithmetic (U U^T tau_t = tau_t), and KnOTS-TIES on a rank-1 case computed by hand differs from
  TIES on the dense entries;
- the regimes' trainer with an adapter trains only the factors and returns W0 + s B A beside them.
"""

import json

import pytest
import torch
from torch import nn

from mergeflow.core.errors import MergeflowError
from mergeflow.core.io import save_state_dict
from mergeflow.ml.lora import (
    AdapterSpec,
    LoraTaskVector,
    attach,
    concatenate,
    delta,
    load_adapter,
    merge_in,
    read_peft_adapter,
    save_adapter,
    split_factors,
)
from mergeflow.ml.merging import REGISTRY
from mergeflow.ml.regimes import REGISTRY as REGIMES, Budget
from mergeflow.ml.task_vectors import read_task_vector

from .test_regime_trainer import ADAMW, THETA0, trainer


def _regression(seed=0, n=64, d_in=3, d_out=2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g, dtype=torch.float64)
    w_true = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    y = x @ w_true.T + 0.1 * torch.randn(n, d_out, generator=g, dtype=torch.float64)
    return x, y


def _linear(d_in=3, d_out=2):
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(d_in, d_out, bias=False).double())


def test_full_rank_lora_reaches_the_least_squares_solution():
    x, y = _regression()
    net = _linear()
    w0 = net[0].weight.detach().clone()
    attach(net, AdapterSpec(rank=2, alpha=2.0, targets=("0",)), seed=3)  # rank 2 = min(out, in): any Delta W
    trainable = [p for p in net.parameters() if p.requires_grad]
    assert len(trainable) == 2 and not net[0].base.weight.requires_grad
    opt = torch.optim.LBFGS(
        trainable,
        lr=1,
        max_iter=500,
        tolerance_grad=1e-14,
        tolerance_change=1e-16,
        history_size=50,
        line_search_fn="strong_wolfe",
    )

    def closure():
        opt.zero_grad()
        loss = ((net(x) - y) ** 2).mean()
        loss.backward()
        return loss

    for _ in range(5):
        opt.step(closure)
    factors = merge_in(net)
    assert isinstance(net[0], nn.Linear) and net[0].weight.requires_grad  # the base layer back, trainable as before
    w_star = torch.linalg.lstsq(x, y).solution.T  # the closed form: argmin_W |X W^T - Y|^2
    assert torch.allclose(net[0].weight, w_star, atol=1e-6)
    assert torch.allclose(w0 + delta(factors["0.lora_A.weight"], factors["0.lora_B.weight"], 1.0), w_star, atol=1e-6)


def test_first_step_with_orthogonal_a_is_the_full_step():
    x, y = _regression(d_in=3, d_out=3)
    full, adapted = _linear(3, 3), _linear(3, 3)
    attach(adapted, AdapterSpec(rank=3, alpha=3.0, targets=("0",)), seed=0)
    q, _ = torch.linalg.qr(torch.randn(3, 3, dtype=torch.float64))
    with torch.no_grad():
        adapted[0].lora_A.weight.copy_(q)  # A^T A = I
    eta = 0.1
    for net in (full, adapted):
        ((net(x) - y) ** 2).mean().backward()
        with torch.no_grad():
            for p in net.parameters():
                if p.requires_grad:
                    p -= eta * p.grad
    # B_1 = -eta grad_W A^T (A gets no gradient while B = 0), so s B_1 A = -eta grad_W A^T A = -eta grad_W
    merge_in(adapted)
    assert torch.allclose(adapted[0].weight, full[0].weight, atol=1e-12)


def _factors(rank, seed, shapes={"blocks.0.attn.qkv": (6, 4), "blocks.0.mlp.fc1": (5, 4)}):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for module, (o, i) in shapes.items():
        out[f"{module}.lora_A.weight"] = torch.randn(rank, i, generator=g)
        out[f"{module}.lora_B.weight"] = torch.randn(o, rank, generator=g)
    return out


SPECS = {
    "blocks.0.attn.qkv.weight": ((6, 4), torch.float32),
    "blocks.0.attn.qkv.bias": ((6,), torch.float32),
    "blocks.0.mlp.fc1.weight": ((5, 4), torch.float32),
    "norm.weight": ((4,), torch.float32),
}


def test_factorised_task_arithmetic_equals_dense():
    adapters = [(_factors(2, 0), 0.5), (_factors(3, 1), 2.0), (_factors(1, 2), 1.0)]
    weights = [0.3, -0.7, 1.1]
    merged = concatenate(adapters, weights)
    assert merged["blocks.0.attn.qkv.lora_A.weight"].shape == (6, 4)  # rank 2 + 3 + 1
    dense = [LoraTaskVector(f, s, SPECS, source=str(i)) for i, (f, s) in enumerate(adapters)]
    via_factors = LoraTaskVector(merged, 1.0, SPECS, source="merged")
    for key in SPECS:
        expected = sum(w * tv[key] for w, tv in zip(weights, dense))
        assert torch.allclose(via_factors[key], expected, atol=1e-5), key
    assert torch.equal(dense[0]["norm.weight"], torch.zeros(4)) and torch.equal(
        dense[0]["blocks.0.attn.qkv.bias"], torch.zeros(6)
    )


def test_factor_file_round_trip_and_peft_layout(tmp_path):
    factors = _factors(2, 0)
    spec = AdapterSpec(rank=2, alpha=8.0)
    save_adapter(tmp_path / "t.safetensors", factors, spec, {"task": "t"})
    back, scale = load_adapter(tmp_path / "t.safetensors")
    assert scale == 4.0 and back.keys() == factors.keys() and all(torch.equal(back[k], factors[k]) for k in factors)
    pretrained = {k: torch.zeros(shape) for k, (shape, _) in SPECS.items()}
    tv = read_task_vector(tmp_path / "t.safetensors", pretrained)
    a, b = factors["blocks.0.mlp.fc1.lora_A.weight"], factors["blocks.0.mlp.fc1.lora_B.weight"]
    assert torch.allclose(tv["blocks.0.mlp.fc1.weight"], 4.0 * b @ a)
    # peft's folder: base_model.model.<module>.lora_A.weight, r and lora_alpha (rsLoRA: alpha / sqrt(r))
    peft = tmp_path / "peft"
    peft.mkdir()
    save_state_dict(peft / "adapter_model.safetensors", {f"base_model.model.{k}": v for k, v in factors.items()})
    (peft / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 8, "use_rslora": True})
    )
    read, scale = read_peft_adapter(peft)
    assert scale == 1.0 and read.keys() == factors.keys()  # each module's scale folded into its B
    assert torch.allclose(
        read["blocks.0.mlp.fc1.lora_B.weight"], factors["blocks.0.mlp.fc1.lora_B.weight"] * 8 / 2**0.5
    )
    # peft's per-module patterns: fc1 at its own alpha; a rank the config does not give is refused
    (peft / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 8, "alpha_pattern": {"mlp.fc1": 2}})
    )
    read, _ = read_peft_adapter(peft)
    assert torch.allclose(read["blocks.0.mlp.fc1.lora_B.weight"], factors["blocks.0.mlp.fc1.lora_B.weight"] * 1.0)
    assert torch.allclose(read["blocks.0.attn.qkv.lora_B.weight"], factors["blocks.0.attn.qkv.lora_B.weight"] * 4.0)
    (peft / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 8, "rank_pattern": {"attn.qkv": 4}})
    )
    with pytest.raises(
        MergeflowError,
        match=r"'blocks.0.attn.qkv.lora_A.weight' has rank 2, adapter_config.json gives blocks.0.attn.qkv rank 4$",
    ):
        read_peft_adapter(peft)
    with pytest.raises(
        MergeflowError,
        match=r"^x: factors of 'blocks.0.mlp.fc1.weight' give shape \(5, 4\) \(rank 2\), expected \(4, 5\)",
    ):
        LoraTaskVector(factors, 1.0, SPECS | {"blocks.0.mlp.fc1.weight": ((4, 5), torch.float32)}, source="x")
    with pytest.raises(MergeflowError, match=r"has no 'blocks.0.attn.qkv.lora_B.weight'"):
        LoraTaskVector(
            {k: v for k, v in factors.items() if k != "blocks.0.attn.qkv.lora_B.weight"}, 1.0, SPECS, source="x"
        )


def test_attach_names_the_layers_it_could_not_find():
    with pytest.raises(
        MergeflowError,
        match=r"LoRA targets \['q_proj'\] match no linear layer of the backbone \(its linear layers end in: 0\)",
    ):
        attach(_linear(), AdapterSpec(rank=1, alpha=1.0, targets=("q_proj",)), seed=0)
    with pytest.raises(MergeflowError, match=r"LoRA rank 3 exceeds 0's dimensions \(2 x 3\)"):
        attach(_linear(), AdapterSpec(rank=3, alpha=1.0, targets=("0",)), seed=0)


KNOTS, TA, TIES = REGISTRY["knots"].fn, REGISTRY["task_arithmetic"].fn, REGISTRY["ties"].fn


def test_knots_ta_is_task_arithmetic():
    g = torch.Generator().manual_seed(0)
    pretrained = {
        "a.weight": torch.randn(5, 7, generator=g, dtype=torch.float64),
        "a.bias": torch.randn(5, generator=g, dtype=torch.float64),
    }
    tvs = {t: {k: torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in pretrained.items()} for t in "xyz"}
    out, ref = (
        KNOTS(pretrained, tvs, base="ta", k=0.2, trim_scope="global", rounding="ties_original", lam=0.3),
        TA(pretrained, tvs, lam=0.3),
    )
    assert all(torch.allclose(out[k], ref[k], atol=1e-12) for k in pretrained)


def test_knots_ties_by_hand():
    # tau_x = u a^T, tau_y = u b^T share the direction u: [tau_x | tau_y] = u [a; b]^T has rank 1, the coefficients
    # are a and b themselves (up to a sign the product undoes). TIES on them, keeping 1 of 3 entries each: a keeps 2,
    # b keeps -3; elected signs +, -; disjoint mean (2, -3, 0); the merge u (2, -3, 0).
    u = torch.tensor([0.6, 0.8], dtype=torch.float64)
    a, b = torch.tensor([2.0, -1.9, 0.5], dtype=torch.float64), torch.tensor([-1.0, -3.0, 0.0], dtype=torch.float64)
    pretrained = {"w.weight": torch.zeros(2, 3, dtype=torch.float64)}
    tvs = {"x": {"w.weight": torch.outer(u, a)}, "y": {"w.weight": torch.outer(u, b)}}
    kw = {"k": 1 / 3, "trim_scope": "global", "rounding": "floor", "lam": 1.0}
    expected = torch.tensor([[1.2, -1.8, 0.0], [1.6, -2.4, 0.0]], dtype=torch.float64)
    assert torch.allclose(KNOTS(pretrained, tvs, base="ties", **kw)["w.weight"], expected, atol=1e-12)
    # tensors no task changed (a LoRA task vector's zeros) are merged apart: they do not widen the coefficients' trim
    padded = KNOTS(
        pretrained | {"b.bias": torch.zeros(30, dtype=torch.float64)},
        {t: tv | {"b.bias": torch.zeros(30, dtype=torch.float64)} for t, tv in tvs.items()},
        base="ties",
        **kw,
    )
    assert torch.allclose(padded["w.weight"], expected, atol=1e-12) and not padded["b.bias"].any()
    # TIES on the dense entries (2 of 6 each) keeps tau_x's 1.6 and -1.52, tau_y's -2.4 and -1.8: another merge
    dense = TIES(pretrained, tvs, **kw)["w.weight"]
    assert torch.allclose(dense, torch.tensor([[0.0, -1.8, 0.0], [1.6, -1.96, 0.0]], dtype=torch.float64), atol=1e-12)


def test_the_trainer_trains_only_the_adapters():
    spec = AdapterSpec(rank=2, alpha=4.0)
    state, _ = trainer(ADAMW)("digits", dict(THETA0), Budget(adapter=spec), None)
    weights, factors = split_factors(state)
    assert weights.keys() == THETA0.keys()
    assert sorted(factors) == sorted(
        f"blocks.0.{m}.{f}.weight"
        for m in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
        for f in ("lora_A", "lora_B")
    )
    for key, value in weights.items():
        module = key.rsplit(".", 1)[0]
        if key.endswith(".weight") and f"{module}.lora_A.weight" in factors:
            change = delta(factors[f"{module}.lora_A.weight"], factors[f"{module}.lora_B.weight"], spec.scale)
            assert change.abs().max() > 0 and torch.allclose(value - THETA0[key], change, atol=1e-6), key
        else:
            assert torch.equal(value, THETA0[key]), key  # biases, norms, embeddings: frozen


def test_the_lora_regime_gives_each_task_its_adapter():
    result = REGIMES["lora"](THETA0, ["digits", "count"], trainer(ADAMW), rank=1, steps=2)
    for t in ("digits", "count"):
        _, factors = split_factors(result.task_states[t])
        assert all(v.shape[0] == 1 for k, v in factors.items() if "lora_A" in k)
    assert result.model is None and len(result.rounds) == 1
    assert set(result.rounds[0].task_vector_norms) == {"digits", "count"}


def test_a_peft_adapter_imports_as_a_fine_tune(tmp_path):
    from mergeflow.ml.checkpoints import read_checkpoint
    from mergeflow.runner.checks import check_checkpoint_headers
    from mergeflow.params import parse_params

    state, _ = trainer(ADAMW)("count", dict(THETA0), Budget(adapter=AdapterSpec(rank=2, alpha=4.0)), None)
    weights, factors = split_factors(state)
    folder = tmp_path / "count_adapter"
    folder.mkdir()
    save_state_dict(folder / "adapter_model.safetensors", {f"base_model.model.{k}": v for k, v in factors.items()})
    (folder / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["qkv", "proj", "fc1", "fc2"]})
    )
    imported = read_checkpoint(
        folder / "adapter_model.safetensors", reference=THETA0, source="finetune.checkpoints.count"
    )
    assert imported.keys() == weights.keys() and all(
        torch.allclose(imported[k], weights[k], atol=1e-6) for k in weights
    )
    params = parse_params(
        {
            "suite": {"tasks": ["digits", "count"]},
            "merge": {"methods": ["task_arithmetic"]},
            "finetune": {"checkpoints": {"count": "count_adapter/adapter_model.safetensors"}},
        }
    )
    check_checkpoint_headers(params, tmp_path, "params.yaml")  # not an image tower, and not refused as one
    save_state_dict(
        folder / "adapter_model.safetensors",
        {
            "base_model.model.blocks.0.attn.q_proj.lora_A.weight": torch.zeros(2, 32),
            "base_model.model.blocks.0.attn.q_proj.lora_B.weight": torch.zeros(32, 2),
        },
    )
    with pytest.raises(
        MergeflowError,
        match=r"^finetune.checkpoints.count: adapts 'blocks.0.attn.q_proj.weight', which the model does not have$",
    ):
        read_checkpoint(folder / "adapter_model.safetensors", reference=THETA0, source="finetune.checkpoints.count")


@pytest.mark.parametrize(
    "config, factors, message",
    [
        ('{"r": 2, "lora_alpha": NaN}', None, r"adapter_config.json: lora_alpha: expected a finite number, got nan$"),
        ('{"r": 0, "lora_alpha": 4}', None, r"adapter_config.json: r: expected a whole number from 1, got 0$"),
        (
            '{"r": 2, "lora_alpha": 4, "rank_pattern": {"qkv": "x"}}',
            None,
            r"adapter_config.json: rank_pattern.qkv: expected a whole number from 1, got x$",
        ),
        (
            '{"r": 2, "lora_alpha": 4, "use_dora": true}',
            None,
            r"adapter_config.json: use_dora: a DoRA adapter's magnitude vectors are not read \(only LoRA\)$",
        ),
        ("[" * 100_000 + "]" * 100_000, None, r"adapter_config.json: not JSON \(RecursionError: "),
        (
            '{"r": 2, "lora_alpha": 4, "x": "' + "a" * (1 << 20) + '"}',
            None,
            r"adapter_config.json: 1,048,\d+ bytes, more than an adapter configuration holds",
        ),
        (
            '{"r": 40, "lora_alpha": 4}',
            {
                "blocks.0.attn.qkv.lora_A.weight": torch.zeros(40, 32),
                "blocks.0.attn.qkv.lora_B.weight": torch.zeros(96, 40),
            },
            r"^count: factors of 'blocks.0.attn.qkv.weight' have rank "
            r"40, expected 1 to 32 \(the weight's smaller side\)$",
        ),
        (
            '{"r": 2, "lora_alpha": 4}',
            {
                "blocks.0.attn.qkv.lora_A.weight": torch.zeros(2, 32),
                "blocks.0.attn.qkv.lora_B.weight": torch.zeros(96, 3),
            },
            r"^count: factors of 'blocks.0.attn.qkv.weight' disagree on the rank: A has 2 rows, B 3 columns$",
        ),
    ],
    ids=[
        "alpha NaN",
        "rank 0",
        "pattern not a number",
        "DoRA",
        "nested 100k deep",
        "a megabyte",
        "rank above the weight",
        "A and B ranks",
    ],
)
def test_a_hostile_peft_adapter_is_one_line(tmp_path, config, factors, message):
    """What a downloaded adapter folder may hold that would crash the reader, hang it, or give a model of NaNs."""
    from mergeflow.ml.checkpoints import read_checkpoint

    folder = tmp_path / "adapter"
    folder.mkdir()
    factors = factors or {
        "blocks.0.attn.qkv.lora_A.weight": torch.zeros(2, 32),
        "blocks.0.attn.qkv.lora_B.weight": torch.zeros(96, 2),
    }
    save_state_dict(folder / "adapter_model.safetensors", {f"base_model.model.{k}": v for k, v in factors.items()})
    (folder / "adapter_config.json").write_text(config)
    with pytest.raises(MergeflowError, match=message):
        read_checkpoint(folder / "adapter_model.safetensors", reference=THETA0, source="count")


def test_a_float64_lora_task_vector_stays_float64():
    factors = {k: v.double() for k, v in _factors(2, 0).items()}
    specs = SPECS | {"norm.weight": ((4,), torch.float64)}
    tv = LoraTaskVector(factors, 0.5, specs, source="x")
    assert (
        tv["blocks.0.attn.qkv.weight"].dtype == torch.float64
        and tv.specs()["blocks.0.attn.qkv.weight"][1] == torch.float64
    )
    assert tv["norm.weight"].dtype == torch.float64 and tv["blocks.0.attn.qkv.bias"].dtype == torch.float32
    a, b = factors["blocks.0.attn.qkv.lora_A.weight"], factors["blocks.0.attn.qkv.lora_B.weight"]
    assert torch.equal(tv["blocks.0.attn.qkv.weight"], 0.5 * (b @ a))
