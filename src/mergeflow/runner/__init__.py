"""What runs the stages: the stage graph from dvc.yaml and dvc.lock's commits (``graph``), running and stopping a
stage (``running``), stages that die with their launcher (``lifetime``), one GPU per stage (``gpus``), the
runners' arguments (``arguments``), the scheduler that runs the stale stages several at once (``scheduler``) from
warm stage servers (``stage_server``), Dask checkouts and the DVC remote, the checks before a run, `mergeflow
plan`, `verify`, `reproduce` and `compare`."""
