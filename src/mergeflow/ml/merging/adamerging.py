"""AdaMerging, layer-wise: theta = theta0 + sum_t sum_l lam_t,l tau_t,l, lam learned at test time.

Yang et al., "AdaMerging: Adaptive model merging for multi-task learning", ICLR 2024 (arXiv:2310.02575). One
coefficient per task and tensor ("layer"), initialised at ``init`` (0.3, the paper's), learned with Adam (lr 1e-3,
batch 16 per task) by minimising the Shannon entropy of each task's head on unlabelled inputs of that task's test
split (``split``: "val" to adapt on the validation inputs instead). It reads the test inputs: test-time adaptation,
not comparable with data-free merging (the summary's "data" column). With lr 0 it is task arithmetic at lam = init.
The engine is merging._adaptive; the learned coefficients and the entropy per step are written with the choice.
"""

from mergeflow.ml.merging import ANY_NUMBER, SEED, Choice, Range, register

# AdaMerging's settings, shared by its three modules: the paper's (init 0.3, Adam lr 1e-3, batch 16 per task,
# 500 steps) on each task's test inputs
ADAPTIVE_DEFAULTS = {"init": 0.3, "lr": 1e-3, "steps": 500, "batch_size": 16, "split": "test", "seed": 0}
ADAPTIVE_RANGES = {
    "init": ANY_NUMBER,
    "lr": Range("a learning rate", 0),
    "steps": Range("a number of steps", 0),
    "batch_size": Range("a batch size", 1),
    "split": Choice(("test", "val")),
    "seed": SEED,
}


@register(
    "adamerging",
    paper="Yang et al. 2024, AdaMerging: Adaptive model merging for multi-task learning (arXiv:2310.02575)",
    defaults=ADAPTIVE_DEFAULTS,
    ranges=ADAPTIVE_RANGES,
    reads="test_inputs",
)
def adamerging(pretrained, task_vectors, *, data, init, lr, steps, batch_size, split, seed):
    from mergeflow.ml.merging._adaptive import adapt

    return adapt(
        pretrained,
        task_vectors,
        data.objective,
        layer_wise=True,
        init=init,
        lr=lr,
        steps=steps,
        batch_size=batch_size,
        split=split,
        seed=seed,
        data=data,
    )
