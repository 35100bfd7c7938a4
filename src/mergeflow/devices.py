"""Where tensors live during a stage: data that every step or candidate reads is moved to a CUDA device once."""

from __future__ import annotations

import torch


def resident(tensor: torch.Tensor, device: torch.device, share: float = 0.5) -> torch.Tensor:
    """``tensor`` moved to a CUDA ``device`` once, when it takes at most ``share`` of the device's free memory, so
    that batches are sliced on the device instead of gathered and copied from the host each step (a batch of 128
    images at 224 px is 19 MB); as it is elsewhere (the CPU, or too large: then each batch is copied as before)."""
    if device.type != "cuda" or tensor.device == device:
        return tensor
    free, _ = torch.cuda.mem_get_info(device)
    return tensor.to(device) if tensor.numel() * tensor.element_size() <= share * free else tensor
