"""Every stage by its name (core.stage_table): ``mergeflow <stage>`` calls ``stages.<stage>``, DVC runs those
commands, and the Prefect flow runs the same commands read from dvc.yaml. The training side is in
``pipeline.train``, the merging and reporting side in ``pipeline.merge``."""

from mergeflow.core.layout import Layout
from mergeflow.pipeline.merge import merge, regime_merge, replicate, report, study
from mergeflow.pipeline.train import _feature_anchor, finetune, prepare, pretrain, regime, sources, statistics, vectors

__all__ = [
    "Layout",
    "_feature_anchor",
    "finetune",
    "merge",
    "prepare",
    "pretrain",
    "regime",
    "regime_merge",
    "replicate",
    "report",
    "sources",
    "statistics",
    "study",
    "vectors",
]
