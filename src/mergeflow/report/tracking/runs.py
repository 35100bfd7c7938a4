"""How ``track`` logs a run: once per result (a fingerprint from dvc.lock's entry or the files' md5s), at the
stage's real start and end (logs/timing), through ``_Recorder``; the helpers every kind of run shares."""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import yaml

from mergeflow.core import lockfile
from mergeflow.core.errors import MergeflowError
from mergeflow.core.files import read_json


def _flatten(prefix: str, obj) -> dict[str, str]:
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            out |= _flatten(f"{prefix}.{k}" if prefix else str(k), v)
        return out
    if isinstance(obj, list):
        return {prefix: json.dumps(obj)}
    return {prefix: str(obj)}


def _git_commit(root: Path) -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _sha256(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _md5(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def lock_stages(root: Path) -> dict[str, dict]:
    """dvc.lock's stage entries by name ({} when there is no lock); read with libyaml (1 s of `track` with PyYAML's
    pure-Python reader on the default run's lock)."""
    lock = root / "dvc.lock"
    if not lock.is_file():
        return {}
    try:
        return (lockfile.parse(lock.read_text()) or {}).get("stages", {}) or {}
    except yaml.YAMLError as err:
        raise MergeflowError(
            f"{lock}: not valid YAML ({str(err).splitlines()[0]}); run 'mergeflow check' to restore it"
        ) from None


def fingerprint(entry: Mapping | None, files: list[Path], root: Path) -> str:
    """What identifies a stage item's result: its dvc.lock entry's params and output hashes, timing logs left
    out (a re-run that gives the same outputs in another time is the same result). Without an entry that
    matches the stage's metrics files (no dvc.lock, or a stage re-run but not yet committed), the md5 of the
    files ``track`` reads for it."""
    recorded = {o["path"]: o.get("md5") for o in (entry or {}).get("outs", [])}
    current = all(
        recorded[rel] == _md5(p)
        for p in files
        if p.suffix == ".json" and (rel := p.relative_to(root).as_posix()) in recorded
    )
    if entry and entry.get("outs") and current:
        outs = {o["path"]: o.get("md5") for o in entry["outs"] if not o["path"].startswith("logs/timing/")}
        return _sha256({"params": entry.get("params", {}), "outs": outs})
    return _sha256({p.relative_to(root).as_posix(): _md5(p) for p in files if p.is_file()})


def _out_md5(entry: Mapping | None, path: Path, root: Path) -> str:
    """A file's md5 as dvc.lock records it (no need to read it again), else computed."""
    rel = path.relative_to(root).as_posix()
    for out in (entry or {}).get("outs", []):
        if out["path"] == rel and out.get("md5"):
            return out["md5"]
    return _md5(path)


def stage_times(path: Path, extra_keys: tuple[str, ...] = ()) -> tuple[float, float]:
    """(started, ended) in Unix seconds from a timing file. Files without them (written before stages recorded
    them) give ended = the file's modification time, when the stage wrote it, and started = ended - wall time."""
    timing = read_json(path)
    try:
        wall = float(timing["wall_time_s"]) + sum(float(timing[k]) for k in extra_keys)
    except (KeyError, TypeError, ValueError):
        raise MergeflowError(f"{path}: needs numbers 'wall_time_s'{''.join(f', {k!r}' for k in extra_keys)}") from None
    ended = float(timing.get("ended") or path.stat().st_mtime)
    return float(timing.get("started") or ended - wall), ended


def curve_records(log, source: Path) -> list[dict]:
    """A training log as records [{"step": 0, "loss": ..., "lr": ...}, ...]; the older column form
    {"step": [...], "loss": [...]} is turned into records."""
    if isinstance(log, Mapping) and isinstance(log.get("step"), list):
        keys = list(log)
        return [dict(zip(keys, values)) for values in zip(*(log[k] for k in keys))]
    if isinstance(log, list) and all(isinstance(r, Mapping) and "step" in r for r in log):
        return list(log)
    raise MergeflowError(
        f"{source}: a training log is records [{{'step': ..., 'loss': ...}}, ...] or columns {{'step': [...], ...}}"
    )


def locked_md5s(lock: Mapping[str, dict], root: Path) -> dict[str, str]:
    """Every output file's md5 as dvc.lock records it, by path from the root: a file output's from its entry, the
    files of a directory output from the directory's manifest in DVC's cache (``.dvc/cache/files/md5/ab/cd….dir``;
    a manifest not there is skipped: its files are hashed when needed)."""
    out: dict[str, str] = {}
    cache = root / ".dvc" / "cache"
    for entry in lock.values():
        for o in (entry or {}).get("outs", []) or []:
            md5 = o.get("md5")
            if not md5:
                continue
            if not md5.endswith(".dir"):
                out[o["path"]] = md5
                continue
            for manifest in (cache / "files" / "md5" / md5[:2] / md5[2:], cache / md5[:2] / md5[2:]):  # DVC 3, DVC 2
                if manifest.is_file():
                    try:
                        out |= {f"{o['path']}/{f['relpath']}": f["md5"] for f in json.loads(manifest.read_text())}
                    except (ValueError, KeyError, TypeError):
                        pass
                    break
    return out


class _Hashes:
    """md5s of output files, from dvc.lock (and DVC's cache) where they are current: a regime's weights are not
    read again on every track."""

    def __init__(self, lock: Mapping[str, dict], root: Path):
        self.root, self.lock, self._locked = root, lock, None

    def __call__(self, files: list[Path]) -> dict[str, str]:
        """{path from the root: md5} of those of ``files`` that exist: dvc.lock's when every one of them is
        recorded there and the JSON files among them match it (the lock is current), else computed."""
        if self._locked is None:
            self._locked = locked_md5s(self.lock, self.root)
        present = {p: p.relative_to(self.root).as_posix() for p in files if p.is_file()}
        current = all(rel in self._locked for rel in present.values()) and all(
            self._locked[rel] == _md5(p) for p, rel in present.items() if p.suffix == ".json"
        )
        return {rel: self._locked[rel] if current else _md5(p) for p, rel in present.items()}


class _Recorder:
    """Logs stage runs into one experiment, skipping those already logged."""

    def __init__(self, client, experiment_id: str, base_tags: dict[str, str]):
        self.client, self.experiment_id, self.base_tags = client, experiment_id, base_tags
        self.stage_runs: dict[str, str] = {}  # stage item -> its run id (new or already there)
        self.fingerprints: dict[str, str] = {}
        self.new_runs: list[str] = []

    def _find_run(self, tag: str, value: str):
        runs = self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.`{tag}` = '{value}' and attributes.status = 'FINISHED'",
            max_results=1,
            order_by=["attributes.start_time DESC"],
        )
        return runs[0] if runs else None

    def find(self, tag: str, value: str) -> str | None:
        run = self._find_run(tag, value)
        return run.info.run_id if run else None

    @contextlib.contextmanager
    def run(
        self, name: str, fp: str, times: tuple[float, float], tags: Mapping[str, str], run_name: str | None = None
    ) -> Iterator[str | None]:
        """A run for stage item ``name`` (a key unique in the pipeline; the UI shows ``run_name``, default
        ``name``) at the stage's real start and end; yields None (nothing to log) when a FINISHED run with
        fingerprint ``fp`` is already there. Such a run gets the tags in ``tags`` it lacks (a run logged by an
        older track: regime=standard), none it has is changed."""
        self.fingerprints[name] = fp
        if existing := self._find_run("mergeflow.fingerprint", fp):
            for key, value in tags.items():
                if key not in existing.data.tags:
                    self.client.set_tag(existing.info.run_id, key, value)
            self.stage_runs[name] = existing.info.run_id
            yield None
            return
        started, ended = times
        run = self.client.create_run(
            self.experiment_id,
            start_time=int(started * 1000),
            run_name=run_name or name,
            tags={**self.base_tags, **tags, "mergeflow.fingerprint": fp},
        )
        run_id = run.info.run_id
        try:
            yield run_id
        except BaseException:
            self.client.set_terminated(run_id, "FAILED")
            raise
        # after everything is logged: a FINISHED run is a complete one (log_model's own end is overwritten here)
        self.client.set_terminated(run_id, "FINISHED", end_time=int(ended * 1000))
        self.stage_runs[name] = run_id
        self.new_runs.append(run_id)

    def log(
        self,
        run_id: str,
        params: Mapping[str, str] = {},
        metrics: Mapping[str, float] = {},
        at: float | None = None,
        history: Mapping[str, list[tuple[int, float]]] = {},
    ) -> None:
        """Parameters, metrics at time ``at`` (the stage's end), and metric histories by step."""
        from mlflow.entities import Metric, Param

        ts = int((at or time.time()) * 1000)
        metrics = {
            k: round(float(v), 3) if k == "wall_time_s" else v for k, v in metrics.items()
        }  # ms: the UI shows every digit
        # a metric that is not defined (gap_recovered when the fine-tunes do not beat the probe) is not logged
        entries = [Metric(k, float(v), ts, 0) for k, v in metrics.items() if v is not None] + [
            Metric(k, float(v), ts, int(step)) for k, points in history.items() for step, v in points
        ]
        params = [Param(k, str(v)) for k, v in params.items()]
        for i in range(0, len(params), 100):  # MLflow's limits per batch: 100 params, 1000 metrics
            self.client.log_batch(run_id, params=params[i : i + 100], synchronous=True)
        for i in range(0, len(entries), 1000):
            self.client.log_batch(run_id, metrics=entries[i : i + 1000], synchronous=True)

    def stored(self, md5: str) -> dict[str, str] | None:
        """The tags of a FINISHED run whose logged weights include a file with this md5, if any."""
        runs = self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.`mergeflow.weights_md5` LIKE '%{md5}%' and attributes.status = 'FINISHED'",
            max_results=1,
        )
        return runs[0].data.tags | {"run_id": runs[0].info.run_id} if runs else None

    def weights(self, run_id: str, files: Mapping[Path, str], artifact_path: Callable[[Path], str]) -> None:
        """Copy weights files (path -> md5) into the run's artifacts, except those the store already holds: the
        run's tag mergeflow.weights_in.<file> names the run that has it."""
        copied = []
        for path, md5 in files.items():
            if holder := self.stored(md5):
                self.client.set_tag(run_id, f"mergeflow.weights_in.{path.stem}", f"runs:/{holder['run_id']}")
                continue
            self.client.log_artifact(run_id, str(path), artifact_path(path))
            copied.append(md5)
        if copied:
            self.client.set_tag(run_id, "mergeflow.weights_md5", " ".join(copied))  # what the next track searches


def _notice(text: str) -> None:
    print(f"MLflow: {text}", flush=True)


SEARCH_PLOT = "plots/search.png"  # one name in every merge run's artifacts
SEARCH_IMAGE = "search"  # and one image key: the runs page's chart view sets the selected runs' searches side by side


def log_search_plot(client, run_id: str, plot: Path) -> None:
    """The merge's validation search plot (logs/merge/<method>.png), logged as the artifact SEARCH_PLOT and as the
    image SEARCH_IMAGE (MLflow's image charts compare runs by an image key; its compare page shows no artifacts)."""
    if not plot.is_file():
        return
    import tempfile

    from PIL import Image

    with tempfile.TemporaryDirectory() as folder:
        copy = Path(folder) / Path(SEARCH_PLOT).name
        shutil.copyfile(plot, copy)
        client.log_artifact(run_id, str(copy), str(Path(SEARCH_PLOT).parent))
    with Image.open(plot) as image:
        client.log_image(run_id, image.convert("RGB"), key=SEARCH_IMAGE, step=0)
