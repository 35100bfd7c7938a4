"""The `mergeflow` command as a user meets it: help for every command and option (with the task and method
choices, also when params.yaml is broken), --version, `mergeflow methods` showing the grids params.yaml makes
effective beside the papers' defaults, `mergeflow ui`, and an unknown method as one line."""

import os

import pytest
import yaml

from mergeflow import __version__, cli
from mergeflow.ml.merging import REGISTRY

from .conftest import REPO
from .profiles import written_out

# a params file of this test's own: two tasks, two methods, and TIES's lam grid narrowed from the paper's 18 values
PARAMS = written_out(
    {
        "suite": {"tasks": ["digits", "count"]},
        "merge": {"methods": ["ties", "weight_averaging"], "ties": {"lam": [0.5, 1.5]}},
    }
)
COMMANDS = [
    "prepare",
    "pretrain",
    "finetune",
    "vectors",
    "sources",
    "merge",
    "report",
    "track",
    "methods",
    "check",
    "verify",
    "reproduce",
    "repro",
    "ui",
    "serve",
    "merge-checkpoints",
]


@pytest.fixture
def project(tmp_path, monkeypatch):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(PARAMS))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "100")
    return tmp_path


def _exit(argv, capsys) -> tuple[int, str, str]:
    """Run `mergeflow ARGV` in this process: (exit status, stdout, stderr)."""
    try:
        status = cli.main(argv)
    except SystemExit as end:
        status = end.code or 0
    out, err = capsys.readouterr()
    return status, out, err


def test_help_reads_as_user_help_and_lists_every_command(project, capsys):
    status, out, _ = _exit(["--help"], capsys)
    assert status == 0
    assert out.splitlines()[2].startswith("Model merging, end to end")  # a description, not the module's docstring
    assert "common commands" in out and "mergeflow ui" in out and "python -m flows.pipeline" in out
    for command in COMMANDS:
        assert f"    {command} " in out or f"    {command}\n" in out, command  # a long name: its help below
    assert max(len(line) for line in out.splitlines()) <= 100


@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "serve"])
def test_every_command_has_help(project, capsys, command):
    status, out, _ = _exit([command, "--help"], capsys)
    assert status == 0 and out.startswith(f"usage: mergeflow {command}")
    options = [line for line in out.splitlines() if line.strip().startswith("--")]
    assert all(len(line.split(None, 2)) >= 2 for line in options), out  # each option with its help text


def test_serve_help_is_the_flows(capsys, monkeypatch):
    monkeypatch.chdir(REPO)  # serve's options are flows/serve.py's: it runs from the repository root
    status, out, _ = _exit(["serve", "--help"], capsys)
    assert status == 0 and "--cron" in out and "--interval" in out


def test_task_and_method_choices_are_listed(project, capsys):
    _, out, _ = _exit(["finetune", "--help"], capsys)
    assert "one of digits, count (suite.tasks in params.yaml)" in " ".join(out.split())
    _, out, _ = _exit(["merge", "--help"], capsys)
    flat = " ".join(out.split())
    assert "ties*" in flat and "weight_averaging*" in flat and "(* = in merge.methods of params.yaml)" in flat
    assert all(name in flat for name in REGISTRY)
    assert "task_arithmetic*" not in flat  # registered, not in this merge.methods


@pytest.mark.parametrize("text", ["suite: [", "suite: {tasks: [digits]}\nmerge: {methods: [fisher_merging]}\n"])
def test_help_works_with_a_broken_params_file(project, capsys, text):
    (project / "params.yaml").write_text(text)
    for argv in (["--help"], ["finetune", "--help"], ["merge", "--help"]):
        status, out, _ = _exit(argv, capsys)
        assert status == 0, argv
    assert "params.yaml did not load" in " ".join(out.split()) and "ties" in out


def test_help_without_a_params_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    status, out, _ = _exit(["finetune", "--help"], capsys)
    assert status == 0 and "did not load" in " ".join(out.split())


def test_version(project, capsys):
    status, out, _ = _exit(["--version"], capsys)
    assert status == 0 and out.strip() == f"mergeflow {__version__}"


def test_methods_shows_the_effective_grid_beside_the_papers(project, capsys):
    status, out, _ = _exit(["methods"], capsys)
    assert status == 0
    assert max(len(line) for line in out.splitlines()) <= 100, "wider than a 100-column terminal"
    rows = out.split("├")  # one block of lines per method
    ties = next(r for r in rows if "│ ties *" in r)
    effective = " ".join(line.split("│")[2].strip() for line in ties.splitlines() if line.count("│") >= 3)
    paper = " ".join(line.split("│")[3].strip() for line in ties.splitlines() if line.count("│") >= 3)
    assert "lam grid [0.5, 1.5]" in effective and "k=0.2" in effective
    assert "lam=1, grid [0.8, 0.9, 1, ..., 2.5] (18 values)" in paper and "TIES-Merging" in paper
    assert "│ weight_averaging *" in out and "│ task_arithmetic " in out  # only merge.methods are marked
    ta = next(r for r in rows if "│ task_arithmetic " in r)
    assert "(the defaults)" in ta


def test_methods_with_a_broken_params_file_shows_the_defaults(project, capsys):
    (project / "params.yaml").write_text("merge: {methods: [fisher_merging]}\n")
    status, out, err = _exit(["methods"], capsys)
    assert status == 0 and err.startswith("warning: params.yaml:") and len(err.splitlines()) == 1
    assert "paper's defaults" in out and "effective" not in out and "│ ties" in out


def test_an_unknown_method_is_one_line_under_repro_and_the_flow(project, capsys):
    (project / "params.yaml").write_text(yaml.safe_dump(PARAMS | {"merge": {"methods": ["ties", "fisher_merging"]}}))
    status, out, err = _exit(["repro"], capsys)
    assert status == 2 and not out and len(err.splitlines()) == 1
    # the key, the closest names and where to list them all, in one short line
    assert (
        err
        == "error: params.yaml: merge.methods: unknown merge method 'fisher_merging' (did you mean fw_merging, fisher? "
        f"`mergeflow methods` lists all {len(REGISTRY)})\n"
    )
    # the flow's command line checks the project before Prefect starts (the flow itself: tests/test_flow_output.py)
    from flows.pipeline import main as flow_main

    (project / "dvc.yaml").write_text((REPO / "dvc.yaml").read_text())
    (project / ".dvc").mkdir()
    assert flow_main(["--root", str(project)]) == 2
    out, err = capsys.readouterr()
    assert not out and len(err.splitlines()) == 1 and "unknown merge method 'fisher_merging'" in err


def test_download_anywhere_on_the_line_lets_the_stages_download(monkeypatch, repo_root):
    # `mergeflow repro --download`: the flag is mergeflow's, not DVC's; the stages DVC starts inherit the permission
    from mergeflow.cli import _allow_downloads
    from mergeflow.config.environment import DOWNLOAD_ENV
    from mergeflow.params import parse_params

    # set, then removed: monkeypatch records the variable's absence and restores it (a delenv of an absent variable
    # records nothing, and the 1 _allow_downloads sets would outlive this test)
    monkeypatch.setenv(DOWNLOAD_ENV, "0")
    monkeypatch.delenv(DOWNLOAD_ENV)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert _allow_downloads(["repro", "-f"]) == ["repro", "-f"] and DOWNLOAD_ENV not in os.environ
    assert _allow_downloads(["repro", "--download", "-f"]) == ["repro", "-f"]
    assert os.environ[DOWNLOAD_ENV] == "1" and os.environ["HF_HUB_OFFLINE"] == "0"
    raw = yaml.safe_load((repo_root / "params.yaml").read_text())
    assert parse_params(raw).downloads()  # suite.download is false; the flag's environment allows it
    monkeypatch.delenv(DOWNLOAD_ENV)
    assert not parse_params(raw).downloads()


def test_the_hub_downloads_only_when_downloads_are_on(monkeypatch):
    from huggingface_hub import constants

    from mergeflow.core.hub import hub_access

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # as outside the Makefile
    with hub_access(False):
        assert constants.HF_HUB_OFFLINE  # the local cache only, and the one-line error when it misses
    with hub_access(True):
        assert not constants.HF_HUB_OFFLINE
    assert constants.HF_HUB_OFFLINE is False


def test_regimes_fit_the_terminal(project, capsys):
    from mergeflow.ml.regimes import REGISTRY as REGIMES
    from mergeflow.studies import REGISTRY as STUDIES

    status, out, _ = _exit(["regimes"], capsys)  # COLUMNS=100 (the fixture)
    lines = out.splitlines()
    assert status == 0 and max(map(len, lines)) <= 100
    starts = {line.split(":")[0].strip(" *") for line in lines if line.startswith("  ") and not line.startswith("   ")}
    assert set(REGIMES) | set(STUDIES) <= starts
