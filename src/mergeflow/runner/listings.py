"""`mergeflow methods` and `mergeflow regimes`: every merging method with the hyperparameters params.yaml makes
effective beside the paper's defaults, and every training-time regime and study with what params.yaml runs."""

from __future__ import annotations

import sys

from mergeflow.core.errors import MergeflowError


def _value(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _values(values, most: int = 8) -> str:
    """A grid, its middle elided when long: [0.05, 0.1, 0.15, ..., 1] (20 values)."""
    shown = [_value(v) for v in values]
    if len(shown) > most:
        return f"[{', '.join(shown[:3])}, ..., {shown[-1]}] ({len(shown)} values)"
    return f"[{', '.join(shown)}]"


def _space(fixed: dict, grid: dict, per_task: dict, method=None) -> str:
    """One method's hyperparameters, one a line: a grid searched on validation, a grid searched per task, or a
    fixed value; with ``method``, each one's default (the value used without validation data) and allowed values."""
    from mergeflow.ml.merging import ANY_NUMBER

    def name(k: str) -> str:
        if method is None:
            return k
        allowed = method.ranges.get(k)
        return f"{k}={_value(method.defaults[k])}" + (
            f" ({allowed})" if allowed is not None and allowed != ANY_NUMBER else ""
        )

    lines = [f"{name(k)}{',' if method else ''} grid {_values(v)}" for k, v in grid.items()]
    lines += [f"{name(k)}{',' if method else ''} per-task grid {_values(v)}" for k, v in per_task.items()]
    lines += [name(k) if method else f"{k}={_value(v)}" for k, v in fixed.items() if k not in per_task]
    return "\n".join(lines) or "(no hyperparameters)"


def methods_table(params, source: str = "params.yaml"):
    """A rich Table: each method, whether merge.methods runs it, the hyperparameters ``params`` makes effective
    (Params.merge.overrides through the method's search_space) and the paper's defaults and grids."""
    from rich.table import Table

    from mergeflow.ml.merging import DATA, REGISTRY

    table = Table(
        title=f"merging methods (* = in merge.methods of {source})"
        if params
        else "merging methods: the papers' defaults",
        show_lines=True,
        title_justify="left",
    )
    table.add_column("method", no_wrap=True)
    if params:
        table.add_column(f"effective ({source})", overflow="fold", ratio=1)
    table.add_column("paper's defaults", overflow="fold", ratio=1)
    for name in sorted(REGISTRY):
        method = REGISTRY[name]
        fixed, grid = method.search_space()
        paper = _space(fixed, grid, method.per_task_space(), method)
        kind = "" if method.kind == "model" else f"\n({method.kind.replace('_', '-')})"
        kind += f"\n(reads {DATA[method.reads]})" if method.reads else ""
        if not params:
            table.add_row(f"{name}{kind}", f"{paper}\n[dim]{method.paper}[/dim]")
            continue
        overrides = params.merge.overrides(name)
        fixed, grid = method.search_space(overrides)
        effective = _space(fixed, grid, method.per_task_space(overrides))
        marked = f"{name} *" if name in params.merge.methods else name
        table.add_row(
            f"{marked}{kind}",
            effective if overrides else f"{effective}\n[dim](the defaults)[/dim]",
            f"{paper}\n[dim]{method.paper}[/dim]",
        )
    return table


def print_methods(params_path: str) -> int:
    from rich.console import Console

    from mergeflow.params import load_params

    try:
        params = load_params(params_path)
    except MergeflowError as err:  # the registry's own defaults still help
        print(f"warning: {err}; showing the papers' defaults only", file=sys.stderr)
        params = None
    console = Console(width=min(Console().width, 120), highlight=False)
    console.print(methods_table(params, params_path))
    return 0


def print_regimes(params_path: str) -> int:
    """Each regime: its paper and defaults; for those regimes.run lists, the variants (with the keyword arguments
    the regime function gets) and the methods they are merged with. Then the studies."""
    from mergeflow.params import load_params
    from mergeflow.ml.regimes import REGISTRY as REGIMES
    from mergeflow.studies import REGISTRY as STUDIES

    import shutil
    import textwrap

    def say(text: str, indent: int) -> None:  # wrapped to the terminal, continued lines indented further
        print(
            textwrap.fill(
                text,
                shutil.get_terminal_size((100, 24)).columns,
                initial_indent=" " * indent,
                subsequent_indent=" " * (indent + 4),
                break_on_hyphens=False,
            )
        )

    params = load_params(params_path)
    print(f"regimes (standard is finetune's; * = in regimes.run of {params_path}):")
    for name, regime in sorted(REGIMES.items()):
        running = name in params.regimes.run
        say(f"{name}{' *' if running else ''}: {regime.formula}", 2)
        say(f"[{regime.paper}]", 6)
        if running:
            for variant, kwargs in params.regimes.config(name).variants(name, params.finetune.steps).items():
                shown = ", ".join(f"{k}={v}" for k, v in kwargs.items()) or "one epoch per task"
                say(f"{variant}: {shown}; merged with {', '.join(params.regimes.methods_of(name))}", 6)
    print("studies (* = in studies.run):")
    for name, spec in sorted(STUDIES.items()):
        say(f"{name}{' *' if name in params.studies.run else ''}: {spec.title}", 2)
        say(f"[{spec.paper}]", 6)
    return 0
