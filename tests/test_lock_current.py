"""The committed dvc.lock matches the code and params.yaml: every source file and folder a stage depends on, and
every parameter it reads, hashes as dvc.lock records it. A change to the code that a stage depends on comes with
the re-run that records it (`make pipeline`, then commit dvc.lock), so that a fresh clone's `dvc status` shows
only the outputs it has not made yet."""

import json
import subprocess

import yaml

from .conftest import run


def test_the_committed_lock_records_the_current_code_and_params(repo_root, tiny_env):
    proc = run(["dvc", "status", "--json"], repo_root, tiny_env, check=False)
    assert proc.returncode == 0 and proc.stdout.strip().startswith("{"), proc.stderr[-2000:]
    status = json.loads(proc.stdout)  # {} when every stage is up to date; a fresh clone lists its missing outputs
    tracked = set(
        subprocess.run(["git", "ls-files"], cwd=repo_root, capture_output=True, text=True, check=True).stdout.split()
    )

    lock = yaml.safe_load((repo_root / "dvc.lock").read_text())
    outs = [o["path"] for entry in lock["stages"].values() for o in entry.get("outs", [])]

    def related(a: str, b: str) -> bool:
        return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")

    def in_git(path: str) -> bool:
        """Code or configuration: tracked by git and no stage's output (metrics/regime holds a README and outputs)."""
        return (path in tracked or any(f.startswith(path.rstrip("/") + "/") for f in tracked)) and not any(
            related(path, o) for o in outs
        )

    stale = []
    for stage, changes in status.items():
        for change in changes:
            if not isinstance(change, dict):
                stale.append(f"{stage}: {change}")  # e.g. "changed command", "always changed"
                continue
            for path, state in change.get("changed deps", {}).items():
                if isinstance(state, dict):  # params.yaml: {key: modified | new | deleted}
                    stale.append(f"{stage}: {path} {state}")
                elif in_git(path) and state != "deleted":
                    stale.append(f"{stage}: {path} {state}")
    assert not stale, "dvc.lock is behind the code (run `make pipeline` and commit dvc.lock):\n" + "\n".join(stale)
