"""The machine-learning library, lowest layer first: the task data (``data``), the backbone and heads (``models``,
``checkpoints``, ``lora``, ``zeroshot``), training (``training``, the ``regimes``), task vectors and their statistics,
the merging methods (``merging``) and the evaluation. It knows nothing of DVC, Prefect or MLflow's runs: the stages
(mergeflow.pipeline) call it."""
