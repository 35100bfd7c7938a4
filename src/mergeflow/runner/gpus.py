"""GPUs handed out one per running stage: the devices CUDA_VISIBLE_DEVICES names, and a pool that gives each
stage one to itself."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

from mergeflow.runner.stage_server import CUDA_DEVICES_ENV


def parse_visible_devices(value: str) -> list[str]:
    """The device ids a CUDA_VISIBLE_DEVICES value names, as CUDA reads it: comma-separated indices or UUIDs,
    cut at the first invalid (negative) entry; "" names none."""
    devices = []
    for entry in (e.strip() for e in value.split(",")):
        if not entry or entry.startswith("-"):
            break
        devices.append(entry)
    return devices


def visible_gpus() -> list[str]:
    """The GPUs the flow's stages may use: those CUDA_VISIBLE_DEVICES names when it is set, else every device
    torch sees ("0", "1", ...); none on a machine without CUDA."""
    if CUDA_DEVICES_ENV in os.environ:
        return parse_visible_devices(os.environ[CUDA_DEVICES_ENV])
    from mergeflow.core.devices import cuda_devices  # without torch's import where there is no GPU driver (seconds)

    return [str(i) for i in range(cuda_devices())]


def worker_devices(devices: list[str] | tuple[str, ...], worker: int, workers: int) -> list[str]:
    """The share of ``devices`` that worker ``worker`` of ``workers`` (processes that each keep a pool of their
    own, such as a Dask LocalCluster's) hands out: devices worker, worker + workers, ..."""
    return list(devices[worker::workers]) if workers > 0 else list(devices)


class DevicePool:
    """Device ids handed out one per running stage and returned when it ends: a stage waits while every device
    is taken, so no two stages share a GPU. An empty pool (no GPU) hands out None at once."""

    def __init__(self, devices):
        self.devices = tuple(devices)
        self._free = list(self.devices)
        self._cond = threading.Condition()

    def acquire(self, timeout: float | None = None) -> str | None:
        """The first free device (lowest position first), waiting for one; None if the pool is empty. Raises
        TimeoutError when ``timeout`` seconds pass with every device taken."""
        if not self.devices:
            return None
        with self._cond:
            if not self._cond.wait_for(lambda: self._free, timeout):
                raise TimeoutError(f"no free device among {', '.join(self.devices)} after {timeout} s")
            return self._free.pop(0)

    def release(self, device: str | None) -> None:
        if device is None:
            return
        with self._cond:
            if device not in self.devices or device in self._free:
                raise ValueError(f"device {device!r} was not handed out by this pool")
            self._free.append(device)
            self._free.sort(key=self.devices.index)
            self._cond.notify()

    def free(self) -> list[str]:
        with self._cond:
            return list(self._free)

    @contextlib.contextmanager
    def lease(self) -> Iterator[dict[str, str]]:
        """Environment for one stage: {CUDA_VISIBLE_DEVICES: its device} for as long as the context lasts, or {}
        when the pool is empty (the stage sees what the flow sees)."""
        device = self.acquire()
        try:
            yield {} if device is None else {CUDA_DEVICES_ENV: device}
        finally:
            self.release(device)


_pools: dict[tuple[str, ...], DevicePool] = {}


_pools_lock = threading.Lock()


def process_device_pool(devices, workers: int | None = None, worker: int | None = None) -> DevicePool:
    """The device pool of this process, shared by every stage it runs at once (the thread runner's threads).
    A process that is worker ``worker`` of ``workers`` (a Dask LocalCluster's, one stage at a time each) hands
    out only its share (worker_devices)."""
    devices = tuple(devices or ())
    if workers and worker is not None:
        devices = tuple(worker_devices(devices, worker, workers))
    with _pools_lock:
        return _pools.setdefault(devices, DevicePool(devices))
