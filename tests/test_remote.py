"""Results that travel: the committed run's headline is readable on a fresh clone before anything runs, `mergeflow
remote add` sets a DVC remote, and `dvc push` then `dvc pull` on a fresh clone restores every output of the run, so
that `dvc status` finds nothing to do; with a local folder and with an S3 server on 127.0.0.1 (moto), whose
credentials come from the environment and never reach git."""

import hashlib
import json
import re
import sys
import time
from pathlib import Path

import pytest

from mergeflow.core.errors import MergeflowError
from mergeflow.runner.remote import add_remote, check_url, default_remote

from .conftest import copy_project, run


def _tree_md5s(root, exclude=(".git", ".dvc", ".venv")) -> dict[str, str]:
    """Every file under root but git's and DVC's own, with its md5: what a clone has after `dvc pull`."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if rel.parts[0] in exclude or not path.is_file() or "__pycache__" in rel.parts:
            continue
        out[str(rel)] = hashlib.md5(path.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def committed_run(tiny_reference, tiny_env, tmp_path_factory):
    """The tiny reference run, committed: dvc.lock, the headline and verdict counts in git, the rest in the cache."""
    root = copy_project(tiny_reference[0], tmp_path_factory.mktemp("remote") / "project")
    run("git add -A && git commit -qm 'the reference run'", root, tiny_env)
    return root


def _stdout(cmd, cwd, env) -> str:
    """A command's output, stdout only (DVC may warn on stderr)."""
    proc = run(cmd, cwd, env, check=False)
    assert proc.returncode == 0, f"{cmd}: {proc.stdout[-2000:]} {proc.stderr[-2000:]}"
    return proc.stdout


def _clone(src, dst, env):
    run(["git", "clone", "-q", str(src), str(dst)], dst.parent, env)
    return dst


def test_remote_urls_are_checked(tmp_path, tiny_env, monkeypatch):
    with pytest.raises(MergeflowError, match=r"has a password, which would go into \.dvc/config"):
        check_url("s3://key:secret@bucket/path")
    with pytest.raises(MergeflowError, match="unknown scheme 'ftp'"):
        check_url("ftp://host/path")
    assert check_url("s3://bucket/path") == "s3" and check_url("/shared/dvc") == ""
    run("git init -q && dvc init -q", tmp_path, tiny_env)
    with pytest.raises(MergeflowError, match="only an s3:// remote has an endpoint"):
        add_remote("/shared/dvc", endpoint_url="http://127.0.0.1:9000", root=tmp_path)
    assert default_remote(tmp_path) is None
    # a relative folder is kept absolute: the same place whatever directory DVC runs from
    monkeypatch.chdir(tmp_path)
    remote = add_remote("../store", root=tmp_path)
    assert remote.url == str(tmp_path.parent / "store") and default_remote(tmp_path) == remote
    assert f"url = {tmp_path.parent / 'store'}" in (tmp_path / ".dvc" / "config").read_text()
    # an endpoint's password would be committed as well; a name must be one DVC can find again
    with pytest.raises(MergeflowError, match=r"--endpoint-url http://127\.0\.0\.1\.\.\.: has a password"):
        add_remote("s3://bucket/path", endpoint_url="http://AKIA:secret@127.0.0.1:9000", root=tmp_path)
    with pytest.raises(MergeflowError, match=r"--name '': a remote's name is a plain word"):
        add_remote("/shared/dvc", name="", root=tmp_path)
    assert "secret" not in (tmp_path / ".dvc" / "config").read_text() and default_remote(tmp_path) == remote
    # DVC's own errors are one line naming the place: not a repository, a config DVC cannot read
    plain = tmp_path.with_name(f"{tmp_path.name}-plain")  # beside the repository, not in it
    plain.mkdir()
    with pytest.raises(MergeflowError, match=rf"{plain}: not a DVC repository"):
        default_remote(plain)
    config = tmp_path / ".dvc" / "config"
    config.write_text(config.read_text().replace("[core]\n", "[core]\n    bogus = 1\n"))
    proc = run(["mergeflow", "remote"], tmp_path, tiny_env, check=False)
    assert proc.returncode == 2 and re.fullmatch(r"error: \.dvc/config: .*'bogus'.*\n", proc.stderr), proc.stderr


def test_a_fresh_clone_shows_the_committed_headline(committed_run, tiny_env, tmp_path):
    clone = _clone(committed_run, tmp_path / "clone", tiny_env)
    assert not (clone / "merged").exists()  # nothing pulled, nothing run
    table = _stdout(["dvc", "metrics", "show"], clone, tiny_env)
    ta = (committed_run / "metrics" / "headline" / "task_arithmetic.json").read_text()
    assert "metrics/headline/task_arithmetic.json" in table and str(json.loads(ta)["test_avg"]) in table
    for row in json.loads(_stdout(["dvc", "exp", "show", "--json"], clone, tiny_env)):  # the workspace and HEAD
        metrics = row["data"]["metrics"]
        assert row["error"] is None and metrics["metrics/headline/task_arithmetic.json"]["data"] == json.loads(ta), row[
            "rev"
        ]


@pytest.mark.parametrize("kind", ["folder", "s3"])
def test_push_then_pull_on_a_fresh_clone_restores_the_run(kind, committed_run, tiny_env, tmp_path, request):
    env = dict(tiny_env)
    if kind == "folder":
        url, extra = str(tmp_path / "store"), []
    else:
        endpoint = request.getfixturevalue("s3_server")
        env |= {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing-secret",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        url, extra = "s3://mergeflow-results/runs", ["--endpoint-url", endpoint]
    project = copy_project(committed_run, tmp_path / "project")
    out = _stdout(["mergeflow", "remote", "add", url, *extra], project, env)
    assert "default remote: storage" in out
    config = (project / ".dvc" / "config").read_text()
    assert "testing" not in config  # the credentials stay in the environment
    run("git add .dvc/config && git commit -qm 'the results remote'", project, env)
    pushed = run(["dvc", "push"], project, env)
    assert "pushed" in pushed and "testing-secret" not in pushed
    assert run(["git", "grep", "-l", "testing-secret"], project, env, check=False).returncode == 1  # in no tracked file

    clone = _clone(project, tmp_path / "clone", env)
    start = time.perf_counter()
    run(["dvc", "pull"], clone, env)
    print(f"dvc pull of the tiny run from the {kind} remote: {time.perf_counter() - start:.1f} s")
    expected = {
        p: h
        for p, h in _tree_md5s(project).items()
        if not p.startswith(("logs/timing", "metrics/tracking.json", "mlflow", "mlruns", "mlartifacts", "dvc_plots"))
    }
    pulled = _tree_md5s(clone)
    assert {p: pulled.get(p) for p in expected} == expected
    assert "Data and pipelines are up to date." in _stdout(["dvc", "status"], clone, env)


def test_a_push_that_fills_the_remote_is_one_line_and_leaves_no_partial_file(tmp_path, tiny_env, monkeypatch):
    """A local remote that runs out of space: DVC logs an error per file (hundreds) and leaves each file it was
    writing under its temporary name; the push's error names the count and the first cause, the partial files go."""
    import errno

    import dvc_objects.fs.local as dvc_local

    from mergeflow.core.errors import MergeflowError
    from mergeflow.runner.remote import push_outputs

    run(
        "git init -q && dvc init -q && for i in 1 2 3 4 5 6; do "
        "echo weights$i > model$i.bin; done && dvc add -q model*.bin",
        tmp_path,
        tiny_env,
    )
    store = tmp_path.parent / f"{tmp_path.name}-store"
    add_remote(str(store), root=tmp_path)
    written = []

    def copy_until_full(src, dest, callback=None):
        if len(written) >= 2:  # room for two files: the rest are cut short, as on a full disk
            Path(dest).write_bytes(Path(src).read_bytes()[:3])
            raise OSError(errno.ENOSPC, "No space left on device")
        Path(dest).write_bytes(Path(src).read_bytes())
        written.append(dest)

    monkeypatch.setattr(dvc_local, "copyfile", copy_until_full)
    with pytest.raises(MergeflowError) as err:
        push_outputs(tmp_path, jobs=1)
    assert (
        str(err.value)
        == f"dvc push to storage ({store}): 4 files failed to upload (the first: [Errno 28] No space left on device); "
        "4 partial files it left there removed"
    )
    assert not list(store.rglob("*.tmp")) and len([p for p in store.rglob("*") if p.is_file()]) == 2


def test_a_push_with_wrong_credentials_says_to_check_them(tmp_path, tiny_env, monkeypatch):
    """An S3 server (moto) that checks credentials, given wrong ones: one line, the credentials named."""
    from moto.server import ThreadedMotoServer

    from mergeflow.core.errors import MergeflowError
    from mergeflow.runner.remote import push_outputs

    from moto import settings as moto_settings

    monkeypatch.setattr(moto_settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # moto: every request authenticated
    for key, value in {
        "AWS_ACCESS_KEY_ID": "wrong",
        "AWS_SECRET_ACCESS_KEY": "wrong",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        run("git init -q && dvc init -q && echo weights > model.bin && dvc add -q model.bin", tmp_path, tiny_env)
        add_remote("s3://bucket/runs", root=tmp_path, endpoint_url=f"http://{host}:{port}")
        with pytest.raises(MergeflowError) as err:
            push_outputs(tmp_path)
    finally:
        server.stop()
    assert str(err.value).startswith("dvc push to storage (s3://bucket/runs): PermissionError: ") and str(
        err.value
    ).endswith("; check the remote's credentials (in the environment, or `dvc remote modify --local`)")
    assert "wrong" not in str(err.value)


@pytest.fixture(scope="module")
def s3_server():
    """An S3-compatible server on 127.0.0.1 (moto), with the bucket the test pushes to."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing-secret",
        region_name="us-east-1",
    )
    s3.create_bucket(Bucket="mergeflow-results")
    yield endpoint
    server.stop()


# ---------------------------------------------------------------- scale-out without a shared file system
def test_worker_checkouts_need_a_remote_and_committed_code(committed_run, tiny_env, tmp_path):
    from mergeflow.runner.checkouts import check_source

    project = copy_project(committed_run, tmp_path / "project")
    with pytest.raises(MergeflowError, match=r"worker checkouts need a DVC remote .*`mergeflow remote add URL`"):
        check_source(project)
    add_remote(str(tmp_path / "store"), root=project)
    with pytest.raises(
        MergeflowError,
        match=r"\.dvc/config differs from the last commit, which is what the workers check out: commit it first",
    ):
        check_source(project)
    run("git add .dvc/config && git commit -qm remote", project, tiny_env)
    assert check_source(project) == run(["git", "rev-parse", "HEAD"], project, tiny_env).strip()
    # a new file the commit lacks (a method being written) is refused like a changed one
    (project / "src" / "mergeflow" / "ml" / "merging" / "new_method.py").write_text("")
    with pytest.raises(MergeflowError, match=r"src/mergeflow/ml/merging/new_method\.py differs from the last commit"):
        check_source(project)
    (project / "src" / "mergeflow" / "ml" / "merging" / "new_method.py").unlink()
    # a remote only in .dvc/config.local: the workers' clones would not know it
    run(
        "git rm -q --cached .dvc/config && git checkout -q HEAD~1 -- .dvc/config && git commit -qm 'no remote'",
        project,
        tiny_env,
    )
    run(["dvc", "remote", "add", "--local", "-d", "mine", str(tmp_path / "store")], project, tiny_env)
    assert default_remote(project).name == "mine"
    with pytest.raises(MergeflowError, match=r"need a DVC remote in \.dvc/config .*config\.local"):
        check_source(project)


def test_a_refused_flow_run_leaves_params_alone(committed_run, tiny_env, tmp_path):
    """Worker checkouts without Dask are refused before anything is written or Prefect starts."""
    project = copy_project(committed_run, tmp_path / "project")
    before = (project / "params.yaml").read_bytes()
    proc = run(
        [sys.executable, "-m", "flows.pipeline", "--worker-checkouts", "-S", "merge.ties.k=0.15"],
        project,
        tiny_env,
        check=False,
    )
    assert proc.returncode == 2 and proc.stderr == "error: worker checkouts need --runner dask\n", proc.stderr
    assert (project / "params.yaml").read_bytes() == before


def test_compare_needs_no_dvc_on_path(committed_run, tiny_env):
    """`mergeflow compare` runs this environment's DVC, started by path as a scheduler would, with PATH bare."""
    env = tiny_env | {"PATH": "/usr/bin:/bin"}
    out = _stdout([str(Path(sys.executable).parent / "mergeflow"), "compare"], committed_run, env)
    assert out.startswith("no experiment differs from the others"), out


def test_a_stage_a_worker_ran_is_recorded_whole(tmp_path):
    """record_stage: the small outputs a worker kept in git replace the flow's (a folder whole: a method no
    longer run leaves no file behind), and the stage's entry goes into dvc.lock beside the others."""
    import yaml

    from mergeflow.runner.checkouts import record_stage

    (tmp_path / "metrics" / "headline").mkdir(parents=True)
    (tmp_path / "metrics" / "headline" / "gone.json").write_text("{}")
    (tmp_path / "dvc.lock").write_text(
        yaml.safe_dump({"schema": "2.0", "stages": {"prepare": {"cmd": "mergeflow prepare"}}})
    )
    entry = {"cmd": "mergeflow report", "outs": [{"path": "metrics/headline", "hash": "md5", "md5": "0" * 32 + ".dir"}]}
    result = {
        "lock_entry": entry,
        "uncached_outs": ["metrics/headline", "metrics/verdicts/mima.json"],
        "uncached": {
            "metrics/headline/ties.json": '{"test_avg": 71.7}',
            "metrics/headline/mima_n4/ties.json": "{}",
            "metrics/verdicts/mima.json": '{"holds": 7}',
        },
    }
    record_stage(tmp_path, "report", result)
    assert sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "metrics").rglob("*.json")) == [
        "metrics/headline/mima_n4/ties.json",
        "metrics/headline/ties.json",
        "metrics/verdicts/mima.json",
    ]
    assert (tmp_path / "metrics" / "headline" / "ties.json").read_text() == '{"test_avg": 71.7}'
    assert yaml.safe_load((tmp_path / "dvc.lock").read_text())["stages"] == {
        "prepare": {"cmd": "mergeflow prepare"},
        "report": entry,
    }


@pytest.mark.e2e
@pytest.mark.deploy
def test_dask_workers_run_stages_in_checkouts_of_their_own(committed_run, tiny_env, prefect_server, tmp_path):
    """`--runner dask --workers 2 --worker-checkouts` (a LocalCluster of 2 worker processes) on the pushed reference
    run with merge.ties.k = 0.1: exactly merge@ties, report and track run; each stage but track runs in a Dask
    worker's own clone (its local directory, none of the project's files), pulling its inputs from the remote and
    pushing its outputs, each worker handing out its own share of two pretend GPUs; the flow records each in
    dvc.lock and pulls the outputs at the end, so that its working tree is the whole run and `dvc status` is clean;
    the Prefect server holds the three task runs, completed; a fresh clone pulls the new merge too. (One flow run
    for the Dask runner's and the worker checkouts' checks: each costs a minute on 2 cores.)"""
    import yaml

    from .test_schedule import _api

    env = tiny_env | {
        "PREFECT_API_URL": prefect_server,
        "CUDA_VISIBLE_DEVICES": "7,9",
    }  # no such devices: stages run on the CPU
    project = copy_project(committed_run, tmp_path / "project")
    run(["mergeflow", "remote", "add", str(tmp_path / "store")], project, env)
    run("git add .dvc/config && git commit -qm remote && dvc push -q", project, env)
    # no regime and no study runs: their outputs go, as a clone has none of them (report and track read the folders)
    run(
        "git clean -qfdX metrics/regime metrics/regime_merge logs/regime_merge "
        "predictions/regime_merge regimes metrics/studies studies",
        project,
        env,
    )
    start = time.perf_counter()
    out = run(
        [
            sys.executable,
            "-m",
            "flows.pipeline",
            "--runner",
            "dask",
            "--workers",
            "2",
            "--worker-checkouts",
            "-S",
            "merge.ties.k=0.1",
            "-S",
            "regimes.run=[]",
            "-S",
            "studies.run=[]",
        ],
        project,
        env,
        timeout=900,
    )
    print(f"flow run with worker checkouts (merge@ties, report, track): {time.perf_counter() - start:.1f} s")
    assert "3 of 19 stages to run: merge@ties, report, track" in out, out[-3000:]  # the standard stages alone
    assert (
        "runner: dask, 2 stages at once, GPUs 7, 9" in out
        and "Creating a new Dask cluster with `mergeflow.runner.arguments.local_cluster`" in out
    )
    # the task runs, on the server: the three stages, completed, each on one of the pretend GPUs
    flow_run = [
        r
        for r in _api(prefect_server, "flow_runs/filter", {"sort": "START_TIME_DESC"})
        if r["parameters"].get("root") == "."
    ][0]
    assert (
        flow_run["parameters"]["runner"] == "dask"
        and flow_run["parameters"]["worker_checkouts"]
        and flow_run["state_type"] == "COMPLETED"
    )
    task_runs = _api(prefect_server, "task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run["id"]]}}})
    assert sorted((t["name"], t["state_type"]) for t in task_runs) == [
        ("merge@ties", "COMPLETED"),
        ("report", "COMPLETED"),
        ("track", "COMPLETED"),
    ]
    logs = [
        e["message"] for e in _api(prefect_server, "logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run["id"]]}}})
    ]
    assert sorted(m for m in logs if " runs on GPU " in m) in (
        [f"merge@ties runs on GPU {a}", f"report runs on GPU {b}", f"track runs on GPU {c}"]
        for a in "79"
        for b in "79"
        for c in "79"
    ), logs
    # merge@ties and report on the workers, each in a clone in its Dask local directory; track here, where MLflow's
    # store is, on its inputs pulled
    checkouts = {
        m.group(1): Path(m.group(2)) for m in re.finditer(r"(merge@ties|report|track) ran in the checkout (\S+)", out)
    }
    assert set(checkouts) == {"merge@ties", "report"}, out[-3000:]
    assert all(c.name == "mergeflow-checkout" and not c.is_relative_to(project) for c in checkouts.values()), checkouts
    assert "Task run 'track' - Finished in state Completed()" in out and "Pushed to the DVC remote **storage**" in out
    assert "Data and pipelines are up to date." in run(["dvc", "status"], project, env)
    lock = yaml.safe_load((project / "dvc.lock").read_text())
    assert lock["stages"]["merge@ties"]["params"]["params.yaml"]["merge.ties"]["k"] == 0.1
    headline = json.loads((project / "metrics" / "headline" / "ties.json").read_text())
    assert headline["test_avg"] == round(
        100 * json.loads((project / "metrics" / "evaluate" / "ties.json").read_text())["average"], 2
    )
    # the run travels: a clone of the commit with this dvc.lock pulls the new merge
    run("git add dvc.lock params.yaml metrics && git commit -qm 'ties k=0.1'", project, env)
    clone = _clone(project, tmp_path / "clone", env)
    run(["dvc", "pull", "merged/ties.safetensors"], clone, env)
    assert (
        hashlib.md5((clone / "merged" / "ties.safetensors").read_bytes()).hexdigest()
        == hashlib.md5((project / "merged" / "ties.safetensors").read_bytes()).hexdigest()
    )


def test_a_flow_run_says_where_its_outputs_went(tmp_path, tiny_env):
    """The flow's summary artifact: this machine's cache when no remote is set; what `dvc push` sent to the remote;
    a push that fails is named, and fails the run (flows.pipeline raises on the error)."""
    from mergeflow.runner.run_summary import push_section

    run("git init -q && dvc init -q && echo weights > model.bin && dvc add -q model.bin", tmp_path, tiny_env)
    text, error = push_section(tmp_path)
    assert error is None and "no DVC remote is set" in text and "mergeflow remote add URL" in text
    add_remote(str(tmp_path.parent / f"{tmp_path.name}-store"), root=tmp_path)
    text, error = push_section(tmp_path)
    assert error is None and text.startswith("Pushed to the DVC remote **storage**") and ": 1 files sent" in text
    assert push_section(tmp_path)[0].count(": 0 files sent") == 1  # nothing new: nothing sent again
    (tmp_path.parent / "not-a-folder").write_text("")
    add_remote(str(tmp_path.parent / "not-a-folder" / "store"), root=tmp_path)
    (tmp_path / "model.bin").unlink()
    run("echo other > model.bin && dvc add -q model.bin", tmp_path, tiny_env)
    text, error = push_section(tmp_path)
    assert text.startswith("**Not pushed**: dvc push to storage (") and error and "\n" not in error
