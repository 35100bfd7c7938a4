"""Every study names each of its claims: the short name is the claim's column in MLflow's studies view
(``verdict.<name>``), where every study's runs share one table, so names are unique across studies. The claim ids a
study can return are read from its source (each ``Claim("<id>", ...)`` and the ids passed to its claim helpers),
an independent route to the registry's table."""

import re
from pathlib import Path

from mergeflow.studies import REGISTRY

STUDIES = Path(__file__).resolve().parents[1] / "src" / "mergeflow" / "studies"
CLAIM_ID = re.compile(r'"((?:0\d\d\.\d+[a-z]?)|(?:knots|opcm|dop)\.\d+)"')


def _ids_in_source(name: str) -> set[str]:
    folder = STUDIES / name
    files = sorted(folder.glob("*.py")) if folder.is_dir() else [STUDIES / f"{name}.py"]
    return {m for f in files for m in CLAIM_ID.findall(f.read_text())}


def test_every_claim_a_study_returns_has_a_short_name():
    for name, study in REGISTRY.items():
        ids = _ids_in_source(name)
        assert ids, name
        assert ids <= set(study.claims), (name, sorted(ids - set(study.claims)))


def test_claim_names_are_unique_identifiers():
    names = [n for study in REGISTRY.values() for n in study.claims.values()]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert [n for n in names if not re.fullmatch(r"[a-z][a-z0-9_]{2,40}", n)] == []
