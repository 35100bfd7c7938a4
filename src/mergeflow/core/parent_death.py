"""Processes that die with the process that started them (Linux's PR_SET_PDEATHSIG), for a stage and its workers.

The kernel sends the signal when the *thread* that forked the process exits, not the whole parent process: so a
process must be started from a thread that lives as long as its parent (a main thread, a pool's worker thread).
The setting is not inherited across fork: each process asks for itself. A stage's worker pools ask in their
initializer (``process_pool``), so a stage killed outright (SIGKILL, or its own parent-death signal) takes its
workers with it, whoever started the stage. No torch here: a stage command asks before its heavy imports.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable

PR_SET_PDEATHSIG = 1


def ask(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``sig`` to this process when the thread that started it exits. False where the
    kernel offers no such thing (not Linux)."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig)) == 0
    except (OSError, AttributeError):
        return False


def _worker_start(parent: int, initializer: Callable[..., Any] | None, initargs: tuple) -> None:
    """A pool worker's first call: SIGKILL when its stage dies (a worker holds nothing a kill could cut short:
    its outputs are written atomically), and exit at once if the stage is gone already."""
    ask(signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(75)
    if initializer is not None:
        initializer(*initargs)


def process_pool(
    workers: int, initializer: Callable[..., Any] | None = None, initargs: tuple = ()
) -> ProcessPoolExecutor:
    """A ProcessPoolExecutor of ``workers`` spawned processes that die with this process; submit from a thread
    that outlives the pool (workers are started on submit, and die when the thread that started them exits)."""
    return ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_worker_start,
        initargs=(os.getpid(), initializer, tuple(initargs)),
    )
