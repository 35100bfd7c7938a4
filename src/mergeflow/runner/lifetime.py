"""Stages that die with whatever started them: a launcher killed outright (SIGKILL, a closed terminal, a job
scheduler) leaves no stage running (``die_with_parent``, called by every stage command); and the flow's own servers
(Prefect's ephemeral API server, which Prefect starts without a parent-death signal) end with the flow
(``watch_children``)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path

from mergeflow.runner.running import DIE_WITH_PARENT_ENV


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


WATCH_INTERVAL = 0.5  # seconds between looks at the watched process's children
GRACE = 10.0  # seconds a child has to stop on SIGTERM before SIGKILL


def watch_children() -> None:
    """Start a watchdog process that ends this process's children once this process is gone, however it went
    (SIGKILL included): what Prefect starts for the flow (its ephemeral API server, a uvicorn process) has no
    parent-death signal and would run on. It records the children every WATCH_INTERVAL seconds and, after the
    death, sends each one still running (same pid, same start time) SIGTERM, then SIGKILL after GRACE seconds. It
    ignores Ctrl-C (the flow handles that) and exits with the children."""
    import subprocess
    import sys

    code = f"from mergeflow.runner.lifetime import _watchdog; _watchdog({os.getpid()})"
    subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, close_fds=True)


def _watchdog(watched: int) -> None:
    import psutil

    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    try:
        parent = psutil.Process(watched)
    except psutil.NoSuchProcess:
        return
    seen: dict[int, float] = {}
    while True:
        with contextlib.suppress(psutil.Error):
            seen |= {child.pid: child.create_time() for child in parent.children() if child.pid != os.getpid()}
        try:
            parent.wait(timeout=WATCH_INTERVAL)  # returns once the watched process has exited (not our child: polled)
            break
        except psutil.TimeoutExpired:
            with contextlib.suppress(psutil.Error):
                if parent.status() == psutil.STATUS_ZOMBIE:  # exited, its own parent not yet reaping it
                    break
    left = []
    for pid, started in seen.items():
        with contextlib.suppress(psutil.Error):
            child = psutil.Process(pid)
            if child.create_time() == started:
                child.terminate()
                left.append(child)
    _, alive = psutil.wait_procs(left, timeout=GRACE)
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()
