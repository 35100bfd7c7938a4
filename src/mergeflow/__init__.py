"""mergeflow: fine-tune one backbone per task, extract task vectors, merge them with every method, evaluate."""

import os

__version__ = "0.1.0"

# OpenMP workers spin after each parallel region before they sleep: libgomp's default is 300,000 spins, milliseconds
# on this CPU. torch and numba each load their own libgomp, so one runtime's spinning workers take the cores from
# the other's and from the merges' selection threads. 10,000 spins (read when torch is first imported: set before
# it) took a TIES merge of 8 ViT-B/32 task vectors from 3.2-4.5 to 2.0-2.3 CPU-s of user time and left a training
# step as fast (80-92 against 84-89 ms; 3 runs each). A value set by the user wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

# The deterministic mode's CPU kernels (mergeflow.core.reproducibility), pinned before torch or numpy can load: whatever
# launched this process, a stage runs the same kernels on every x86-64 machine. The mergeflow command takes them
# back when params.yaml sets runtime.deterministic: false.
# after the spin setting, which it does not read
from mergeflow.core.reproducibility import pin_environment  # noqa: E402

pin_environment()
