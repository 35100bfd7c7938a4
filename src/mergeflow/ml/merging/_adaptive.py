"""AdaMerging's engine (Yang et al. 2024): merging coefficients learned by minimising the Shannon entropy of each
task's predictions on unlabelled inputs of that task, shared by adamerging, adamerging_task and adamerging_cart.

The merged model theta = base + sum_t lam_t,l direction_t,l is evaluated inside the forward
(torch.func.functional_call on the backbone with the merged tensors as its parameters), so each Adam step
differentiates through the merge to the coefficients alone; no state dict is rebuilt or loaded per step.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from mergeflow.core.devices import resident
from mergeflow.core.io import StateDict
from mergeflow.ml.merging._tensors import as_compute


@dataclass
class EntropyObjective:
    """What AdaMerging reads: a backbone of the merged architecture (its own weights are never used), each task's
    frozen head, and each task's unlabelled inputs (the test split by default: test-time adaptation)."""

    backbone: nn.Module  # mergeflow.ml.models.Backbone: normalise() then net
    heads: Mapping[str, nn.Linear]
    inputs: Mapping[str, Mapping[str, torch.Tensor]]  # {split: {task: images}}
    device: torch.device

    def loss(self, params: Mapping[str, torch.Tensor], batches: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Sum over tasks of the mean entropy of that task's head on its batch, the backbone at ``params``."""
        tasks = list(batches)
        images = torch.cat([batches[t] for t in tasks]).to(self.device)
        return self.entropy(self.features(params, images), {t: len(batches[t]) for t in tasks})

    def features(self, params: Mapping[str, torch.Tensor], images: torch.Tensor) -> torch.Tensor:
        """The backbone's features of uint8 ``images`` with ``params`` as its weights (differentiable in them)."""
        dtype = next(iter(params.values())).dtype
        return self.backbone.embed(
            functional_call(self.backbone.net, dict(params), (self.backbone.normalise(images).to(dtype),))
        )

    def entropy(self, features: torch.Tensor, counts: Mapping[str, int]) -> torch.Tensor:
        """Sum over tasks of the mean entropy of each task's head on its rows of ``features`` (``counts``' order)."""
        total = features.new_zeros(())
        for t, f in zip(counts, features.split(list(counts.values()))):
            log_p = torch.log_softmax(self.heads[t](f), -1)
            total = total - (log_p.exp() * log_p).sum(-1).mean()
        return total


class MergedParameters(nn.Module):
    """theta(lam) = base + sum_t lam[t, layer(k)] direction_t[k]: one coefficient per task (task-wise) or per task and
    tensor (layer-wise); a tensor without directions stays at base."""

    def __init__(
        self,
        base: StateDict,
        directions: Mapping[str, StateDict],
        *,
        layer_wise: bool,
        init: float,
        device: torch.device,
    ):
        super().__init__()
        self.tasks = list(directions)
        self.keys = [k for k in base if k in directions[self.tasks[0]]]
        self.base = {k: v.to(device) for k, v in base.items()}
        self.stacked = {k: torch.stack([directions[t][k] for t in self.tasks]).to(device) for k in self.keys}
        dtype = next(iter(self.base.values())).dtype
        self.lam = nn.Parameter(
            torch.full((len(self.tasks), len(self.keys) if layer_wise else 1), float(init), dtype=dtype, device=device)
        )
        self.layer_wise = layer_wise

    def forward(self) -> dict[str, torch.Tensor]:
        out = dict(self.base)
        for i, k in enumerate(self.keys):
            lam = self.lam[:, i if self.layer_wise else 0]
            out[k] = self.base[k] + torch.tensordot(lam, self.stacked[k], dims=1)
        return out

    def coefficients(self) -> dict[str, dict[str, float]]:
        lam = self.lam.detach().cpu()
        names = self.keys if self.layer_wise else ["all"]
        return {t: {n: round(float(lam[i, j]), 6) for j, n in enumerate(names)} for i, t in enumerate(self.tasks)}


def _batches(inputs: Mapping[str, torch.Tensor], batch_size: int, generator: torch.Generator):
    """An endless stream of {task: batch}, each task's inputs reshuffled every pass."""
    orders = {t: torch.randperm(len(x), generator=generator) for t, x in inputs.items()}
    position = dict.fromkeys(inputs, 0)
    while True:
        batch = {}
        for t, x in inputs.items():
            if position[t] + batch_size > len(x):
                orders[t], position[t] = torch.randperm(len(x), generator=generator), 0
            batch[t] = x[orders[t][position[t] : position[t] + batch_size]]
            position[t] += batch_size
        yield batch


def batch_stream(
    inputs: Mapping[str, torch.Tensor], batch_size: int, generator: torch.Generator, *, method: str, split: str
):
    """_batches, after checking that every task has ``batch_size`` inputs (one line naming ``method`` otherwise)."""
    smallest = min(len(x) for x in inputs.values())
    if smallest < batch_size:
        raise ValueError(f"{method}: batch_size {batch_size} is more than the {smallest} {split} inputs of a task")
    return _batches(inputs, batch_size, generator)


def record_timing(data, steps: int, seconds: float, device: torch.device) -> None:
    """A learned method's steps per second, kept apart from its outputs (``MergeData.timing``)."""
    data.timing.append(
        {
            "steps": steps,
            "seconds": seconds,
            "steps_per_second": steps / seconds if seconds else None,
            "device": str(device),
        }
    )


def adapt(
    base: StateDict,
    directions: Mapping[str, StateDict],
    objective: EntropyObjective,
    *,
    layer_wise: bool,
    init: float,
    lr: float,
    steps: int,
    batch_size: int,
    split: str,
    seed: int,
    data,
    parametrise=None,
) -> StateDict:
    """Learn the coefficients with Adam; return the merged model, appending to ``data.learned`` the coefficients and
    the mean entropy per task at every step, and to ``data.timing`` the steps per second (one record per call: a
    search over a grid calls once per candidate). ``parametrise(base, directions, device)``: a module of another
    parametrisation than MergedParameters' (AdaRank's masks), with ``tasks``, ``coefficients()`` and a forward that
    gives the merged tensors; every trainable parameter of it is learned."""
    dtypes = {k: v.dtype for k, v in base.items()}
    base = {k: as_compute(v) for k, v in base.items()}
    directions = {t: {k: as_compute(v) for k, v in d.items()} for t, d in directions.items()}
    dtype = next(iter(base.values())).dtype
    if parametrise is None:
        merged = MergedParameters(base, directions, layer_wise=layer_wise, init=init, device=objective.device)
    else:
        merged = parametrise(base, directions, objective.device)
    objective.backbone.to(device=objective.device, dtype=dtype).eval()
    for head in objective.heads.values():
        head.to(device=objective.device, dtype=dtype).requires_grad_(False)
    inputs = {t: resident(objective.inputs[split][t], objective.device) for t in merged.tasks}  # on CUDA: copied once
    stream = batch_stream(inputs, batch_size, torch.Generator().manual_seed(seed), method="adamerging", split=split)
    optimizer = torch.optim.Adam([p for p in merged.parameters() if p.requires_grad], lr=lr)
    entropy = []
    start = time.perf_counter()
    for _ in range(steps):
        loss = objective.loss(merged(), next(stream))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        entropy.append(round(float(loss.detach()) / len(merged.tasks), 6))
    if objective.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    record = {"layer_wise": layer_wise, "split": split, "coefficients": merged.coefficients(), "entropy": entropy}
    if hasattr(merged, "kept"):  # AdaRank: the singular components each task keeps, per matrix
        record["kept"] = merged.kept()
    data.learned.append(record)
    record_timing(data, steps, seconds, objective.device)
    with torch.no_grad():
        return {k: v.detach().cpu().to(dtypes[k]) for k, v in merged().items()}
