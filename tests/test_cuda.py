"""The CUDA path, where a GPU is present (skipped elsewhere): the SVD-based merges on the GPU against the same
merges on the CPU, features on the GPU against the CPU's, and one full-batch GD step under bf16 autocast against
seed 000's identity tau = -eta * grad L."""

import copy
import math

import pytest
import torch

from mergeflow.config import BackboneConfig, FinetuneConfig
from mergeflow.ml.merging import REGISTRY, _tensors
from mergeflow.ml.models import backbone_state, build_backbone, make_head
from mergeflow.ml.training import extract_features, finetune, seed_everything
from tests.test_merging import models_of

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SVD_METHODS = ["cart", "cart_indexing", "iso_c", "iso_cts", "low_rank_ta", "svc", "tsv_c", "tsv_m"]
CUDA = torch.device("cuda")
SMALL = BackboneConfig(kwargs={"img_size": 32, "patch_size": 8, "embed_dim": 64, "depth": 2, "num_heads": 2})


def _models(n_tasks=4, seed=0):
    # ViT-shaped keys: matrices (qkv, mlp) take the SVD route, the rest the element-wise one
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "blocks.0.attn.qkv.weight": (96, 32),
        "blocks.0.mlp.fc1.weight": (64, 32),
        "blocks.0.norm1.bias": (32,),
        "pos_embed": (1, 5, 32),
    }
    theta0 = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    tvs = {f"t{i}": {k: 0.1 * torch.randn(s, generator=g) for k, s in shapes.items()} for i in range(n_tasks)}
    return theta0, tvs


def test_svd_methods_list_is_complete():
    # every module that calls an SVD helper is in SVD_METHODS, so a new SVD method gets its GPU check
    import ast
    import importlib
    import inspect

    helpers = {"svd", "low_rank", "polar", "top_singular"}

    def imported_names(module_name: str) -> set[str]:  # at the top or inside a function (methods import torch lazily)
        tree = ast.parse(inspect.getsource(importlib.import_module(module_name)))
        return {
            alias.asname or alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            for alias in node.names
        }

    uses_svd = {n for n, m in REGISTRY.items() if helpers & imported_names(m.fn.__module__)}
    # adamerging_cart: test_data_aware_methods_on_the_gpu_match_the_cpu; doge_ta: its basis on the GPU, its Adam loop
    # (sign-like steps, which carry rounding differences) on the CPU's tensors: checked on the CPU only; so adarank
    # (Adam on its masks' logits) and knots (a TIES trim of SVD coefficients: a rounding difference moves its cut);
    # smile gives a routed network, not a state dict: tests/test_smile.py compares its GPU network with the CPU's;
    # ada_svd routes the training inputs block by block: checked on the CPU only (no GPU was lent to write its check)
    assert uses_svd == set(SVD_METHODS) | {"adamerging_cart", "doge_ta", "adarank", "knots", "smile", "ada_svd"}


@needs_cuda
def test_data_aware_methods_on_the_gpu_match_the_cpu(monkeypatch):
    """AdaMerging's adaptation (its forward through the merge on the GPU) and the Fisher diagonal, against the CPU's.
    In strict float32: cuDNN's default TF32 convolutions (10-bit mantissa) would move the patch embedding by ~1e-3,
    and Adam's sign-like steps carry such a change into the coefficients."""
    from mergeflow.ml.merging import MergeData

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    from mergeflow.ml.statistics import fisher_diagonal
    from tests.test_data_aware import _tiny_setup

    learned = {}
    for device in ("cpu", "cuda"):
        for method in ("adamerging", "adamerging_cart"):
            theta0, taus, objective = _tiny_setup()
            objective.device = torch.device(device)
            data = MergeData(objective=objective)
            REGISTRY[method].with_data(data)(theta0, taus, steps=5, lr=0.01)
            learned[device, method] = data.learned[0]
    for method in ("adamerging", "adamerging_cart"):
        cpu, gpu = learned["cpu", method], learned["cuda", method]
        assert gpu["entropy"] == pytest.approx(cpu["entropy"], rel=1e-3)
        for t in cpu["coefficients"]:
            assert gpu["coefficients"][t] == pytest.approx(cpu["coefficients"][t], abs=1e-4)
    _, _, objective = _tiny_setup()
    images, head = objective.inputs["test"]["a"][:6], objective.heads["a"]
    labels = torch.arange(6) % 3
    on = {
        d: fisher_diagonal(
            copy.deepcopy(objective.backbone),
            copy.deepcopy(head),
            images,
            labels,
            generator=torch.Generator(),
            device=torch.device(d),
        )
        for d in ("cpu", "cuda")
    }
    for k, v in on["cpu"].items():
        assert (on["cuda"][k] - v).norm() <= 1e-3 * v.norm() + 1e-12, k


@needs_cuda
@pytest.mark.parametrize("name", SVD_METHODS)
def test_svd_methods_on_the_gpu_match_the_cpu(name, monkeypatch):
    theta0, tvs = _models()
    gram_calls = []
    real_gram_svd = _tensors.gram_svd
    monkeypatch.setattr(_tensors, "gram_svd", lambda a: gram_calls.append(a.device.type) or real_gram_svd(a))
    on_gpu = models_of(name, theta0, tvs)
    assert gram_calls and set(gram_calls) == {"cuda"}
    monkeypatch.setattr(_tensors, "svd_device", lambda: torch.device("cpu"))
    n_gpu_calls = len(gram_calls)
    on_cpu = models_of(name, theta0, tvs)
    assert len(gram_calls) == n_gpu_calls  # the CPU route is LAPACK's
    for t in tvs:
        for k in theta0:
            a, b = on_gpu[t][k], on_cpu[t][k]
            assert a.device.type == "cpu" and a.dtype == torch.float32, (t, k)
            assert (a - b).norm() <= 1e-5 * b.norm(), (name, t, k, ((a - b).norm() / b.norm()).item())


def _images(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 32, 32, 3), generator=g, dtype=torch.uint8), torch.randint(0, 3, (n,), generator=g)


@needs_cuda
def test_features_on_the_gpu_match_the_cpu():
    torch.manual_seed(0)
    backbone = build_backbone(SMALL)
    images, _ = _images(20)
    on_cpu = extract_features(backbone, images, batch_size=8, device=torch.device("cpu"))
    on_gpu = extract_features(backbone, images, batch_size=8, device=CUDA)
    assert on_gpu.device.type == "cpu" and on_gpu.dtype == torch.float32
    # cuDNN runs the patch-embedding convolution in TF32 (torch's default, 10-bit mantissa): ~1e-3; a wrong
    # result is off by O(1)
    assert (on_gpu - on_cpu).norm() <= 1e-2 * on_cpu.norm()


@needs_cuda
def test_one_full_batch_gd_step_under_bf16_autocast_is_minus_lr_times_gradient():
    """Seed 000's identity on the GPU: the step is taken in float32 weights from a bf16-autocast gradient, so
    tau matches -eta * grad L (float32, CPU) to bf16's precision, ~1e-2, and not better."""
    torch.manual_seed(0)
    images, labels = _images(32)
    backbone = build_backbone(SMALL)
    head = make_head(backbone.num_features, 3)
    theta0 = backbone_state(backbone)

    ref_backbone, ref_head = (
        copy.deepcopy(backbone),
        copy.deepcopy(head),
    )  # float32 on the CPU: ~1e-6, exact beside bf16
    loss = torch.nn.functional.cross_entropy(ref_head(ref_backbone(images)), labels)
    names = [n for n, _ in ref_backbone.net.named_parameters()]
    grads = dict(zip(names, torch.autograd.grad(loss, list(ref_backbone.net.parameters()))))

    lr = 0.05
    cfg = FinetuneConfig(optimizer="gd", epochs=1, lr=lr, weight_decay=0.0, warmup_steps=0)
    curve = finetune(backbone, head, images, labels, cfg, seed=0, device=CUDA)
    assert len(curve.step) == 1
    theta1 = {k: v.cpu() for k, v in backbone_state(backbone).items()}
    assert all(v.dtype == torch.float32 for v in theta1.values())  # autocast leaves the weights in float32
    tau = torch.cat([(theta1[n] - theta0[n]).flatten() for n in names])
    expected = torch.cat([-lr * grads[n].flatten() for n in names])
    rel = ((tau - expected).norm() / expected.norm()).item()
    assert rel < 3e-2, rel


@needs_cuda
def test_finetuning_on_the_gpu_is_deterministic():
    images, labels = _images(64)
    states = []
    for _ in range(2):
        seed_everything(0)
        backbone = build_backbone(SMALL)
        head = make_head(backbone.num_features, 3)
        finetune(
            backbone,
            head,
            images,
            labels,
            FinetuneConfig(steps=5, batch_size=16, lr=1e-3, warmup_steps=1),
            seed=5,
            device=CUDA,
        )
        states.append(backbone_state(backbone))
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


@needs_cuda
def test_finetuning_from_device_resident_images_equals_host_batches(monkeypatch):
    """The images moved to the GPU once (devices.resident) give the same batches, so the same weights, as batches
    gathered on the host and copied each step."""
    import mergeflow.ml.training as training

    images, labels = _images(64)
    states = []
    for keep_on_host in (False, True):
        if keep_on_host:
            monkeypatch.setattr(training, "resident", lambda tensor, device, share=0.5: tensor)
        seed_everything(0)
        backbone = build_backbone(SMALL)
        head = make_head(backbone.num_features, 3)
        curve = finetune(
            backbone,
            head,
            images,
            labels,
            FinetuneConfig(steps=40, batch_size=16, lr=1e-3, warmup_steps=1),
            seed=5,
            device=CUDA,
        )
        assert len(curve.loss) == 40 and all(
            math.isfinite(v) for v in curve.loss
        )  # read back in stretches of LOSS_READ_EVERY
        states.append(backbone_state(backbone))
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


@needs_cuda
def test_a_non_finite_loss_on_the_gpu_names_its_step():
    from mergeflow.core.errors import MergeflowError

    images, labels = _images(32)
    backbone = build_backbone(SMALL)
    head = make_head(backbone.num_features, 3)
    with torch.no_grad():
        backbone.net.blocks[0].mlp.fc1.weight.fill_(float("nan"))
    with pytest.raises(MergeflowError, match="at step 0, before any update"):
        finetune(
            backbone,
            head,
            images,
            labels,
            FinetuneConfig(steps=5, batch_size=8, lr=1e-3, warmup_steps=0),
            seed=0,
            device=CUDA,
        )


@needs_cuda
def test_bf16_features_are_the_float32_ones_to_bf16_precision():
    """The validation search's candidates are scored under bf16 autocast: features within bf16's ~1e-2."""
    torch.manual_seed(0)
    backbone = build_backbone(SMALL)
    images, _ = _images(40)
    full = extract_features(backbone, images, batch_size=16, device=CUDA)
    half = extract_features(backbone, images, batch_size=16, device=CUDA, bf16=True)
    assert half.dtype == torch.float32 and half.device.type == "cpu"
    assert 0 < (half - full).norm() <= 3e-2 * full.norm()


@needs_cuda
def test_the_gpu_benchmark_runs_tiny_on_the_gpu(tmp_path):
    from tests.test_bench_gpu import run_bench

    result = run_bench(tmp_path, "--device", "cuda")
    assert result["device"].startswith("cuda") and result["peak_bytes"] > 0


@needs_cuda
@pytest.mark.e2e
def test_mergeflow_repro_runs_the_tiny_pipeline_a_gpu_a_stage(tmp_path, tiny_env):
    """`mergeflow repro` on a GPU machine: one stage per GPU, each forked from the stage server started for its GPU
    (a server that imported torch but never touched CUDA: a forked child initialises CUDA itself; that a stage is
    served by its GPU's server is checked on the CPU, tests/test_scheduler.py). Every stage completes, and
    AdaMerging's loop ran on CUDA. Skipped where DVC is not installed (GPU
    machines without the project's environment have run the rest of this module)."""
    import json
    import re

    pytest.importorskip("dvc.repo")
    from tests.conftest import make_tiny_project, run

    env = {k: v for k, v in tiny_env.items() if k != "CUDA_VISIBLE_DEVICES"}
    root = make_tiny_project(tmp_path / "p", env)
    out = run("mergeflow repro", root, env)
    assert re.search(rf"stages to run, up to {torch.cuda.device_count()} at once on a GPU each \(", out), out[-2000:]
    assert "Running stage 'merge@adamerging_cart' on GPU " in out and "stages ran; dvc.lock records them" in out, out[
        -2000:
    ]
    learning = json.loads((root / "logs/timing/merge/adamerging_cart.json").read_text())["learning"]
    assert learning[0]["device"].startswith("cuda")
    assert "Data and pipelines are up to date." in run(["dvc", "status"], root, env)


@needs_cuda
def test_a_split_stacked_on_the_gpu_is_the_hosts_cat():
    """The evaluator's images on the device: each task's part copied into its rows there (no cat on the host
    first), the same bytes as the host's torch.cat."""
    from mergeflow.core.devices import resident_stack

    g = torch.Generator().manual_seed(0)
    parts = [torch.randint(0, 256, (n, 8, 8, 3), dtype=torch.uint8, generator=g) for n in (5, 1, 7)]
    stacked = resident_stack(parts, CUDA)
    assert stacked.device.type == "cuda" and torch.equal(stacked.cpu(), torch.cat(parts))
    assert resident_stack(parts, CUDA, share=0.0).device.type == "cpu"  # too large for the device: kept on the host
    assert (
        resident_stack([parts[0][:0], *parts], CUDA, share=0.0).device.type == "cpu"
    )  # an empty first part: sized still
    with pytest.raises(RuntimeError):  # parts that differ are torch.cat's error, not broadcast into the first's shape
        resident_stack([parts[0], parts[1][..., :1]], CUDA)
