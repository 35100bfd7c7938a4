"""``mergeflow reproduce`` on the tiny reference run: the stages re-run in a scratch copy give the bytes dvc.lock
records (the deterministic mode, on this machine's CPU as when they were written), and the report fails past its
tolerance: a headline metric that moved, bytes that differ (with the machine that wrote them named).

CI's own check of the committed default run is `make reproduce` (the same command on a fresh clone: minutes)."""

from __future__ import annotations

import json

import yaml

from .conftest import copy_project, run


def test_a_rerun_merge_gives_the_recorded_bytes_and_metrics(tmp_path, tiny_reference, tiny_env):
    root = copy_project(tiny_reference[0], tmp_path / "project")
    before = (root / "dvc.lock").read_bytes()
    proc = run(["mergeflow", "reproduce", "merge@task_arithmetic"], root, tiny_env, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "ok: every output the same bytes, every metric within 0 points"
    assert [line.split()[-1] for line in lines if line.startswith(("merged/", "metrics/evaluate/", "logs/merge/"))] == [
        "same"
    ] * 4
    recorded = json.loads((root / "metrics/headline/task_arithmetic.json").read_text())["test_avg"]
    row = next(line.split() for line in lines if line.startswith("merge@task_arithmetic test_avg"))
    assert [float(v) for v in row[2:]] == [recorded, recorded, 0.0]
    assert (root / "dvc.lock").read_bytes() == before  # the workspace as it was


def test_a_moved_metric_and_other_bytes_fail_with_the_machine_named(tmp_path, tiny_reference, tiny_env):
    """One re-run for both failures (each a merge in a scratch copy): a recorded headline 1.5 points from what the
    re-run gives, and a recorded hash it cannot give (as another machine's would be), written by a machine on record."""
    root = copy_project(tiny_reference[0], tmp_path / "project")
    headline = root / "metrics/headline/task_arithmetic.json"
    entry = json.loads(headline.read_text())
    headline.write_text(json.dumps(entry | {"test_avg": entry["test_avg"] + 1.5}))
    lock = yaml.safe_load((root / "dvc.lock").read_text())
    out = next(
        o for o in lock["stages"]["merge@task_arithmetic"]["outs"] if o["path"] == "merged/task_arithmetic.safetensors"
    )
    out["md5"] = "0" * 32
    (root / "dvc.lock").write_text(yaml.safe_dump(lock, sort_keys=False))
    provenance = json.loads((root / "provenance.json").read_text())
    provenance["merge@task_arithmetic"]["cpu"] |= {"vendor": "GenuineIntel", "model": "Intel(R) Xeon(R) Processor"}
    (root / "provenance.json").write_text(json.dumps(provenance))
    proc = run(["mergeflow", "reproduce", "merge@task_arithmetic", "--tolerance", "1"], root, tiny_env, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "merge@task_arithmetic test_avg: -1.50 points" in proc.stderr.splitlines()[-1]
    assert "merged/task_arithmetic.safetensors (stage merge@task_arithmetic): other bytes" in proc.stderr
    assert "merge@task_arithmetic: written on Intel(R) Xeon(R) Processor (GenuineIntel;" in proc.stdout
    assert (
        "differs in cpu.model: Intel(R) Xeon(R) Processor -> " in proc.stdout
        and "cpu.vendor: GenuineIntel -> " in proc.stdout
    )


def test_an_unknown_stage_is_one_line(tmp_path, tiny_reference, tiny_env):
    root = copy_project(tiny_reference[0], tmp_path / "project")
    proc = run(["mergeflow", "reproduce", "merge@nothing"], root, tiny_env, check=False)
    assert (
        proc.returncode == 2
        and proc.stderr.startswith("error: mergeflow reproduce: dvc.yaml has no stage 'merge@nothing'")
        and len(proc.stderr.splitlines()) == 1
    )
