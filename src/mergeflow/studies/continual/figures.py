"""Study continual's figure: the average accuracy over the tasks seen so far after each arrival, per method, and
each method's backward transfer."""

from __future__ import annotations

from pathlib import Path

from mergeflow.studies.continual.measure import Run


def plot_arrivals(runs: dict[str, Run], individual: dict[str, float] | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = next(iter(runs.values())).order
    steps = list(range(1, len(order) + 1))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 5), gridspec_kw={"width_ratios": [2.2, 1]})
    for name, run in runs.items():
        left.plot(steps, [100 * run.average(t) for t in range(len(order))], marker="o", label=name)
    if individual is not None:
        seen = [100 * sum(individual[t] for t in order[:k]) / k for k in steps]
        left.plot(steps, seen, color="black", linestyle="--", label="fine-tuned models (each its own task)")
    left.set_xticks(steps, [f"{k}\n{t}" for k, t in zip(steps, order)], fontsize=7)
    left.set_xlabel("arrival (task)")
    left.set_ylabel("test accuracy, mean over the tasks seen (%)")
    left.set_title("accuracy after each arrival")
    left.grid(alpha=0.3)
    left.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3)
    names = list(runs)
    bwt = [100 * (runs[n].backward_transfer() or 0.0) for n in names]
    right.barh(names, bwt, color=["tab:red" if v < 0 else "tab:green" for v in bwt])
    right.axvline(0, color="black", linewidth=0.8)
    right.invert_yaxis()
    for y, v in enumerate(bwt):
        right.annotate(
            f"{v:+.1f}",
            (v, y),
            xytext=(3 if v >= 0 else -3, 0),
            textcoords="offset points",
            ha="left" if v >= 0 else "right",
            va="center",
            fontsize=8,
        )
    right.margins(x=0.25)
    right.set_xlabel("backward transfer (points)")
    right.set_title("BWT: final minus right after arrival", fontsize=10)
    right.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
