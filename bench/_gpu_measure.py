"""bench/gpu.py's measuring tools: timing on the device (synchronised, or by CUDA events), peak memory, the model's
FLOPs by PaLM's count and by torch's counter, the GPU's datasheet peak, and the step's matrix products timed alone."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
from torch import nn

# dense bf16 matrix throughput from the datasheets, FLOP/s (H200: the H100 SXM's chip)
PEAK_BF16 = {"H100 PCIe": 756e12, "H100": 989.4e12, "H200": 989.4e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def peak_memory(device: torch.device, into: dict):
    """The section's peak of allocated device memory (CUDA; nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    yield
    if device.type == "cuda":
        into["peak_bytes"] = int(torch.cuda.max_memory_allocated(device))


def timed(fn, device: torch.device) -> tuple[object, float]:
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def model_flops_per_image(backbone, image_size: int, training: bool) -> float:
    """PaLM's count (Chowdhery et al. 2022, appendix B): 2 FLOPs per matrix parameter and token forward, 3x that for
    training, plus attention's 4 L T^2 D forward (12 for training). The patch embedding is a matrix product too."""
    net = backbone.net
    tokens = (image_size // net.patch_embed.patch_size[0]) ** 2 + getattr(net, "num_prefix_tokens", 1)
    in_blocks = sum(p.numel() for n, p in net.blocks.named_parameters() if p.ndim == 2)
    patch = net.patch_embed.proj.weight.numel()
    head = net.head.weight.numel() if isinstance(getattr(net, "head", None), nn.Linear) else 0
    forward = 2 * (in_blocks * tokens + patch * (tokens - 1) + head) + 4 * len(net.blocks) * tokens**2 * net.embed_dim
    return 3 * forward if training else forward


def matmul_floor_s(backbone, batch: int, image_size: int, device: torch.device) -> float:
    """One training step's matrix products and attention alone, in bf16, each shape timed by itself: the step's
    time if nothing else cost anything (norms, activations, casts, the optimiser), so its MFU is a ceiling for this
    batch. Per linear layer: the forward product and the two of the backward (the input's gradient, the weight's);
    the patch embedding has no input gradient and the frozen head no weight gradient."""
    net = backbone.net
    tokens = (image_size // net.patch_embed.patch_size[0]) ** 2 + getattr(net, "num_prefix_tokens", 1)
    rows = batch * tokens
    shapes: dict[tuple[int, int, int], int] = {}  # (m, k, n) -> how many products of that shape a step makes

    def add(m, k, n, times=1):
        shapes[(m, k, n)] = shapes.get((m, k, n), 0) + times

    for module in net.blocks.modules():
        if isinstance(module, nn.Linear):
            k, n = module.in_features, module.out_features
            add(rows, k, n)  # forward
            add(rows, n, k)  # the input's gradient
            add(k, rows, n)  # the weight's gradient
    patch = net.patch_embed.proj.weight
    add(batch * (tokens - 1), patch[0].numel(), patch.shape[0], 2)  # forward and the weight's gradient
    add(batch, net.head.in_features, net.head.out_features, 2)  # forward and the input's gradient
    seconds = 0.0
    for (m, k, n), count in shapes.items():
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
        seconds += count * event_time(lambda a=a, b=b: a @ b, device)
    heads = net.blocks[0].attn.num_heads
    q, k, v = (
        torch.randn(
            batch, heads, tokens, net.embed_dim // heads, device=device, dtype=torch.bfloat16, requires_grad=True
        )
        for _ in range(3)
    )
    out = nn.functional.scaled_dot_product_attention(q, k, v)
    grad = torch.randn_like(out)
    forward = event_time(lambda: nn.functional.scaled_dot_product_attention(q, k, v), device)
    both = event_time(
        lambda: torch.autograd.grad(nn.functional.scaled_dot_product_attention(q, k, v), (q, k, v), grad), device
    )
    return seconds + len(net.blocks) * max(both, forward)


def event_time(fn, device: torch.device, repeats: int = 20) -> float:
    """Median seconds of ``fn`` after a warm-up: by CUDA events on a GPU, the host's clock elsewhere."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device.type != "cuda":
            times.append(timed(fn, device)[1])
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def counted_flops(fn) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def peak_flops(device: torch.device, given: float | None) -> tuple[float | None, str]:
    if given:
        return given * 1e12, "given"
    if device.type != "cuda":
        return None, "not a GPU"
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16.items():
        if all(word in name for word in key.split()):
            return value, f"{key} datasheet, dense bf16"
    return None, f"unknown for {name} (give --peak-tflops)"
