"""A warm start for the pipeline's stages: one process imports torch, timm and the stages once, and forks a child
per stage, so that a stage pays milliseconds instead of seconds of imports.

A stage started by DVC is a new ``mergeflow <stage>`` process, and importing torch and timm (which pulls in
torchvision and torch._dynamo) took about 6 s of each stage's start on the 2-core machine: a third of the default
run. ``mergeflow repro`` (and the test suite) start a server for the run and put its socket in
``MERGEFLOW_STAGE_SERVER``; a stage command that finds it there sends its arguments, working directory,
environment and standard streams (the file descriptors themselves) to the server, which forks a child that runs
the command exactly as the process would have, on those streams, and reports its exit status. Without the variable,
or when the server cannot be reached, the command runs in its own process as before.

The child is the stage's only copy: it leads its own process group (its workers in it), and dies with the stage's
command: the command forwards SIGTERM, SIGINT and SIGHUP to it, and the server kills the group when the command's
connection closes (the command killed outright, by SIGKILL or its own parent's death). A child also dies with the
server (PR_SET_PDEATHSIG), and the server with its parent. The server itself never runs torch code (thread pools
start on first use, and forking a process that has them is unsafe) and is single-threaded for the same reason.

A command whose environment differs from the server's in a variable read at import time (HF_*, TORCH_*, OMP_*,
CUDA_*, ...: imported modules already hold their values) runs in its own process instead, as does ``--help``.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import selectors
import signal
import socket
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from mergeflow.core.stage_table import STAGES

SERVER_ENV = "MERGEFLOW_STAGE_SERVER"
CUDA_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"  # a stage's GPU (mergeflow.runner.gpus.DevicePool hands them out)
SERVE_COMMAND = "_serve-stages"  # `python -m mergeflow.cli _serve-stages ADDRESS`: the server (not a user command)
# the commands a server runs: the stages (everything else is quick or starts its own processes)
STAGE_COMMANDS = frozenset(STAGES)
# environment variables that libraries read when they are imported: a command whose values differ runs on its own
IMPORT_TIME_PREFIXES = (
    "HF_",
    "HUGGINGFACE_",
    "TORCH",
    "PYTORCH_",
    "ATEN_",
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "NPY_",
    "CUDA_",
    "NUMBA_",
    "TIMM_",
    "PYTHON",
    "LD_",
    "MERGEFLOW_DOWNLOAD",
    "MERGEFLOW_DETERMINISTIC",
)
# ... but for str's hash seed, which no stage's result may depend on (Dask's workers set one of their own)
_NOT_COMPARED = frozenset({"PYTHONHASHSEED"})
_HEADER = struct.Struct("!I")
# (track's MLflow store: 1.5 s of sqlalchemy and alembic a run, which every experiment ends with)
_PRELOAD = (
    "torch",
    "timm",
    "mergeflow.pipeline.stages",
    "mergeflow.cli",
    "mergeflow.ml.merging._kernels",
    "sklearn.linear_model",
    "matplotlib.pyplot",
    "mergeflow.report.tracking",
    "mlflow.store.tracking.sqlalchemy_store",
)


def _import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES) and k not in _NOT_COMPARED}


def _same_imports(command_env: dict[str, str], server_env: dict[str, str], set_by_imports: dict[str, str]) -> bool:
    """Whether a command's import-time variables are the server's: each equal to the server's before its imports,
    or to the value those imports set (TORCHINDUCTOR_CACHE_DIR: a launcher that imported torch passes it on)."""
    return all(
        command_env.get(k) == server_env.get(k) or (k in set_by_imports and command_env.get(k) == set_by_imports[k])
        for k in command_env.keys() | server_env.keys()
    )


def _send(sock: socket.socket, message: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    payload = _HEADER.pack(len(data)) + data
    if fds:
        sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendall(payload)


def _receive(sock: socket.socket, with_fds: int = 0) -> tuple[dict | None, list[int]]:
    """One message (None when the peer closed), and the file descriptors that came with it."""
    fds: list[int] = []
    if with_fds:
        head, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, with_fds)
    else:
        head = sock.recv(_HEADER.size, socket.MSG_WAITALL)
    if len(head) < _HEADER.size:
        return None, fds
    (size,) = _HEADER.unpack(head)
    body = b""
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        if not chunk:
            return None, fds
        body += chunk
    return json.loads(body), fds


# ---------------------------------------------------------------- the command's side
def forward(argv: list[str]) -> int | None:
    """Run ``mergeflow argv`` in the server SERVER_ENV names: its exit status, or None to run it here (no server,
    not reachable, or an environment the server's imports do not match)."""
    address = os.environ.get(SERVER_ENV)
    if not address:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address)
        _send(sock, {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}, [0, 1, 2])
    except OSError:
        sock.close()
        return None
    forwarded = {}

    def relay(signum, frame):  # the stage dies with its command: a signal to the command goes to the stage
        with contextlib.suppress(OSError):
            _send(sock, {"signal": signum})

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        forwarded[signum] = signal.signal(signum, relay)
    try:
        while True:
            try:
                reply, _ = _receive(sock)
                break
            except InterruptedError:
                continue
    except OSError:
        reply = None
    finally:
        sock.close()
        for signum, handler in forwarded.items():
            signal.signal(signum, handler)
    if reply is None:
        print("error: the stage server closed the connection before the stage ended", file=sys.stderr)
        return 75
    if reply.get("fallback"):
        return None
    return int(reply["status"])


# ---------------------------------------------------------------- the server's side
def _die_with_parent(sig: int = signal.SIGKILL) -> None:
    from mergeflow.core.parent_death import ask

    ask(sig)


def _run_child(
    request: dict, fds: list[int], server_pid: int, inherited: list[socket.socket], entry: Callable[[list[str]], int]
) -> None:
    """In the forked child: become the command (its streams, directory, environment and arguments), run it, exit."""
    try:
        for sock in inherited:  # the server's sockets: only the server holds them
            sock.close()
        os.setpgid(0, 0)  # the stage and its workers: one group, killed together
        _die_with_parent()
        if os.getppid() != server_pid:
            os._exit(75)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        env = dict(request["env"])
        env.pop(SERVER_ENV, None)  # a stage's own subprocesses start as usual
        env.pop("MERGEFLOW_DIE_WITH_PARENT", None)  # the command checked its parent; this child's parent is the server
        os.environ.clear()
        os.environ.update(env)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own streams, as the interpreter opens them
        sys.stdout = open(1, "w", buffering=1 if os.isatty(1) else -1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.argv = ["mergeflow", *request["argv"]]
        status = entry(request["argv"])
    except SystemExit as exit_:
        code = exit_.code
        status = code if isinstance(code, int) else (0 if code is None else 1)
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, status 1
        import traceback

        traceback.print_exc()
        status = 1
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(status if isinstance(status, int) else 1)


class _Stage:
    def __init__(self, conn: socket.socket, pid: int):
        self.conn, self.pid = conn, pid


def _pass_on_signal(stage: _Stage, selector: selectors.BaseSelector) -> None:
    """The signal a command sent, to its stage's process group; SIGKILL when the command closed (it was killed)."""
    try:
        message, _ = _receive(stage.conn)
    except OSError:
        message = None
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(stage.pid, message["signal"] if message else signal.SIGKILL)
    if message is None:
        selector.unregister(stage.conn)


def _reap(stages: dict[int, _Stage], selector: selectors.BaseSelector) -> None:
    """Each stage that ended: its exit status sent to its command, its connection closed."""
    for fd, stage in list(stages.items()):
        done, status = os.waitpid(stage.pid, os.WNOHANG)
        if not done:
            continue
        code = os.waitstatus_to_exitcode(status)
        with contextlib.suppress(OSError):
            _send(stage.conn, {"status": code if code >= 0 else 128 - code})
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(stage.conn)
        stage.conn.close()
        del stages[fd]


def serve(address: str, entry: Callable[[list[str]], int]) -> None:
    """Listen on ``address`` (a Unix socket path) and fork a child per request that runs ``entry(argv)`` (the
    ``mergeflow`` command's main), until the parent dies or a SIGTERM: then every running stage's group is killed
    with it."""
    _die_with_parent(signal.SIGTERM)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)  # commands wait in the backlog while the imports below run
    stages: dict[int, _Stage] = {}  # by connection fd
    stopping = False

    def stop(signum, frame):
        nonlocal stopping
        stopping = True

    def quit_now(signum, frame):  # during the imports nothing is forked yet: a run that ends waits for nothing
        os._exit(0)

    signal.signal(signal.SIGTERM, quit_now)
    signal.signal(signal.SIGINT, quit_now)
    before = dict(os.environ)
    frozen = _import_time_env(before)  # what the imports below read
    for module in _PRELOAD:
        with contextlib.suppress(Exception):
            __import__(module)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    # what they set (KMP_*, TORCHINDUCTOR_CACHE_DIR): a child has them, as a process that imported them would
    set_by_imports = {k: v for k, v in os.environ.items() if k not in before}
    server_pid = os.getpid()
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    try:
        while not stopping:
            for key, _ in selector.select(timeout=0.05):
                if key.fileobj is listener:
                    conn, _ = listener.accept()
                    try:
                        request, fds = _receive(conn, with_fds=3)
                    except OSError:
                        conn.close()
                        continue
                    if request is None or not _same_imports(_import_time_env(request["env"]), frozen, set_by_imports):
                        with contextlib.suppress(OSError):
                            _send(conn, {"fallback": True})
                        conn.close()
                        for fd in fds:
                            os.close(fd)
                        continue
                    pid = os.fork()
                    if pid == 0:
                        request["env"] = set_by_imports | request["env"]
                        _run_child(
                            request, fds, server_pid, [listener, conn, *(st.conn for st in stages.values())], entry
                        )
                    with contextlib.suppress(OSError):
                        os.setpgid(pid, pid)  # also here: a signal may come before the child has run a line
                    for fd in fds:
                        os.close(fd)
                    stages[conn.fileno()] = _Stage(conn, pid)
                    selector.register(conn, selectors.EVENT_READ)
                else:  # a command sent a signal to pass on, or closed: it was killed, so is its stage
                    _pass_on_signal(stages[key.fileobj.fileno()], selector)
            _reap(stages, selector)
    finally:
        for stage in stages.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(stage.pid, signal.SIGKILL)
        listener.close()
        with contextlib.suppress(OSError):
            os.unlink(address)


@contextlib.contextmanager
def running_server(env: dict[str, str] | None = None, reuse: bool = True):
    """A server for the duration of the block (the caller's child, dying with it); yields its address, which the
    block passes on in SERVER_ENV. The server's imports run while the caller goes on. ``reuse``: the server
    SERVER_ENV already names, if there is one (it serves this run)."""
    import subprocess

    if reuse and os.environ.get(SERVER_ENV) and os.path.exists(os.environ[SERVER_ENV]):
        yield os.environ[SERVER_ENV]
        return
    folder = Path(tempfile.mkdtemp(prefix="mergeflow-stages-"))
    address = str(folder / "socket")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mergeflow.cli", SERVE_COMMAND, address], env=env, stdin=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(address) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)  # binding comes first, before the imports: milliseconds
        yield address if os.path.exists(address) else None
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        with contextlib.suppress(OSError):
            os.unlink(address)
        with contextlib.suppress(OSError):
            folder.rmdir()


@contextlib.contextmanager
def running_servers(devices: list[str] | tuple[str, ...] = ()):
    """The servers of a run whose stages each get a GPU of ``devices`` to themselves: one server per GPU, started
    with CUDA_VISIBLE_DEVICES naming it, so that a stage given that GPU (CUDA_VISIBLE_DEVICES, an import-time
    variable) finds a server whose environment is its own and forks from it. Yields {device: address}, an address
    None where its server did not start; without devices, {} (the caller uses running_server)."""
    with contextlib.ExitStack() as stack:
        yield {
            d: stack.enter_context(running_server({**os.environ, CUDA_DEVICES_ENV: d}, reuse=False)) for d in devices
        }


def served_env(device_env: dict[str, str], servers: dict[str, str | None] | None) -> dict[str, str]:
    """A stage's device environment ({CUDA_VISIBLE_DEVICES: its GPU} or {}) with the address of that GPU's server,
    where running_servers started one."""
    address = (servers or {}).get(device_env.get(CUDA_DEVICES_ENV, ""))
    return device_env | {SERVER_ENV: address} if address else device_env
