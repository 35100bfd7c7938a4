"""What runs the stages: the stage graph and running a stage (``orchestration``), the scheduler that runs the stale
stages several at once (``scheduler``) from warm stage servers (``stage_server``), Dask checkouts and the DVC
remote, the checks before a run, `mergeflow plan`, `verify`, `reproduce` and `compare`."""
