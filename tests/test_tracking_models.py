"""What `mergeflow track`'s store gives back, on this module's own tracked copy of the session's tiny reference run
(made as tests/test_tracking.py makes its own): merged models that load back in one call and say what they take,
the registry's best model on validation, and `mergeflow ui`'s views, served until its server stops."""

import json
import shutil
import warnings

import pytest
import torch

from mergeflow.core.io import load_state_dict
from mergeflow.ml.mlflow_model import load_model, load_timm

from .profiles import TINY
from .test_tracking import _runs, _tracked_copy

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tracked(tiny_reference, tiny_env, tmp_path_factory):
    """(root, env, client, experiment id): a copy of the reference run and its MLflow store."""
    return _tracked_copy(tiny_reference, tiny_env, tmp_path_factory)


def test_merged_model_loads_back_in_one_call(tracked):
    root, _, client, exp_id = tracked
    for r in _runs(client, exp_id, "merge").values():
        method = r.data.tags["mergeflow.item"]
        if r.data.params["kind"] != "model":
            assert "mergeflow.model_uri" not in r.data.tags, method  # per-task stores and negation are not one model
            continue
        state = load_model(f"runs:/{r.info.run_id}/model", f"sqlite:///{root / 'mlflow.db'}").net.state_dict()
        expected = load_state_dict(root / f"merged/{method}.safetensors")
        assert state.keys() == expected.keys(), method
        for key, tensor in expected.items():
            assert torch.equal(state[key], tensor), (method, key)


def test_a_merged_model_says_what_it_takes(tracked, monkeypatch):
    """Its MLflow signature: uint8 images [N, H, W, 3] in, float32 features [N, D] out; pyfunc refuses float
    images; the timm model and its preprocessing give the same features as load_model's module."""
    import mlflow
    import numpy as np

    root, _, client, exp_id = tracked
    run_id = next(r.info.run_id for r in _runs(client, exp_id, "merge").values() if r.data.params["kind"] == "model")
    uri, store = f"runs:/{run_id}/model", f"sqlite:///{root / 'mlflow.db'}"
    mlflow.set_tracking_uri(store)
    monkeypatch.chdir(root)  # MLflow's own calls read the artifacts from the workspace (its locations are relative)
    width = TINY["backbone"]["kwargs"]["embed_dim"]
    sig = mlflow.models.get_model_info(uri).signature.to_dict()
    assert json.loads(sig["inputs"]) == [
        {"type": "tensor", "tensor-spec": {"dtype": "uint8", "shape": [-1, -1, -1, 3]}}
    ]
    assert json.loads(sig["outputs"]) == [{"type": "tensor", "tensor-spec": {"dtype": "float32", "shape": [-1, width]}}]
    images = torch.randint(0, 256, (3, 32, 32, 3), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    module = load_model(uri, store)
    net, preprocess = load_timm(uri, store)
    with torch.no_grad():
        expected = module(images)
        assert expected.shape == (3, width) and torch.allclose(net(preprocess(images)), expected)
        assert preprocess(images).shape == (3, 3, 32, 32) and preprocess(images).dtype == torch.float32
        # the preprocessing by hand (backbone.input_norm: center):
        # NCHW in [0, 1], each channel centred, one scale an image
        x = images.permute(0, 3, 1, 2).double() / 255
        by_hand = (x - x.mean(dim=(2, 3), keepdim=True)) / (x.std(dim=(1, 2, 3), keepdim=True) + 0.05)
        assert torch.allclose(preprocess(images).double(), by_hand, atol=1e-5) and torch.allclose(
            net(by_hand.float()), expected, atol=1e-5
        )
    pyfunc = mlflow.pyfunc.load_model(uri)
    assert np.allclose(pyfunc.predict(images.numpy()), expected.numpy(), atol=1e-6)
    with pytest.raises(Exception, match="uint8"):
        pyfunc.predict(images.numpy().astype(np.float32))


def test_registry_holds_the_best_merged_model_on_validation(tracked):
    _, _, client, exp_id = tracked
    singles = [r for r in _runs(client, exp_id, "merge").values() if r.data.params["kind"] == "model"]
    top = max(r.data.metrics["val_avg"] for r in singles)
    versions = client.search_model_versions("name = 'mergeflow-embedded'")
    latest = max(versions, key=lambda v: int(v.version))
    best = next(r for r in singles if r.info.run_id == latest.run_id)  # a tie goes to the method listed first
    assert best.data.metrics["val_avg"] == top and latest.tags["method"] == best.data.params["method"]
    assert (
        latest.tags["val_avg"] == f"{top:.2f}"
        and "(its version number" not in client.get_registered_model("mergeflow-embedded").description
    )
    assert {
        k: latest.tags[k]
        for k in best.data.params
        if k not in ("method", "kind", "paper") and not k.startswith("grid.")
    } == {
        k: v for k, v in best.data.params.items() if k not in ("method", "kind", "paper") and not k.startswith("grid.")
    }


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.deploy  # the MLflow UI served and read in a browser: a deployment scenario (make test-deploy)
def test_ui_serves_the_views_and_stops_with_its_server(tracked, tmp_path):
    """`mergeflow ui` on the copy's store says when it answers, and SIGTERM to it ends its server too (a process
    group of its own). With Chromium (Debian's; CI installs it), the headless rendering of the standard fine-tune's
    view: the methods, the baselines and their scores are in the cells a researcher reads (the pipeline run's
    description is test_merge_runs_share_one_metric_convention's)."""
    import re
    import signal
    import socket
    import subprocess
    import sys
    import urllib.request

    root, env, client, exp_id = tracked
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "mergeflow.cli", "ui", "--port", str(port)],
        cwd=root,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = []
        for line in server.stderr:  # until it says it answers (or exits)
            lines.append(line)
            if "ready in" in line:
                break
        assert (
            f"sqlite:///{root / 'mlflow.db'}" in lines[0]
            and "ready in" in lines[-1]
            and f"http://127.0.0.1:{port}" in lines[-1]
        ), lines
        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10).status == 200
        if CHROMIUM is None:
            warnings.warn("no Chromium: the MLflow pages were not rendered (Debian: apt-get install chromium)")
            return
        chromium = [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--virtual-time-budget=20000",
            "--dump-dom",
            "--window-size=4000,1200",
        ]  # wide: the grid renders only the columns in view

        def page(path: str) -> str:
            dom = subprocess.run(
                [*chromium, f"http://127.0.0.1:{port}/{path}"], capture_output=True, text=True, timeout=600
            ).stdout
            return re.sub(r"<[^>]+>", "\n", dom)  # the text of the cells, one per line

        cells = {
            c.strip()
            for c in page(
                f"#/experiments/{exp_id}/runs?viewStateShareKey=methods.standard&workflowType=machine_learning"
            ).splitlines()
            if c.strip()
        }
        merges = [r for r in _runs(client, exp_id, "merge").values() if r.data.params["kind"] != "negation"]
        for r in merges:  # each method's row: its name and its test_avg as the table prints it
            assert r.data.params["method"] in cells, r.data.params["method"]
            assert f"{r.data.metrics['test_avg']:g}" in cells, (r.data.params["method"], r.data.metrics["test_avg"])
        assert (
            "test_avg_ci_low" in cells and "task_negation" not in cells and "Individual" in cells
        )  # a baseline's run among them
        # the studies' view: a column per claim, named by the claim's short name
        study_cells = page(f"#/experiments/{exp_id}/runs?viewStateShareKey=studies&workflowType=machine_learning")
        claims = json.loads((root / "metrics/studies/cart.json").read_text())["claims"]
        assert [c["name"] for c in claims if f"verdict.{c['name']}" not in study_cells] == []
        # the server reads the artifacts at their workspace-relative locations: the pipeline run's summary
        pipeline = max(_runs(client, exp_id, "pipeline").values(), key=lambda r: r.info.start_time)
        url = f"http://127.0.0.1:{port}/get-artifact?path=results/summary.md&run_uuid={pipeline.info.run_id}"
        served = urllib.request.urlopen(url, timeout=30).read()
        assert served == (root / "results/summary.md").read_bytes()
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=120) == 0  # the server, stopped, exited cleanly, and the command with it
    with pytest.raises(OSError):  # nothing serves there any more
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
