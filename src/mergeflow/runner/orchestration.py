"""The stage graph as DVC defines it (dvc.yaml), for the Prefect flow: which stages there are, what each waits
for, which are out of date, running one stage's command, and recording it in dvc.lock.

The flow holds no copy of the pipeline: it reads the stages from dvc.yaml, runs their commands, and commits each
finished stage to dvc.lock, so after a Prefect run ``dvc status`` is clean, and after ``dvc repro`` the flow
finds nothing to redo.

Safety, and why:
- commands run as argument lists, never through a shell: no value can become code;
- the flow holds DVC's repository lock for its whole run (``locked_repo``), so a concurrent ``dvc repro`` is
  refused with DVC's one line instead of doing the same work, and it refuses to start while another DVC command
  is running a stage; its dvc.lock writes are atomic (mergeflow.core.lockfile);
- stages run in their own process groups, are stopped with the flow (``stop_stages``), and die with it when it is
  killed outright (the parent-death signal the CLI asks for: ``DIE_WITH_PARENT_ENV``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from mergeflow.core import lockfile
from mergeflow.core.errors import BAD_INPUT_STATUS, TRANSIENT_STATUS, MergeflowError
from mergeflow.runner.stage_server import CUDA_DEVICES_ENV

# set to the flow's pid in a stage's environment: the stage asks the kernel to send it SIGTERM when the flow dies
DIE_WITH_PARENT_ENV = "MERGEFLOW_DIE_WITH_PARENT"
_SHELL_TOKENS = {"&&", "||", ";", "|", ">", ">>", "<", "&"}


@dataclass(frozen=True)
class StageNode:
    address: str  # e.g. "finetune@digits"
    argv: tuple[str, ...]  # the stage's command, split as a POSIX shell would split it, run without one
    upstream: tuple[str, ...]  # stages whose outputs this one reads
    outs: tuple[str, ...] = ()  # its outputs, relative to the repository root


def _repo(root: str | Path):
    from dvc.repo import Repo

    return Repo(str(root))


def _argv(address: str, cmd) -> tuple[str, ...]:
    if not isinstance(cmd, str):
        raise MergeflowError(f"dvc.yaml: stage '{address}' has a list of commands; the flow runs one command per stage")
    argv = tuple(shlex.split(cmd))
    if not argv or _SHELL_TOKENS & set(argv):
        raise MergeflowError(f"dvc.yaml: stage '{address}' command {cmd!r} needs a shell; the flow runs commands as argument lists")
    return argv


def stage_graph(root_or_repo=".") -> list[StageNode]:
    """Every stage of dvc.yaml, in an order where each comes after those it depends on."""
    import networkx as nx

    with contextlib.nullcontext(root_or_repo) if not isinstance(root_or_repo, (str, Path)) else _repo(root_or_repo) as repo:
        graph = repo.index.graph  # edges point from a stage to the stages it depends on
        order = list(reversed(list(nx.topological_sort(graph))))
        return [StageNode(s.addressing, _argv(s.addressing, s.cmd), tuple(sorted(u.addressing for u in graph.successors(s))), tuple(str(o.def_path) for o in s.outs)) for s in order]


def stale_stages(root_or_repo, nodes: list[StageNode], also: set[str] | frozenset[str] = frozenset()) -> set[str]:
    """Stages DVC reports as changed (and those in ``also``), and every stage downstream of one."""
    with contextlib.nullcontext(root_or_repo) if not isinstance(root_or_repo, (str, Path)) else _repo(root_or_repo) as repo:
        changed = set(repo.status()) | set(also)
    downstream = {n.address: set() for n in nodes}
    for n in nodes:
        for u in n.upstream:
            downstream[u].add(n.address)
    stale, frontier = set(), list(changed)
    while frontier:
        address = frontier.pop()
        if address in stale:
            continue
        stale.add(address)
        frontier.extend(downstream.get(address, ()))
    return stale


def _running_dvc_commands(root: Path) -> list[str]:
    """Commands another DVC process is running here: DVC records them in .dvc/tmp/rwlock while a stage runs (it
    releases its repository lock meanwhile, so the lock alone does not show them)."""
    from mergeflow.core.io import process_alive  # torch with it: not for a stage command's start (die_with_parent)

    path = root / ".dvc" / "tmp" / "rwlock"
    try:
        lock = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    infos = [*(i for entries in lock.get("read", {}).values() for i in entries), *lock.get("write", {}).values()]
    return sorted({f"pid {i['pid']}: {i['cmd']}" for i in infos if isinstance(i, dict) and i.get("pid") != os.getpid() and process_alive(int(i.get("pid", 0)))})


@contextlib.contextmanager
def locked_repo(root: str | Path = ".") -> Iterator:
    """The DVC repository at ``root``, with DVC's repository lock held until the context ends and dvc.lock written
    atomically. Refuses (one line, MergeflowError) when another DVC command holds the lock or is running a stage."""
    from dvc.lock import LockError
    from dvc.repo import lock_repo

    root = Path(root)
    with lockfile.atomic_dvc_writes(), _repo(root) as repo, contextlib.ExitStack() as stack:
        try:
            stack.enter_context(lock_repo(repo))
        except LockError:
            raise MergeflowError(f"{root.resolve()}: another DVC command holds the repository lock; run again when it ends") from None
        if running := _running_dvc_commands(root):
            raise MergeflowError(f"{root.resolve()}: another DVC command is running a stage here ({running[0]}); run again when it ends")
        yield repo


def commit_stage(repo, address: str) -> None:
    """Record a finished stage's outputs in dvc.lock and the cache (call with the repository lock held), and keep
    the new dvc.lock as the last whole copy (mergeflow.core.lockfile)."""
    repo.commit(f"{os.path.join(repo.root_dir, 'dvc.yaml')}:{address}", force=True)  # the repository's, whatever the cwd
    lockfile.keep_good_copy(repo.root_dir, check=False)  # written atomically (locked_repo): whole


class StageFailed(Exception):
    """A stage that exited with a non-zero status: ``tail`` is the last line it printed (its ``error: ...`` line
    for bad input), ``output`` the end of what it printed (stdout and stderr)."""

    def __init__(self, address: str, returncode: int, tail: str, output: str = ""):
        self.address, self.returncode, self.tail, self.output = address, returncode, tail, output
        super().__init__(f"stage {address} exited with status {returncode}: {tail}")

    def __reduce__(self):  # pickled whole: a Dask worker sends the failure back to the flow
        return type(self), (self.address, self.returncode, self.tail, self.output)

    @property
    def transient(self) -> bool:
        """Worth a retry: killed by a signal (the OOM killer, a preempted node) or a transient error (status 75).
        Bad input (2) and unexpected errors (1, a traceback) fail the same way again."""
        return (self.returncode < 0 or self.returncode == TRANSIENT_STATUS) and not _stopping.is_set()

    @property
    def bad_input(self) -> bool:
        return self.returncode == BAD_INPUT_STATUS


class StageNotStarted(StageFailed):
    """A stage the run was stopped before (one that waited for a GPU, say): recorded as not run, not as failed."""

    def __init__(self, address: str, returncode: int = -signal.SIGTERM, tail: str = "not started: the run is stopping", output: str = ""):
        super().__init__(address, returncode, tail, output)


class PipelineFailed(MergeflowError):
    """Stages of a flow run failed (each is reported with its own status and last line)."""

    exit_status = 1


class OneLineFailures(logging.Filter):
    """Drops the traceback Prefect logs with a failed stage (StageFailed) or bad input (MergeflowError): the
    message already names the stage and holds its own error line, and a traceback through the flow's machinery
    reads as a crash of mergeflow. A stage's own traceback (an unexpected error) is in its logged output."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], (StageFailed, MergeflowError)):
            record.exc_info, record.exc_text = None, None
        return True


def quiet_failure_tracebacks() -> None:
    """Install OneLineFailures on Prefect's flow- and task-run loggers (in each process that runs either)."""
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, OneLineFailures) for f in logger.filters):
            logger.addFilter(OneLineFailures())


_stopping = threading.Event()
_running: dict[int, subprocess.Popen] = {}
_running_lock = threading.Lock()


def stopping() -> bool:
    """Whether stop_stages was called: the run is being stopped on purpose."""
    return _stopping.is_set()


def stop_stages(grace_s: float = 10.0) -> int:
    """Stop every running stage (SIGTERM to its process group, SIGKILL after ``grace_s``) and start no more.
    Returns how many were running."""
    _stopping.set()
    with _running_lock:
        procs = list(_running.values())
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    return len(procs)


def _read_lines(stream, into: list[str], echo, target) -> None:
    for line in stream:
        into.append(line)
        echo(line.rstrip("\n"), target)


def run_stage(node: StageNode, root: str | Path = ".", env: dict[str, str] | None = None, echo: Callable[[str, object], None] | None = None) -> dict:
    """Run one stage's command in the repository root, in a process group of its own, as DVC would (DVC_STAGE and
    DVC_ROOT set). ``echo(line, sys.stdout or sys.stderr)`` is given each line the stage prints as it comes.
    Raises StageFailed with the last line the command printed when it fails."""
    if _stopping.is_set():
        raise StageNotStarted(node.address)
    root = Path(root).resolve()
    stage_env = {**os.environ, **(env or {}), "DVC_STAGE": node.address, "DVC_ROOT": str(root), DIE_WITH_PARENT_ENV: str(os.getpid())}
    with _running_lock:
        proc = subprocess.Popen(list(node.argv), cwd=root, env=stage_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        _running[proc.pid] = proc
    try:
        if echo is None:
            stdout, stderr = proc.communicate()
        else:
            out, err = [], []
            readers = [threading.Thread(target=_read_lines, args=(proc.stdout, out, echo, sys.stdout), daemon=True), threading.Thread(target=_read_lines, args=(proc.stderr, err, echo, sys.stderr), daemon=True)]
            for reader in readers:
                reader.start()
            for reader in readers:
                reader.join()
            proc.wait()
            stdout, stderr = "".join(out), "".join(err)
    finally:
        with _running_lock:
            _running.pop(proc.pid, None)
    if proc.returncode != 0:
        lines = (stderr or stdout).strip().splitlines()
        raise StageFailed(node.address, proc.returncode, lines[-1] if lines else "(no output)", (stdout + stderr)[-4000:])
    # stdout and stderr apart too: a stage's summary is the end of its stdout, and warnings on stderr must not
    # push it out of the lines the flow logs
    return {"stage": node.address, "argv": list(node.argv), "output": (stdout + stderr)[-4000:], "stdout": stdout[-4000:], "stderr": stderr[-4000:]}


def die_with_parent() -> None:
    """In a stage command: ask the kernel for SIGTERM when whatever started it dies, so that a launcher killed
    outright (SIGKILL, a closed terminal, a job scheduler) leaves no stage running; the stage's worker pools die
    with the stage in turn (mergeflow.core.parent_death.process_pool). Exits at once if the launcher is gone already.

    - Started by the flow (DIE_WITH_PARENT_ENV holds its pid; the stage leads its own process group): a SIGTERM
      is passed on to the whole group.
    - Started by plain ``dvc repro`` (DVC_STAGE set, not a group leader): DVC runs ``$SHELL -c CMD`` from its main
      thread (dvc.stage.run._run), so the signal comes when dvc dies, not before. bash and zsh exec a single
      command, and the parent is dvc itself; dash (Debian's /bin/sh, the shell when SHELL is unset) forks it and
      waits, and a shell outlives a killed dvc: then the stage watches dvc, its grandparent, through a pidfd
      (``_die_with_dvc``). The stage is in dvc's process group (the terminal's job: Ctrl-C reaches it), so a
      SIGTERM is not passed to the group: the stage kills its own child processes, then dies (``_end_children``);
      workers of mergeflow.core.parent_death.process_pool also die by their own parent-death signal.
    - A child of the stage server (its own group, DVC_STAGE passed on) or a command typed by hand: nothing to do
      (the server already asked, and kills the group when the command's connection closes)."""
    from mergeflow.core import parent_death

    flow = os.environ.get(DIE_WITH_PARENT_ENV)
    under_dvc = not flow and bool(os.environ.get("DVC_STAGE")) and os.getpgrp() != os.getpid()
    if not (flow or under_dvc) or not parent_death.ask(signal.SIGTERM):
        return
    if flow and os.getppid() != int(flow):
        raise SystemExit(f"error: the flow that started this stage (pid {flow}) is gone")
    if under_dvc:
        _die_with_dvc()
        signal.signal(signal.SIGTERM, _end_children)
        return

    def end_group(signum, frame):
        # the stage leads its own process group (run_stage): take its workers (prepare's process pool) with it
        signal.signal(signum, signal.SIG_DFL)
        os.killpg(os.getpgrp(), signum)

    signal.signal(signal.SIGTERM, end_group)


SHELLS = frozenset({"sh", "dash", "bash", "zsh", "ksh", "mksh", "fish", "busybox"})


def _stat(pid: int) -> tuple[str, int]:
    """A process's command name and parent pid (/proc/PID/stat); ("", 0) when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "", 0
    name, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
    return name, int(rest[1])


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``, and theirs (/proc)."""
    found, parents = [], {pid}
    for _ in range(4):  # workers, their helpers (a pool's resource tracker): a few levels at most
        level = []
        for entry in os.scandir("/proc"):
            if entry.name.isdigit() and int(entry.name) not in found and _stat(int(entry.name))[1] in parents:
                level.append(int(entry.name))
        if not level:
            break
        found += level
        parents = set(level)
    return found


def _end_children(signum, frame) -> None:
    """SIGTERM to a stage under plain dvc (its parent-death signal, or a kill): its worker processes die first
    (a pool started without mergeflow.core.parent_death's initializer, such as a regime's, would outlive it), then
    the stage, by the signal's default action."""
    signal.signal(signum, signal.SIG_DFL)
    for pid in _children(os.getpid()):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signum)


def _die_with_dvc() -> None:
    """Under plain dvc (the parent-death signal asked for): exit if the dvc command is gone already, and when a
    shell stands between it and the stage, SIGTERM to the stage when dvc exits (a pidfd watched by a thread)."""
    gone = "error: the dvc command that started this stage is gone"
    launcher = os.getppid()
    if launcher == 1:  # reparented before it asked
        raise SystemExit(gone)
    name, grandparent = _stat(launcher)
    if name not in SHELLS:
        return
    if grandparent in (0, 1):
        raise SystemExit(gone)
    try:
        pidfd = os.pidfd_open(grandparent)
    except ProcessLookupError:
        raise SystemExit(gone) from None
    except (OSError, AttributeError):
        return  # no pidfd here (Linux before 5.3): the stage dies with the shell only

    def watch() -> None:
        import select

        select.select([pidfd], [], [])  # readable once dvc has exited
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="die-with-dvc", daemon=True).start()


def describe(nodes: list[StageNode]) -> str:
    return "\n".join(f"{n.address}: {shlex.join(n.argv)} after {', '.join(n.upstream) or '-'}" for n in nodes)


def check_repo(root: str | Path) -> None:
    if not (Path(root) / "dvc.yaml").is_file() or not (Path(root) / ".dvc").is_dir():
        raise MergeflowError(f"{Path(root).resolve()}: not a DVC project with dvc.yaml (run from the repository root)")


# ---------------------------------------------------------------- the runner's and the schedule's arguments
MAX_WORKERS = 1024  # stages at once: more than any machine or cluster here runs; -1 or 1e9 is a slip
MAX_INTERVAL_S = 366 * 24 * 3600  # a scheduled run at least once a year
DASK_CONNECT_TIMEOUT_S = 10.0  # an unreachable scheduler is one line after this, not a traceback minutes later
DASK_DEFAULT_PORT = 8786


def workers_problem(value: object) -> str | None:
    """Why ``value`` cannot be the number of stages at once (--workers, the flow's ``workers``), or None."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{value!r} is not a whole number of stages at once (1 to {MAX_WORKERS:,})"
    if not 1 <= value <= MAX_WORKERS:
        return f"{value} stages at once: give 1 to {MAX_WORKERS:,}"
    return None


def workers_argument(text: str) -> int:
    """--workers (argparse's type): a whole number of stages at once, 1 to MAX_WORKERS."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = text
    if problem := workers_problem(value):
        raise argparse.ArgumentTypeError(problem)
    return value


def check_workers(workers: int | None, key: str = "--workers") -> None:
    if workers is not None and (problem := workers_problem(workers)):
        raise MergeflowError(f"{key}: {problem}")


def check_schedule(cron: str | None, interval: float | None) -> None:
    """A cron expression that is not blank, an interval that is a finite number of seconds in (0, a year]; the
    schedule's own parser checks the expression's syntax."""
    if cron is not None and not cron.strip():
        raise MergeflowError(f"--cron {cron!r}: give a cron expression, e.g. \"0 3 * * *\" (every day at 03:00)")
    if interval is not None and (isinstance(interval, bool) or not isinstance(interval, (int, float)) or not math.isfinite(interval) or not 0 < interval <= MAX_INTERVAL_S):
        shown = f"{interval:g}" if isinstance(interval, (int, float)) else repr(interval)
        raise MergeflowError(f"--interval {shown}: give a finite number of seconds above 0, at most {MAX_INTERVAL_S:,} (366 days)")


def probe_dask_scheduler(address: str, timeout: float = DASK_CONNECT_TIMEOUT_S, key: str = "--dask-address") -> None:
    """One line unless a Dask scheduler answers at ``address`` (tcp://HOST:PORT, tls://, ws://, wss://, or
    HOST[:PORT]) within about ``timeout`` seconds in all: a TCP connection first (a refused port or an unknown host
    fails at once), then Dask's own handshake (``distributed.comm.connect``: something else listening there, or
    nothing answering, fails within the time left). Other transports (inproc, ucx) are left to Dask."""
    import socket
    import time
    import urllib.parse

    deadline = time.monotonic() + timeout
    parts = urllib.parse.urlsplit(address if "://" in address else f"tcp://{address}")
    if parts.scheme not in ("tcp", "tls", "ws", "wss"):
        return
    try:
        host, port = parts.hostname, parts.port or DASK_DEFAULT_PORT
    except ValueError:
        host = None
    if not host:
        raise MergeflowError(f"{key} {address}: not a scheduler address (tcp://HOST:PORT)")
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except TimeoutError:
        raise MergeflowError(f"{key} {address}: no Dask scheduler answered within {timeout:g} s") from None
    except OSError as err:
        raise MergeflowError(f"{key} {address}: no Dask scheduler there ({err.strerror or type(err).__name__})") from None
    try:
        import asyncio
        from concurrent.futures import ThreadPoolExecutor

        from distributed.comm import connect
    except ImportError:
        return  # no Dask here: the runner's own check says so

    left = max(1.0, deadline - time.monotonic())

    async def handshake() -> None:
        # distributed's own timeout covers connecting, not a peer that accepts and then says nothing
        comm = await asyncio.wait_for(connect(address, timeout=left), left)
        comm.abort()

    pool = ThreadPoolExecutor(1)  # a loop of its own, whatever loop the caller's thread runs
    try:
        pool.submit(asyncio.run, handshake()).result(left + 2)
    except Exception as err:  # noqa: BLE001 - any failure to shake hands (a timeout, garbage read as a frame)
        why = (str(err).strip().splitlines() or [""])[0][:120]
        raise MergeflowError(f"{key} {address}: no Dask scheduler answers there ({type(err).__name__}{': ' + why if why else f' after {timeout:g} s'})") from None
    finally:
        pool.shutdown(wait=False)


# ---------------------------------------------------------------- GPUs: one stage per device


def parse_visible_devices(value: str) -> list[str]:
    """The device ids a CUDA_VISIBLE_DEVICES value names, as CUDA reads it: comma-separated indices or UUIDs,
    cut at the first invalid (negative) entry; "" names none."""
    devices = []
    for entry in (e.strip() for e in value.split(",")):
        if not entry or entry.startswith("-"):
            break
        devices.append(entry)
    return devices


def visible_gpus() -> list[str]:
    """The GPUs the flow's stages may use: those CUDA_VISIBLE_DEVICES names when it is set, else every device
    torch sees ("0", "1", ...); none on a machine without CUDA."""
    if CUDA_DEVICES_ENV in os.environ:
        return parse_visible_devices(os.environ[CUDA_DEVICES_ENV])
    from mergeflow.core.devices import cuda_devices  # without torch's import where there is no GPU driver (seconds)

    return [str(i) for i in range(cuda_devices())]


def worker_devices(devices: list[str] | tuple[str, ...], worker: int, workers: int) -> list[str]:
    """The share of ``devices`` that worker ``worker`` of ``workers`` (processes that each keep a pool of their
    own, such as a Dask LocalCluster's) hands out: devices worker, worker + workers, ..."""
    return list(devices[worker::workers]) if workers > 0 else list(devices)


class DevicePool:
    """Device ids handed out one per running stage and returned when it ends: a stage waits while every device
    is taken, so no two stages share a GPU. An empty pool (no GPU) hands out None at once."""

    def __init__(self, devices):
        self.devices = tuple(devices)
        self._free = list(self.devices)
        self._cond = threading.Condition()

    def acquire(self, timeout: float | None = None) -> str | None:
        """The first free device (lowest position first), waiting for one; None if the pool is empty. Raises
        TimeoutError when ``timeout`` seconds pass with every device taken."""
        if not self.devices:
            return None
        with self._cond:
            if not self._cond.wait_for(lambda: self._free, timeout):
                raise TimeoutError(f"no free device among {', '.join(self.devices)} after {timeout} s")
            return self._free.pop(0)

    def release(self, device: str | None) -> None:
        if device is None:
            return
        with self._cond:
            if device not in self.devices or device in self._free:
                raise ValueError(f"device {device!r} was not handed out by this pool")
            self._free.append(device)
            self._free.sort(key=self.devices.index)
            self._cond.notify()

    def free(self) -> list[str]:
        with self._cond:
            return list(self._free)

    @contextlib.contextmanager
    def lease(self) -> Iterator[dict[str, str]]:
        """Environment for one stage: {CUDA_VISIBLE_DEVICES: its device} for as long as the context lasts, or {}
        when the pool is empty (the stage sees what the flow sees)."""
        device = self.acquire()
        try:
            yield {} if device is None else {CUDA_DEVICES_ENV: device}
        finally:
            self.release(device)


_pools: dict[tuple[str, ...], DevicePool] = {}
_pools_lock = threading.Lock()


def process_device_pool(devices, workers: int | None = None, worker: int | None = None) -> DevicePool:
    """The device pool of this process, shared by every stage it runs at once (the thread runner's threads).
    A process that is worker ``worker`` of ``workers`` (a Dask LocalCluster's, one stage at a time each) hands
    out only its share (worker_devices)."""
    devices = tuple(devices or ())
    if workers and worker is not None:
        devices = tuple(worker_devices(devices, worker, workers))
    with _pools_lock:
        return _pools.setdefault(devices, DevicePool(devices))


def resume_stages() -> None:
    """Accept stages again after stop_stages: in a long-lived process that runs the stages of flow after flow (a
    worker of an existing Dask cluster), one flow's stop must not refuse the next flow's stages."""
    _stopping.clear()


OUTPUT_LINES = 20  # the last lines of a stage's output that reach the Prefect logs


def last_lines(output: str, n: int = OUTPUT_LINES) -> str:
    return "\n".join(output.strip().splitlines()[-n:])


def completed_line(node: StageNode, root: str, seconds: float, most: int = 6) -> str:
    """The stage's summary line: its address, time and the numbers at the top level of the metrics files it
    wrote (metrics/*.json), e.g. "merge@ties completed in 3.1 s: average=0.322, val_average=0.233"."""
    numbers = []
    for out in node.outs:
        if not (out.startswith("metrics/") and out.endswith(".json")):
            continue
        try:
            record = json.loads((Path(root) / out).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict):
            numbers += [f"{k}={v:.4g}" for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    shown = ", ".join(numbers[:most]) + (", ..." if len(numbers) > most else "")
    return f"{node.address} completed in {seconds:.1f} s" + (f": {shown}" if shown else "")


def local_cluster(**kwargs):
    """A Dask LocalCluster whose workers keep this process's thread settings: Dask's nannies otherwise set
    OMP_NUM_THREADS, MKL_NUM_THREADS and OPENBLAS_NUM_THREADS to 1 in every worker, and a stage (a worker's child)
    would run on one thread where `mergeflow repro` uses every core (slower, other bytes), and never fork from the
    stage server, whose imports read those variables."""
    import dask
    from distributed import LocalCluster

    keep = {k: v for k, v in dask.config.get("distributed.nanny.pre-spawn-environ", {}).items() if not k.endswith("_NUM_THREADS")}
    with dask.config.set({"distributed.nanny.pre-spawn-environ": keep}):
        return LocalCluster(**kwargs)
