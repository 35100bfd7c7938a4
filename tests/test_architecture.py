"""The library's layers, read from its own imports: every module of src/mergeflow, flows/ and tasks/ is parsed with
``ast`` (nothing is imported) and its imports, at the top and inside functions alike, must go to its own layer or
to the layers below (``LAYER``), never up, and no chain of imports may come back to where it started.

docs/architecture.md says what each layer holds and where new code goes."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]

# The layers, lowest first: a module may import its own layer and the layers before it.
ORDER = [
    "foundation",
    "config",
    "data",
    "models",
    "training",
    "task vectors",
    "merging",
    "evaluation",
    "studies",
    "params",
    "stages",
    "orchestration",
    "flows",
    "cli",
]

# module -> its layer. A package's entry covers every module under it (the longest entry wins); "mergeflow" is the
# package's own __init__ alone. A new module needs its line here unless its folder's entry covers it (the test says so).
LAYER = {
    "mergeflow": "foundation",  # __version__ and the OpenMP setting, nothing else
    # errors, I/O, paths, the stage table, YAML, dvc.lock, the deterministic mode, processes
    "mergeflow.core": "foundation",
    "mergeflow.config": "config",  # params.yaml's schema, its fields and backbone checks; the environment's settings
    "mergeflow.ml": "data",  # the ML library's own __init__ (a docstring); its modules' layers follow
    "mergeflow.ml.data": "data",  # the task suite: generated, converted, read
    "mergeflow.ml.models": "models",  # the backbone and the heads
    "mergeflow.ml.checkpoints": "models",  # published fine-tunes read without running their pickles
    "mergeflow.ml.weights_header": "models",  # a weights file's naming and shapes from its header alone (no torch)
    "mergeflow.ml.zeroshot": "models",  # CLIP's zero-shot heads
    "mergeflow.ml.mlflow_model": "models",  # a merged model as an MLflow model
    "mergeflow.ml.lora": "models",  # LoRA adapters on the backbone, and LoRA task vectors as their factors
    "mergeflow.ml.text_models": "models",  # the text backbone: a transformers encoder, features only
    "mergeflow.ml.seq2seq_models": "models",  # the text-to-text backbone: an encoder-decoder read at its first token
    "mergeflow.ml.training": "training",  # probe, fine-tuning, pretraining loops
    "mergeflow.ml.probes": "training",  # the linear probe on theta0's features (logistic, ridge)
    "mergeflow.ml.text_training": "training",  # the text backbone's masked-LM pretraining
    "mergeflow.ml.regimes": "training",  # training-time regimes: other ways to make the task models
    "mergeflow.ml.task_vectors": "task vectors",  # tau_t = theta_t - theta0, its statistics, read back for a merge
    "mergeflow.ml.statistics": "task vectors",  # per-task Fisher diagonals and Grams the data-aware methods read
    "mergeflow.ml.merging": "merging",  # the method registry, the methods, the validation search
    "mergeflow.ml.continual": "merging",  # continual merging: update rules (merged, state, new tau) -> (merged, state)
    "mergeflow.ml.evaluation": "evaluation",  # a model scored on every task
    "mergeflow.report": "evaluation",  # the summary table, headline metrics, plots (and tracking, below)
    "mergeflow.studies": "studies",  # the papers' analyses, each a stage study@<name>
    "mergeflow.params": "params",  # params.yaml checked against the registries (methods, regimes, studies)
    "mergeflow.pipeline": "stages",  # the stage functions, the merge's data binding and sources, imported checkpoints
    "mergeflow.report.tracking": "stages",  # the track stage: MLflow records of the other stages' files
    # the stage graph, scheduler, stage servers, checks, plan, verify, reproduce, remote
    "mergeflow.runner": "orchestration",
    "tasks": "flows",  # the Prefect task that runs one stage
    "flows": "flows",  # the Prefect flows
    "mergeflow.cli": "cli",  # the mergeflow command
    "mergeflow.readme": "cli",  # python -m mergeflow.readme
}

# the folders of src/mergeflow and the layers their modules may have: `ls` shows where a thing goes
FOLDERS = {
    "core": {"foundation"},
    "config": {"config"},
    "ml": {"data", "models", "training", "task vectors", "merging", "evaluation"},
    "studies": {"studies"},
    "pipeline": {"stages"},
    "report": {"evaluation", "stages"},
    "runner": {"orchestration"},
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT / "src" if path.is_relative_to(ROOT / "src") else ROOT).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {
    _module_name(p): p
    for base in (ROOT / "src" / "mergeflow", ROOT / "flows", ROOT / "tasks")
    for p in sorted(base.rglob("*.py"))
}


def layer_of(module: str) -> str | None:
    if module == "mergeflow":
        return LAYER["mergeflow"]
    keys = [k for k in LAYER if k != "mergeflow" and (module == k or module.startswith(k + "."))]
    return LAYER[max(keys, key=len)] if keys else None


def _known(name: str) -> str | None:
    """The module ``name`` refers to: itself, or the longest module it is inside of; None when outside the project."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(module: str) -> list[tuple[str, int, bool, bool]]:
    """(imported module, line, inside a function, under ``if TYPE_CHECKING``) for every import of the project's
    modules in ``module``. ``from package import name`` is an import of package.name when that is a module, else
    of the package."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, in_function: bool, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            function = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            typing = typing_only or (isinstance(child, ast.If) and _type_checking(child))
            targets = []
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - (child.level - 1)]
                    base = ".".join(parts + ([child.module] if child.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in child.names]
            for target in targets:
                if (known := _known(target)) and known != module:
                    found.append((known, child.lineno, function, typing))
            visit(child, function, typing)

    tree = ast.parse(path.read_text(), str(path))
    visit(tree, False, False)
    # a registry's discovery (pkgutil.iter_modules(__path__) then importlib.import_module) imports every public
    # module of the package when the package is imported: an import at the top, as Python runs it
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "iter_modules"
    ]
    if path.name == "__init__.py" and calls:
        for sub in sorted(
            p
            for p in path.parent.iterdir()
            if not p.name.startswith("_") and (p.suffix == ".py" or (p / "__init__.py").is_file())
        ):
            found.append((f"{package}.{sub.name.removesuffix('.py')}", calls[0].lineno, False, False))
    return found


def test_every_module_has_a_layer_and_every_entry_a_module():
    assert not [m for m in MODULES if layer_of(m) is None], "add these modules to LAYER"
    assert set(LAYER.values()) <= set(ORDER)
    assert not [k for k in LAYER if k not in MODULES], "LAYER names modules that are gone"


def test_the_folders_show_the_layers():
    src = ROOT / "src" / "mergeflow"
    assert {p.name for p in src.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(FOLDERS)
    wrong = [
        m
        for m in MODULES
        if m.startswith("mergeflow.") and m.split(".")[1] in FOLDERS and layer_of(m) not in FOLDERS[m.split(".")[1]]
    ]
    assert not wrong, f"modules outside their folder's layers: {wrong}"
    flat = sorted(p.name for p in src.glob("*.py"))
    assert flat == ["__init__.py", "cli.py", "params.py", "readme.py"], (
        "a flat module of src/mergeflow is a layer of its own"
    )


def test_no_import_goes_up_a_layer():
    wrong = []
    for module in MODULES:
        for target, line, in_function, _ in imports(module):
            if ORDER.index(layer_of(target)) <= ORDER.index(layer_of(module)):
                continue
            wrong.append(
                f"{MODULES[module].relative_to(ROOT)}:{line}: {module} ({layer_of(module)}) imports {target} "
                f"({layer_of(target)}){'' if in_function else ' at the top'}"
            )
    assert not wrong, "imports against the layers (docs/architecture.md):\n" + "\n".join(dict.fromkeys(wrong))


def _package(module: str) -> str:
    """The package a module belongs to: mergeflow.ml.merging for mergeflow.ml.merging._tensors, mergeflow for
    mergeflow.core.io."""
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def test_no_module_imports_another_packages_private_module():
    """A package's `_` modules are its own: code elsewhere imports the names the package exports."""
    wrong = []
    for module in MODULES:
        for target, line, _, _ in imports(module):
            private = target.rpartition(".")[2].startswith("_") and MODULES[target].name != "__init__.py"
            if private and not (module + ".").startswith(_package(target) + "."):
                wrong.append(f"{MODULES[module].relative_to(ROOT)}:{line}: {module} imports {target}")
    assert not wrong, "private modules imported from outside their package:\n" + "\n".join(dict.fromkeys(wrong))


def test_no_import_circle():
    graph = nx.DiGraph()
    graph.add_nodes_from(MODULES)
    for module in MODULES:
        graph.add_edges_from(
            (module, target) for target, _, _, typing_only in imports(module) if not typing_only
        )  # a type-only import never runs

    # a registry package and its own modules import each other (the package discovers them, they import its
    # ``register``): a circle inside one package is that pattern; one that leaves it is not
    def inside_one_package(c: set[str]) -> bool:
        root = min(c, key=len)
        return MODULES[root].name == "__init__.py" and all(m == root or m.startswith(root + ".") for m in c)

    circles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1 and not inside_one_package(c)]
    described = [
        " -> ".join([*(a for a, _ in nx.find_cycle(graph.subgraph(c))), nx.find_cycle(graph.subgraph(c))[0][0]])
        for c in circles
    ]
    assert not circles, "import circles:\n" + "\n".join(described)


@pytest.mark.parametrize(
    "module, target, in_function, typing_only",
    [
        ("mergeflow.cli", "flows.serve", True, False),  # inside a function: still an import (the CLI may run the flows)
        (
            "mergeflow.ml.data._benchmark_datasets",
            "mergeflow.ml.data.prompts",
            False,
            False,
        ),  # from a package, a module: that module
        ("mergeflow.pipeline.train", "mergeflow.ml.data", False, False),  # from mergeflow.ml import data as data_mod
        ("mergeflow.ml.models", "mergeflow.ml.data", False, True),  # under TYPE_CHECKING
        (
            "mergeflow.studies.provable.report",
            "mergeflow.studies.provable.claims",
            False,
            False,
        ),  # a package's own modules
        ("mergeflow.studies", "mergeflow.studies.ctl", False, False),  # a registry's discovery imports its modules
        ("mergeflow.ml.regimes", "mergeflow.ml.regimes.mima", False, False),
    ],
)
def test_the_walk_reads_imports_as_python_does(module, target, in_function, typing_only):
    assert (target, in_function, typing_only) in {(t, f, c) for t, _, f, c in imports(module)}


def test_no_file_over_500_lines_and_no_function_over_80():
    """Small enough to read at once: a module of at most 500 lines, a function of at most 80."""
    long_files = [
        f"{p.relative_to(ROOT)}: {n} lines" for p in MODULES.values() if (n := len(p.read_text().splitlines())) > 500
    ]
    long_functions = [
        f"{p.relative_to(ROOT)}:{node.lineno}: {node.name}, {node.end_lineno - node.lineno + 1} lines"
        for p in MODULES.values()
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80
    ]
    assert not long_files and not long_functions, "\n".join(long_files + long_functions)
