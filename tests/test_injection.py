"""No name from params.yaml, an override or a deployment parameter ever becomes code: every name that reaches a
path, a stage name or a command is a plain word, checked before anything runs, under the CLI, `mergeflow check`,
`dvc repro` and the Prefect flow."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mergeflow.runner.checks import check_interpolations
from mergeflow.params import apply_overrides, parse_params
from mergeflow.core.errors import MergeflowError

from .conftest import make_tiny_project

CANARY = "/tmp/mergeflow-injection-canary"
# the injection found in review, and the usual shell metacharacters, quoting and path tricks
HOSTILE = [
    f"wa;touch {CANARY};#",
    f"$(touch {CANARY})",
    f"`touch {CANARY}`",
    f"x' ; touch {CANARY} ; '",
    f'x" ; touch {CANARY} ; "',
    f"x|touch {CANARY}",
    f"x&&touch {CANARY}",
    f"x&touch {CANARY}",
    f"x>{CANARY}",
    f"x\ntouch {CANARY}",
    "../../etc/passwd",
    "a/b",
    "-rf",
    "with space",
    "${HOME}",
    "x*",
]


def _raw(repo_root) -> dict:
    return yaml.safe_load((repo_root / "params.yaml").read_text())


@pytest.fixture(autouse=True)
def _no_canary():
    Path(CANARY).unlink(missing_ok=True)
    yield
    assert not Path(CANARY).exists(), "a name from the configuration ran as a command"


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_task_names_are_refused_at_load(repo_root, name):
    raw = _raw(repo_root)
    raw["suite"]["tasks"][1] = name
    with pytest.raises(MergeflowError) as err:
        parse_params(raw)
    assert str(err.value).startswith("params.yaml: suite.tasks: task 1: ") and "is not a plain name" in str(err.value)
    assert "\n" not in str(err.value).replace("\\n", "")


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_method_names_are_refused_at_load(repo_root, name):
    raw = _raw(repo_root)
    raw["merge"]["methods"].append(name)
    with pytest.raises(MergeflowError, match=r"^params.yaml: merge.methods: unknown merge method "):
        parse_params(raw)


@pytest.mark.parametrize("field, value", [("model", "vit;rm -rf ~"), ("model", "../x")])
def test_hostile_backbone_names_are_refused(repo_root, field, value):
    raw = _raw(repo_root)
    raw["backbone"][field] = value
    with pytest.raises(MergeflowError, match=r"^params.yaml: backbone.model: String should match pattern"):
        parse_params(raw)


@pytest.mark.parametrize("name", HOSTILE[:6])
def test_a_value_pasted_into_a_command_must_be_a_plain_name(name):
    """A future stage that pastes ${...} into its command, or loops over a list, is checked too."""
    dvc_yaml = {
        "stages": {
            "study": {"cmd": "mergeflow study --name ${study.name}"},
            "regime": {"foreach": "${regimes}", "do": {"cmd": "mergeflow regime"}},
        }
    }
    with pytest.raises(MergeflowError, match=r"study.name \(pasted into the command of stage 'study'\)"):
        check_interpolations(dvc_yaml, {"study": {"name": name}, "regimes": ["standard"]})
    with pytest.raises(MergeflowError, match=r"regimes\[1\] \(stage name 'regime@...'\)"):
        check_interpolations(dvc_yaml, {"study": {"name": "cart"}, "regimes": ["standard", name]})
    check_interpolations(dvc_yaml, {"study": {"name": "cart"}, "regimes": ["standard", "one_epoch"]})


@pytest.mark.parametrize(
    "override",
    [
        f"merge.methods=[task_arithmetic, 'wa;touch {CANARY};#']",
        f"suite.tasks=[digits, '$(touch {CANARY})']",
        f"merge.x;touch {CANARY}=1",
        "merge.ties.k",
    ],
)
def test_hostile_overrides_leave_params_untouched(tmp_path, repo_root, override):
    params = tmp_path / "params.yaml"
    params.write_text((repo_root / "params.yaml").read_text())
    before = params.read_text()
    with pytest.raises(MergeflowError):
        apply_overrides(params, [override])
    assert params.read_text() == before


def test_overrides_keep_the_file_and_its_comments(tmp_path, repo_root):
    params = tmp_path / "params.yaml"
    params.write_text((repo_root / "params.yaml").read_text())
    new = apply_overrides(params, ["merge.ties.k=0.1", "finetune.steps=400"])
    assert new.merge.overrides("ties")["k"] == 0.1 and new.finetune.steps == 400
    original, text = (repo_root / "params.yaml").read_text().splitlines(), params.read_text().splitlines()
    assert [l for l in original if l.strip().startswith("#")] == [l for l in text if l.strip().startswith("#")]
    changed = [(a, b) for a, b in zip(original, text) if a != b]
    assert len(original) == len(text) and [b.strip() for _, b in changed] == [
        "steps: 400",
        "ties: {k: 0.1, trim_scope: global, lam: [0.8, 1.0, 1.2, 1.5, 2.0, 2.5]}",
    ]


@pytest.mark.parametrize(
    "override",
    [
        "merge.ties.k=0.1",
        "suite.tasks=[digits,signs]",
        "backbone.pretrained=weights.safetensors",
        "merge.cart.lam=[1.0,2.0]",
        "runtime.threads=2",
    ],
)
def test_params_yaml_is_in_the_form_dvc_writes(tmp_path, repo_root, override):
    """`dvc exp run -S` rewrites the whole file with its own YAML writer: params.yaml is kept in that form, so
    DVC's rewrite and ours give the same file, and change only the value set."""
    from dvc.utils.hydra import apply_overrides as dvc_apply_overrides

    ours, dvcs = tmp_path / "ours.yaml", tmp_path / "dvc.yaml"
    for path in (ours, dvcs):
        path.write_text((repo_root / "params.yaml").read_text())
    apply_overrides(ours, [override])
    dvc_apply_overrides(str(dvcs), [override])
    assert ours.read_text() == dvcs.read_text()
    original = (repo_root / "params.yaml").read_text().splitlines()
    removed = [l for l in original if l not in dvcs.read_text().splitlines()]
    assert len(removed) == (6 if override.startswith("suite.tasks") else 1), removed


# ---------------------------------------------------------------- through the commands users run
@pytest.fixture(scope="module")
def hostile_project(tmp_path_factory, tiny_env):
    """A fresh tiny project whose params.yaml lists a hostile merge method (its task data is never built)."""
    root = make_tiny_project(tmp_path_factory.mktemp("hostile"), tiny_env)
    raw = yaml.safe_load((root / "params.yaml").read_text())
    raw["merge"]["methods"].append(f"wa;touch {CANARY};#")
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return root, tiny_env


def _one_line_refusal(proc, pattern):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and any(l.startswith("error: ") and pattern in l for l in lines), proc.stderr[
        -2000:
    ]


def test_mergeflow_check_and_repro_refuse(hostile_project):
    root, env = hostile_project
    for cmd in (["mergeflow", "check"], ["mergeflow", "repro"]):
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
        _one_line_refusal(proc, "unknown merge method 'wa;touch")
    assert not (root / "data").exists() and not (root / "dvc.lock").exists()


def test_plain_dvc_repro_runs_no_name_as_code(hostile_project):
    """`dvc repro` itself: the command it runs is `mergeflow prepare`, which refuses the params before writing."""
    root, env = hostile_project
    proc = subprocess.run(["dvc", "repro"], cwd=root, env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "unknown merge method 'wa;touch" in proc.stderr + proc.stdout
    assert not (root / "data").exists()


def test_the_flow_refuses_before_any_stage(hostile_project, prefect_server):
    root, env = hostile_project
    proc = subprocess.run(
        [sys.executable, "-m", "flows.pipeline", "--root", str(root)],
        cwd=root,
        env=env | {"PREFECT_API_URL": prefect_server},
        capture_output=True,
        text=True,
    )
    _one_line_refusal(proc, "unknown merge method 'wa;touch")
    assert not (root / "data").exists()


def test_a_hostile_override_to_the_flow_is_refused(tmp_path_factory, tiny_env, prefect_server):
    """As a deployment parameter from the Prefect UI or API would arrive: overrides, applied only when valid."""
    root = make_tiny_project(tmp_path_factory.mktemp("override"), tiny_env)
    before = (root / "params.yaml").read_text()
    override = f"suite.tasks=[digits, 'x;touch {CANARY}']"
    proc = subprocess.run(
        [sys.executable, "-m", "flows.pipeline", "--root", str(root), "-S", override],
        cwd=root,
        env=tiny_env | {"PREFECT_API_URL": prefect_server},
        capture_output=True,
        text=True,
    )
    _one_line_refusal(proc, "is not a plain name")
    assert (root / "params.yaml").read_text() == before and not (root / "data").exists()


def test_a_hostile_deployment_parameter_fails_the_flow_run(tmp_path_factory, tiny_env, prefect_server):
    """The flow function itself, as a deployment run calls it with parameters from the UI or API: the run fails on
    the override, in Prefect's record too, and params.yaml is untouched."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.pipeline import pipeline

    root = make_tiny_project(tmp_path_factory.mktemp("deployment"), tiny_env)
    before = (root / "params.yaml").read_text()
    with temporary_settings({PREFECT_API_URL: prefect_server}):
        state = pipeline(root=str(root), overrides=[f"merge.methods=['$(touch {CANARY})']"], return_state=True)
    assert state.is_failed() and "unknown merge method '$(touch" in state.message
    assert (root / "params.yaml").read_text() == before and not (root / "data").exists()
