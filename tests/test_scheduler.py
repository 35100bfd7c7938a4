"""The stage graph run several stages at once (mergeflow.runner.scheduler): order, the limit, failures, and `mergeflow
repro`'s run of a DVC project that DVC then finds up to date; without torch or a Prefect server."""

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mergeflow.runner.graph import StageNode

from mergeflow.runner.running import StageFailed
from mergeflow.runner.scheduler import run_graph

DVC = os.path.join(os.path.dirname(sys.executable), "dvc")


def test_a_stage_starts_after_its_upstream_is_committed_and_never_downstream_of_a_failure():
    nodes = [
        StageNode("a", ("a",), ()),
        *(StageNode(f"b@{i}", ("b",), ("a",)) for i in range(4)),
        StageNode("c", ("c",), ("b@0",)),
        StageNode("d", ("d",), ("b@1",)),
    ]
    committed, running, most = [], set(), [0]
    lock = threading.Lock()

    def work(node):
        with lock:
            assert all(u in committed for u in node.upstream), (
                f"{node.address} started before {node.upstream} was committed"
            )
            running.add(node.address)
            most[0] = max(most[0], len(running))
        time.sleep(0.05)
        with lock:
            running.discard(node.address)
        if node.address == "b@0":
            raise StageFailed("b@0", 2, "error: bad input")
        return {"stage": node.address}

    with ThreadPoolExecutor(4) as pool:
        outcome = run_graph(nodes, lambda node, upstream: pool.submit(work, node), committed.append, limit=2)
    assert most[0] == 2  # four b's were ready at once; two ran
    assert (
        committed[0] == "a"
        and set(committed) == {"a", "b@1", "b@2", "b@3", "d"}
        and committed.index("d") > committed.index("b@1")
    )
    assert (
        list(outcome.failed) == ["b@0"]
        and outcome.error_line("b@0") == "error: bad input"
        and outcome.status("b@0") == "exit status 2 (bad input)"
    )
    assert outcome.not_run == {"c": "needs b@0, which failed"}


def test_a_stage_downstream_of_a_change_runs_only_if_its_inputs_changed():
    """sources -> merge@ties, merge@emr -> report: sources changed, and of its outputs only emr's changed (as when one
    method's module was edited). merge@ties is up to date once sources ran, so report waits only for merge@emr; a
    stage asked is asked once its upstream stages are committed."""
    nodes = [
        StageNode("sources", ("s",), ()),
        StageNode("merge@ties", ("m",), ("sources",)),
        StageNode("merge@emr", ("m",), ("sources",)),
        StageNode("report", ("r",), ("merge@ties", "merge@emr")),
    ]
    committed, asked = [], []

    def changed(node):
        asked.append((node.address, list(committed)))
        return node.address in ("sources", "merge@emr", "report")

    with ThreadPoolExecutor(2) as pool:
        outcome = run_graph(
            nodes,
            lambda node, upstream: pool.submit(lambda: {"stage": node.address}),
            committed.append,
            limit=2,
            must_run=changed,
        )
    assert (
        committed == ["sources", "merge@emr", "report"]
        and outcome.up_to_date == ["merge@ties"]
        and outcome.done == committed
    )
    assert dict(asked)["merge@ties"] == ["sources"] and dict(asked)["report"] == ["sources", "merge@emr"]
    assert not outcome.failed and not outcome.not_run


STAGE = (
    "import json, os, sys, time; item = os.environ['DVC_STAGE'].split('@')[1]; start = time.time(); time.sleep(0.5); "
    "json.dump({'item': item, 'span': [start, time.time()]}, open(f'out/{item}.json', 'w')); print('made', item); "
    "sys.exit(3 if item == 'bad' else 0)"
)
TOTAL = (
    "import glob, json; open('total.txt', "
    "'w').write(','.join(sorted(json.load(open(p))['item'] for p in glob.glob('out/*.json'))))"
)


def _repro(root, workers=2, force=(), env=None) -> subprocess.CompletedProcess:
    """scheduler.repro in a process of its own (DVC's logger keeps the stream it first saw)."""
    code = (
        "import sys; from mergeflow.runner.scheduler import repro; "
        f"sys.exit(repro({str(root)!r}, {workers}, {set(force)!r}))"
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=root, env={**os.environ, **(env or {})}, capture_output=True, text=True
    )


def _project(root, items):
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run([DVC, "init", "-q"], cwd=root, check=True)
    (root / "params.yaml").write_text(json.dumps({"items": items}))
    (root / "out").mkdir()
    (root / "dvc.yaml").write_text(
        json.dumps(
            {
                "stages": {
                    "make": {
                        "foreach": "${items}",
                        "do": {
                            "cmd": f'{sys.executable} -c "{STAGE}"',
                            "outs": [{"out/${item}.json": {"persist": False}}],
                        },
                    },
                    "total": {
                        "cmd": f'{sys.executable} -c "{TOTAL}"',
                        "deps": [f"out/{i}.json" for i in items],
                        "outs": ["total.txt"],
                    },
                }
            }
        )
    )
    return root


def test_repro_runs_the_items_at_once_and_dvc_agrees(tmp_path):
    root = _project(tmp_path, ["x", "y", "z"])
    proc = _repro(root)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert (
        "4 of 4 stages to run, up to 2 at once" in out and "[make@y] made y" in out and "Running stage 'total':" in out
    )
    assert (root / "total.txt").read_text() == "x,y,z"
    spans = sorted(json.loads((root / f"out/{i}.json").read_text())["span"] for i in "xyz")
    assert spans[1][0] < spans[0][1] and spans[2][0] >= min(spans[0][1], spans[1][1])  # two at once, never three
    status = subprocess.run([DVC, "status", "--json"], cwd=root, capture_output=True, text=True, check=True)
    assert json.loads(status.stdout) == {}
    assert "up to date" in _repro(root).stdout
    forced = _repro(root, force={"make@x"})
    assert "1 of 4 stages to run" in forced.stdout and "[make@x] made x" in forced.stdout


def test_a_failed_stage_is_named_and_the_others_are_recorded(tmp_path):
    root = _project(tmp_path, ["bad", "good"])
    proc = _repro(root)
    assert proc.returncode == 1
    err = proc.stderr
    assert "failed: make@bad, exit status 3: made bad" in err and "not run: total (needs make@bad, which failed)" in err
    status = json.loads(
        subprocess.run([DVC, "status", "--json"], cwd=root, capture_output=True, text=True, check=True).stdout
    )
    assert "make@good" not in status and "make@bad" in status  # the good item is in dvc.lock


def test_of_the_ready_stages_the_one_more_stages_wait_on_starts_first():
    """A regime (two stages after it) and vectors (the merges after it) are ready together; one at a time, vectors
    starts first."""
    nodes = [
        StageNode("regime@r", ("r",), ()),
        StageNode("vectors", ("v",), ()),
        *(StageNode(f"merge@{i}", ("m",), ("vectors",)) for i in range(3)),
        StageNode("regime_merge@r", ("rm",), ("regime@r",)),
    ]
    started = []

    def work(node):
        started.append(node.address)
        return {"stage": node.address}

    with ThreadPoolExecutor(1) as pool:
        outcome = run_graph(nodes, lambda node, upstream: pool.submit(work, node), lambda address: None, limit=1)
    assert started[0] == "vectors" and len(outcome.done) == len(nodes)


def test_a_stage_that_takes_every_core_runs_alone_and_items_pair_up():
    """On 2 cores: the fine-tunes (one core each) two at once, vectors (every core) alone, and nothing started
    beside it while it waits for a core."""
    nodes = [
        *(StageNode(f"finetune@{t}", ("f",), ()) for t in "abc"),
        StageNode("vectors", ("v",), tuple(f"finetune@{t}" for t in "abc")),
        StageNode("regime@r", ("r",), ("finetune@a",)),
    ]
    together, running, lock = [], set(), threading.Lock()

    def work(node):
        with lock:
            running.add(node.address)
            together.append(set(running))
        time.sleep(0.05)
        with lock:
            running.discard(node.address)
        return {"stage": node.address}

    def cores(node):
        return 1 if "@" in node.address and not node.address.startswith("regime") else 2

    with ThreadPoolExecutor(4) as pool:
        outcome = run_graph(
            nodes,
            lambda node, upstream: pool.submit(work, node),
            lambda address: None,
            limit=4,
            cores=cores,
            capacity=2,
        )
    assert len(outcome.done) == len(nodes)
    assert max(len(s) for s in together) == 2 and all(len(s) == 1 for s in together if {"vectors", "regime@r"} & s)


def test_a_stage_that_does_not_wait_for_the_finished_one_starts_during_its_commit():
    """One stage at a time: while merge@0 is committed, merge@1 (which needs only vectors) is already running;
    report, which needs every merge, starts only after the last commit, and vectors' own commit comes before any
    merge (they wait for it)."""
    nodes = [
        StageNode("vectors", ("v",), ()),
        *(StageNode(f"merge@{i}", ("m",), ("vectors",)) for i in range(3)),
        StageNode("report", ("r",), tuple(f"merge@{i}" for i in range(3))),
    ]
    events, lock = [], threading.Lock()

    def work(node):
        with lock:
            events.append(("start", node.address))
        return {"stage": node.address}

    def commit(address):
        with lock:
            events.append(("commit", address))
        time.sleep(0.2)  # long enough for the pool to start the next stage
        with lock:
            events.append(("committed", address))

    with ThreadPoolExecutor(1) as pool:
        outcome = run_graph(nodes, lambda node, upstream: pool.submit(work, node), commit, limit=1)
    assert len(outcome.done) == len(nodes)
    at = {event: i for i, event in enumerate(events)}
    assert at[("start", "merge@0")] > at[("committed", "vectors")]  # downstream: after the commit
    assert at[("commit", "merge@0")] < at[("start", "merge@1")] < at[("committed", "merge@0")]  # beside it
    assert at[("start", "report")] > at[("committed", "merge@2")]


GPU_STAGE = (
    "import json, os, time\n"
    "from mergeflow.runner.stage_server import SERVER_ENV\n"
    "start = time.time(); time.sleep(0.5)\n"
    "env = {k: v for k, v in os.environ.items() if k not in ('DVC_STAGE', 'DVC_ROOT')}\n"
    "item = os.environ['DVC_STAGE'].split('@')[1]\n"
    "json.dump({'item': item, 'device': os.environ['CUDA_VISIBLE_DEVICES'], 'span': [start, time.time()], 'server': "
    "os.environ.get(SERVER_ENV), 'listening': os.path.exists(os.environ.get(SERVER_ENV, '')), 'env': env}, "
    "open(f'out/{item}.json', 'w'))\n"
)


def test_repro_gives_each_stage_a_gpu_to_itself_and_that_gpus_stage_server(tmp_path):
    """Two pretend GPUs (CUDA_VISIBLE_DEVICES "6,9": on the CPU they are only handed out), three stages: two at
    once, each with a GPU no running stage has, and the address of the stage server started for that GPU, whose
    environment matches the stage's import-time variables (so a stage command forks from it rather than
    importing torch again: mergeflow.runner.stage_server)."""
    from mergeflow.runner.stage_server import SERVER_ENV, _import_time_env, _same_imports

    root = _project(tmp_path, ["x", "y", "z"])
    (root / "stage.py").write_text(GPU_STAGE)
    stages = json.loads((root / "dvc.yaml").read_text())
    stages["stages"]["make"]["do"]["cmd"] = f"{sys.executable} stage.py"
    (root / "dvc.yaml").write_text(json.dumps(stages))
    env = {k: v for k, v in os.environ.items() if k != SERVER_ENV} | {"CUDA_VISIBLE_DEVICES": "6,9"}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; from mergeflow.runner.scheduler import repro; sys.exit(repro({str(root)!r}))",
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        "4 of 4 stages to run, up to 2 at once on a GPU each (6, 9)" in proc.stdout
        and "Running stage 'make@x' on GPU " in proc.stdout
    )
    runs = [json.loads((root / f"out/{i}.json").read_text()) for i in "xyz"]
    assert {r["device"] for r in runs} == {"6", "9"}
    for a in runs:  # never two at once on one GPU
        assert all(
            b is a or b["device"] != a["device"] or b["span"][0] >= a["span"][1] or a["span"][0] >= b["span"][1]
            for b in runs
        )
    assert all(r["env"]["MERGEFLOW_RUN_GPUS"] == "2" for r in runs)  # their threads: the cores' share of one GPU
    servers = {r["device"]: r["server"] for r in runs}
    assert len(set(servers.values())) == 2 and all(r["listening"] for r in runs)
    for r in runs:
        own = _import_time_env(r["env"])
        assert _same_imports(own, _import_time_env(env | {"CUDA_VISIBLE_DEVICES": r["device"]}), {})  # its server's
        assert not _same_imports(own, _import_time_env(env), {})  # not a server started with both GPUs
    assert not any(Path(s).exists() for s in servers.values())  # the servers ended with the run


def test_stages_kept_on_the_cpu_by_params_get_no_gpu(tmp_path, monkeypatch, repo_root):
    """runtime.device: cpu keeps every stage on the CPU: no GPU is handed out (the stages share the cores)."""
    import yaml

    from mergeflow.runner.scheduler import stage_gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,9")
    params = yaml.safe_load((repo_root / "params.yaml").read_text())
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    assert stage_gpus(tmp_path) == ["6", "9"]  # runtime.device: auto
    params["runtime"]["device"] = "cpu"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    assert stage_gpus(tmp_path) == []
    (tmp_path / "params.yaml").write_text(json.dumps({"items": ["x"]}))
    assert stage_gpus(tmp_path) == ["6", "9"]  # a DVC project of another kind: the GPUs this machine shows


def test_a_stopped_gpu_run_records_the_stages_waiting_for_a_gpu_as_not_run(tmp_path):
    """Five stages, four threads, two pretend GPUs: SIGINT while two run. The two running ones are stopped; the
    ones waiting for a GPU (and the one never started) are not run, not failed; the run ends 130."""
    import signal

    root = _project(tmp_path, list("abcde"))
    (root / "stage.py").write_text("import os, time\nprint('start', flush=True)\ntime.sleep(60)\n")
    stages = json.loads((root / "dvc.yaml").read_text())
    stages["stages"] = {
        "make": stages["stages"]["make"]
        | {"do": stages["stages"]["make"]["do"] | {"cmd": f"{sys.executable} stage.py"}}
    }
    (root / "dvc.yaml").write_text(json.dumps(stages))
    env = {k: v for k, v in os.environ.items() if k != "MERGEFLOW_STAGE_SERVER"} | {"CUDA_VISIBLE_DEVICES": "7,9"}
    code = f"import sys; from mergeflow.runner.scheduler import repro; sys.exit(repro({str(root)!r}, 4))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if sum(text.endswith("] start\n") for text in lines) == 2:  # two stages run, the others wait for a GPU
            proc.send_signal(signal.SIGINT)
            break
    out = "".join(lines) + proc.stdout.read()
    assert proc.wait() == 130, out
    failed = [line for line in out.splitlines() if line.startswith("failed: ")]
    assert len(failed) == 2 and all("exit status -15" in line for line in failed), out  # the two that ran
    not_run = next(line for line in out.splitlines() if line.startswith("not run: "))
    assert not_run.count("(the run was stopped)") == 3, out


def test_a_stage_given_a_gpu_forks_from_that_gpus_server_and_not_from_another(tmp_path, monkeypatch):
    """The per-GPU stage servers: a stage command whose environment names GPU 9 and GPU 9's server is served by it
    (forward returns the forked stage's exit status, here report's bad-input 2 in an empty folder); sent to GPU 7's
    server instead, the server refuses it (its CUDA_VISIBLE_DEVICES differs: an import-time variable) and the
    command would run in its own process (forward returns None)."""
    from mergeflow.runner.stage_server import SERVER_ENV, running_servers

    monkeypatch.delenv(SERVER_ENV, raising=False)
    child = (
        "import sys; from mergeflow.runner.stage_server import forward; "
        "sys.exit(100 if (r := forward(['report'])) is None else r)"
    )
    with running_servers(["7", "9"]) as servers:
        assert all(servers.values())
        for server, expected in ((servers["9"], 2), (servers["7"], 100)):
            env = {
                **os.environ,
                "CUDA_VISIBLE_DEVICES": "9",
                SERVER_ENV: server,
                "DVC_STAGE": "report",
                "DVC_ROOT": str(tmp_path),
            }
            proc = subprocess.run([sys.executable, "-c", child], cwd=tmp_path, env=env, capture_output=True, text=True)
            assert proc.returncode == expected, proc.stderr[-1000:]


def test_a_runners_own_failure_of_several_lines_is_its_first():
    """Dask's errors run to several lines (its deserialization error, ten): the flow's error line is the first."""
    from mergeflow.runner.scheduler import RunOutcome

    outcome = RunOutcome(["merge@ties"])
    outcome.failed["merge@ties"] = RuntimeError(
        "Error during deserialization of the task graph. This frequently\n"
        "occurs if the Scheduler and Client have different environments."
    )
    assert (
        outcome.error_line("merge@ties")
        == "RuntimeError: Error during deserialization of the task graph. This frequently"
    )
    assert outcome.status("merge@ties") == "did not finish"
