"""Put the leaderboard of the last run into README.md: ``python -m mergeflow.readme`` (from the repository root).

The text between the README's two marker lines is replaced by ``results/leaderboard.md`` (the report stage's output)
and one line saying where it came from, so the README shows the run that ``dvc.lock`` records, never typed figures.
When DVC's cache holds the manifest of that ``results`` output, a summary that differs from it is refused.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

from mergeflow.core import lockfile
from mergeflow.core.errors import MergeflowError

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def recorded_results(lock: Path) -> str | None:
    """dvc.lock's hash of the report stage's ``results`` output (``<md5>.dir``), or None."""
    if not lock.is_file():
        return None
    stage = ((lockfile.parse(lock.read_text()) or {}).get("stages") or {}).get("report") or {}
    return next((out.get("md5") for out in stage.get("outs") or [] if out.get("path") == "results"), None)


def render(readme_text: str, summary: Path, lock: Path) -> str:
    """``readme_text`` with the block between the markers replaced by ``summary`` and its provenance."""
    if not summary.is_file():
        raise MergeflowError(f"{summary}: not found (the report stage writes it: run `make pipeline` first)")
    head, begin, rest = readme_text.partition(BEGIN + "\n")
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise MergeflowError(f"README: expected a line '{BEGIN}' followed later by a line '{END}'")
    data = summary.read_bytes()
    md5 = hashlib.md5(data).hexdigest()
    recorded = recorded_results(lock)
    manifest = lock.parent / ".dvc" / "cache" / "files" / "md5" / recorded[:2] / recorded[2:] if recorded else None
    if manifest is not None and manifest.is_file():  # DVC's list of the files in that `results` output
        files = {entry["relpath"]: entry["md5"] for entry in json.loads(manifest.read_text())}
        if files.get(summary.name) != md5:
            raise MergeflowError(
                f"{summary}: not the summary dvc.lock records (results "
                f"{recorded}): run `dvc status`, then `dvc checkout results`"
            )
    dated = datetime.datetime.fromtimestamp(summary.stat().st_mtime, datetime.timezone.utc).date().isoformat()
    source = f"dvc.lock records `results` as `{recorded}`" if recorded else "dvc.lock records no `results` output"
    note = (
        f"<sub>`{summary.parent.name}/{summary.name}` of {dated} (md5 `{md5}`; "
        f"{source}), inserted by `python -m mergeflow.readme`.</sub>\n"
    )
    return f"{head}{begin}\n{data.decode().strip()}\n\n{note}{end}{tail}"


def update(readme: Path, summary: Path, lock: Path) -> str:
    """Rewrite ``readme`` in place (atomically) with the block rendered; returns the new text."""
    text = render(readme.read_text(), summary, lock)
    fd, tmp = tempfile.mkstemp(dir=readme.parent, prefix=f".{readme.name}.tmp-{os.getpid()}-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, readme.stat().st_mode & 0o777)
    os.replace(tmp, readme)
    return text


def main() -> int:
    try:
        update(Path("README.md"), Path("results/leaderboard.md"), Path("dvc.lock"))
    except MergeflowError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_status
    print("README.md: the leaderboard replaced with results/leaderboard.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
