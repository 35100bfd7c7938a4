"""A round's fine-tunes at once, in worker processes: a trainer with ``map`` (see mergeflow.ml.regimes).

Each worker builds its own trainer once (``build``, a picklable callable: a module-level function with its
arguments) and runs with ``threads`` torch threads; states travel to and from it as safetensors bytes. A call's
result depends only on its arguments and the worker's thread count, so a run with the same number of workers
repeats itself bit for bit, and a resumed run repeats an uninterrupted one.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from safetensors.torch import load as load_bytes, save as save_bytes

from mergeflow.core.io import StateDict
from mergeflow.core.reproducibility import configure
from mergeflow.ml.regimes import Budget, Trainer

_worker_trainer: Trainer | None = None


def _start_worker(build: Callable[[], Trainer], threads: int, deterministic: bool) -> None:
    global _worker_trainer
    configure(deterministic, threads)  # as the stage's own process is (mergeflow.core.reproducibility)
    _worker_trainer = build()


def _in_order(state: StateDict, like: StateDict) -> StateDict:
    return {k: state[k] for k in like} | {k: v for k, v in state.items() if k not in like}


def _train_in_worker(task: str, state: bytes, budget: Budget, carry: Any) -> tuple[bytes, Any]:
    new_state, carry = _worker_trainer(task, load_bytes(state), budget, carry)  # keyed: the order does not matter
    return save_bytes({k: v.contiguous() for k, v in new_state.items()}), carry


class PoolTrainer:
    """``train(task, state, budget, carry)`` and ``train.map(calls)`` on ``workers`` processes of ``threads``
    threads each (deterministic: their GEMMs', torch on one). Use as a context manager: the workers stop when it
    closes."""

    def __init__(self, build: Callable[[], Trainer], workers: int, threads: int, deterministic: bool = False):
        self._pool = ProcessPoolExecutor(
            workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_start_worker,
            initargs=(build, threads, deterministic),
        )

    def map(self, calls: Sequence[tuple[str, StateDict, Budget, Any]]) -> list[tuple[StateDict, Any]]:
        futures = [
            self._pool.submit(
                _train_in_worker, task, save_bytes({k: v.contiguous() for k, v in state.items()}), budget, carry
            )
            for task, state, budget, carry in calls
        ]
        results = [f.result() for f in futures]
        # safetensors gives the tensors back in an order of its own: restore the caller's
        return [(_in_order(load_bytes(new), state), carry) for (new, carry), (_, state, _, _) in zip(results, calls)]

    def __call__(self, task: str, state: StateDict, budget: Budget, carry: Any) -> tuple[StateDict, Any]:
        return self.map([(task, state, budget, carry)])[0]

    def __enter__(self) -> PoolTrainer:
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown(cancel_futures=True)
