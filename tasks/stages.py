"""Prefect task: run one stage of dvc.yaml. All logic lives in mergeflow.orchestration."""

from prefect import task

from mergeflow.orchestration import StageFailed, StageNode, run_stage


def _retry_unless_bad_input(task, task_run, state) -> bool:
    # exit status 2 is bad input or configuration: retrying cannot help
    try:
        state.result()
    except StageFailed as err:
        return err.returncode != 2
    except Exception:
        return True
    return False


@task(retries=2, retry_delay_seconds=2, retry_condition_fn=_retry_unless_bad_input, task_run_name="{node.address}")
def run_stage_task(node: StageNode, root: str, env: dict[str, str]) -> dict:
    return run_stage(node, root, env)
