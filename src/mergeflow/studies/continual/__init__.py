"""Study ``continual``: continual merging, the task models arriving one at a time in the order params.yaml gives
(``order``, else suite.tasks). After each arrival every method of ``methods`` (mergeflow.ml.continual: sequential
weight averaging and task arithmetic, MagMax, OPCM, DOP) updates its merged model from the previous one and the new
task vector alone; the merged model is scored on every task seen so far. It reads the standard fine-tune's outputs
(models/pretrained, vectors, models/heads, data/tasks, metrics/finetune) and trains nothing.

Claims (each from the numbers; not measured when a method it compares is not in ``methods``):

1. opcm.1: OPCM's average accuracy after the last arrival is above sequential weight averaging's and task
   arithmetic's (Tang et al. 2025).
2. opcm.2: OPCM's backward transfer is above theirs: it forgets less (Tang et al. 2025).
3. dop.1: DOP's average accuracy after the last arrival is above OPCM's (DOP, NeurIPS 2025).

The study is a package: ``settings``, ``measure`` (the runs and their accuracies), ``claims``, ``figures`` and
``report`` (the study function, registered as ``continual``).
"""

from mergeflow.studies.continual.claims import claims
from mergeflow.studies.continual.measure import Run, Suite, individual_accuracy
from mergeflow.studies.continual.report import accuracy_table, continual_study, forgetting_table
from mergeflow.studies.continual.settings import METHODS, ContinualSettings

__all__ = [
    "METHODS",
    "ContinualSettings",
    "Run",
    "Suite",
    "accuracy_table",
    "claims",
    "continual_study",
    "forgetting_table",
    "individual_accuracy",
]
