"""``mergeflow plan``: before a long run, which stages will run and about how long and how much memory each takes.

The estimate is work / measured throughput. The work of each stage is counted from params.yaml in the units the
stage spends its time in (images through the backbone's forward pass, training images, per-example gradients,
elementwise passes over the parameters, SVDs): ``work``. The throughputs are measured on this device, on the real
backbone architecture with random weights, in a few seconds and robustly to other load (``measure``), once per
machine: ``cache`` keeps them (``mergeflow plan --remeasure`` measures again). ``report`` makes the plan (DVC's
status, the estimates, the stages whose peak exceeds the machine's memory) and prints it.

The estimate is for ``mergeflow repro`` running one stage after another (as on one GPU or 2 cores), the stages
forked from its stage server: ``work`` says more.
"""

from mergeflow.runner.plan.measure import (
    ModelShape,
    Throughput,
    decode_seconds,
    fastest_time,
    measure_throughput,
    model_shape,
)
from mergeflow.runner.plan.work import (
    LOAD_BYTES_PER_S,
    STAGE_GAP_S,
    Work,
    compute_seconds,
    finetune_work,
    merge_work,
    overhead_seconds,
    peak_bytes,
    regime_merge_work,
    regime_work,
    stage_work,
    statistics_work,
    vectors_work,
)
from mergeflow.runner.plan.report import (
    device_line,
    machine_memory,
    make_plan,
    memory_warning,
    plan_table,
    print_plan,
    project_plan,
)

__all__ = [
    "LOAD_BYTES_PER_S",
    "ModelShape",
    "STAGE_GAP_S",
    "Throughput",
    "Work",
    "compute_seconds",
    "decode_seconds",
    "device_line",
    "fastest_time",
    "finetune_work",
    "machine_memory",
    "make_plan",
    "measure_throughput",
    "memory_warning",
    "merge_work",
    "model_shape",
    "overhead_seconds",
    "peak_bytes",
    "plan_table",
    "print_plan",
    "project_plan",
    "regime_merge_work",
    "regime_work",
    "stage_work",
    "statistics_work",
    "vectors_work",
]
