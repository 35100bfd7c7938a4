"""Results that travel: the committed run's headline is readable on a fresh clone before anything runs, `mergeflow
remote add` sets a DVC remote, and `dvc push` then `dvc pull` on a fresh clone restores every output of the run, so
that `dvc status` finds nothing to do; with a local folder and with an S3 server on 127.0.0.1 (moto), whose
credentials come from the environment and never reach git."""

import hashlib
import os
import time

import pytest

from mergeflow.errors import MergeflowError
from mergeflow.remote import add_remote, check_url, default_remote

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


def test_remote_urls_are_checked(tmp_path, tiny_env):
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
    os.chdir(tmp_path)
    try:
        remote = add_remote("../store", root=tmp_path)
    finally:
        os.chdir(os.path.dirname(__file__))
    assert remote.url == str(tmp_path.parent / "store") and default_remote(tmp_path) == remote
    assert f"url = {tmp_path.parent / 'store'}" in (tmp_path / ".dvc" / "config").read_text()


def test_a_fresh_clone_shows_the_committed_headline(committed_run, tiny_env, tmp_path):
    clone = _clone(committed_run, tmp_path / "clone", tiny_env)
    assert not (clone / "merged").exists()  # nothing pulled, nothing run
    table = _stdout(["dvc", "metrics", "show"], clone, tiny_env)
    ta = (committed_run / "metrics" / "headline" / "task_arithmetic.json").read_text()
    assert "metrics/headline/task_arithmetic.json" in table and str(__import__("json").loads(ta)["test_avg"]) in table
    shown = _stdout(["dvc", "exp", "show", "--json"], clone, tiny_env)
    assert '"metrics/headline/ties.json"' in shown and '"error"' not in shown


@pytest.mark.parametrize("kind", ["folder", "s3"])
def test_push_then_pull_on_a_fresh_clone_restores_the_run(kind, committed_run, tiny_env, tmp_path, request):
    env = dict(tiny_env)
    if kind == "folder":
        url, extra = str(tmp_path / "store"), []
    else:
        endpoint = request.getfixturevalue("s3_server")
        env |= {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret", "AWS_DEFAULT_REGION": "us-east-1"}
        url, extra = "s3://mergeflow-results/runs", ["--endpoint-url", endpoint]
    project = copy_project(committed_run, tmp_path / "project")
    out = _stdout(["mergeflow", "remote", "add", url, *extra], project, env)
    assert "default remote: storage" in out
    config = (project / ".dvc" / "config").read_text()
    assert "testing" not in config  # the credentials stay in the environment
    run("git add .dvc/config && git commit -qm 'the results remote'", project, env)
    assert "pushed" in run(["dvc", "push"], project, env)

    clone = _clone(project, tmp_path / "clone", env)
    start = time.perf_counter()
    run(["dvc", "pull"], clone, env)
    print(f"dvc pull of the tiny run from the {kind} remote: {time.perf_counter() - start:.1f} s")
    expected = {p: h for p, h in _tree_md5s(project).items() if not p.startswith(("logs/timing", "metrics/tracking.json", "mlflow", "mlruns", "mlartifacts", "dvc_plots"))}
    pulled = _tree_md5s(clone)
    assert {p: pulled.get(p) for p in expected} == expected
    assert "Data and pipelines are up to date." in _stdout(["dvc", "status"], clone, env)


@pytest.fixture(scope="module")
def s3_server():
    """An S3-compatible server on 127.0.0.1 (moto), with the bucket the test pushes to."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing-secret", region_name="us-east-1")
    s3.create_bucket(Bucket="mergeflow-results")
    yield endpoint
    server.stop()
