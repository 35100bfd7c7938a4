"""`mergeflow verify`: every output dvc.lock records hashed again from its bytes; a byte flipped with size and mtime
kept (which `dvc status` does not see) is named, as is a file missing from or added to a folder output."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mergeflow.core.errors import MergeflowError
from mergeflow.runner.verify import check_outputs, verify

DVC = os.path.join(os.path.dirname(sys.executable), "dvc")
REPO = Path(__file__).resolve().parents[1]
MAKE = """\
import os
from pathlib import Path
os.makedirs("folder/sub", exist_ok=True)
Path("model.bin").write_bytes(bytes(range(256)) * 64)
for i in range(3):
    Path(f"folder/sub/{i}.bin").write_bytes(bytes([i]) * 4096)
Path("folder/top.txt").write_text("top")
Path("metric.json").write_text('{"a": 1}')
"""


@pytest.fixture
def project(tmp_path):
    root = tmp_path / "p"
    root.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run([DVC, "init", "-q"], cwd=root, check=True)
    (root / "make.py").write_text(MAKE)
    (root / "dvc.yaml").write_text(
        f"stages:\n  make:\n    cmd: {sys.executable} make.py\n    deps: [make.py]\n    outs: [model.bin, folder]\n    "
        "metrics:\n      - metric.json:\n          cache: false\n"
    )
    proc = subprocess.run([DVC, "repro"], cwd=root, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return root


def _flip_keeping_size_and_mtime(path: Path, offset: int = 100) -> None:
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    with open(path, "r+b") as f:  # in place: the same inode, as rot or a stray write leaves it
        f.write(data)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def _dvc_status_clean(root: Path) -> bool:
    proc = subprocess.run([DVC, "status", "--json"], cwd=root, capture_output=True, text=True)
    return proc.returncode == 0 and proc.stdout.strip() == "{}"


def test_a_fresh_run_verifies_with_dvcs_own_hashes(project):
    found, read = check_outputs(project)
    assert found == [] and read == 6  # model.bin, 4 files in folder/, metric.json
    assert verify(project).startswith("ok: ")


def test_a_flipped_byte_with_size_and_mtime_kept_is_named(project):
    _flip_keeping_size_and_mtime(project / "model.bin")
    _flip_keeping_size_and_mtime(project / "folder" / "sub" / "1.bin", 7)
    assert _dvc_status_clean(project)  # what DVC sees: nothing changed
    found, _ = check_outputs(project)
    assert [(c.path, c.why, c.stage) for c in found] == [
        ("folder/sub/1.bin", "changed", "make"),
        ("model.bin", "changed", "make"),
    ]
    lines = []
    with pytest.raises(
        MergeflowError,
        match=r"^2 files differ from dvc.lock \(2 changed; each named above\): `dvc repro --force --single-item make` "
        r"\(or the Prefect flow\) makes them again$",
    ):
        verify(project, lines.append)
    assert lines == ["changed: folder/sub/1.bin (stage make)", "changed: model.bin (stage make)"]


def test_many_missing_files_are_one_short_line_and_the_command_goes_with_the_report(project, monkeypatch):
    from mergeflow.runner import verify as verify_module

    found = [verify_module.Changed(f"merge@m{i}", f"merged/m{i}.safetensors", "missing") for i in range(400)]
    monkeypatch.setattr(verify_module, "check_outputs", lambda root: (found, 0))
    lines = []
    with pytest.raises(MergeflowError) as err:
        verify(project, lines.append)
    assert (
        str(err.value)
        == "400 files differ from dvc.lock (400 missing; each named above): the command above (their 400 stages, or "
        "the Prefect flow) makes them again"
    )
    assert len(lines) == 401 and lines[-1] == "to make them again: dvc repro --force --single-item " + " ".join(
        sorted(f"merge@m{i}" for i in range(400))
    )


def test_a_changed_stage_is_named_beside_the_machine_that_wrote_it(project):
    import json

    from mergeflow.core.reproducibility.machine import describe

    written = describe()
    written["cpu"] = {**written["cpu"], "vendor": "GenuineIntel", "model": "Intel(R) Xeon(R) Processor"}
    (project / "provenance.json").write_text(json.dumps({"other": written}))
    _flip_keeping_size_and_mtime(project / "model.bin")
    lines = []
    with pytest.raises(MergeflowError):
        verify(project, lines.append)
    assert lines == [
        "changed: model.bin (stage make)",
        "make: provenance.json has no record of the machine that wrote it",
    ]
    (project / "provenance.json").write_text(json.dumps({"make": written}))
    lines.clear()
    with pytest.raises(MergeflowError):
        verify(project, lines.append)
    assert lines[1].startswith("make: written on Intel(R) Xeon(R) Processor (GenuineIntel;")
    assert (
        "differs in cpu.model: Intel(R) Xeon(R) Processor -> " in lines[2]
        and "cpu.vendor: GenuineIntel -> " in lines[2]
    )


def test_missing_and_added_files_and_the_commands_exit_status(project):
    (project / "folder" / "top.txt").unlink()
    (project / "folder" / "stray.txt").write_text("x")
    (project / "metric.json").unlink()
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run(
        [sys.executable, "-m", "mergeflow.cli", "verify"], cwd=project, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stdout.splitlines() == [
        "added: folder/stray.txt (stage make)",
        "missing: folder/top.txt (stage make)",
        "missing: metric.json (stage make)",
    ]
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("error: 3 files differ from dvc.lock")


def test_what_the_flow_reruns_when_bytes_changed(project):
    """The Prefect flow's use: outputs of stages about to run are not read; a stage whose bytes changed joins the
    stale ones (with what is downstream of it), though DVC sees nothing."""
    from mergeflow.runner.graph import stage_graph, stale_stages

    _flip_keeping_size_and_mtime(project / "model.bin")
    nodes = stage_graph(project)
    assert stale_stages(project, nodes) == set()
    rotted, _ = check_outputs(project)
    assert stale_stages(project, nodes, also={c.stage for c in rotted}) == {"make"}
    assert check_outputs(project, skip={"make"}) == ([], 0)
