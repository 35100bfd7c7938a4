"""Sequential MagMax: per entry, the task-vector value of largest magnitude seen so far; theta(t) = theta0 + lam * m_t,
m_t = maxabs(m_(t-1), tau_t), m_1 = tau_1.

Marczak et al., "MagMax: leveraging model merging for seamless continual learning", ECCV 2024 (arXiv:2407.06322): after
each task the paper merges the task vectors seen so far by maximum magnitude, lam = 1. (It fine-tunes each task from
the previous fine-tune; here the fine-tunes are fixed, each from theta0.) Selection by magnitude is associative, so the
running vector m_t is the only state and after T arrivals this is mergeflow.ml.merging.magmax over the T vectors; a
tie keeps the earlier value, that method's rule (the first task wins).
"""

from mergeflow.ml.continual import Interval, register


@register(
    "magmax",
    paper="Marczak et al. 2024, MagMax (arXiv:2407.06322)",
    reference="the paper's Algorithm 1 (no FusionBench continual module)",
    defaults={"lam": 1.0},
    ranges={"lam": Interval()},
)
def magmax(pretrained, merged, state, tau, *, lam):
    import torch

    if state is None:
        vector = {k: tau[k].clone() for k in pretrained}
    else:
        vector = {k: torch.where(tau[k].abs() > state[k].abs(), tau[k], state[k]) for k in pretrained}
    return {k: pretrained[k] + lam * vector[k] for k in pretrained}, vector
