"""Linear probes: a task's head fitted on a backbone's frozen features.

Multinomial logistic regression (ridge for a regression task), its strength chosen on validation, the
standardisation folded into the head so that it reads raw features. ``mergeflow.ml.training`` exports them too."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from mergeflow.config import NEWTON_MAX_UNKNOWNS, ProbeConfig
from mergeflow.ml.metrics import is_regression, score as metric_score
from mergeflow.ml.models import make_head


@dataclass
class ProbeResult:
    head: nn.Linear
    c: float
    val_accuracy: float
    val_curve: dict[str, float]
    iterations: dict[str, int] = field(
        default_factory=dict
    )  # the solver's iterations per C; max_iter: stopped unconverged
    max_iter: int = 0
    solver: str = "newton-cholesky"

    def convergence_line(self, where: str) -> str:
        """One line for the stage's log: the chosen fit's iterations, and whether the solver converged."""
        used = self.iterations.get(str(self.c), 0)
        name = "Newton" if self.solver == "newton-cholesky" else "L-BFGS"
        if used < self.max_iter:
            return (
                f"{where}: probe C={self.c:g} converged in {used} {name} iterations (val "
                f"{100 * self.val_accuracy:.1f}%)"
            )
        return (
            f"{where}: probe C={self.c:g} stopped at probe.max_iter={self.max_iter} {name} iterations before "
            f"converging (val {100 * self.val_accuracy:.1f}%)"
        )


def fit_probe(
    train_x: torch.Tensor,
    train_y: torch.Tensor,
    val_x: torch.Tensor,
    val_y: torch.Tensor,
    cfg: ProbeConfig,
    *,
    seed: int,
    num_classes: int | None = None,
    metric: str = "accuracy",
) -> ProbeResult:
    """Multinomial logistic regression on standardised features; C chosen on validation.

    The solver is Newton's method (``probe.solver: newton-cholesky``), which reaches the L2-regularised optimum in
    about ten iterations: the head is a smooth function of the features. L-BFGS stopped on its path (150
    iterations, or even at its tolerance) is not: features perturbed by 1e-6 (last bits) moved its coefficients by
    0.3-4% and a task's test accuracy by up to 1.2 points, Newton's by 1e-5 and none (digits, signs, texture, count
    on the default suite, 2026-11-28). Past NEWTON_MAX_UNKNOWNS features x classes, L-BFGS runs (to ``max_iter``).

    The head has ``num_classes`` outputs (the task's declared classes; by default the largest training label
    plus one): a class absent from the training split gets a logit that is never the largest.

    The standardisation is folded into the returned head, so it reads raw backbone features. The fits run with
    one BLAS thread: their products (n x d by d x classes, here 3000 x 128 by 128 x 10) are too small to share, and
    on the 2-core machine a real task's probe took 4.3-5.6 s with OpenBLAS's default threads against 0.4-0.7 s with
    one. One thread also makes the solver's path, and so the head, independent of the core count.
    """
    import warnings

    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression  # imported here: it costs every other stage a second
    from threadpoolctl import threadpool_limits

    if is_regression(metric):
        return _ridge_probe(train_x, train_y, val_x, val_y, cfg, metric)
    mu = train_x.mean(0)
    sd = train_x.std(0) + 1e-6
    seed %= 2**32  # scikit-learn's random_state range: a task's seed (seed x 1000003 + crc) can pass it
    xs, vs = ((train_x - mu) / sd).numpy(), ((val_x - mu) / sd).numpy()
    best = None
    curve, iterations = {}, {}
    classes_seen = len(np.unique(train_y.numpy()))
    solver = cfg.solver if cfg.solver == "lbfgs" or train_x.shape[1] * classes_seen <= NEWTON_MAX_UNKNOWNS else "lbfgs"
    for c in cfg.c_grid:
        clf = LogisticRegression(C=c, max_iter=cfg.max_iter, random_state=seed, solver=solver)
        # an unconverged fit is reported once, as a figure (ProbeResult.convergence_line), not as a warning per fit
        with threadpool_limits(limits=1, user_api="blas"), warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            clf.fit(xs, train_y.numpy())
        if metric == "accuracy":
            acc = float((clf.predict(vs) == val_y.numpy()).mean())
        else:  # the task's own metric on val (GLUE's Matthews correlation, accuracy and F1)
            acc = metric_score(metric, torch.as_tensor(clf.predict_proba(vs)), val_y)
        curve[str(c)] = acc
        iterations[str(c)] = int(max(clf.n_iter_))
        if best is None or acc > best[0]:
            best = (acc, c, clf)
    acc, c, clf = best
    n_classes = num_classes if num_classes is not None else int(train_y.max()) + 1
    coef = torch.zeros(n_classes, train_x.shape[1])
    bias = torch.full((n_classes,), -1e4)  # a class absent from training is never predicted
    classes = torch.as_tensor(clf.classes_)
    weights = torch.as_tensor(clf.coef_, dtype=torch.float32)
    intercepts = torch.as_tensor(clf.intercept_, dtype=torch.float32)
    if len(classes) == 2:  # scikit-learn keeps one logit for two classes: split it symmetrically
        weights, intercepts = torch.cat([-weights, weights]) / 2, torch.cat([-intercepts, intercepts]) / 2
    coef[classes] = weights
    bias[classes] = intercepts
    head = make_head(train_x.shape[1], n_classes)
    with torch.no_grad():
        head.weight.copy_(coef / sd)
        head.bias.copy_(bias - (coef / sd) @ mu)
    return ProbeResult(
        head=head, c=c, val_accuracy=acc, val_curve=curve, iterations=iterations, max_iter=cfg.max_iter, solver=solver
    )


def _ridge_probe(
    train_x: torch.Tensor,
    train_y: torch.Tensor,
    val_x: torch.Tensor,
    val_y: torch.Tensor,
    cfg: ProbeConfig,
    metric: str,
) -> ProbeResult:
    """A regression task's probe: ridge regression on standardised features (L2 strength 1 / C, C from
    ``probe.c_grid`` chosen by the metric on val), solved exactly (Cholesky): a one-output head."""
    mu, sd = train_x.mean(0), train_x.std(0) + 1e-6
    xs, vs = ((train_x - mu) / sd).double(), ((val_x - mu) / sd).double()
    target = train_y.double()
    offset = target.mean()
    gram, moment = xs.T @ xs, xs.T @ (target - offset)
    best, curve = None, {}
    for c in cfg.c_grid:
        weights = torch.linalg.solve(gram + torch.eye(len(gram), dtype=gram.dtype) / c, moment)
        value = metric_score(metric, (vs @ weights + offset).unsqueeze(1), val_y)
        curve[str(c)] = value
        if best is None or value > best[0]:
            best = (value, c, weights)
    value, c, weights = best
    head = make_head(train_x.shape[1], 1)
    with torch.no_grad():
        head.weight.copy_((weights.float() / sd).unsqueeze(0))
        head.bias.copy_((offset - (weights / sd.double()) @ mu.double()).float().reshape(1))
    return ProbeResult(
        head=head,
        c=c,
        val_accuracy=value,
        val_curve=curve,
        iterations={str(k): 1 for k in cfg.c_grid},
        max_iter=cfg.max_iter,
        solver="cholesky",
    )
