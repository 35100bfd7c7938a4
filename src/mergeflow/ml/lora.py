"""LoRA: low-rank adapters on a backbone's linear layers, trained in place of its weights, and LoRA task vectors
kept as their factors.

Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", ICLR 2022 (arXiv:2106.09685). A frozen weight W0
(out x in) gets the update Delta W = s B A, s = alpha / r, with A (r x in) drawn as nn.Linear draws its weight
(Kaiming-uniform, as peft does) and B (out x r) zero, so that training starts at W0; dropout applies to the
adapter's input only. Every other parameter stays frozen.

A LoRA task vector is stored as its factors, in peft's key layout (``<module>.lora_A.weight``,
``<module>.lora_B.weight``) with the scale, rank and alpha in the file's metadata; ``LoraTaskVector`` forms the dense
Delta W of a tensor only when it is read, so that every merge method takes LoRA task vectors as it takes full ones.
``read_peft_adapter`` reads a peft adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from pathlib import Path

import torch
from torch import nn

from mergeflow.core.errors import MergeflowError
from mergeflow.core.io import StateDict, load_metadata, load_state_dict, save_state_dict, tensor_specs

DEFAULT_TARGETS = ("qkv", "proj", "fc1", "fc2")  # timm ViT: attention qkv and projection, MLP fc1 and fc2
A_KEY, B_KEY = "lora_A.weight", "lora_B.weight"
FORMAT = "lora"  # the metadata's "format" of a factor file
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class AdapterSpec:
    """What to adapt and how: rank r, alpha (scale alpha / r), dropout on the adapter's input, the modules (by the
    last part of their name) and the learning rate (None: the fine-tune's own)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    lr: float | None = None

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoraLinear(nn.Module):
    """base(x) + s B A dropout(x), base frozen."""

    def __init__(self, base: nn.Linear, spec: AdapterSpec, generator: torch.Generator):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.scale = spec.scale
        self.dropout = nn.Dropout(spec.dropout) if spec.dropout > 0 else nn.Identity()
        weight = base.weight
        self.lora_A = nn.Linear(base.in_features, spec.rank, bias=False, device=weight.device, dtype=weight.dtype)
        self.lora_B = nn.Linear(spec.rank, base.out_features, bias=False, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            bound = 1.0 / math.sqrt(base.in_features)  # nn.Linear's (and peft's) Kaiming-uniform with a = sqrt(5)
            self.lora_A.weight.copy_(
                torch.rand(self.lora_A.weight.shape, generator=generator, dtype=torch.float64)
                .mul_(2 * bound)
                .sub_(bound)
            )
            self.lora_B.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(self.dropout(x))) * self.scale


def _modules(net: nn.Module, targets: Sequence[str]) -> list[str]:
    return [
        name
        for name, module in net.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets
    ]


def attach(net: nn.Module, spec: AdapterSpec, *, seed: int) -> list[str]:
    """Wrap every nn.Linear of ``net`` whose name ends in one of ``spec.targets`` in a LoraLinear (A drawn from
    ``seed``, module by module in order) and freeze every other parameter. Returns the adapted modules' names."""
    if spec.rank < 1:
        raise MergeflowError(f"LoRA rank {spec.rank}: expected at least 1")
    names = _modules(net, spec.targets)
    if not names:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in net.named_modules() if isinstance(m, nn.Linear)})
        raise MergeflowError(
            f"LoRA targets {list(spec.targets)} match no linear layer of "
            f"the backbone (its linear layers end in: {', '.join(linear)})"
        )
    net._lora_requires_grad = {n: p.requires_grad for n, p in net.named_parameters()}  # merge_in restores them
    net.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    for name in names:
        parent, _, leaf = name.rpartition(".")
        owner = net.get_submodule(parent) if parent else net
        base = getattr(owner, leaf)
        if spec.rank > min(base.in_features, base.out_features):
            raise MergeflowError(
                f"LoRA rank {spec.rank} exceeds {name}'s dimensions ({base.out_features} x {base.in_features})"
            )
        setattr(owner, leaf, LoraLinear(base, spec, generator))
    return names


def merge_in(net: nn.Module) -> StateDict:
    """Undo ``attach``: each LoraLinear becomes its base layer with W0 + s B A, every parameter as trainable as it
    was before. Returns the factors, keyed as peft keys them (``<module>.lora_A.weight``,
    ``<module>.lora_B.weight``)."""
    factors: StateDict = {}
    for name, module in list(net.named_modules()):
        if not isinstance(module, LoraLinear):
            continue
        a, b = module.lora_A.weight.detach(), module.lora_B.weight.detach()
        factors[f"{name}.{A_KEY}"], factors[f"{name}.{B_KEY}"] = a.clone(), b.clone()
        with torch.no_grad():
            module.base.weight += delta(a, b, module.scale).to(module.base.weight.dtype)
        parent, _, leaf = name.rpartition(".")
        setattr(net.get_submodule(parent) if parent else net, leaf, module.base)
    previous = net.__dict__.pop("_lora_requires_grad", {})
    for name, param in net.named_parameters():
        param.requires_grad_(previous.get(name, True))
    return factors


def delta(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """s B A, in float32 (float64 when a factor is)."""
    dtype = torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32
    return (b.to(dtype) @ a.to(dtype)) * scale


def is_factor(key: str) -> bool:
    return key.endswith("." + A_KEY) or key.endswith("." + B_KEY)


def split_factors(state: Mapping[str, torch.Tensor]) -> tuple[StateDict, StateDict]:
    """(the model's own tensors, the LoRA factors) of a trainer's state that carries both."""
    return {k: v for k, v in state.items() if not is_factor(k)}, {k: v for k, v in state.items() if is_factor(k)}


def adapted_weights(factors: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, str]]:
    """{weight key: (A key, B key)} of the factors."""
    out = {}
    for key in factors:
        if key.endswith("." + A_KEY):
            module = key[: -len(A_KEY) - 1]
            b_key = f"{module}.{B_KEY}"
            if b_key not in factors:
                raise MergeflowError(f"LoRA factors: '{key}' has no '{b_key}'")
            out[f"{module}.weight"] = (key, b_key)
    if 2 * len(out) != len(factors):
        stray = sorted(k for k in factors if k.endswith("." + B_KEY) and f"{k[: -len(B_KEY) - 1]}.weight" not in out)
        raise MergeflowError(f"LoRA factors: '{stray[0] if stray else next(iter(factors))}' has no matching A factor")
    return out


class LoraTaskVector(Mapping[str, torch.Tensor]):
    """A task vector over the model's keys whose adapted weights are s B A and every other tensor zero, each formed
    only when read: a merge reads it as it reads a dense task vector, one tensor at a time."""

    def __init__(
        self,
        factors: Mapping[str, torch.Tensor],
        scale: float,
        model_specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        *,
        source: str,
    ):
        self.factors, self.scale, self.source = dict(factors), scale, source
        self._weights = adapted_weights(self.factors)
        # a dense task vector's dtypes: float64 where the model (or, for an adapted weight, a factor) is, else float32
        wide = {
            k for k, (a, b) in self._weights.items() if torch.float64 in (self.factors[a].dtype, self.factors[b].dtype)
        }
        self._specs = {
            k: (tuple(shape), torch.float64 if dtype == torch.float64 or k in wide else torch.float32)
            for k, (shape, dtype) in model_specs.items()
        }
        for key, (a_key, b_key) in self._weights.items():
            if key not in self._specs:
                raise MergeflowError(f"{source}: adapts '{key}', which the model does not have")
            a, b = self.factors[a_key], self.factors[b_key]
            if not (a.is_floating_point() and b.is_floating_point()) or a.dim() != 2 or b.dim() != 2:
                raise MergeflowError(
                    f"{source}: factors of '{key}' must be floating-point matrices (A {a.dtype} {tuple(a.shape)}, B "
                    f"{b.dtype} {tuple(b.shape)})"
                )
            if a.shape[0] != b.shape[1]:
                raise MergeflowError(
                    f"{source}: factors of '{key}' disagree on the rank: "
                    f"A has {a.shape[0]} rows, B {b.shape[1]} columns"
                )
            want, got = self._specs[key][0], (b.shape[0], a.shape[1])
            if len(want) != 2 or tuple(got) != tuple(want):
                raise MergeflowError(
                    f"{source}: factors of '{key}' give shape {tuple(got)} (rank {a.shape[0]}), expected {tuple(want)}"
                )

    def specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return dict(self._specs)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self._weights:
            a_key, b_key = self._weights[key]
            return delta(self.factors[a_key], self.factors[b_key], self.scale).to(self._specs[key][1])
        shape, dtype = self._specs[key]
        return torch.zeros(shape, dtype=dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    @property
    def adapted(self) -> list[str]:
        return list(self._weights)


def factor_bytes(factors: Mapping[str, torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in factors.values())


def save_adapter(
    path: str | Path, factors: Mapping[str, torch.Tensor], spec: AdapterSpec, metadata: Mapping[str, str] | None = None
) -> None:
    """The factors as one safetensors file (atomically), the scale, rank and alpha in its metadata."""
    meta = dict(metadata or {}) | {
        "format": FORMAT,
        "rank": str(spec.rank),
        "alpha": repr(float(spec.alpha)),
        "scale": repr(spec.scale),
        "targets": json.dumps(list(spec.targets)),
    }
    save_state_dict(path, factors, meta)


def is_adapter(path: str | Path) -> bool:
    return load_metadata(path).get("format") == FORMAT


def load_adapter(path: str | Path) -> tuple[StateDict, float]:
    """(factors, scale) of a file ``save_adapter`` wrote."""
    meta = load_metadata(path)
    if meta.get("format") != FORMAT or "scale" not in meta:
        raise MergeflowError(f"{path}: not a LoRA factor file (its metadata has no format 'lora' with a scale)")
    factors = load_state_dict(path)
    adapted_weights(factors)
    return factors, float(meta["scale"])


def is_peft_adapter(path: str | Path) -> bool:
    """A peft adapter's weights file (``adapter_model.safetensors``, or a safetensors file beside an
    ``adapter_config.json``) or its folder."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    return (folder / "adapter_config.json").exists() and (path.is_dir() or path.suffix == ".safetensors")


def _pattern_value(pattern: Mapping[str, float], module: str, default: float) -> float:
    """peft's ``rank_pattern`` / ``alpha_pattern``: the value of the first key that is the module's name or ends it."""
    for key, value in pattern.items():
        if module == key or module.endswith("." + key):
            return value
    return default


MAX_CONFIG_BYTES = 1 << 20  # an adapter_config.json is a few hundred bytes; a megabyte is no configuration


def _peft_config(path: Path) -> dict:
    """adapter_config.json read and checked: a regular file of at most MAX_CONFIG_BYTES holding a JSON object, a LORA
    adapter (not DoRA, whose magnitudes a LoRA reader would drop), r a whole number from 1, lora_alpha finite, the
    patterns module names to numbers of the same kinds. One line naming the file and the key otherwise."""

    def refuse(why: str) -> MergeflowError:
        return MergeflowError(f"{path}: {why}")

    if not path.is_file():
        raise refuse("not a regular file")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise refuse(
            f"{path.stat().st_size:,} bytes, more than an adapter configuration holds (at most {MAX_CONFIG_BYTES:,})"
        )
    try:
        config = json.loads(path.read_text(encoding="utf-8"), parse_constant=lambda name: float("nan"))
    except (ValueError, RecursionError, UnicodeDecodeError) as err:
        raise refuse(f"not JSON ({type(err).__name__}: {str(err)[:80]})") from None
    if not isinstance(config, dict):
        raise refuse(f"expected a JSON object, got {type(config).__name__}")
    if config.get("peft_type", "LORA") != "LORA":
        raise refuse(f"peft_type {str(config['peft_type'])[:40]!r}, only LORA adapters are read")
    if config.get("use_dora"):
        raise refuse("use_dora: a DoRA adapter's magnitude vectors are not read (only LoRA)")

    def rank(value: Any, key: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise refuse(f"{key}: expected a whole number from 1, got {str(value)[:40]}")
        return value

    def alpha(value: Any, key: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise refuse(f"{key}: expected a finite number, got {str(value)[:40]}")
        return float(value)

    checked = {
        "r": rank(config.get("r"), "r"),
        "lora_alpha": alpha(config.get("lora_alpha"), "lora_alpha"),
        "use_rslora": bool(config.get("use_rslora")),
    }
    for key, kind in (("rank_pattern", rank), ("alpha_pattern", alpha)):
        pattern = config.get(key) or {}
        if not isinstance(pattern, dict):
            raise refuse(f"{key}: expected an object of module names, got {type(pattern).__name__}")
        checked[key] = {str(module): kind(value, f"{key}.{module}") for module, value in pattern.items()}
    return checked


def read_peft_adapter(path: str | Path) -> tuple[StateDict, float]:
    """(factors keyed by the model's module names, scale 1) of a peft LoRA adapter (its folder or its weights file):
    ``adapter_config.json`` (r, lora_alpha, use_rslora, rank_pattern, alpha_pattern) and
    ``adapter_model.safetensors`` (keys ``base_model.model.<module>.lora_A.weight``). Each module's own scale
    (alpha / r, or alpha / sqrt(r) for rsLoRA, from the patterns where they name it) is folded into its B, and each
    A must have that module's rank."""
    path = Path(path)
    directory = path if path.is_dir() else path.parent
    config_path, weights_path = (
        directory / "adapter_config.json",
        path if path.is_file() else directory / "adapter_model.safetensors",
    )
    for needed in (config_path, weights_path):
        if not needed.exists():
            raise MergeflowError(f"{directory}: not a peft adapter folder (no {needed.name})")
        if not needed.is_file():
            raise MergeflowError(f"{needed}: not a regular file")
    config = _peft_config(config_path)
    rank, alpha = config["r"], config["lora_alpha"]
    raw = load_state_dict(weights_path)
    factors = {}
    for key, value in raw.items():
        name = key.removeprefix(PEFT_PREFIX)
        # peft names a factor with its adapter: lora_A.<adapter>.weight in a model, lora_A.weight once saved
        if not is_factor(name):
            raise MergeflowError(f"{weights_path}: tensor '{key}' is not a LoRA factor (lora_A.weight / lora_B.weight)")
        factors[name] = value
    for weight, (a_key, b_key) in adapted_weights(factors).items():
        module = weight[: -len(".weight")]
        r = int(_pattern_value(config["rank_pattern"], module, rank))
        a = float(_pattern_value(config["alpha_pattern"], module, alpha))
        if factors[a_key].shape[0] != r:
            raise MergeflowError(
                f"{weights_path}: '{a_key}' has rank {factors[a_key].shape[0]}, "
                f"adapter_config.json gives {module} rank {r}"
            )
        factors[b_key] = factors[b_key] * (a / math.sqrt(r) if config.get("use_rslora") else a / r)
    return factors, 1.0


def apply_adapter(
    pretrained: Mapping[str, torch.Tensor], factors: Mapping[str, torch.Tensor], scale: float, *, source: str
) -> StateDict:
    """theta0 + s B A on the adapted weights, theta0 elsewhere: an adapter made a fine-tuned model (each module name
    must be the model's own; one line names the first that is not)."""
    tv = LoraTaskVector(factors, scale, tensor_specs(pretrained), source=source)
    for key, (a_key, _) in adapted_weights(factors).items():  # one adapter's rank (concatenated ones may exceed it)
        if not 1 <= factors[a_key].shape[0] <= min(pretrained[key].shape):
            raise MergeflowError(
                f"{source}: factors of '{key}' have rank {factors[a_key].shape[0]}, expected 1 to "
                f"{min(pretrained[key].shape)} (the weight's smaller side)"
            )
    adapted = set(tv.adapted)
    wide = {
        k: torch.float64 if v.dtype == torch.float64 else torch.float32 for k, v in pretrained.items()
    }  # the compute dtype
    return {
        k: (v.to(wide[k]) + tv[k].to(wide[k])).to(v.dtype) if k in adapted else v.clone() for k, v in pretrained.items()
    }


def concatenate(adapters: Sequence[tuple[Mapping[str, torch.Tensor], float]], weights: Sequence[float]) -> StateDict:
    """Task arithmetic on the factors, exactly: sum_t w_t s_t B_t A_t = [w_1 s_1 B_1 | ... | w_T s_T B_T] [A_1; ...;
    A_T], one adapter of rank sum_t r_t and scale 1 (every adapter must adapt the same weights)."""
    keys = [adapted_weights(f) for f, _ in adapters]
    if any(set(k) != set(keys[0]) for k in keys):
        raise MergeflowError("LoRA task arithmetic on the factors: the adapters adapt different weights")
    out = {}
    for weight, (a_key, b_key) in keys[0].items():
        module = weight[: -len(".weight")]
        out[f"{module}.{A_KEY}"] = torch.cat([f[keys[i][weight][0]] for i, (f, _) in enumerate(adapters)], 0)
        out[f"{module}.{B_KEY}"] = torch.cat(
            [f[keys[i][weight][1]] * (w * s) for i, ((f, s), w) in enumerate(zip(adapters, weights))], 1
        )
    return out
