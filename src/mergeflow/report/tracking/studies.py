"""What the studies record: a run per study@<s>, its verdicts as metrics and parameters, its report as artifacts."""

from __future__ import annotations

from collections.abc import Mapping

from mergeflow.config import Params
from mergeflow.core.files import read_json
from mergeflow.core.layout import Layout
from mergeflow.report.tracking.runs import _notice, _Recorder, fingerprint, stage_times


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def study_note(study: Mapping) -> str:
    """A study run's description (Markdown): its verdicts, one line per claim."""
    lines = [
        f"**{study['holds']} hold, {study['fails']} fail, {study['not_measured']} not measured.** {study['paper']}",
        "",
        "The report with its figures: artifact `report.md`.",
        "",
        "| claim | verdict | measured |",
        "|---|---|---|",
    ]
    lines += [
        f"| {_cell(c['id'])} `{_cell(c.get('name', ''))}` {_cell(c['claim'])} | **{c['verdict']}** | "
        f"{_cell(c.get('detail', ''))} |"
        for c in study["claims"]
    ]
    return "\n".join(lines)


def _track_studies(params: Params, layout: Layout, rec: _Recorder, lock: Mapping[str, dict]) -> list[tuple[str, str]]:
    """One run per study@<s>: its verdict counts as metrics, each claim's verdict as parameter verdict.<id>, the
    report and its figures as artifacts, the verdicts as its description. Returns (study, run id) in order."""
    out = []
    for s in params.studies.run:
        path, timing, folder = layout.metrics("studies", s), layout.timing("study", s), layout.study(s)
        if not (path.is_file() and timing.is_file()):
            _notice(
                f"study {s} not tracked: {path if not path.is_file() else timing} is missing (study@{s} has not run)"
            )
            continue
        name = f"study@{s}"
        files = [path, *sorted(f for f in folder.rglob("*") if f.is_file())]
        times = stage_times(timing)
        with rec.run(
            name,
            fingerprint(lock.get(name), files, layout.root),
            times,
            {"mergeflow.stage": "study", "mergeflow.item": s, "study": s},
        ) as run_id:
            if run_id:
                study = read_json(path)
                verdicts = {f"verdict.{c.get('name', c['id'])}": c["verdict"] for c in study["claims"]}
                rec.log(
                    run_id,
                    {"study": s, "paper": study["paper"]} | verdicts,
                    {k: study[k] for k in ("holds", "fails", "not_measured")}
                    | {"wall_time_s": read_json(timing)["wall_time_s"]},
                    times[1],
                )
                if folder.is_dir():
                    rec.client.log_artifacts(
                        run_id, str(folder)
                    )  # report.md and its figures, side by side as it links them
                rec.client.log_dict(run_id, study, "study.json")  # every claim's numbers
                rec.client.set_tag(run_id, "mlflow.note.content", study_note(study))
        out.append((s, rec.stage_runs[name]))
    return out
