"""mergeflow: fine-tune one backbone per task, extract task vectors, merge them with every method, evaluate."""

__version__ = "0.1.0"
