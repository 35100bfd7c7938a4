"""The committed dvc.lock matches the code and params.yaml: every source file and folder a stage depends on, and
every parameter it reads, hashes as dvc.lock records it. A change to the code that a stage depends on comes with
the re-run that records it (`make pipeline`, then commit dvc.lock), so that a fresh clone's `dvc status` shows
only the outputs it has not made yet."""

import json
import subprocess

from .conftest import run


def test_the_committed_lock_records_the_current_code_and_params(repo_root, tiny_env):
    proc = run(["dvc", "status", "--json"], repo_root, tiny_env, check=False)
    assert proc.returncode == 0 and proc.stdout.strip().startswith("{"), proc.stderr[-2000:]
    status = json.loads(proc.stdout)  # {} when every stage is up to date; a fresh clone lists its missing outputs
    tracked = set(subprocess.run(["git", "ls-files"], cwd=repo_root, capture_output=True, text=True, check=True).stdout.split())

    def in_git(path: str) -> bool:
        return path in tracked or any(f.startswith(path.rstrip("/") + "/") for f in tracked)

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
