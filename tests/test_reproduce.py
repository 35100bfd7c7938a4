"""A fresh clone reproduces the committed dvc.lock: `dvc repro prepare pretrain` on the real params gives the
same data and pretrained model, byte for byte (their hashes in dvc.lock). Minutes on 2 cores, so it runs only with
MERGEFLOW_REPRODUCE=1 (CI sets it after `make test`; `make reproduce` runs it)."""

import os

import pytest
import yaml

from .conftest import run

pytestmark = pytest.mark.skipif(os.environ.get("MERGEFLOW_REPRODUCE") != "1", reason="set MERGEFLOW_REPRODUCE=1 (minutes)")


def _outs(lock: dict, stage: str) -> dict[str, str]:
    # wall times differ run to run; everything else a stage writes must not
    return {o["path"]: o["md5"] for o in lock["stages"][stage]["outs"] if not o["path"].startswith("logs/timing")}


def test_fresh_clone_reproduces_the_committed_lock(tmp_path, repo_root, tiny_env):
    clone = tmp_path / "clone"
    run(["git", "clone", "-q", str(repo_root), str(clone)], tmp_path, tiny_env)
    committed = yaml.safe_load((clone / "dvc.lock").read_text())
    env = tiny_env  # as `make pipeline` runs: no thread count fixed
    run(["dvc", "repro", "prepare", "pretrain"], clone, env)
    rerun = yaml.safe_load((clone / "dvc.lock").read_text())
    # the data are integers and exact anywhere; the trained weights' last bits follow the CPU's vector kernels (torch's
    # and MKL's, chosen by the instruction set), so the lock is for a machine like the one that wrote it
    import torch

    machine = f"torch's CPU kernels here: {torch.backends.cpu.get_cpu_capability()}"
    for stage in ("prepare", "pretrain"):
        assert _outs(rerun, stage) == _outs(committed, stage), f"{stage}'s outputs differ from the committed dvc.lock ({machine})"
