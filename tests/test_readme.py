"""The README's result table is the report stage's summary, put in by mergeflow.readme between the markers."""

import hashlib
import json

import pytest

from mergeflow.core.errors import MergeflowError
from mergeflow.readme import BEGIN, END, update

SUMMARY = "| method | a | avg |\n|---|---|---|\n| task_arithmetic | 71.0 | **71.0** |\n"
LOCK = (
    "schema: '2.0'\nstages:\n  report:\n    cmd: mergeflow report\n    outs:\n    - path: results\n      hash: md5\n   "
    "   md5: 0123456789abcdef0123456789abcdef.dir\n"
)


def _project(tmp_path, summary=SUMMARY):
    (tmp_path / "results").mkdir()
    if summary is not None:
        (tmp_path / "results" / "summary.md").write_text(summary)
    (tmp_path / "dvc.lock").write_text(LOCK)
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nbefore\n{BEGIN}\nplaceholder\n{END}\nafter\n")
    return readme


def test_table_replaced_between_markers(tmp_path):
    readme = _project(tmp_path)
    text = update(readme, tmp_path / "results" / "summary.md", tmp_path / "dvc.lock")
    md5 = hashlib.md5(SUMMARY.encode()).hexdigest()
    head, block = text.split(BEGIN + "\n")
    block, tail = block.split(END)
    assert head == "# title\n\nbefore\n" and tail == "\nafter\n" and readme.read_text() == text
    assert block.startswith("\n" + SUMMARY + "\n<sub>") and "placeholder" not in block
    assert f"md5 `{md5}`" in block and "`0123456789abcdef0123456789abcdef.dir`" in block
    assert update(readme, tmp_path / "results" / "summary.md", tmp_path / "dvc.lock") == text  # idempotent


def test_missing_summary_is_one_line_and_leaves_readme(tmp_path):
    readme = _project(tmp_path, summary=None)
    before = readme.read_text()
    with pytest.raises(MergeflowError, match=r"summary.md: not found"):
        update(readme, tmp_path / "results" / "summary.md", tmp_path / "dvc.lock")
    assert readme.read_text() == before


def test_summary_other_than_the_recorded_one_is_refused(tmp_path):
    readme = _project(tmp_path)
    manifest = tmp_path / ".dvc" / "cache" / "files" / "md5" / "01" / "23456789abcdef0123456789abcdef.dir"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps([{"md5": hashlib.md5(b"another table\n").hexdigest(), "relpath": "summary.md"}]))
    with pytest.raises(MergeflowError, match=r"not the summary dvc.lock records"):
        update(readme, tmp_path / "results" / "summary.md", tmp_path / "dvc.lock")
    manifest.write_text(json.dumps([{"md5": hashlib.md5(SUMMARY.encode()).hexdigest(), "relpath": "summary.md"}]))
    assert SUMMARY in update(readme, tmp_path / "results" / "summary.md", tmp_path / "dvc.lock")
