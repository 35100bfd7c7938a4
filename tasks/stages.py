"""Prefect task: run one stage of dvc.yaml. All logic lives in mergeflow.orchestration."""

from prefect import get_run_logger, task

from mergeflow.orchestration import StageFailed, StageNode, run_stage


def _retry_if_transient(task, task_run, state) -> bool:
    """Retry a stage killed by a signal or failing with status 75 (StageFailed.transient); never bad input (2) or
    an unexpected error (1), which fail the same way again. Failures outside the stage (launching it) retry."""
    try:
        state.result()
    except StageFailed as err:
        return err.transient
    except Exception:
        return True
    return False


@task(retries=2, retry_delay_seconds=2, retry_condition_fn=_retry_if_transient, task_run_name="{node.address}")
def run_stage_task(node: StageNode, root: str, env: dict[str, str]) -> dict:
    result = run_stage(node, root, env)
    if result["output"].strip():
        get_run_logger().info("%s output (last lines):\n%s", node.address, "\n".join(result["output"].strip().splitlines()[-20:]))
    return result
