"""Sequential weight averaging: the running mean of the task models, theta(t) = ((t - 1) theta(t-1) + theta_t) / t.

After T arrivals it is weight averaging (model soup) of the T models, theta0 + (1/T) sum_t tau_t, whatever the order.
Wortsman et al., "Model soups", ICML 2022 (arXiv:2203.05482); FusionBench's continual baseline
(fusion_bench/method/opcm/weight_average.py: ``(merged * t + task) / (t + 1)``). State: the arrivals so far.
"""

from mergeflow.ml.continual import register


@register(
    "weight_averaging",
    paper="Wortsman et al. 2022, Model soups (arXiv:2203.05482), as a running mean",
    reference="fusion_bench/method/opcm/weight_average.py",
)
def weight_averaging(pretrained, merged, state, tau):
    arrival = 1 if state is None else state["arrivals"] + 1
    model = {k: pretrained[k] + tau[k] for k in pretrained}
    if merged is None:
        return model, {"arrivals": 1}
    return {k: (merged[k] * (arrival - 1) + model[k]) / arrival for k in pretrained}, {"arrivals": arrival}
