"""dvc.lock after plain DVC's in-place write was cut short (a kill, a full disk): empty, unparseable, or cut at a
point where it still parses. `mergeflow check` / `mergeflow repro` (lockfile.recover) recognise each, keep the
lock's whole entries and take the rest from the last whole copy; a whole lock is never taken for a cut one."""

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mergeflow.core import lockfile
from mergeflow.core.errors import MergeflowError

DVC = os.path.join(os.path.dirname(sys.executable), "dvc")
REPO = Path(__file__).resolve().parents[1]

MAKE = """\
import os, sys
from pathlib import Path
if sys.argv[1] == "one":
    Path("a.txt").write_text(Path("in.txt").read_text())
else:
    item = sys.argv[2]
    os.makedirs(f"d/{item}", exist_ok=True)
    os.makedirs("m", exist_ok=True)
    Path(f"d/{item}/f").write_text(Path("a.txt").read_text() + item)
    Path(f"m/{item}.json").write_text("{}")
"""
DVC_YAML = f"""\
stages:
  one:
    cmd: {sys.executable} make.py one
    deps: [in.txt, make.py]
    params: [x, y]
    outs: [a.txt]
  two:
    foreach: [p, q]
    do:
      cmd: {sys.executable} make.py two ${{item}}
      deps:
        - a.txt
      params:
        - y
      outs:
        - d/${{item}}
      metrics:
        - m/${{item}}.json:
            cache: false
"""


def _dvc(root, *args):
    return subprocess.run([DVC, *args], cwd=root, capture_output=True, text=True)


@pytest.fixture
def project(tmp_path):
    root = tmp_path / "p"
    root.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    assert _dvc(root, "init", "-q").returncode == 0
    (root / "dvc.yaml").write_text(DVC_YAML)
    (root / "make.py").write_text(MAKE)
    (root / "params.yaml").write_text("x: 1\ny: {a: 1, b: [2, 3]}\n")
    (root / "in.txt").write_text("1")
    proc = _dvc(root, "repro")
    assert proc.returncode == 0, proc.stderr
    return root


def _line_ends(text: str) -> list[int]:
    return [i + 1 for i, c in enumerate(text) if c == "\n" and i + 1 < len(text)]


def test_every_cut_that_still_parses_is_recognised_and_mended_to_the_whole_lock(project):
    whole = (project / "dvc.lock").read_text()
    assert lockfile.recover(project) is None and lockfile.good_copy(project).read_text() == whole
    assert lockfile.cut_short(whole, project, whole) is None
    parsing = [t for t in [whole[:i] for i in range(1, len(whole))] if lockfile.readable(t)]
    assert len(parsing) > 50  # most cuts of a YAML file still parse
    missed = [len(t) for t in parsing if lockfile.cut_short(t, project, whole) is None]
    assert missed == []
    for cut in [whole[:i] for i in _line_ends(whole)[::3]] + [whole[:-1]]:
        (project / "dvc.lock").write_text(cut)
        notice = lockfile.recover(project)
        assert notice and "cut short" in notice or "unreadable" in notice, cut
        assert (project / "dvc.lock").read_text() == whole, f"not mended from a cut at {len(cut)}"


def test_a_cut_write_of_a_newer_lock_keeps_its_whole_entries(project):
    """Plain `dvc repro` after a change writes the lock once per stage: killed in the write of a later stage, the
    entries it had finished are kept, and DVC reruns only what lost its record."""
    assert lockfile.recover(project) is None  # the good copy: the first run's
    (project / "in.txt").write_text("2")
    assert _dvc(project, "repro", "-q", "one").returncode == 0
    newer = (project / "dvc.lock").read_text()
    start = newer.index("  two@q:")  # a cut in the write of two@q's entry, after one's new entry
    (project / "dvc.lock").write_text(newer[: start + newer[start:].index("    outs:")])
    assert "cut short" in lockfile.recover(project)
    mended = yaml.safe_load((project / "dvc.lock").read_text())["stages"]
    assert mended["one"] == yaml.safe_load(newer)["stages"]["one"]  # the record the run finished is kept
    status = _dvc(project, "status", "--json")
    assert status.returncode == 0 and "one" not in status.stdout


def test_a_whole_lock_is_not_taken_for_a_cut_one(project):
    whole = (project / "dvc.lock").read_text()
    assert lockfile.recover(project) is None
    # dvc.yaml edited since (a dep added to the last stage): the entry is the good copy's, so not cut
    (project / "dvc.yaml").write_text(
        (project / "dvc.yaml").read_text().replace("        - a.txt\n", "        - a.txt\n        - in.txt\n")
    )
    assert lockfile.cut_short(whole, project, whole) is None
    assert lockfile.recover(project) is None and (project / "dvc.lock").read_text() == whole


def test_the_repositorys_own_lock_is_whole_and_its_cuts_are_not(repo_root):
    whole = (repo_root / "dvc.lock").read_text()
    assert lockfile.cut_short(whole, repo_root, whole) is None
    cuts = [whole[:i] for i in random.Random(0).sample(_line_ends(whole), 10)] + [
        whole[:i] for i in random.Random(1).sample(range(1, len(whole)), 10)
    ]
    missed = [len(t) for t in cuts if lockfile.readable(t) and lockfile.cut_short(t, repo_root, whole) is None]
    assert missed == []


def test_a_cut_lock_with_nothing_to_mend_it_from_is_one_line(project):
    whole = (project / "dvc.lock").read_text()
    (project / "dvc.lock").write_text(whole[: whole.index("  two@q:")] + "  two@q:\n    cmd: x\n")
    lockfile.good_copy(project).unlink(missing_ok=True)
    # no good copy: the count check needs one, but an entry with no deps' hashes is cut all the same
    (project / "dvc.lock").write_text(
        whole[: whole.index("  two@q:") + whole[whole.index("  two@q:") :].index("      hash: md5")]
    )
    with pytest.raises(
        MergeflowError, match=r"dvc.lock: cut short \(stage two@q: deps entry a.txt has no hash\) and no good copy"
    ):
        lockfile.recover(project)


def test_an_empty_lock_as_a_full_disk_leaves_it_comes_back(project):
    whole = (project / "dvc.lock").read_text()
    assert lockfile.recover(project) is None
    (project / "dvc.lock").write_text("")
    assert "unreadable (0 bytes" in lockfile.recover(project)
    assert (project / "dvc.lock").read_text() == whole and _dvc(project, "status").returncode == 0


def _run_and_commit(root, commit) -> None:
    """New inputs, then each stage's command run by hand and recorded by ``commit(address)``."""
    (root / "in.txt").write_text("2")
    for address, args in (("one", ["one"]), ("two@p", ["two", "p"]), ("two@q", ["two", "q"])):
        subprocess.run([sys.executable, "make.py", *args], cwd=root, check=True)
        commit(address)


def test_commits_that_skip_reading_their_own_lock_write_dvcs_own_bytes(project, tmp_path, monkeypatch):
    """mergeflow's commits read dvc.lock with DVC's round-trip reader only when this process did not write the
    file as it stands (lockfile._modify_lock); the lock they leave is byte for byte the one plain `dvc commit`
    leaves after the same work."""
    import shutil

    from dvc.utils.serialize import _yaml

    from mergeflow.runner.graph import commit_stage, locked_repo

    plain = tmp_path / "plain"
    shutil.copytree(project, plain)
    _run_and_commit(plain, lambda address: subprocess.run([DVC, "commit", "-f", "-q", address], cwd=plain, check=True))

    monkeypatch.chdir(project)  # as `mergeflow repro` runs
    reads = []
    original = _yaml.parse_yaml_for_update
    monkeypatch.setattr(_yaml, "parse_yaml_for_update", lambda text, path: reads.append(path) or original(text, path))
    with locked_repo(project) as repo:
        _run_and_commit(project, lambda address: commit_stage(repo, address))
    assert len(reads) == 1  # the first commit's; the next two read what it wrote back with libyaml
    assert (project / "dvc.lock").read_text() == (plain / "dvc.lock").read_text()
    assert lockfile._written == {}  # forgotten when the context ends


def test_a_lock_changed_between_commits_is_read_again(project, monkeypatch):
    """A dvc.lock that changed after mergeflow's last write (here: a comment someone added) is read as it is now:
    DVC's round-trip reader keeps the comment through the next commit."""
    from mergeflow.runner.graph import commit_stage, locked_repo

    monkeypatch.chdir(project)
    with locked_repo(project) as repo:
        (project / "in.txt").write_text("3")
        subprocess.run([sys.executable, "make.py", "one"], cwd=project, check=True)
        commit_stage(repo, "one")
        lock = project / "dvc.lock"
        lock.write_text("# kept by hand\n" + lock.read_text())
        subprocess.run([sys.executable, "make.py", "two", "p"], cwd=project, check=True)
        commit_stage(repo, "two@p")
    text = lock.read_text()
    assert text.startswith("# kept by hand\n")
    assert (
        yaml.safe_load(text)["stages"]["two@p"]["deps"][0]["md5"]
        == yaml.safe_load(text)["stages"]["one"]["outs"][0]["md5"]
    )


def test_libyaml_writes_what_dvcs_dumper_writes_or_leaves_it_to_dvc():
    """lockfile._libyaml_dump: the bytes of DVC's ruamel dumper for what it accepts (the repository's own lock
    included), None for what the two could write or read back differently."""
    import collections
    import io

    from dvc.utils.serialize._yaml import _dump

    def dvc_text(data):
        stream = io.StringIO()
        _dump(data, stream)
        return stream.getvalue()

    accepted = [
        lockfile.parse((REPO / "dvc.lock").read_text()),
        {
            "schema": "2.0",
            "stages": {
                "s@x": {
                    "cmd": "mergeflow merge",
                    "params": {"params.yaml": {"a.b": None, "c": [1, 2.5, True, "2.0", "a b"], "d": {}, "e": []}},
                }
            },
        },
        {
            "outs": [
                {
                    "path": "m/x.json",
                    "hash": "md5",
                    "md5": "0f1762dc8a0b5499597d66583e5d3076.dir",
                    "size": 40229,
                    "nfiles": 11,
                }
            ]
        },
        {"stages": {"one": collections.OrderedDict([("cmd", "python make.py one"), ("deps", [])])}},  # DVC's entries
    ]
    for data in accepted:
        assert lockfile._libyaml_dump(data) == dvc_text(data)
    # 1.1 against 1.2 (yes, 1e5, 0o7, 1:30), exponents, None in a list, long or quoted-by-style strings
    for value in ("yes", "1e5", "0o7", "1:30", 1e-05, float("inf"), "x" * 61, "a: b", "", "é"):
        assert lockfile._libyaml_dump({"k": value}) is None, value
    assert lockfile._libyaml_dump({"k": [None]}) is None
    assert lockfile._libyaml_dump({"k": [1, None]}) is None
