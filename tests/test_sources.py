"""mergeflow.pipeline.sources: the files a merge follows from, read from the imports; and what DVC re-runs when
one method's module changes (only the merges whose modules import it)."""

import hashlib
import json
import subprocess

from .conftest import copy_project, run

from mergeflow.pipeline.sources import PACKAGE, closure, digest, imported_modules, merging_dir, method_sources


def _package(root, files: dict[str, str]):
    for name, text in files.items():
        (root / name).write_text(text)
    return root


def test_imports_are_followed_at_the_top_inside_functions_and_relative(tmp_path):
    pkg = _package(
        tmp_path,
        {
            "__init__.py": "from pkg import shared\n",
            "shared.py": "",
            "a.py": "from pkg._helper import x\n\ndef f():\n    from . import b\n",
            "b.py": "import os\nimport pkg.c\n",
            "c.py": "from .. import elsewhere\n",
            "d.py": "import numpy\n",
            "_helper.py": "x = 1\n",
        },
    )
    assert imported_modules(pkg / "a.py", "pkg.a") == {"pkg._helper", "pkg._helper.x", "pkg", "pkg.b"}
    assert imported_modules(pkg / "__init__.py", "pkg") == {"pkg", "pkg.shared"}
    names = lambda roots: [p.name for p in closure(pkg, "pkg", roots)]  # noqa: E731
    assert names(["pkg.a"]) == [
        "__init__.py",
        "_helper.py",
        "a.py",
        "b.py",
        "c.py",
        "shared.py",
    ]  # pkg: a's `from . import b`
    # a submodule's package runs first (its __init__, and what that imports)
    assert names(["pkg.d"]) == ["__init__.py", "d.py", "shared.py"]
    assert names(["pkg.c"]) == ["__init__.py", "c.py", "shared.py"]


def test_a_method_follows_from_its_module_what_it_imports_and_the_shared_machinery(repo_root):
    package_dir = merging_dir(repo_root)
    ties = {p.name for p in method_sources("ties", package_dir)}
    assert {"ties.py", "__init__.py", "search.py", "binding.py", "_tensors.py"} <= ties and "model_stock.py" not in ties
    assert "breadcrumbs.py" in {
        p.name for p in method_sources("breadcrumbs_ties", package_dir)
    }  # it imports breadcrumbs' masks
    assert {p.name for p in method_sources("iso_c", package_dir)} >= {"iso.py", "tsv_m.py"}
    files = method_sources("model_stock", package_dir)
    recorded = digest(files, package_dir)
    assert (
        set(recorded)
        == {f"mergeflow/ml/merging/{p.name}" for p in files if p.name != "binding.py"}
        | {"mergeflow/pipeline/binding.py"}
        and PACKAGE == "mergeflow.ml.merging"
    )
    import hashlib

    assert (
        recorded["mergeflow/ml/merging/model_stock.py"]
        == hashlib.md5((package_dir / "model_stock.py").read_bytes()).hexdigest()
    )


def test_changing_one_method_reruns_only_the_merges_that_import_it(tmp_path, tiny_reference, tiny_env):
    root = copy_project(tiny_reference[0], tmp_path / "project")
    before = json.loads((root / "sources" / "merge" / "ties.json").read_text())
    with open(
        root / "src" / "mergeflow" / "ml" / "merging" / "model_stock.py", "a"
    ) as f:  # a method the tiny run does not merge with
        f.write("# touched\n")
    with open(root / "src" / "mergeflow" / "ml" / "merging" / "emr.py", "a") as f:
        f.write("# touched\n")
    run(["dvc", "repro", "--single-item", "sources"], root, tiny_env)
    assert json.loads((root / "sources" / "merge" / "ties.json").read_text()) == before
    status = json.loads(
        subprocess.run(
            ["dvc", "status", "--json"], cwd=root, env=tiny_env, capture_output=True, text=True, check=True
        ).stdout
    )
    merges = sorted(s for s in status if s.startswith(("merge@", "regime_merge@")))  # the regimes merge with neither
    assert merges == ["merge@emr"], status
    # a study that looks methods up by name (cart) follows every method; those that merge nothing do not
    studies = sorted(s for s in status if s.startswith("study@"))
    assert studies == ["study@cart"], status
    # a method the regimes merge with (regimes.methods: weight_averaging, task_arithmetic, ties): their merges too
    with open(root / "src" / "mergeflow" / "ml" / "merging" / "ties.py", "a") as f:
        f.write("# touched\n")
    run(["dvc", "repro", "--single-item", "sources"], root, tiny_env)
    status = json.loads(
        subprocess.run(
            ["dvc", "status", "--json"], cwd=root, env=tiny_env, capture_output=True, text=True, check=True
        ).stdout
    )
    assert sorted(s for s in status if s.startswith("regime_merge@")) == [
        "regime_merge@mima",
        "regime_merge@one_epoch",
    ], status


def test_a_study_and_a_regime_follow_from_their_own_modules(repo_root):
    """study@cart follows from the cart package, the studies' registry and the library modules it imports, not from
    another study; regime@mima from
    its module, the registry and the regimes' private machinery (imported by name), not from another regime; and
    dvc.yaml makes each stage depend on its own file."""
    import yaml

    from mergeflow.pipeline.sources import regime_sources, source_dir, study_sources

    src = source_dir(repo_root)
    cart = {p.relative_to(src).as_posix() for p in study_sources("cart", src)}
    assert {
        "studies/__init__.py",
        "studies/cart/__init__.py",
        "studies/cart/report.py",
        "studies/cart/spectra.py",
    } <= cart
    assert not [p for p in cart if p.startswith("studies/mima")]
    # cart merges by method name: the merging registry's every method; mima reads the pipeline's outputs: none
    assert {"ml/merging/__init__.py", "ml/merging/ties.py", "ml/merging/cart.py"} <= cart
    assert not [
        p for p in (q.relative_to(src).as_posix() for q in study_sources("mima", src)) if p.startswith("ml/merging")
    ]
    mima = {p.relative_to(src).as_posix() for p in regime_sources("mima", src)}
    assert {
        "ml/regimes/__init__.py",
        "ml/regimes/mima.py",
        "ml/regimes/_rounds.py",
        "ml/regimes/_finetune.py",
    } <= mima and "ml/regimes/atm.py" not in mima
    recorded = digest(regime_sources("mima", src), src)
    assert (
        recorded["mergeflow/ml/regimes/mima.py"]
        == hashlib.md5((src / "ml" / "regimes" / "mima.py").read_bytes()).hexdigest()
    )
    stages = yaml.safe_load((repo_root / "dvc.yaml").read_text())["stages"]
    assert (
        "sources/study/${item}.json" in stages["study"]["do"]["deps"]
        and "src/mergeflow/studies" not in stages["study"]["do"]["deps"]
    )
    assert (
        "sources/regime/${item}.json" in stages["regime"]["do"]["deps"]
        and "src/mergeflow/ml/regimes" not in stages["regime"]["do"]["deps"]
    )
    assert "sources/regime_merge/${item}.json" in stages["regime_merge"]["do"]["deps"] and not [
        d for d in stages["regime_merge"]["do"]["deps"] if d.startswith("src/")
    ]


def test_a_replicate_follows_the_files_of_the_methods_it_merges(tmp_path, repo_root):
    """sources/replicate.json holds the files of merge.methods' methods alone (what every replicate@<seed> merges
    with): a method outside merge.methods is not in it; and dvc.yaml makes replicate@ depend on it, not on the
    whole merging folder."""
    import yaml

    from mergeflow.params import load_params
    from mergeflow.pipeline import stages

    params = load_params(repo_root / "params.yaml")
    methods = ["ties", "task_arithmetic"]
    params = params.model_copy(update={"merge": params.merge.model_copy(update={"methods": methods})})
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "mergeflow").symlink_to(repo_root / "src" / "mergeflow")
    layout = stages.Layout(project)
    stages.sources(params, layout)
    replicate = json.loads(layout.replicate_sources.read_text())
    expected = {}
    for method in methods:
        expected |= json.loads(layout.method_sources(method).read_text())
    assert replicate == expected and "mergeflow/ml/merging/ties.py" in replicate
    assert "mergeflow/ml/merging/model_stock.py" not in replicate
    deps = yaml.safe_load((repo_root / "dvc.yaml").read_text())["stages"]["replicate"]["do"]["deps"]
    assert "sources/replicate.json" in deps and not [d for d in deps if d.startswith("src/mergeflow/ml/merging")]


def test_statistics_are_computed_only_when_a_method_reads_them(tmp_path, repo_root):
    """sources/statistics.json says whether a method of merge.methods reads the statistics (fisher, regmean: yes;
    ties alone: no); with none, the statistics stage computes nothing and reads no input (an empty project here),
    leaving a note in its folder; dvc.yaml makes the stage follow that file."""
    import yaml

    from mergeflow.params import load_params
    from mergeflow.pipeline import stages

    params = load_params(repo_root / "params.yaml")
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "mergeflow").symlink_to(repo_root / "src" / "mergeflow")
    layout = stages.Layout(project)
    for methods, needed in ((["ties", "fisher", "regmean"], True), (["ties", "task_arithmetic"], False)):
        chosen = params.model_copy(update={"merge": params.merge.model_copy(update={"methods": methods})})
        stages.sources(chosen, layout)
        assert json.loads(layout.statistics_needed.read_text()) == {"needed": needed}
    assert stages.statistics(chosen, layout) == {"examples": {}, "read_by": []}
    folder = layout.statistics(params.suite.tasks[0]).parent
    assert [f.name for f in folder.iterdir()] == ["README.md"] and "computed none" in (folder / "README.md").read_text()
    assert json.loads(layout.metrics("statistics").read_text()) == {"examples": {}, "read_by": []}
    deps = yaml.safe_load((repo_root / "dvc.yaml").read_text())["stages"]["statistics"]["deps"]
    assert "sources/statistics.json" in deps
