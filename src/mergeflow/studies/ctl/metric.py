"""Study ``ctl``'s metric, pure functions on features (1 - cos and coef against the target feature of each claim),
and the block outputs read by forward hooks (``Probe``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field


from mergeflow.studies.ctl.settings import State
from mergeflow.studies import no_grad

if TYPE_CHECKING:
    import torch
    from torch import nn


def combine(parts: Sequence[tuple[float, torch.Tensor]]) -> torch.Tensor:
    """sum_k w_k F_k, in float64."""
    import torch

    out = None
    for w, f in parts:
        term = w * f.to(torch.float64)
        out = term if out is None else out + term
    return out


def cosine_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row cosine of [N, ...] features (flattened per row), float64; two zero rows have cosine 1."""
    import torch

    a, b = a.reshape(len(a), -1).to(torch.float64), b.reshape(len(b), -1).to(torch.float64)
    na, nb = a.norm(dim=1), b.norm(dim=1)
    cos = (a * b).sum(1) / (na * nb).clamp_min(1e-300)
    both_zero = (na == 0) & (nb == 0)
    return torch.where(both_zero, torch.ones_like(cos), cos.clamp(-1.0, 1.0))


def linearity(model: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d, coef) per example: d = 1 - cos(F, G), coef = ||F|| cos(F, G) / ||G||."""
    import torch

    f, g = model.reshape(len(model), -1).to(torch.float64), target.reshape(len(target), -1).to(torch.float64)
    cos = cosine_rows(f, g)
    gn = g.norm(dim=1)
    coef = torch.where(gn > 0, f.norm(dim=1) * cos / gn.clamp_min(1e-300), torch.ones_like(cos))
    return 1.0 - cos, coef


def ctl_terms(f_mix: torch.Tensor, f_i: torch.Tensor, f_j: torch.Tensor, alpha: float) -> dict[str, torch.Tensor]:
    """Claim 1 at one layer: d = 1 - cos(f(theta_alpha), alpha f_i + (1 - alpha) f_j), its coef, and the baseline
    1 - cos(f_i, f_j), per example."""
    d, coef = linearity(f_mix, combine([(alpha, f_i), (1 - alpha, f_j)]))
    return {"d": d, "coef": coef, "baseline": 1.0 - cosine_rows(f_i, f_j)}


def average_terms(f_avg: torch.Tensor, fs: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Claim 3 (seed eq. 1): f(mean theta) against mean f(theta_t); baseline mean_t (1 - cos(f(mean theta),
    f(theta_t)))."""
    import torch

    k = len(fs)
    d, coef = linearity(f_avg, combine([(1 / k, f) for f in fs]))
    return {"d": d, "coef": coef, "baseline": torch.stack([1.0 - cosine_rows(f_avg, f) for f in fs]).mean(0)}


def addition_terms(f_sum: torch.Tensor, f_2i: torch.Tensor, f_2j: torch.Tensor) -> dict[str, torch.Tensor]:
    """Claim 4 (seed eq. 2): f(theta0 + lam (tau_i + tau_j)) against (f(theta0 + 2 lam tau_i) + f(theta0 + 2 lam tau_j))
    / 2."""
    d, coef = linearity(f_sum, combine([(0.5, f_2i), (0.5, f_2j)]))
    return {"d": d, "coef": coef, "baseline": 1.0 - cosine_rows(f_2i, f_2j)}


def negation_terms(f_0: torch.Tensor, f_plus: torch.Tensor, f_minus: torch.Tensor) -> dict[str, torch.Tensor]:
    """Claim 5 (seed eq. 3): f(theta0) against (f(theta0 + lam tau) + f(theta0 - lam tau)) / 2."""
    d, coef = linearity(f_0, combine([(0.5, f_plus), (0.5, f_minus)]))
    return {"d": d, "coef": coef, "baseline": 1.0 - cosine_rows(f_plus, f_minus)}


def loss_barrier(loss_i: float, loss_mid: float, loss_j: float) -> float:
    """L(theta_0.5) - (L(theta_i) + L(theta_j)) / 2."""
    return loss_mid - (loss_i + loss_j) / 2


def recovery(avg: Sequence[float], own: Sequence[float], other: Sequence[float]) -> float:
    """sum(avg - other) / sum(own - other): 1 when the stitched average matches each task's own stitched model, 0
    when it is no better than the other task's."""
    den = sum(o - x for o, x in zip(own, other))
    return sum(a - x for a, x in zip(avg, other)) / den if den > 0 else math.nan


def mix(states: Sequence[tuple[float, Mapping[str, torch.Tensor]]]) -> State:
    """sum_k w_k theta_k over floating tensors (the first state's other tensors kept), in the first state's dtype."""
    import torch

    first = states[0][1]
    out = {}
    for k, v in first.items():
        if v.is_floating_point():
            acc = sum(w * s[k].to(torch.float64) for w, s in states)
            out[k] = acc.to(v.dtype)
        else:
            out[k] = v.clone()
    return out


def _wide(t: torch.Tensor) -> torch.Tensor:
    """Detached, in float32 or wider (a float64 model keeps float64: the exactness tests need it)."""
    import torch

    return t.detach().to(torch.promote_types(t.dtype, torch.float32))


def _cpu() -> torch.device:
    import torch

    return torch.device("cpu")


def _hidden(output) -> torch.Tensor:
    """A block's hidden states (a transformers block returns them first in a tuple)."""
    return output[0] if isinstance(output, tuple) else output


@dataclass
class Probe:
    """A model whose layers' outputs are read by forward hooks: ``model(x)`` runs it, ``target`` receives the
    states (a state dict), ``layers`` are the modules whose outputs are f_l, and ``pools`` (per layer, when given)
    make f_l of an output: a text model's pooled tokens (seed 003's T5 features); without them f_l is every token's
    output, flattened (the ViT's)."""

    model: nn.Module
    target: nn.Module
    layers: list[nn.Module]
    batch_size: int = 512
    device: torch.device = field(default_factory=_cpu)
    pools: list[Callable] | None = None
    reading: str = "block l's output, every token, flattened"  # what f_l is, for the report
    names: list[str] | None = None  # the layers' names in the figures (None: block 0, block 1, ...)

    def load(self, state: Mapping[str, torch.Tensor]) -> None:
        self.target.load_state_dict(dict(state))

    @no_grad
    def run(
        self,
        state: Mapping[str, torch.Tensor] | None,
        x: torch.Tensor,
        *,
        replace: tuple[int, torch.Tensor] | None = None,
        keep: Sequence[int] | None = None,
        raw: bool = False,
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(f_l for l in ``keep`` (default all), each [N, features] in the model's dtype (at least float32), and the
        model's output) on ``x``; ``raw``: every token's output instead of the pooled feature (a text model's padded
        to x's length: a batch's tokens are cut after its longest example);
        ``replace`` = (l, F): layer l's output is replaced by F, a raw output (stitching)."""
        import torch

        if state is not None:
            self.load(state)
        self.model.eval()
        keep = list(range(len(self.layers))) if keep is None else list(keep)
        feats: dict[int, list[torch.Tensor]] = {i: [] for i in keep}
        outs, handles, batch = [], [], {}
        text = self.pools is not None

        def hook(i):
            def fn(_module, _inputs, output):
                hidden = _hidden(output)
                if replace is not None and replace[0] == i:
                    new = replace[1][batch["lo"] : batch["hi"]]
                    new = new.reshape(len(new), -1, hidden.shape[-1])[:, : hidden.shape[1]] if text else new
                    hidden = new.reshape(hidden.shape).to(device=hidden.device, dtype=hidden.dtype)
                    output = (hidden, *output[1:]) if isinstance(output, tuple) else hidden
                if i in feats:
                    if text and not raw:
                        feats[i].append(_wide(self.pools[i](output)).cpu())
                    else:
                        tokens = (
                            torch.nn.functional.pad(hidden, (0, 0, 0, x.shape[1] - hidden.shape[1])) if text else hidden
                        )
                        feats[i].append(_wide(tokens).reshape(len(tokens), -1).cpu())
                return output

            return fn

        for i, layer in enumerate(self.layers):
            handles.append(layer.register_forward_hook(hook(i)))
        try:
            for lo in range(0, len(x), self.batch_size):
                batch["lo"], batch["hi"] = lo, min(lo + self.batch_size, len(x))
                outs.append(_wide(self.model(x[lo : batch["hi"]].to(self.device))).cpu())
        finally:
            for h in handles:
                h.remove()
        return [torch.cat(feats[i]) for i in keep], torch.cat(outs)
