"""The seed's synthetic setting: its data (patterns and tokens), its one-layer Transformer with hinge-loss
fine-tuning, task vectors and their merge, the low-rank tools (Corollary 1) and the out-of-domain condition (7)
with the seed's closed-form lambdas."""

from __future__ import annotations

from typing import TYPE_CHECKING

import math
from collections.abc import Sequence


from mergeflow.studies.provable.settings import RESERVED, ProvableSettings
from mergeflow.studies import no_grad

if TYPE_CHECKING:
    import torch


def grid(lo: float, hi: float, step: float) -> list[float]:
    """lo, lo + step, ..., hi (hi included when on the grid), rounded to 6 decimals."""
    n = int(math.floor((hi - lo) / step + 1e-9))
    return [round(lo + i * step, 6) for i in range(n + 1)]


def patterns(alpha: float, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """mu1 = e0 and mu2 = alpha e0 + sqrt(1 - alpha^2) e1: unit vectors with mu1^T mu2 = alpha."""
    import torch

    mu1, mu2 = torch.zeros(d), torch.zeros(d)
    mu1[0] = 1.0
    mu2[0], mu2[1] = alpha, math.sqrt(max(0.0, 1.0 - alpha * alpha))
    return mu1, mu2


def target_pattern(gamma1: float, gamma2: float, d: int) -> torch.Tensor:
    """mu' = gamma1 e0 + gamma2 e1 + kappa e2, kappa = sqrt(1 - gamma1^2 - gamma2^2) >= 0 (e2 is mu_perp)."""
    import torch

    mu = torch.zeros(d)
    mu[0], mu[1], mu[2] = gamma1, gamma2, math.sqrt(max(0.0, 1.0 - gamma1 * gamma1 - gamma2 * gamma2))
    return mu


def irrelevant_directions(d: int) -> torch.Tensor:
    """The v_j: e3, ..., e_{d-1} (M = d - 3 rows), orthonormal and orthogonal to every pattern used here."""
    import torch

    return torch.eye(d)[RESERVED:]


def make_data(
    mu: torch.Tensor,
    irrelevant: torch.Tensor,
    n: int,
    *,
    tokens: int,
    relevant: int,
    confusion: int,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """n samples (X: n x P x d, y: n) of Definition 2: y = +-1 equally likely; ``relevant`` tokens y mu,
    ``confusion`` tokens -y mu, the rest drawn uniformly from the rows of ``irrelevant``; positions shuffled."""
    import torch

    y = torch.randint(0, 2, (n,), generator=gen).float() * 2 - 1
    rest = tokens - relevant - confusion
    sign = (
        torch.cat([torch.ones(n, relevant), -torch.ones(n, confusion), torch.zeros(n, rest)], dim=1) * y[:, None]
    )  # n x P
    idx = torch.randint(0, irrelevant.shape[0], (n, rest), generator=gen)
    X = sign[:, :, None] * mu[None, None, :]
    X[:, relevant + confusion :] = irrelevant[idx]
    perm = torch.argsort(torch.rand(n, tokens, generator=gen), dim=1)
    return torch.gather(X, 1, perm[:, :, None].expand(-1, -1, mu.shape[0])).contiguous(), y


def majority_sign(X: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """The sign of the sum over tokens of x_s^T mu counting only the tokens that carry +-mu (the label's rule)."""
    import torch

    proj = X @ mu
    carrying = (proj.abs() > 1 - 1e-6).float()
    return torch.sign((torch.sign(proj) * carrying).sum(1))


Params = dict[str, "torch.Tensor"]  # {"W": d x d, "V": m x d}


def init_model(d: int, m: int, init_std: float, gen: torch.Generator) -> tuple[Params, torch.Tensor]:
    """Psi0: W, V ~ N(0, init_std^2); the frozen output layer a in {+-1/sqrt(m)}^m."""
    import torch

    W = torch.randn(d, d, generator=gen) * init_std
    V = torch.randn(m, d, generator=gen) * init_std
    a = (torch.randint(0, 2, (m,), generator=gen).float() * 2 - 1) / math.sqrt(m)
    return {"W": W, "V": V}, a


def forward(params: Params, a: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """f(X) = 1/P sum_l a^T ReLU(V sum_s x_s softmax_s(x_s^T W x_l)), for a batch X (n x P x d)."""
    import torch

    scores = X @ params["W"] @ X.transpose(1, 2)  # [n, s, l] = x_s^T W x_l
    attn = torch.softmax(scores, dim=1)  # over s
    z = attn.transpose(1, 2) @ X  # [n, l, :] = sum_s attn[s, l] x_s
    return (torch.relu(z @ params["V"].T) @ a).mean(dim=1)


def hinge(f: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.clamp(1 - y * f, min=0)


def finetune(
    theta0: Params,
    a: torch.Tensor,
    mu: torch.Tensor,
    irrelevant: torch.Tensor,
    s: ProvableSettings,
    gen: torch.Generator,
) -> Params:
    """``s.steps`` SGD steps of size ``s.lr`` on the mean hinge loss of fresh mini-batches of ``s.batch``
    samples of the task with pattern ``mu``; a is frozen. Returns the fine-tuned W, V."""
    import torch

    params = {k: v.clone().requires_grad_(True) for k, v in theta0.items()}
    for _ in range(s.steps):
        X, y = make_data(mu, irrelevant, s.batch, tokens=s.tokens, relevant=s.relevant, confusion=s.confusion, gen=gen)
        loss = hinge(forward(params, a, X), y).mean()
        grads = torch.autograd.grad(loss, list(params.values()))
        with torch.no_grad():
            for p, g in zip(params.values(), grads):
                p -= s.lr * g
    return {k: v.detach() for k, v in params.items()}


@no_grad
def evaluate(params: Params, a: torch.Tensor, X: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(mean hinge loss, accuracy) on (X, y); a zero output counts as wrong."""
    import torch

    f = forward(params, a, X)
    return float(hinge(f, y).mean()), float((torch.sign(f) == y).float().mean())


def delta(params: Params, theta0: Params) -> Params:
    return {k: params[k] - theta0[k] for k in theta0}


def merge(theta0: Params, deltas: Sequence[Params], lambdas: Sequence[float]) -> Params:
    """Task arithmetic: theta0 + sum_i lambda_i delta_i."""
    return {k: theta0[k] + sum(lam * dv[k] for lam, dv in zip(lambdas, deltas)) for k in theta0}


def truncate(matrix: torch.Tensor, r: int) -> torch.Tensor:
    """The best rank-r approximation (truncated SVD)."""
    import torch

    U, S, Vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    return ((U[:, :r] * S[:r]) @ Vh[:r]).to(matrix.dtype)


def top_energy(matrix: torch.Tensor) -> float:
    """sigma_1^2 / sum_i sigma_i^2: the top singular value's share of ||matrix||_F^2."""
    import torch

    S = torch.linalg.svdvals(matrix.double())
    total = float((S * S).sum())
    return float(S[0] ** 2) / total if total > 0 else math.nan


def residual(matrix: torch.Tensor, r: int) -> float:
    """R(r) = ||matrix - rank-r truncation||_F / ||matrix||_F."""
    norm = float(matrix.double().norm())
    return float((matrix.double() - truncate(matrix, r).double()).norm()) / norm if norm > 0 else math.nan


def alignment(matrix: torch.Tensor, mu: torch.Tensor) -> tuple[float, float]:
    """(|cos(u1, mu)|, |cos(v1, mu)|) of the top left and right singular vectors (the left side needs a d-row matrix:
    NaN otherwise)."""
    import torch

    U, _, Vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    m = mu.double() / mu.double().norm()
    left = float((U[:, 0] @ m).abs()) if matrix.shape[0] == mu.shape[0] else math.nan
    return left, float((Vh[0] @ m).abs())


def second_alignment(matrix: torch.Tensor, direction: torch.Tensor) -> float:
    """|cos| of the second right singular vector with ``direction``."""
    import torch

    _, _, Vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    u = direction.double() / direction.double().norm()
    return float((Vh[1] @ u).abs()) if Vh.shape[0] > 1 else math.nan


def truncate_params(d: Params, r: int) -> Params:
    return {k: truncate(v, r) for k, v in d.items()}


def ood_condition(lambdas: Sequence[float], gammas: Sequence[float], c: float, beta: float) -> bool:
    """The seed's (7): sum lambda_i gamma_i >= 1 + c, sum lambda_i gamma_i^2 >= 1 + c, |lambda_i| beta <= c,
    and (A) some gamma_i != 0."""
    if not any(g != 0 for g in gammas):
        return False
    s1 = sum(lam * g for lam, g in zip(lambdas, gammas))
    s2 = sum(lam * g * g for lam, g in zip(lambdas, gammas))
    return s1 >= 1 + c - 1e-12 and s2 >= 1 + c - 1e-12 and all(abs(lam) * beta <= c for lam in lambdas)


def closed_form_lambdas(gammas: Sequence[float], c: float) -> list[float] | None:
    """The seed's (75)-(76): lambda_i = C (gamma_i / sqrt(sum gamma^2) + gamma_i^2 / sqrt(sum gamma^4)),
    C = (1 + c) sqrt(sum gamma^4) / (sqrt(sum gamma^2) sqrt(sum gamma^4) + sum gamma^3), as printed. None when
    undefined (all gamma_i zero, or all equal and negative: the denominator is 0)."""
    s2 = sum(g**2 for g in gammas)
    s3 = sum(g**3 for g in gammas)
    s4 = sum(g**4 for g in gammas)
    den = math.sqrt(s2) * math.sqrt(s4) + s3
    if s2 == 0 or abs(den) < 1e-12:
        return None
    C = (1 + c) * math.sqrt(s4) / den
    return [C * (g / math.sqrt(s2) + g * g / math.sqrt(s4)) for g in gammas]


def impossible(gammas: Sequence[float]) -> bool:
    """Theorem 3's impossible case: every gamma_i equal to one k < 0."""
    return len(set(gammas)) == 1 and gammas[0] < 0
