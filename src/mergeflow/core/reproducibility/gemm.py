"""torch's CPU GEMMs on OpenBLAS's pinned kernels: the same bits on every x86-64 machine.

torch multiplies float matrices with MKL (and convolves with oneDNN or NNPACK), each choosing its kernels and
blocking by the CPU: Intel and AMD, AVX2 and AVX-512 give other last bits, and no MKL branch but its SSE2 one
(2.2x slower here) is the same on both makers. OpenBLAS's Haswell kernels (AVX2 + FMA, ``OPENBLAS_CORETYPE``) have
their blocking fixed at build time, so with a fixed thread count a product's bits follow from its operands alone;
on the 2-core AMD EPYC they were as fast as MKL's own for the default ViT's shapes (5.3 ms against 6.1 ms for its
six GEMM shapes, bench/determinism.py).

``route(threads)`` registers, for CPU tensors, ``mm``, ``addmm``, ``bmm`` and ``baddbmm`` (their functional,
in-place and ``out=`` forms) as numpy's ``matmul`` on numpy's OpenBLAS, and ``convolution`` as unfold + GEMM.
Everything above them (``linear``, ``matmul``, ``einsum``, every backward formula) goes through them. Other dtypes
than float32/float64/complex (bfloat16 on the CPU) are computed in float32 and cast back. OpenBLAS runs single-
threaded: a product is split into the stage's thread count of row blocks, run at once on Python threads (numpy
releases the GIL). OpenBLAS's own threads busy-wait for each other and for the cores torch's OpenMP threads hold:
beside torch's two threads they made a pretraining step slower, and on one core 8x slower.
"""

from __future__ import annotations

import warnings
from typing import Any

_library: Any = None  # the torch.library registrations, kept alive while the process lives
_threads = 0
_pool: Any = None  # the threads (besides the caller) that run a product's other blocks
# multiply-adds below which a product runs whole on the calling thread: handing a block to a thread costs ~30 us,
# and the Fisher's one-example products (17 x 512 x 128) split in two took 90 us against 40 us whole
SPLIT_MIN_WORK = 2**24

# numpy computes these dtypes itself (OpenBLAS for the float and complex ones); others go through float32
_NUMPY_DTYPES = ("float32", "float64", "complex64", "complex128", "int8", "int16", "int32", "int64", "uint8", "bool")


def openblas_core() -> str:
    """The core type numpy's OpenBLAS runs ('Haswell', 'SkylakeX', ...); '' when numpy uses another BLAS."""
    from threadpoolctl import threadpool_info

    return next(
        (info.get("architecture", "") for info in threadpool_info() if info.get("internal_api") == "openblas"), ""
    )


def routed() -> int:
    """The threads the CPU GEMMs run on in this process (each block on OpenBLAS, single-threaded); 0 when torch's
    own kernels run them."""
    return _threads


def _array(tensor):
    return tensor.detach().resolve_conj().resolve_neg().numpy()


def _product(a, b):
    """a @ b of two CPU tensors (2-D, or 3-D batches of equal size), as a new tensor of their dtype, in memory torch
    allocates (aligned as every other tensor: no result's bits may depend on where malloc put it)."""
    import numpy as np
    import torch

    if a.dtype != b.dtype:
        raise RuntimeError(f"expected m1 and m2 to have the same dtype, but got: {a.dtype} != {b.dtype}")
    if str(a.dtype).removeprefix("torch.") not in _NUMPY_DTYPES:
        return _product(a.float(), b.float()).to(a.dtype)
    out = torch.empty((*a.shape[:-1], b.shape[-1]), dtype=a.dtype)
    x, y, z = _array(a), _array(b), out.numpy()
    rows = x.shape[0]  # a 2-D product's rows, a batch's matrices: the blocks split among the threads
    if _threads > 1 and rows >= _threads and x.size * y.shape[-1] >= SPLIT_MIN_WORK:
        bounds = [rows * i // _threads for i in range(_threads + 1)]
        blocks = [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:])]
        second = y if y.ndim == 2 else None
        pending = [_pool.submit(np.matmul, x[s], second if second is not None else y[s], out=z[s]) for s in blocks[1:]]
        np.matmul(x[blocks[0]], second if second is not None else y[blocks[0]], out=z[blocks[0]])
        for future in pending:
            future.result()
    else:
        np.matmul(x, y, out=z)
    return out


def _scaled_sum(product, c, beta, alpha):
    """beta * c + alpha * product, in place in ``product`` (c ignored where beta is 0, as BLAS does)."""
    if alpha != 1:
        product.mul_(alpha)
    if beta == 0:
        return product
    return product.add_(c, alpha=beta) if beta != 1 else product.add_(c)


def _into(out, value):
    out.resize_(value.shape)
    return out.copy_(value)


def mm(a, b):
    return _product(a, b)


def mm_out(a, b, *, out):
    return _into(out, _product(a, b))


def addmm(c, a, b, *, beta=1, alpha=1):
    return _scaled_sum(_product(a, b), c, beta, alpha)


def addmm_out(c, a, b, *, beta=1, alpha=1, out):
    return _into(out, addmm(c, a, b, beta=beta, alpha=alpha))


def addmm_(c, a, b, *, beta=1, alpha=1):
    return c.copy_(addmm(c, a, b, beta=beta, alpha=alpha))


def convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """A 1-D or 2-D convolution as unfold (im2col) + one GEMM per group: the same sums as a direct convolution's,
    in the GEMM's order. Registered both above autograd (so that its backward is the unfold's and the GEMM's) and
    for the CPU itself (inference mode)."""
    import torch
    import torch.nn.functional as F

    if transposed or input.dim() not in (3, 4):
        raise NotImplementedError(
            f"runtime.deterministic: a {'transposed ' if transposed else ''}{input.dim() - 2}-D convolution has no "
            "deterministic CPU kernel here (runtime.deterministic: false runs torch's)"
        )
    if input.dim() == 3:  # 1-D: a 2-D convolution of height 1
        out = convolution(
            input.unsqueeze(2),
            weight.unsqueeze(2),
            bias,
            [1, *stride],
            [0, *padding],
            [1, *dilation],
            False,
            [0, *output_padding],
            groups,
        )
        return out.squeeze(2)
    n, c, h, w = input.shape
    cout, cin_g, kh, kw = weight.shape
    oh = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    # rows = every output position of every image, its patch's values in (channel, row, column) order: one GEMM a
    # group over all of them (its backward too, not a weight gradient per image then summed)
    if tuple(stride) == (kh, kw) and not any(padding) and tuple(dilation) == (1, 1) and h % kh == 0 and w % kw == 0:
        # a ViT's patch embedding: the patches tile the image, a reshape (unfold's im2col took 44 ms a batch of 512
        # from the channels-last images the backbone reads)
        rows = (
            input.reshape(n, c, oh, kh, ow, kw).permute(0, 2, 4, 1, 3, 5).reshape(n * oh * ow, groups, cin_g * kh * kw)
        )
    else:
        cols = F.unfold(
            input, (kh, kw), dilation=tuple(dilation), padding=tuple(padding), stride=tuple(stride)
        )  # [N, C*kh*kw, L]
        rows = cols.transpose(1, 2).reshape(n * oh * ow, groups, cin_g * kh * kw)
    kernels = weight.reshape(groups, cout // groups, cin_g * kh * kw)
    out = (
        torch.cat([rows[:, g] @ kernels[g].T for g in range(groups)], dim=1)
        if groups > 1
        else rows[:, 0] @ kernels[0].T
    )
    out = out.reshape(n, oh, ow, cout).permute(0, 3, 1, 2)
    return (out + bias.reshape(1, cout, 1, 1) if bias is not None else out).contiguous()


def route(threads: int) -> None:
    """Send this process's CPU GEMMs to numpy's OpenBLAS, single-threaded, each product split into ``threads``
    blocks of rows (or of a batch's matrices) run at once on as many threads, however many cores the machine has: a
    row's bits depend on the block it falls in, so the split is fixed by the shape and the count alone. Idempotent;
    a second call changes only the thread count."""
    global _library, _threads, _pool
    from concurrent.futures import ThreadPoolExecutor

    # scipy's own OpenBLAS (scikit-learn's probe) loaded now, so that the limit reaches it too
    import scipy.linalg  # noqa: F401
    import torch
    from threadpoolctl import threadpool_limits

    threadpool_limits(1, user_api="blas")  # OpenBLAS's own threads busy-wait: on one core two of them took 8x as long
    if threads != _threads:
        if _pool is not None:
            _pool.shutdown()
        _pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="gemm") if threads > 1 else None
    _threads = threads
    if _library is not None:
        return
    library = torch.library.Library("aten", "IMPL")
    kernels = {
        "mm": mm,
        "mm.out": mm_out,
        "addmm": addmm,
        "addmm.out": addmm_out,
        "addmm_": addmm_,
        "bmm": mm,
        "bmm.out": mm_out,
        "baddbmm": addmm,
        "baddbmm.out": addmm_out,
        "baddbmm_": addmm_,
    }
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": that is the point
        warnings.simplefilter("ignore", UserWarning)
        for name, fn in kernels.items():
            library.impl(name, fn, "CPU")
        library.impl("convolution", convolution, "AutogradCPU")
        library.impl("convolution", convolution, "CPU")
    _library = library
