"""The deterministic mode (mergeflow.core.reproducibility): the kernels pinned before torch loads, every CPU GEMM on
OpenBLAS's fixed kernels, and bits that do not follow the machine's cores.

What each library's kernels give on another CPU cannot be run here; what can: the routed GEMMs and convolutions
compute what torch's own do (to float64 rounding), their gradients are right (gradcheck), and a training run gives
the same bytes on one core as on every core. Each check runs in a process of its own: routing is process-wide."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from mergeflow.core.reproducibility import KERNEL_ENV, MODE_ENV


def _python(code: str, env: dict | None = None, prefix: list[str] | None = None) -> str:
    proc = subprocess.run(
        [*(prefix or []), sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env or os.environ.copy(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def test_routed_gemms_and_convolutions_compute_what_torchs_own_do():
    out = _python("""
        import mergeflow, torch, torch.nn.functional as F
        from mergeflow.core.reproducibility import gemm
        g = torch.Generator().manual_seed(0)
        r = lambda *s: torch.randn(*s, dtype=torch.float64, generator=g)
        a, b, c, A, B, C = r(5, 7), r(7, 3), r(3), r(4, 5, 7), r(4, 7, 3), r(4, 5, 3)
        x, w, bias, x1, w1 = r(2, 6, 9, 9), r(4, 3, 3, 2), r(4), r(2, 6, 11), r(4, 6, 3)
        cases = lambda: [a @ b, torch.addmm(c, a, b, beta=0.5, alpha=2), torch.bmm(A, B), torch.baddbmm(C, A, B, \
alpha=3),
                         torch.mm(a, b, out=torch.empty(0, dtype=torch.float64)), c.expand(5, 3).clone().addmm_(a, b),
                         F.conv2d(x, w, bias, stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=2), F.conv1d(x1, \
w1, None, 2, 1),
                         torch.nn.functional.linear(r(2, 4, 7), b.T.contiguous(), c),
                         F.conv2d(x[:, :3, :8, :8].permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2), w[:, :, :2, \
:2].repeat(1, 2, 2, 2)[:, :3], bias, stride=4)]
        g.manual_seed(0); a, b, c, A, B, C = r(5, 7), r(7, 3), r(3), r(4, 5, 7), r(4, 7, 3), r(4, 5, 3)
        x, w, bias, x1, w1 = r(2, 6, 9, 9), r(4, 3, 3, 2), r(4), r(2, 6, 11), r(4, 6, 3)
        state = g.get_state(); torchs = cases()
        gemm.route(2)
        g.set_state(state); routed = cases()
        print(all(t.shape == o.shape and torch.allclose(t, o, rtol=1e-12, atol=1e-12) for t, o in zip(torchs, routed)))
        print(gemm.routed(), torch.mm(torch.ones(2, 3).bfloat16(), torch.ones(3, 2).bfloat16()).tolist())
        xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, bias))
        conv = lambda x, w, b: F.conv2d(x, w, b, stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=2)
        patches = lambda x, w: F.conv2d(x, w, None, stride=4)  # a ViT's patch embedding: the reshape path
        print(torch.autograd.gradcheck(conv, (xg, wg, bg)) and torch.autograd.gradcheck(patches, (x[:, :3, :8, \
:8].clone().requires_grad_(), r(4, 3, 4, 4).requires_grad_())), torch.autograd.gradcheck(lambda m, n: torch.bmm(m, n), \
(A.requires_grad_(), B.requires_grad_())))
        with torch.inference_mode():
            print(torch.allclose(conv(x, w, bias), torchs[6], rtol=1e-12, atol=1e-12))
    """)
    assert out.splitlines() == ["True", "2 [[3.0, 3.0], [3.0, 3.0]]", "True True", "True"]


_TRAIN = """
    import hashlib, sys, mergeflow, torch
    from mergeflow.core.reproducibility import configure, stage_threads
    configure(True, 2)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 4, 4), torch.nn.Flatten(), torch.nn.LayerNorm(1024), \
torch.nn.Linear(1024, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    x, y = torch.randn(512, 3, 32, 32), torch.randint(0, 10, (512,))  # 512 x 1024 x 64: past SPLIT_MIN_WORK, split in \
two
    for _ in range(30):
        opt.zero_grad(); torch.nn.functional.cross_entropy(net(x), y).backward(); opt.step()
    print(hashlib.md5(b"".join(p.detach().numpy().tobytes() for p in net.parameters())).hexdigest(), \
torch.get_num_threads(), stage_threads(), len(__import__("os").sched_getaffinity(0)))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to compare with 1")
def test_a_training_gives_the_same_bytes_on_one_core_as_on_every_core():
    """Two threads (torch's, and a GEMM's two blocks) on whatever cores there are: taskset to one core changes
    nothing."""
    every = _python(_TRAIN).split()
    one = _python(_TRAIN, prefix=["taskset", "-c", str(min(os.sched_getaffinity(0)))]).split()
    assert one[0] == every[0] and one[1:3] == every[1:3] == ["2", "2"] and one[3] == "1"


def test_import_pins_the_kernels_and_the_command_takes_them_back_only_where_it_set_them():
    env = {k: v for k, v in os.environ.items() if k not in KERNEL_ENV and k != MODE_ENV} | {
        "OMP_DYNAMIC": "TRUE"
    }  # the user's own
    out = _python(
        """
        import os, json, mergeflow
        from mergeflow.core.reproducibility import KERNEL_ENV, pin_environment
        pinned = {k: os.environ.get(k) for k in KERNEL_ENV}
        pin_environment(False)
        print(json.dumps([pinned, {k: os.environ.get(k) for k in KERNEL_ENV}, os.environ["MERGEFLOW_DETERMINISTIC"]]))
    """,
        env=env,
    )
    import json

    pinned, unpinned, mode = json.loads(out)
    assert pinned == KERNEL_ENV and mode == "0"
    # the user's own value back, and the package's default spin count (mergeflow/__init__.py)
    assert unpinned == {k: {"OMP_DYNAMIC": "TRUE", "GOMP_SPINCOUNT": "10000"}.get(k) for k in KERNEL_ENV}
    child = _python("import os, mergeflow; print(os.environ.get('ATEN_CPU_CAPABILITY'))", env=env | {MODE_ENV: "0"})
    assert child == "None"  # a launcher's "machine's own kernels" holds in the processes it starts


def test_the_command_runs_a_stage_with_the_kernels_params_yaml_asks_for(tmp_path, repo_root):
    """runtime.deterministic: false in params.yaml: the stage process has no pins (read before torch loads)."""
    text = (repo_root / "params.yaml").read_text().replace("  deterministic: true", "  deterministic: false")
    (tmp_path / "params.yaml").write_text(text)
    code = (
        "import os; from mergeflow.core.reproducibility import pin_environment, requested; "
        "pin_environment(requested('params.yaml')); print(os.environ.get('ATEN_CPU_CAPABILITY'), "
        "os.environ['MERGEFLOW_DETERMINISTIC'])"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert proc.stdout.split() == ["None", "0"], proc.stderr
    (tmp_path / "params.yaml").write_text(text.replace("  deterministic: false", "  deterministic: true"))
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert proc.stdout.split() == ["avx2", "1"], proc.stderr


def test_a_torch_loaded_before_the_pins_is_refused_in_deterministic_mode():
    """Decided by the machine: only a CPU with AVX-512 makes torch pick other kernels than the pinned AVX2 ones."""
    code = """
        import os
        for k in ("ATEN_CPU_CAPABILITY", "MERGEFLOW_DETERMINISTIC"): os.environ.pop(k, None)
        import torch
        torch.ones(3).sum()
        import mergeflow
        from mergeflow.core.errors import MergeflowError
        from mergeflow.core.reproducibility import configure
        try:
            configure(True, 2); print("configured", torch.backends.cpu.get_cpu_capability())
        except MergeflowError as err:
            print(err)
    """
    out = _python(code)
    if out.startswith("configured"):
        assert out == "configured AVX2" or out == "configured DEFAULT"  # this CPU has no AVX-512: nothing to refuse
    else:
        assert out.startswith("runtime.deterministic: torch runs its AVX512") and "import mergeflow before torch" in out


def test_the_reports_environment_is_the_same_from_any_cpu_in_deterministic_mode():
    from mergeflow.core.reproducibility.machine import environment_markdown

    kernels = {
        "torch": "AVX2",
        "mkl": "COMPATIBLE",
        "gemm": "OpenBLAS, 2 threads",
        "openblas": "Haswell",
        "numpy": "X86_V3",
    }
    det = {"deterministic": True, "kernels": kernels, "versions": {"torch": "2.14.1"}}
    intel = det | {"cpu": {"model": "Intel(R) Xeon(R)", "vendor": "GenuineIntel", "features": ["avx2"], "cores": 64}}
    amd = det | {"cpu": {"model": "AMD EPYC", "vendor": "AuthenticAMD", "features": ["avx2", "avx512f"], "cores": 2}}
    fast = {"deterministic": False, "kernels": {}, "versions": {"torch": "2.14.1"}, "cpu": amd["cpu"]}
    one = environment_markdown({"pretrain": intel, "merge@ties": amd})
    assert (
        one == environment_markdown({"pretrain": amd, "merge@ties": intel}) and "Xeon" not in one and "EPYC" not in one
    )
    line = (
        "- deterministic: torch AVX2, MKL COMPATIBLE, GEMMs on OpenBLAS, 2 threads, OpenBLAS Haswell, numpy X86_V3; "
        "torch 2.14.1: merge@ties, pretrain"
    )
    assert line in one.splitlines()
    two = environment_markdown({"pretrain": intel, "merge@ties": fast}).splitlines()
    assert "- machine's own kernels; torch 2.14.1: merge@ties" in two and environment_markdown({}) == ""
