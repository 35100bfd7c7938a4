"""RegMean: per linear layer W = (sum_t G~_t)^-1 sum_t G~_t W_t, the other tensors averaged.

Jin, Ren, Preotiuc-Pietro and Cheng, "Dataless knowledge fusion by merging weights of language models", ICLR 2023
(arXiv:2212.09849). G_t = X_t^T X_t is the Gram of the layer's inputs over n examples of task t's training split
(the stage ``statistics``; mergeflow.ml.statistics), and G~_t = alpha G_t + (1 - alpha) diag(G_t) shrinks its
off-diagonal entries. It is the least-squares fit of every task's outputs X_t W_t^T on the union of the tasks'
inputs (alpha = 1), so G_t = I gives weight averaging and one task gives its own W back. torch's Linear computes
x W^T: with W [out, in], W = (sum_t W_t G~_t) (sum_t G~_t)^-1 (the Grams are symmetric). Biases, norms, embeddings
and convolutions: weight averaging. Defaults: alpha 0.95 (the paper's), searched on validation. An input that is
zero in every task's examples (a ReLU unit none of them activates: a T5 decoder's at its first token) leaves its
column of W free, and takes the weights' average there.
"""

from mergeflow.ml.merging import FRACTION, register

ALPHA_GRID = [0.1, 0.5, 0.8, 0.9, 0.95, 1.0]


def regression_mean(weights, grams, alpha: float, *, key: str, method: str = "regmean"):
    """(sum_t W_t G~_t)(sum_t G~_t)^-1, G~ = alpha G + (1 - alpha) diag(G), in float64 (a Gram of thousands of rows
    is ill-conditioned in float32), returned in the weights' dtype."""
    import torch

    shrunk = []
    for g in grams:
        g = g.double()
        shrunk.append(alpha * g + (1 - alpha) * torch.diag(torch.diagonal(g)))
    weighted = sum(w.double() @ g for w, g in zip(weights, shrunk))
    total = sum(shrunk)
    dead = torch.diagonal(total) == 0  # its row and column are zero: the average's column solves it alone
    if bool(dead.any()):
        total[dead, dead] = 1.0
        weighted[:, dead] = torch.stack([w.double()[:, dead] for w in weights]).mean(0)
    try:
        return torch.linalg.solve(total, weighted.T).T.to(weights[0].dtype)
    except RuntimeError:  # torch.linalg.LinAlgError
        raise ValueError(
            f"merge.{method}: the Gram of {key}'s inputs is singular "
            f"at alpha={alpha} (an input never varies); use alpha < 1"
        ) from None


@register(
    "regmean",
    paper="Jin et al. 2023, Dataless knowledge fusion by merging weights of language models (arXiv:2212.09849)",
    defaults={"alpha": 0.95},
    grid={"alpha": ALPHA_GRID},
    ranges={"alpha": FRACTION},
    reads="train_statistics",
)
def regmean(pretrained, task_vectors, *, data, alpha):
    from mergeflow.ml.merging._tensors import map_tensors

    grams = [data.statistics[t]["gram"] for t in task_vectors]

    def merge(key, theta0, taus):
        if key not in grams[0]:
            return theta0 + taus.mean(0)
        return regression_mean(
            [theta0.double() + tau.double() for tau in taus], [g[key] for g in grams], alpha, key=key
        ).to(taus.dtype)

    return map_tensors(pretrained, task_vectors, merge)
