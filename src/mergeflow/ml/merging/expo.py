"""ExPO: extrapolate past the merged model, away from the pretrained one: theta = theta_m + alpha (theta_m - theta0).

Zheng et al., "Weak-to-strong extrapolation expedites alignment", 2024 (arXiv:2404.16792), as FusionBench
implements it (fusion_bench/method/linear/expo.py: ``ExPOAlgorithm``; linear/llama_expo.py:
``ExPOAlgorithmForLlama``). The paper extrapolates one aligned model theta_1 beyond its SFT start theta0,
theta_1 + alpha (theta_1 - theta0). For several models FusionBench first averages them and extrapolates the
average, theta_m = theta0 + (1/T) sum_t tau_t, as mergeflow does:
theta = theta0 + ((1 + alpha) / T) sum_t tau_t,
task arithmetic at lam = (1 + alpha) / T; alpha = 0 is weight averaging. alpha = 0.1 is FusionBench's default.

``scope`` says which tensors are extrapolated, where FusionBench's two codes differ: ``all`` every tensor
(``ExPOAlgorithm``), ``matrices`` only the 2-D weights of the linear layers (_tensors.is_matrix), every other tensor
(biases, norms, embeddings) staying at the average (``ExPOAlgorithmForLlama`` at its defaults: linear weights only,
no biases, embeddings or LM head). That code's other options (attention layers' alpha scaled by
``attention_scaling_factor``, 1.0 in its config; magnitude pruning of the difference, off) are not carried.
"""

from mergeflow.ml.merging import ANY_NUMBER, Choice, register


@register(
    "expo",
    paper="Zheng et al. 2024, ExPO (arXiv:2404.16792), on the average as in FusionBench",
    defaults={"scope": "all", "alpha": 0.1},
    grid={"alpha": [0.0, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0]},
    coefficient="alpha",
    ranges={"scope": Choice(("all", "matrices")), "alpha": ANY_NUMBER},
)
def expo(pretrained, task_vectors, *, scope, alpha):
    from mergeflow.ml.merging._kernels import task_sum
    from mergeflow.ml.merging._tensors import is_matrix, kernel_vector, map_stacked, plus_scaled

    tasks = len(task_vectors)

    def scale(key, t, tau):  # map_stacked's prepare sees each tensor's key and shape: its scale of sum_t tau_t
        return (1 + alpha if scope == "all" or is_matrix(key, tau) else 1.0) / tasks

    return map_stacked(
        pretrained,
        task_vectors,
        lambda theta0, taus, scales: plus_scaled(theta0, scales[0], kernel_vector(task_sum, taus)),
        prepare=scale,
    )
