"""What runs the stages: the stage graph from dvc.yaml and dvc.lock's commits (``graph``), running and stopping a
stage (``running``), stages that die with their launcher (``lifetime``), one GPU per stage (``gpus``), the
runners' arguments (``arguments``), the scheduler that runs the stale stages several at once (``scheduler``) from
warm stage servers (``stage_server``), Dask checkouts and the DVC remote, the checks before a run, `mergeflow
plan`, `verify`, `reproduce` and `compare`; for the ``mergeflow`` command and the flow: what each non-stage
command does (``commands``), the listings of methods and regimes (``listings``), one stage in this process
(``stage_command``), the flow's runner options (``flow_options``) and its summary's Markdown (``run_summary``)."""
