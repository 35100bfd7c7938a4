"""Study continual's claims, each computed from the runs: holds, fails, or not measured (a method it compares was not
run, or a single task arrived)."""

from __future__ import annotations

from mergeflow.studies import Claim
from mergeflow.studies.continual.measure import Run

BASELINES = ("weight_averaging", "task_arithmetic")


def _points(x: float) -> str:
    return f"{100 * x:.1f}"


def claim_opcm_accuracy(runs: dict[str, Run]) -> Claim:
    text = (
        "OPCM's average accuracy after the last arrival is above sequential weight averaging's and sequential task "
        "arithmetic's (Tang et al. 2025: 5-8 points on CLIP-ViT)"
    )
    if "opcm" not in runs or not all(b in runs for b in BASELINES):
        return Claim("opcm.1", text, None, {}, "needs opcm, weight_averaging and task_arithmetic in methods")
    final = {m: runs[m].average(-1) for m in ("opcm", *BASELINES)}
    best = max(BASELINES, key=final.get)
    margin = final["opcm"] - final[best]
    detail = f"OPCM {_points(final['opcm'])} against {best} {_points(final[best])} (%)"
    numbers = {m: round(v, 4) for m, v in final.items()}
    return Claim("opcm.1", text, margin > 0, numbers, detail, margin)


def claim_opcm_forgetting(runs: dict[str, Run]) -> Claim:
    text = (
        "OPCM forgets less than sequential weight averaging and task arithmetic: its backward transfer is higher "
        "(Tang et al. 2025, BWT tables)"
    )
    if "opcm" not in runs or not all(b in runs for b in BASELINES):
        return Claim("opcm.2", text, None, {}, "needs opcm, weight_averaging and task_arithmetic in methods")
    bwt = {m: runs[m].backward_transfer() for m in ("opcm", *BASELINES)}
    if any(v is None for v in bwt.values()):
        return Claim("opcm.2", text, None, {}, "needs two arrivals or more")
    best = max(BASELINES, key=bwt.get)
    margin = bwt["opcm"] - bwt[best]
    detail = f"BWT OPCM {bwt['opcm'] * 100:+.1f} against {best} {bwt[best] * 100:+.1f} (points)"
    return Claim("opcm.2", text, margin > 0, {m: round(v, 4) for m, v in bwt.items()}, detail, margin)


def claim_dop_accuracy(runs: dict[str, Run]) -> Claim:
    text = "DOP's average accuracy after the last arrival is above OPCM's (DOP, NeurIPS 2025)"
    if "dop" not in runs or "opcm" not in runs:
        return Claim("dop.1", text, None, {}, "needs dop and opcm in methods")
    final = {m: runs[m].average(-1) for m in ("dop", "opcm")}
    margin = final["dop"] - final["opcm"]
    detail = f"DOP {_points(final['dop'])} against OPCM {_points(final['opcm'])} (%)"
    return Claim("dop.1", text, margin > 0, {m: round(v, 4) for m, v in final.items()}, detail, margin)


def claims(runs: dict[str, Run]) -> list[Claim]:
    return [claim_opcm_accuracy(runs), claim_opcm_forgetting(runs), claim_dop_accuracy(runs)]
