"""AdaMerging, task-wise: theta = theta0 + sum_t lam_t tau_t, lam learned at test time.

Yang et al., "AdaMerging: Adaptive model merging for multi-task learning", ICLR 2024 (arXiv:2310.02575). One
coefficient per task, otherwise as ``adamerging`` (layer-wise): initialised at 0.3, Adam (lr 1e-3, batch 16) on the
entropy of each task's predictions on its unlabelled test inputs (test-time adaptation).
"""

from mergeflow.ml.merging import register
from mergeflow.ml.merging.adamerging import ADAPTIVE_DEFAULTS, ADAPTIVE_RANGES


@register(
    "adamerging_task",
    paper="Yang et al. 2024, AdaMerging: Adaptive model merging for multi-task learning (arXiv:2310.02575), task-wise",
    defaults=ADAPTIVE_DEFAULTS,
    ranges=ADAPTIVE_RANGES,
    reads="test_inputs",
)
def adamerging_task(pretrained, task_vectors, *, data, init, lr, steps, batch_size, split, seed):
    from mergeflow.ml.merging._adaptive import adapt

    return adapt(
        pretrained,
        task_vectors,
        data.objective,
        layer_wise=False,
        init=init,
        lr=lr,
        steps=steps,
        batch_size=batch_size,
        split=split,
        seed=seed,
        data=data,
    )
