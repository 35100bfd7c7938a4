"""Where tensors live during a stage: data that every step or candidate reads is moved to a CUDA device once; and
how many GPUs a run's stages share. torch is imported inside the functions: a machine without a GPU driver is
told apart without it (seconds), so that `mergeflow repro` and the stage-thread rule stay light there."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# the GPUs `mergeflow repro` and the flow hand out, one a running stage: set in each stage's environment
RUN_GPUS_ENV = "MERGEFLOW_RUN_GPUS"
# what a GPU driver puts on a machine (NVIDIA's; WSL's GPU bridge; ROCm's, which torch.cuda also drives)
_GPU_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")


def gpu_driver_present() -> bool:
    """Whether this machine may have a GPU torch can use: False without any GPU driver's files (then torch need not
    be imported to know that CUDA is unavailable)."""
    return any(os.path.exists(path) for path in _GPU_DRIVER_PATHS)


def run_gpus(device: str) -> int:
    """How many stages run at once on the GPU path, a GPU each (``device``: runtime.device): RUN_GPUS_ENV where
    `mergeflow repro` or the flow set it (the GPUs they hand out), else the GPUs this process sees (plain `dvc
    repro`, one stage at a time); 0 when the stages run on the CPU (runtime.device: cpu, or no CUDA)."""
    seen = cuda_devices() if device != "cpu" else 0
    env = os.environ.get(RUN_GPUS_ENV, "")
    return int(env) if seen and env.isdecimal() and int(env) > 0 else seen


def cuda_devices() -> int:
    """The CUDA devices this process sees (CUDA_VISIBLE_DEVICES applied); 0 without CUDA, and without importing
    torch where no GPU driver is installed."""
    if not gpu_driver_present():
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _fits(nbytes: int, device: torch.device, share: float) -> bool:
    """Whether ``nbytes`` take at most ``share`` of the CUDA ``device``'s free memory."""
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    return nbytes <= share * free


def resident(tensor: torch.Tensor, device: torch.device, share: float = 0.5) -> torch.Tensor:
    """``tensor`` moved to a CUDA ``device`` once, when it takes at most ``share`` of the device's free memory, so
    that batches are sliced on the device instead of gathered and copied from the host each step (a batch of 128
    images at 224 px is 19 MB); as it is elsewhere (the CPU, or too large: then each batch is copied as before)."""
    if device.type != "cuda" or tensor.device == device:
        return tensor
    return tensor.to(device) if _fits(tensor.numel() * tensor.element_size(), device, share) else tensor


def resident_stack(parts: list[torch.Tensor], device: torch.device, share: float = 0.5) -> torch.Tensor:
    """``torch.cat(parts)``, made where ``resident`` would put it: on a CUDA ``device`` (when it takes at most
    ``share`` of its free memory) each part is copied straight into its rows there, without the copy of every part
    that the cat on the host makes first (13 GB for the 8-task benchmark's test splits); elsewhere, the host's cat."""
    import torch

    alike = all(p.shape[1:] == parts[0].shape[1:] and p.dtype == parts[0].dtype for p in parts)  # else cat's error
    if device.type == "cuda" and parts and alike:
        rows = sum(len(p) for p in parts)
        if _fits(rows * parts[0].shape[1:].numel() * parts[0].element_size(), device, share):
            out = torch.empty((rows, *parts[0].shape[1:]), dtype=parts[0].dtype, device=device)
            start = 0
            for part in parts:
                out[start : start + len(part)].copy_(part)
                start += len(part)
            return out
    return torch.cat(parts)
