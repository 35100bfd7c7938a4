"""Running the stale stages of dvc.yaml as a graph, several at once: which stage may start, and what a run did.
`mergeflow repro` runs it on a thread pool here (``repro``); the Prefect flow (flows/pipeline.py) runs the same
loop on Prefect's task runners.

A stage starts when its upstream stages are done and the running stages' threads leave it cores: each stage's
threads follow from params.yaml and the machine (``Params.stage_share``: the items of a foreach stage share the
cores, at least 2 threads each), so they give the same bytes however they are run. On 2 cores every stage takes
both and they run one at a time (a second stage on one thread each finished no sooner: 2026-11-26); on 16 cores
eight fine-tunes run at once. Where there are GPUs, each running stage gets one to itself instead (as the flow
does): a merge of the 8-task benchmark keeps its 13 GB of images on the device (14.7 GiB at its peak on an H100), and
eight at once would not fit.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from mergeflow.core.devices import RUN_GPUS_ENV
from mergeflow.core.errors import first_line
from mergeflow.runner.gpus import DevicePool, visible_gpus
from mergeflow.runner.graph import (
    StageNode,
    changed_stages,
    commit_stage,
    locked_repo,
    stage_graph,
    stale_stages,
    still_changed,
)
from mergeflow.runner.running import StageFailed, StageNotStarted, run_stage, stop_stages, stopping
from mergeflow.runner.stage_server import CUDA_DEVICES_ENV, SERVER_ENV, running_server, running_servers, served_env


@dataclass
class RunOutcome:
    """What a run did with its stale stages, each named by its address."""

    planned: list[str]  # the stale stages, in dependency order
    done: list[str] = field(default_factory=list)  # completed and committed to dvc.lock
    failed: dict[str, BaseException] = field(default_factory=dict)  # address -> its failure (StageFailed, mostly)
    not_run: dict[str, str] = field(default_factory=dict)  # address -> why it never started
    # downstream of a changed stage, but up to date once that one ran (the sources stage's files: a method's
    # change leaves the other merges' unchanged): not run
    up_to_date: list[str] = field(default_factory=list)

    def settled(self, address: str) -> bool:
        """Whether ``address`` completed or was found up to date: what waits for it may start."""
        return address in self.done or address in self.up_to_date

    def error_line(self, address: str) -> str:
        """A failed stage's one line: its own last line (``error: ...`` for bad input), or the failure's message."""
        err = self.failed[address]
        # a runner's own failure (Dask's) may run to several lines: its first
        return err.tail if isinstance(err, StageFailed) else f"{type(err).__name__}: {first_line(err)}"

    def status(self, address: str) -> str:
        err = self.failed[address]
        if not isinstance(err, StageFailed):
            return "did not finish"
        return f"exit status {err.returncode}" + (" (bad input)" if err.bad_input else "")


def run_graph(
    nodes: list[StageNode],
    submit: Callable[[StageNode, list], object],
    commit: Callable[[str], None],
    limit: int | None = None,
    on_stop: Callable[[], None] | None = None,
    cores: Callable[[StageNode], int] | None = None,
    capacity: int | None = None,
    must_run: Callable[[StageNode], bool] | None = None,
) -> RunOutcome:
    """Run ``nodes`` (stale stages, in dependency order): ``submit(node, upstream_futures)`` starts one and returns
    a future (concurrent.futures' or Prefect's); ``commit(address)`` records a finished one in dvc.lock, one at a
    time from this thread. A stage starts once every stage it waits for in this run has completed and been
    committed (one that does not wait for the stage just finished starts while that one is committed), at most
    ``limit`` at once and, given ``cores(node)`` and ``capacity``, only while the cores of the running stages leave
    it room (a stage that takes every core runs alone: more threads than cores only contend, and OpenMP's waiting
    threads spin). Of the stages ready at once, the one more stages wait on starts
    first, and none after it starts before it. One downstream of a failure never starts and is recorded as not
    run, by address. The calling thread waits in short spells (Python runs signal handlers only on the main
    thread); ``on_stop`` is called once when the run is being stopped (stop_stages). Given ``must_run(node)``, a
    stage whose upstream stages in this run are settled is asked first whether it still has to run (DVC's status
    of that stage, now that they ran): one that has not is up to date, and counts as settled for what waits on it."""
    outcome = RunOutcome([n.address for n in nodes])
    starts = _Starts(nodes, outcome, submit, limit, cores, capacity, must_run)
    starts.submit_ready()
    while len(outcome.done) + len(outcome.failed) + len(outcome.not_run) + len(outcome.up_to_date) < len(nodes):
        try:
            address, future = starts.finished.get(timeout=0.5)
        except queue.Empty:
            if stopping():
                if on_stop is not None:
                    on_stop()
                    on_stop = None
                starts.submit_ready()  # what still waits will not start
            continue
        starts.running.pop(address, None)
        try:
            result = future.result()
        except StageNotStarted:  # it waited (for a GPU) while the run was being stopped
            outcome.not_run[address] = "the run was stopped"
        except Exception as err:  # noqa: BLE001 - reported by address; stages that do not depend on it go on
            outcome.failed[address] = err
        else:
            starts.submit_ready(committing=address)  # DVC's commit hashes the outputs: the next stage need not wait
            commit(result["stage"])
            outcome.done.append(address)
        starts.submit_ready()
    return outcome


class _Starts:
    """run_graph's stages that wait to start, and the starting of those that are ready and fit beside the running
    ones; each started stage's future is put on ``finished`` as (address, future) when it is done."""

    def __init__(
        self,
        nodes: list[StageNode],
        outcome: RunOutcome,
        submit: Callable[[StageNode, list], object],
        limit: int | None,
        cores: Callable[[StageNode], int] | None,
        capacity: int | None,
        must_run: Callable[[StageNode], bool] | None,
    ) -> None:
        self.outcome = outcome
        # of the stages ready at once, those more stages wait on start first (vectors before a regime: 24 merges wait)
        self.waiting = {n.address: n for n in sorted(nodes, key=lambda n: -len(_downstream(nodes, n.address)))}
        self.submit, self.limit, self.cores, self.capacity, self.must_run = submit, limit, cores, capacity, must_run
        self.futures: dict = {}
        self.running: dict[str, int] = {}  # address -> its cores
        self.finished: queue.Queue = queue.Queue()

    def fits(self, node: StageNode) -> bool:
        if self.limit is not None and len(self.running) >= self.limit:
            return False
        return (
            not self.running
            or self.cores is None
            or self.capacity is None
            or sum(self.running.values()) + self.cores(node) <= self.capacity
        )

    def submit_ready(self, committing: str | None = None) -> None:
        """Start what is ready; ``committing``: a finished stage not yet committed, whose downstream stages wait
        for its commit (and keep their turn: none after them starts first)."""
        outcome, futures, must_run = self.outcome, self.futures, self.must_run
        changed = True
        while changed:  # a stage recorded as not run makes the stages after it not run
            changed = False
            full = False  # a ready stage did not fit: none after it may take its place
            for address, node in list(self.waiting.items()):
                upstream = [u for u in node.upstream if u in outcome.planned]
                blocked = next((u for u in upstream if u in outcome.failed or u in outcome.not_run), None)
                if blocked or stopping():
                    outcome.not_run[address] = (
                        f"needs {blocked}, which {'failed' if blocked in outcome.failed else 'did not run'}"
                        if blocked
                        else "the run was stopped"
                    )
                elif committing in upstream:
                    full = full or all(outcome.settled(u) or u == committing for u in upstream)
                    continue
                elif all(outcome.settled(u) for u in upstream) and must_run is not None and not must_run(node):
                    outcome.up_to_date.append(address)
                elif all(outcome.settled(u) for u in upstream) and not full and self.fits(node):
                    future = self.submit(node, [futures[u] for u in upstream if u in futures])
                    futures[address] = future
                    self.running[address] = self.cores(node) if self.cores else 1
                    future.add_done_callback(lambda f, a=address: self.finished.put((a, f)))
                else:
                    full = full or all(outcome.settled(u) for u in upstream)
                    continue
                del self.waiting[address]
                changed = True


def stage_cores(root: str | Path) -> tuple[Callable[[StageNode], int] | None, int]:
    """(the cores each stage takes, the cores here): its threads as the stage will read them (Params.threads:
    MERGEFLOW_THREADS, runtime.threads, else its share), at most every core. None when params.yaml does not load
    (a DVC project of another kind): then only the number of stages at once is bounded."""
    from mergeflow.params import load_params
    from mergeflow.core.errors import MergeflowError

    capacity = os.cpu_count() or 1
    try:
        params = load_params(Path(root) / "params.yaml")
    except MergeflowError:
        return None, capacity
    env = os.environ.get("MERGEFLOW_THREADS", "")
    fixed = int(env) if env.isdecimal() else params.runtime.threads

    def cores(node: StageNode) -> int:
        return max(1, min(capacity, fixed or params.stage_share(node.address, capacity) or capacity))

    return cores, capacity


def stage_gpus(root: str | Path) -> list[str]:
    """The GPUs a run's stages each get one of to themselves (gpus.visible_gpus): none where params.yaml
    keeps the stages on the CPU (runtime.device: cpu)."""
    from mergeflow.params import load_params
    from mergeflow.core.errors import MergeflowError

    try:
        if load_params(Path(root) / "params.yaml").runtime.device == "cpu":
            return []
    except MergeflowError:
        pass  # a DVC project of another kind
    return visible_gpus()


def _downstream(nodes: list[StageNode], address: str) -> set[str]:
    """The stages of ``nodes`` that wait, directly or not, on the stage at ``address``."""
    found, frontier = set(), [address]
    while frontier:
        current = frontier.pop()
        for n in nodes:
            if current in n.upstream and n.address not in found:
                found.add(n.address)
                frontier.append(n.address)
    return found


# ---------------------------------------------------------------- `mergeflow repro`: the graph on a thread pool here
_print_lock = threading.Lock()


def _say(text: str, stream=None) -> None:
    with _print_lock:
        print(text, file=stream or sys.stdout, flush=True)


def repro(
    root: str | Path = ".", workers: int | None = None, force: set[str] = frozenset(), env: dict[str, str] | None = None
) -> int:
    """Run every stale stage of the DVC project at ``root`` (and those in ``force``), ``workers`` at once (default:
    one per GPU, else one per core), each committed to dvc.lock as it completes. Each line a stage prints is shown
    as it comes, after ``[<stage>]``. Returns the exit status: 0, 1 when a stage failed (each named with its status
    and last line; what does not depend on it still ran), 130 when stopped by SIGINT or SIGTERM."""
    root = Path(root).resolve()
    gpus = stage_gpus(root)
    workers = workers or len(gpus) or os.cpu_count() or 1
    devices = DevicePool(gpus)
    # DVC names a stage relative to the working directory, and a stage learns its item from that name (DVC_STAGE)
    with contextlib.ExitStack() as stack:
        # the stages fork from a process that has imported torch and timm (mergeflow.runner.stage_server), seconds saved
        # a stage; where there are GPUs, from one such process per GPU. Started first: they import while DVC reads.
        servers = stack.enter_context(running_servers(gpus))
        address = None if gpus else stack.enter_context(running_server())
        # the stages' threads: the cores' share of one GPU, where each has one (Params.stage_share)
        stage_env = (
            (env or {}) | ({SERVER_ENV: address} if address else {}) | ({RUN_GPUS_ENV: str(len(gpus))} if gpus else {})
        )
        stack.enter_context(contextlib.chdir(root))
        repo = stack.enter_context(locked_repo(root))
        nodes = stage_graph(repo)
        changed = changed_stages(repo)
        stale = stale_stages(repo, nodes, changed=changed) | set(force)  # a forced stage alone: not what follows it
        to_run = [n for n in nodes if n.address in stale]
        if not to_run:
            _say("Data and pipelines are up to date.")
            return 0
        cores, capacity = stage_cores(root) if not gpus else (None, None)
        where = f"a GPU each ({', '.join(gpus)})" if gpus else f"{capacity} cores"
        _say(
            f"{len(to_run)} of {len(nodes)} stages to run, up to "
            f"{min(workers, len(to_run), len(gpus) or workers)} at once on {where}"
        )
        one = _stage_runner(devices, root, stage_env, servers)
        with _stopping_on_signals(), ThreadPoolExecutor(workers, thread_name_prefix="stage") as pool:
            outcome = run_graph(
                to_run,
                lambda node, _: pool.submit(one, node),
                lambda address: commit_stage(repo, address),
                limit=workers,
                cores=cores,
                capacity=capacity,
                must_run=still_changed(repo, changed | set(force)),
            )
    return _report(outcome, len(to_run))


def _stage_runner(
    devices: DevicePool, root: Path, stage_env: dict[str, str], servers: dict[str, str | None]
) -> Callable[[StageNode], dict]:
    """What a pool thread runs for one stage: on a GPU of its own where there are GPUs (forked from that GPU's
    server), each line it prints shown after ``[<stage>]``; its result is run_stage's."""

    def one(node: StageNode) -> dict:
        with devices.lease() as device_env:
            if stopping():  # it waited for a GPU while the run was being stopped
                raise StageNotStarted(node.address)
            _say(
                f"Running stage '{node.address}'" + (f" on GPU {device_env[CUDA_DEVICES_ENV]}:" if device_env else ":")
            )
            started = time.monotonic()
            result = run_stage(
                node,
                root,
                stage_env | served_env(device_env, servers),
                echo=lambda line, stream: _say(f"[{node.address}] {line}", stream),
            )
        _say(f"[{node.address}] done in {time.monotonic() - started:.1f} s")
        return result

    return one


@contextlib.contextmanager
def _stopping_on_signals():
    """SIGINT and SIGTERM stop the run (_stop) while the context lasts, where this is the main thread (only it
    may set handlers); the previous handlers are back afterwards."""
    previous = (
        {s: signal.signal(s, _stop) for s in (signal.SIGINT, signal.SIGTERM)}
        if threading.current_thread() is threading.main_thread()
        else {}
    )
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _report(outcome: RunOutcome, planned: int) -> int:
    """Say what the run of ``planned`` stages did (its failures and what did not run on stderr) and return the exit
    status: 130 when it was stopped, 1 when a stage failed or did not run, else 0."""
    for address in outcome.failed:
        _say(f"failed: {address}, {outcome.status(address)}: {outcome.error_line(address)}", sys.stderr)
    if outcome.not_run:
        _say(f"not run: {'; '.join(f'{a} ({why})' for a, why in outcome.not_run.items())}", sys.stderr)
    if stopping():
        _say(
            f"stopped: {len(outcome.done)} of {planned} stages "
            "completed and are recorded in dvc.lock; the rest run next time",
            sys.stderr,
        )
        return 130
    if outcome.failed or outcome.not_run:
        return 1
    up_to_date = (
        f"; {len(outcome.up_to_date)} more were up to date once the stages before them ran"
        if outcome.up_to_date
        else ""
    )
    _say(f"{len(outcome.done)} stages ran; dvc.lock records them{up_to_date}")
    return 0


def _stop(signum, frame) -> None:
    """SIGINT or SIGTERM: stop the running stages and start no more (a second signal kills at once)."""
    signal.signal(signum, signal.SIG_DFL)
    stopped = stop_stages()
    _say(f"mergeflow: {signal.Signals(signum).name}: stopped {stopped} running stages", sys.stderr)
