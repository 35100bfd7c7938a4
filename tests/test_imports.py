"""An imported checkpoint file (finetune.checkpoints) is a DVC dependency of its fine-tune stage wherever it lives:
imports/<task> links to it (mergeflow.pipeline.imports), finetune@<task> depends on that, and replacing the file re-runs
that stage alone under a plain `dvc repro`."""

import os
import subprocess
import sys
from pathlib import Path

import yaml

from mergeflow.pipeline import imports
from mergeflow.params import parse_params

DVC = os.path.join(os.path.dirname(sys.executable), "dvc")
REPO = Path(__file__).resolve().parents[1]


def _params(tasks, checkpoints):
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["suite"]["tasks"] = tasks
    raw["finetune"]["checkpoints"] = checkpoints
    return parse_params(raw)


def test_each_task_gets_a_link_or_the_placeholder(tmp_path):
    root, outside = tmp_path / "repo", tmp_path / "elsewhere" / "digits.safetensors"
    root.mkdir()
    outside.parent.mkdir()
    outside.write_bytes(b"weights")
    (root / "ckpt").mkdir()
    (root / "ckpt" / "signs.safetensors").write_bytes(b"inside")
    params = _params(
        ["digits", "signs", "texture", "count"],
        {"digits": str(outside), "signs": "ckpt/signs.safetensors", "count": "hf:org/repo"},
    )
    assert imports.sync(params, root) == ["digits", "signs", "texture", "count"]
    assert os.readlink(root / "imports/digits") == str(outside)  # outside: absolute
    assert (
        os.readlink(root / "imports/signs") == "../ckpt/signs.safetensors"
    )  # inside: relative, moves with the repository
    assert (root / "imports/digits").read_bytes() == b"weights"
    for task in ("texture", "count"):  # fine-tuned here, or from the hub (pinned in params.yaml)
        assert (
            not (root / "imports" / task).is_symlink() and (root / "imports" / task).read_text() == imports.PLACEHOLDER
        )
    assert imports.sync(params, root) == []  # as it should be: untouched
    assert imports.sync(
        _params(["digits", "signs", "texture", "count"], {"signs": "ckpt/signs.safetensors"}), root
    ) == ["digits"]
    assert (root / "imports/digits").read_text() == imports.PLACEHOLDER
    assert not [p for p in (root / "imports").iterdir() if ".tmp-" in p.name]


def test_the_repositorys_placeholders_are_committed_for_its_tasks(repo_root):
    """A fresh clone's plain `dvc repro` finds each fine-tune's dependency (no stage makes it before prepare)."""
    from mergeflow.params import load_params

    tracked = subprocess.run(
        ["git", "ls-files", "imports"], cwd=repo_root, capture_output=True, text=True, check=True
    ).stdout.split()
    tasks = load_params(repo_root / "params.yaml").suite.tasks
    assert sorted(tracked) == sorted(f"imports/{t}" for t in tasks)
    assert all((repo_root / "imports" / t).read_text() == imports.PLACEHOLDER for t in tasks)
    finetune = yaml.safe_load((repo_root / "dvc.yaml").read_text())["stages"]["finetune"]["do"]
    assert "imports/${item}" in finetune["deps"]


def test_replacing_an_imported_file_reruns_its_stage_alone_under_plain_dvc(tmp_path):
    root, outside = tmp_path / "repo", tmp_path / "elsewhere" / "digits.safetensors"
    root.mkdir()
    outside.parent.mkdir()
    outside.write_bytes(b"first")
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run([DVC, "init", "-q"], cwd=root, check=True)
    stage = (
        "import sys, os; t = os.environ['DVC_STAGE'].split('@')[1]; os.makedirs('out', exist_ok=True); "
        "open(f'out/{t}', 'wb').write(open(f'imports/{t}', 'rb').read())"
    )
    (root / "s.py").write_text(stage)
    (root / "dvc.yaml").write_text(
        f"stages:\n  finetune:\n    foreach: [digits, signs]\n    do:\n      cmd: {sys.executable} s.py\n      deps:\n "
        f"       - imports/${{item}}\n      outs:\n        - out/${{item}}\n"
    )
    imports.sync(_params(["digits", "signs"], {"digits": str(outside)}), root)
    assert subprocess.run([DVC, "repro", "-q"], cwd=root).returncode == 0
    assert (root / "out/digits").read_bytes() == b"first"

    replacement = outside.with_name("new.safetensors")
    replacement.write_bytes(b"second")
    os.replace(replacement, outside)  # replaced by a rename, as a download or a copy tool does
    status = subprocess.run([DVC, "status", "--json"], cwd=root, capture_output=True, text=True)
    assert list(yaml.safe_load(status.stdout)) == ["finetune@digits"]
    out = subprocess.run([DVC, "repro"], cwd=root, capture_output=True, text=True).stdout
    assert "Running stage 'finetune@digits'" in out and "Running stage 'finetune@signs'" not in out
    assert (root / "out/digits").read_bytes() == b"second"
    with open(outside, "ab") as f:  # or changed in place
        f.write(b"!")
    status = subprocess.run([DVC, "status", "--json"], cwd=root, capture_output=True, text=True)
    assert list(yaml.safe_load(status.stdout)) == ["finetune@digits"]
