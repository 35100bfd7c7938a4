"""One stage table (mergeflow.core.stage_table): dvc.yaml, the CLI, the stage server, `mergeflow plan`'s cost models,
track's recorders and the cores' share all follow it, so that a stage left out of one of them fails here."""

import yaml

from mergeflow.core.stage_table import STAGES, parse_address


def test_dvc_yaml_has_exactly_the_tables_stages_each_run_by_its_command(repo_root):
    stages = yaml.safe_load((repo_root / "dvc.yaml").read_text())["stages"]
    assert list(stages) == list(STAGES)  # the same stages, in the pipeline's order
    for name, entry in stages.items():
        item = STAGES[name].item
        assert (entry.get("foreach") == f"${{{item.params_list}}}") if item else "foreach" not in entry, name
        assert (entry["do"] if item else entry)["cmd"] == f"mergeflow {name}", name


def test_the_cli_has_a_subcommand_per_stage_with_its_help_and_item():
    from mergeflow.cli import _parser

    parser = _parser(["report"])
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name, stage in STAGES.items():
        assert commands[name].description == stage.description
        options = {o for a in commands[name]._actions for o in (a.option_strings or [a.dest])}
        if stage.item:
            assert (stage.item.option if stage.item.positional else f"--{stage.item.option}") in options, name


def test_plan_track_and_the_stage_server_cover_every_stage():
    from mergeflow.runner.plan.work import COSTS
    from mergeflow.runner.stage_server import STAGE_COMMANDS
    from mergeflow.report.tracking import NOT_RECORDED, RECORDERS

    assert set(COSTS) == set(STAGES) == STAGE_COMMANDS
    recorded = [s for stages, _ in RECORDERS for s in stages]
    assert len(recorded) == len(set(recorded)) and not set(recorded) & set(NOT_RECORDED)
    assert set(recorded) | set(NOT_RECORDED) == set(STAGES)


def test_the_items_that_share_the_cores_are_the_tables(repo_root):
    from mergeflow.params import load_params

    params = load_params(repo_root / "params.yaml").model_copy(
        update={"runtime": load_params(repo_root / "params.yaml").runtime.model_copy(update={"deterministic": False})}
    )
    tasks = len(params.suite.tasks)
    # 8 fine-tunes on 32 cores: 4 threads each; a regime starts its own processes: every core (None)
    assert params.stage_share("finetune@digits", cores=32, gpus=0) == 32 // tasks
    assert params.stage_share("dvc.yaml:regime@mima", cores=32, gpus=0) is None
    assert params.stage_share("vectors", cores=32, gpus=0) is None
    assert parse_address("dvc.yaml:merge@ties") == ("merge", "ties") and parse_address("report") == ("report", "")
