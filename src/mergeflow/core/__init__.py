"""The foundation every layer stands on, importing nothing of mergeflow above it: errors, atomic I/O and
safetensors, every path (``layout``) and every stage (``stage_table``), YAML read strictly, dvc.lock kept whole,
the deterministic mode, process lifetimes, and where the MLflow store is."""
