"""`mergeflow merge-checkpoints` against mergekit's `mergekit-yaml` on the same checkpoint folders: wall time and peak
RSS of each whole process (os.wait4's rusage), several rounds that alternate the two tools so that other load on the
machine hits both alike, min / median / max; then whether the outputs agree (largest absolute difference per
method, or, for DARE-TIES, whose random drops differ, statistics of the merged task vector).

Two checkpoint sets, built once into --cache and reused:
  vit    timm's vit_base_patch16_224 shape, random weights, float32: a base and 4 fine-tunes (base + N(0, 1e-3)),
         343 MB each, as Hugging Face model folders (model.safetensors + a config.json mergekit can read);
         about 2.5 GB with the outputs.
  llama  (--llama-1b) a Llama-shaped model of 1.1B parameters (TinyLlama's shape: 22 layers, hidden 2048,
         vocabulary 32000) in bfloat16, a base and 4 fine-tunes (base + N(0, 2e-3)), each sharded at 1GB as
         huggingface_hub writes them (model-0000i-of-00003.safetensors + index), with a LlamaConfig config.json;
         needs about 16 GB of disk under --cache (11 GB of inputs, two 2.2 GB outputs) and about 5 GB of memory
         while building.

The settings compared (mergeflow computes in float32 and writes the base's dtype; mergekit is told dtype float32
and out_dtype the base's):
  task_arithmetic  mergeflow lam=0.3                          mergekit weight 0.3 per model
  ties             k=0.2 trim_scope=tensor rounding=floor     density 0.2, weight 1, normalize (disjoint mean)
  dare_ties        p=0.9 lam=1                                density 0.1, weight 1, normalize, rescale (l1)
  slerp            t=0.3 space=weights, fine-tunes 1 and 2     base_model fine-tune 1, models 1 and 2, t 0.3

    python bench/merge_checkpoints.py --cache /tmp/ckpt-bench --mergekit /tmp/mkvenv/bin/mergekit-yaml
    python bench/merge_checkpoints.py --cache /tmp/ckpt-bench --mergekit ... --llama-1b --rounds 2 --sets llama
    # a second invocation's rounds, mergekit first (the alternation continued)
    python bench/merge_checkpoints.py --cache /tmp/ckpt-bench --mergekit ... --rounds 1 --mergekit-first

mergekit in a venv of its own that reuses this project's torch:
    python3 -m venv /tmp/mkvenv
    echo $PWD/.venv/lib/python3.11/site-packages > /tmp/mkvenv/lib/python3.11/site-packages/mergeflow_site.pth
    /tmp/mkvenv/bin/pip install mergekit        # 0.1.5 on 2026-11-29, torch left as it is
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

METHODS = {  # name -> (mergeflow's --set, mergekit's method, its global parameters, its per-model ones, models)
    "task_arithmetic": ({"lam": 0.3}, "task_arithmetic", {}, {"weight": 0.3}, 4),
    "ties": (
        {"k": 0.2, "trim_scope": "tensor", "rounding": "floor", "lam": 1.0},
        "ties",
        {},
        {"density": 0.2, "weight": 1.0},
        4,
    ),
    "dare_ties": (
        {"p": 0.9, "seed": 0, "lam": 1.0},
        "dare_ties",
        {"normalize": True},
        {"density": 0.1, "weight": 1.0},
        4,
    ),
    "slerp": ({"t": 0.3, "space": "weights"}, "slerp", {"t": 0.3}, {}, 2),
}
LLAMA = {  # TinyLlama-1.1B's shape
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


# ------------------------------------------------------------------ the checkpoint sets
def _save_folder(folder: Path, state: dict, config: dict, max_shard_size: str) -> None:
    from huggingface_hub import save_torch_state_dict

    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_torch_state_dict(state, tmp, max_shard_size=max_shard_size)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)


def _finetunes(root: Path, base: dict, config: dict, scale: float, shard: str, seed: int) -> None:
    import torch

    for t in range(4):
        if (root / f"ft{t + 1}" / "config.json").is_file():
            continue
        g = torch.Generator().manual_seed(seed + 1 + t)
        state = {k: (v.float() + scale * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in base.items()}
        _save_folder(root / f"ft{t + 1}", state, config, shard)
        del state


def build_vit(root: Path, seed: int = 0) -> None:
    """Base + 4 fine-tunes of vit_base_patch16_224's shape, float32 (mergekit infers the layout from the names)."""
    import timm
    import torch

    if (root / "ft4" / "config.json").is_file():
        return
    torch.manual_seed(seed)
    base = {k: v.float().contiguous() for k, v in timm.create_model("vit_base_patch16_224").state_dict().items()}
    config = {"model_type": "vit", "architectures": ["TimmVisionTransformer"], "torch_dtype": "float32"}
    if not (root / "base" / "config.json").is_file():
        _save_folder(root / "base", base, config, "5GB")
    _finetunes(root, base, config, 1e-3, "5GB", seed)


def build_llama(root: Path, seed: int = 0, layers: int | None = None) -> None:
    """Base + 4 fine-tunes of TinyLlama-1.1B's shape in bfloat16, sharded at 1GB, with LlamaConfig's config.json."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (root / "ft4" / "config.json").is_file():
        return
    config = LlamaConfig(**(LLAMA | ({"num_hidden_layers": layers} if layers else {})))
    config.architectures = ["LlamaForCausalLM"]
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    base = {
        k: (torch.ones(s) if k.endswith("norm.weight") else 0.02 * torch.randn(s, generator=g)).to(torch.bfloat16)
        for k, s in shapes.items()
    }
    config_dict = config.to_dict()
    if not (root / "base" / "config.json").is_file():
        _save_folder(root / "base", base, config_dict, "1GB")
    _finetunes(root, base, config_dict, 2e-3, "1GB", seed)


# ------------------------------------------------------------------ the two commands
def mergeflow_argv(method: str, root: Path, out: Path) -> list[str]:
    options, *_, n = METHODS[method]
    sets = [arg for k, v in options.items() for arg in ("--set", f"{k}={v}")]
    models = [str(root / f"ft{i + 1}") for i in range(n)]
    mergeflow = str(Path(sys.executable).with_name("mergeflow"))
    return [
        mergeflow,
        "merge-checkpoints",
        "--method",
        method,
        *sets,
        "--base",
        str(root / "base"),
        *models,
        "-o",
        str(out),
    ]


def mergekit_config(method: str, root: Path, out_dtype: str) -> dict:
    _, name, parameters, per_model, n = METHODS[method]
    base = root / ("ft1" if method == "slerp" else "base")
    models = [{"model": str(root / f"ft{i + 1}")} | ({"parameters": per_model} if per_model else {}) for i in range(n)]
    config = {"merge_method": name, "base_model": str(base), "models": models, "dtype": "float32"}
    return config | {"out_dtype": out_dtype} | ({"parameters": parameters} if parameters else {})


def timed(argv: list[str]) -> tuple[float, float, str]:
    """Wall seconds and peak RSS (GB) of one process (its own rusage from wait4), and its stderr's last line."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = proc.stderr.read()
    _, status, rusage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed ({proc.returncode}): {(err.strip().splitlines() or ['?'])[-1]}")
    return wall, rusage.ru_maxrss / 1024**2, err


# ------------------------------------------------------------------ do the outputs agree?
def folder_tensors(folder: Path) -> dict:
    """tensor name -> its file, over every safetensors file of a model folder."""
    from safetensors import safe_open

    where = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            where |= dict.fromkeys(f.keys(), path)
    return where


def _tensor(where: dict, key: str):
    from safetensors import safe_open

    with safe_open(str(where[key]), framework="pt") as f:
        return f.get_tensor(key).float()


def compare(ours: Path, theirs: Path, base: Path) -> dict:
    """Largest |ours - theirs| and |theirs| over every tensor, and how many entries differ by more than 1e-6; of
    the merged task vectors (merge - base): the share of nonzero entries and the L2 norm of each, their cosine."""
    import torch

    a, b, z = folder_tensors(ours), folder_tensors(theirs), folder_tensors(base)
    if set(a) != set(b):
        raise RuntimeError(f"different tensors: {sorted(set(a) ^ set(b))[:3]}")
    stats = {"max_abs_diff": 0.0, "max_abs": 0.0, "differ": 0, "nonzero": [0, 0], "sq": [0.0, 0.0], "dot": 0.0, "n": 0}
    for key in a:
        x, y, theta0 = _tensor(a, key), _tensor(b, key), _tensor(z, key)
        diff = (x - y).abs()
        stats["max_abs_diff"] = max(stats["max_abs_diff"], diff.max().item())
        # beyond rounding: 1e-3 of the merged task vector's scale (fine-tunes differ from the base by ~1e-3)
        stats["differ"] += int((diff > 1e-6).sum())
        stats["max_abs"] = max(stats["max_abs"], y.abs().max().item())
        dx, dy = (x - theta0).double(), (y - theta0).double()
        for i, d in enumerate((dx, dy)):
            stats["nonzero"][i] += int(torch.count_nonzero(d))
            stats["sq"][i] += float((d * d).sum())
        stats["dot"] += float((dx * dy).sum())
        stats["n"] += x.numel()
    return {
        "max_abs_diff": stats["max_abs_diff"],
        "max_abs": stats["max_abs"],
        "differ": stats["differ"],
        "entries": stats["n"],
        "nonzero": [c / stats["n"] for c in stats["nonzero"]],
        "norm": [math.sqrt(s) for s in stats["sq"]],
        "cosine": stats["dot"] / (math.sqrt(stats["sq"][0] * stats["sq"][1]) or 1.0),
    }


# ------------------------------------------------------------------ the benchmark
def run_set(
    name: str, root: Path, methods: list[str], rounds: int, mergekit: str | None, out_dtype: str, first: int = 0
) -> list:
    """Every method, ``rounds`` times each tool, alternating (mergeflow first in odd rounds, mergekit in even;
    ``first`` = 1: the other way round, for a second invocation)."""
    import yaml

    rows = []
    for method in methods:
        runs: dict[str, list] = {"mergeflow": [], "mergekit": []}
        outs = {tool: root / f"out-{tool}-{method}" for tool in runs}
        config = root / f"mergekit-{method}.yml"
        config.write_text(yaml.safe_dump(mergekit_config(method, root, out_dtype), sort_keys=False))
        commands = {
            "mergeflow": mergeflow_argv(method, root, outs["mergeflow"]),
            "mergekit": [mergekit, str(config), str(outs["mergekit"])] if mergekit else None,
        }
        for round_ in range(rounds):
            order = ["mergeflow", "mergekit"] if (round_ + first) % 2 == 0 else ["mergekit", "mergeflow"]
            for tool in order:
                if commands[tool] is None:
                    continue
                shutil.rmtree(outs[tool], ignore_errors=True)
                try:
                    wall, rss, _ = timed(commands[tool])
                except RuntimeError as err:  # one tool failing on one method: said, and the others still run
                    print(f"  {name} {method} {tool}: {err}", flush=True)
                    commands[tool] = None
                    continue
                runs[tool].append((wall, rss))
                print(f"  {name} {method} round {round_ + 1} {tool}: {wall:.1f} s, {rss:.2f} GB", flush=True)
        both = all(runs.values())
        agreement = compare(outs["mergeflow"], outs["mergekit"], root / "base") if both else None
        rows.append({"set": name, "method": method, "runs": runs, "agreement": agreement})
        print_table(rows[-1:])  # each method's row as soon as it is measured: a long run cut short keeps them
    return rows


def _spread(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    return " / ".join(format(v, fmt) for v in (min(values), statistics.median(values), max(values)))


def print_table(rows: list) -> None:
    print(
        "\n| set | method | mergeflow wall s (min / median / max) | mergekit wall s | mergeflow peak RSS GB | "
        "mergekit peak RSS GB | agreement |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        mf, mk = row["runs"]["mergeflow"], row["runs"]["mergekit"]
        agreement = row["agreement"]
        if agreement is None:
            said = "-"
        elif row["method"] == "dare_ties":
            said = (
                f"nonzero {agreement['nonzero'][0]:.3f} vs {agreement['nonzero'][1]:.3f}, "
                f"norm {agreement['norm'][0]:.4g} vs {agreement['norm'][1]:.4g}, cosine {agreement['cosine']:.3f}"
            )
        else:
            said = (
                f"max abs diff {agreement['max_abs_diff']:.3g} (max abs {agreement['max_abs']:.3g}); "
                f"{agreement['differ']} of {agreement['entries']} entries differ by > 1e-6"
            )
        print(
            f"| {row['set']} | {row['method']} | {_spread([w for w, _ in mf], '.1f')} | "
            f"{_spread([w for w, _ in mk], '.1f')} | {_spread([r for _, r in mf], '.2f')} | "
            f"{_spread([r for _, r in mk], '.2f')} | {said} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, required=True, help="where the checkpoint sets are built and reused")
    parser.add_argument("--mergekit", default=None, help="the mergekit-yaml executable (without it: mergeflow only)")
    parser.add_argument("--sets", default="vit", help="comma-separated: vit, llama (llama needs --llama-1b)")
    parser.add_argument(
        "--llama-1b",
        action="store_true",
        help="build and time the Llama-shaped 1.1B bf16 set: about 16 GB of disk under --cache",
    )
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated, of " + ", ".join(METHODS))
    parser.add_argument("--rounds", type=int, default=3, help="runs of each tool per method, alternating")
    parser.add_argument("--llama-layers", type=int, default=None, help=argparse.SUPPRESS)  # a quick trial's size
    parser.add_argument(
        "--mergekit-first", action="store_true", help="start each method with mergekit (a second invocation's rounds)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write every run here")
    args = parser.parse_args()
    sets = args.sets.split(",")
    if "llama" in sets and not args.llama_1b:
        parser.error("--sets llama: give --llama-1b (about 16 GB of disk under --cache)")
    methods = args.methods.split(",")
    rows = []
    for name in sets:
        root = args.cache / name
        start = time.perf_counter()
        build_vit(root) if name == "vit" else build_llama(root, layers=args.llama_layers)
        size = sum(p.stat().st_size for p in root.glob("*/*.safetensors") if "out-" not in p.parent.name) / 1e9
        print(f"{name}: {size:.2f} GB of checkpoints in {root}, ready in {time.perf_counter() - start:.0f} s")
        out_dtype = "float32" if name == "vit" else "bfloat16"
        rows += run_set(name, root, methods, args.rounds, args.mergekit, out_dtype, first=int(args.mergekit_first))
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
