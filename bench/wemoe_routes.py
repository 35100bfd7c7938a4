"""WEMoE's routed MLP layer (merging/wemoe.py): the two ways to compute x (W0 + sum_t w_t T_t)^T per sample, forward
and backward, timed on random tensors of a layer's shapes. ``experts`` (what wemoe.py does): every task vector's
output in one GEMM, then mixed per sample. ``per_sample``: each sample's weight formed first, then B small products
(fewer multiply-adds, B weight-sized tensors). Prints milliseconds per forward + backward and their ratio.

    python bench/wemoe_routes.py                                 # the default suite's fc1 and fc2, and ViT-B/32's
    python bench/wemoe_routes.py --shape 128 17 128 512 8        # batch, tokens, in, out, tasks
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = [(128, 17, 128, 512, 8), (128, 17, 512, 128, 8), (16, 50, 768, 3072, 8)]  # default fc1, fc2; ViT-B/32 fc1


def routes(batch: int, tokens: int, width_in: int, width_out: int, tasks: int, device: torch.device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, tokens, width_in, generator=g).to(device)
    w0, b0 = torch.randn(width_out, width_in, generator=g).to(device), torch.randn(width_out, generator=g).to(device)
    experts, expert_bias = (
        (0.01 * torch.randn(tasks, width_out, width_in, generator=g)).to(device),
        (0.01 * torch.randn(tasks, width_out, generator=g)).to(device),
    )
    weights = torch.randn(batch, tasks, generator=g).to(device).requires_grad_()

    def per_sample():
        weight = w0 + torch.einsum("bt,toi->boi", weights, experts)
        return torch.baddbmm((b0 + weights @ expert_bias)[:, None], x, weight.transpose(1, 2))

    def mixed():
        outputs = (x.reshape(batch * tokens, -1) @ experts.reshape(tasks * width_out, -1).T).view(
            batch * tokens, tasks, width_out
        )
        out = torch.nn.functional.linear(x, w0, b0) + torch.bmm(
            weights.repeat_interleave(tokens, 0)[:, None], outputs
        ).view(batch, tokens, width_out)
        return out + (weights @ expert_bias)[:, None]

    return {"experts": mixed, "per_sample": per_sample}


def milliseconds(fn, device: torch.device, repeats: int) -> float:
    for _ in range(2):
        fn().sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn().sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=5, action="append", metavar=("B", "N", "I", "O", "T"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"device {device}, {torch.get_num_threads()} threads; ms per forward + backward")
    for shape in args.shape or SHAPES:
        fns = routes(*shape, device)
        with torch.no_grad():
            a, b = fns["experts"](), fns["per_sample"]()
        error = float((a - b).abs().max() / b.abs().max())
        times = {name: milliseconds(fn, device, args.repeats) for name, fn in fns.items()}
        print(
            f"B N I O T = {shape}: experts {times['experts']:.1f}, per_sample {times['per_sample']:.1f} "
            f"({times['per_sample'] / times['experts']:.1f}x), relative difference {error:.1e}"
        )


if __name__ == "__main__":
    main()
