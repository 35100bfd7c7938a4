"""Which source files a merge's bytes follow from, so that changing or adding one method re-runs only its merges.

A merge runs its method's module, the merging modules that module imports (at its top or inside a function, read
from the code with ``ast``, transitively), and what every merge runs: the registry (``mergeflow.ml.merging``), the
validation search, and the stage side's binding of data and models (mergeflow.pipeline.binding). The stage ``sources``
writes, for every registered method,
``sources/merge/<method>.json`` ({file: md5} of those files). ``merge@<method>`` depends on its own file, not on
the whole of src/mergeflow/ml/merging: the stage re-runs on any change there (a second), and DVC re-runs only the
merges whose file changed. Modules outside ``mergeflow.ml.merging`` are not followed, as before (the stage code is
not a merge's dependency). The regime merges and the replicates follow the files of the methods params.yaml gives
them (regimes.methods, merge.methods); a study that looks methods up by name follows the whole folder.
"""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

PACKAGE = "mergeflow.ml.merging"
# what every merge runs besides its method: the registry and option checks, the validation search; and, on the
# stage side, the binding of data and models (mergeflow.pipeline.binding, with the merging modules it imports)
SHARED = (PACKAGE, f"{PACKAGE}.search")
BINDING = "mergeflow.pipeline.binding"


def module_file(package_dir: Path, package: str, module: str) -> Path | None:
    """The file of ``module`` (a dotted name inside ``package``, whose folder is ``package_dir``); None if none."""
    if module == package:
        return package_dir / "__init__.py"
    if not module.startswith(package + "."):
        return None
    rel = Path(*module[len(package) + 1 :].split("."))
    for candidate in (package_dir / rel.with_suffix(".py"), package_dir / rel / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_modules(path: Path, module: str) -> set[str]:
    """Every module ``path`` (the module ``module``) imports, anywhere in it: ``from a.b import c`` counts as a.b
    and as a.b.c (c may be a submodule); relative imports resolved."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".")
                base = parts[: len(parts) - node.level + (1 if is_package else 0)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            found.add(origin)
            found |= {f"{origin}.{alias.name}" for alias in node.names}
    return found


def closure(package_dir: Path, package: str, roots: list[str], registries: frozenset[str] = frozenset()) -> list[Path]:
    """The files of ``roots`` and of every module of ``package`` they import, transitively, sorted. A package of
    ``registries`` discovers its modules when imported (``pkgutil.iter_modules``): importing it imports every
    public module of it, which a registry looks up by name at run time."""
    seen: dict[str, Path] = {}
    pending = list(roots)
    while pending:
        name = pending.pop()
        if name in seen or (path := module_file(package_dir, package, name)) is None:
            continue
        seen[name] = path
        parents = [name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)]  # a submodule's packages run first
        discovered = [
            f"{name}.{p.stem}"
            for p in sorted(path.parent.iterdir())
            if name in registries and not p.name.startswith("_") and p.suffix == ".py"
        ]
        pending += [m for m in [*imported_modules(path, name), *parents, *discovered] if m not in seen]
    return sorted(set(seen.values()))


def merging_dir(root: Path) -> Path:
    """The merging modules DVC sees (under source_dir)."""
    return source_dir(root) / "ml" / "merging"


def method_sources(method: str, package_dir: Path) -> list[Path]:
    """The files a merge with ``method`` follows from (its module, what that imports, the shared machinery)."""
    from mergeflow.ml.merging import REGISTRY

    binding = package_dir.parents[1] / "pipeline" / "binding.py"
    roots = [
        *SHARED,
        REGISTRY[method].fn.__module__,
        *sorted(m for m in imported_modules(binding, BINDING) if m.startswith(PACKAGE)),
    ]
    return sorted({*closure(package_dir, PACKAGE, roots), binding})


def source_dir(root: Path) -> Path:
    """src/mergeflow as DVC sees it: the project's (where the project is a clone), else the imported package's."""
    project = root / "src" / "mergeflow"
    return project if project.is_dir() else Path(__file__).resolve().parents[1]


# the registries a study may look methods or regimes up in by name: importing one follows all of its modules
STUDY_REGISTRIES = frozenset({"mergeflow.ml.merging", "mergeflow.ml.regimes", "mergeflow.ml.continual"})


def study_sources(study: str, src: Path) -> list[Path]:
    """The files study@<study> follows from: its module (or its package's modules it imports), the studies'
    registry, and every module of mergeflow they import, transitively (the whole merging or regimes package where
    it imports that registry: it looks methods up by name); not the other studies."""
    from mergeflow.studies import REGISTRY

    return closure(src, "mergeflow", ["mergeflow.studies", REGISTRY[study].fn.__module__], STUDY_REGISTRIES)


def regime_sources(regime: str, src: Path) -> list[Path]:
    """The files regime@<regime> follows from: its module, the registry and every private module of the package
    (the round loop, trainers, checkpoints: the registry imports them by name when first asked for)."""
    from mergeflow.ml.regimes import REGISTRY

    package_dir = src / "ml" / "regimes"
    private = [f"mergeflow.ml.regimes.{p.stem}" for p in sorted(package_dir.glob("_*.py")) if p.stem != "__init__"]
    return closure(
        package_dir, "mergeflow.ml.regimes", ["mergeflow.ml.regimes", REGISTRY[regime].fn.__module__, *private]
    )


def digest(files: list[Path], package_dir: Path) -> dict[str, str]:
    """{path as mergeflow/ml/merging/ties.py: md5 of its bytes}; ``package_dir`` is any folder under src/mergeflow
    (the paths start at src/)."""
    src = next(p for p in (package_dir, *package_dir.parents) if p.name == "mergeflow").parent
    return {f.relative_to(src).as_posix(): hashlib.md5(f.read_bytes()).hexdigest() for f in files}
