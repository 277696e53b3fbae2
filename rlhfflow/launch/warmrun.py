"""A run as a fork of the warm server (``rlhfflow.launch.warm``): the client's side,
``run_in_server`` (pass the fork this process's terminal, directory, environment and
limits; relay signals; return its exit code), and the fork's, ``coordinator`` (take them
on, then become ``rlhfflow ARGV``).

Like ``warm``, imports the standard library only: the client runs it before anything
heavy is imported.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rlhfflow.launch import caller
from rlhfflow.launch.warm import (
    ENTRY_POINT,
    LOCK_FD_VAR,
    STARTED_AT_VAR,
    adopt_for_workers,
    refuse,
    touch,
    unadopt,
)


class Refused(OSError):
    """The server's fork cannot take what this process may use (``caller.CannotApply``):
    nothing was run; this process runs cold (``enabled`` is False from now on)."""


def run_in_server(sock: Path, argv: list[str]) -> int:
    """Run ``rlhfflow ARGV`` as a fork of the warm server at ``sock`` with this process's
    terminal, directory, environment, nice value, affinity, limits and umask; relay
    signals to it and return its exit code (-N for a death by signal N). ``OSError``:
    the server could not be reached, or its fork could not take this process's limits
    (``Refused``), and nothing was run."""
    import multiprocessing

    touch(sock)  # first: the server's idle clock must not run out while we connect
    adopt_for_workers(sock, timeout=5.0)
    life_r, life_w = os.pipe()  # the fork's lifeline: only this process holds life_w
    status_r, status_w = os.pipe()  # why the fork refused the run, if it did
    env = dict(os.environ)
    env[STARTED_AT_VAR] = repr(_process_start())
    lock = _inherited_lock()
    process = multiprocessing.get_context("forkserver").Process(
        target=coordinator, name="rlhfflow-run",
        args=(argv, env, str(sock), _Fd(0), _Fd(1), _Fd(2), _Fd(life_r), _Fd(status_w),
              None if lock is None else _Fd(lock)))
    process.daemon = False
    forward = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
    previous = {}

    def relay(signum: int, _frame: Any) -> None:
        if process.pid:
            try:
                os.kill(process.pid, signum)
            except ProcessLookupError:
                pass

    try:
        process.start()
    except (OSError, EOFError) as exc:  # the server went before forking: nothing started
        unadopt()
        os.close(status_r)
        raise OSError(f"the warm server went away ({exc!r})") from exc
    finally:
        os.close(life_r)
        os.close(status_w)
    for signum in forward:
        previous[signum] = signal.signal(signum, relay)
    try:
        while process.exitcode is None:
            process.join(0.5)
            touch(sock)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    os.set_blocking(status_r, False)
    try:
        refused = os.read(status_r, 4096).decode(errors="replace")
    except BlockingIOError:
        refused = ""
    finally:
        os.close(status_r)
    if refused:
        unadopt()
        refuse(refused)
        raise Refused(refused)
    return process.exitcode


def _inherited_lock() -> int | None:
    """The output directory's lock this process inherited (``LOCK_FD_VAR``), or None."""
    try:
        fd = int(os.environ[LOCK_FD_VAR])
        os.fstat(fd)
    except (KeyError, ValueError, OSError):
        return None
    return fd


class _Fd:
    """A file descriptor passed to the fork (it arrives as the fork's own descriptor)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction

        return (_received, (reduction.DupFd(self.fd),))


def _received(dup: Any) -> int:
    return dup.detach()


def coordinator(argv: list[str], env: dict[str, str], sock: str, stdin: int, stdout: int,
                stderr: int, lifeline: int, status: int, lock: int | None = None) -> None:
    """The fork's side of ``run_in_server``: become the client's ``rlhfflow ARGV``."""
    import io
    from multiprocessing import forkserver

    try:  # before anything else: nothing of the run may use more than its caller
        caller.apply(json.loads(env[caller.ENV_VAR]))
    except caller.CannotApply as exc:
        os.write(status, str(exc).encode())
        os._exit(1)
    os.close(status)
    env.pop(LOCK_FD_VAR, None)  # the client's number: here the lock has another, or none
    if lock is not None:
        env[LOCK_FD_VAR] = str(lock)
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True,
                                  errors="backslashreplace")
    os.environ.clear()
    os.environ.update(env)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # this run's workers: forks of the same server (its address as clients know it)
    forkserver._forkserver._forkserver_address = sock
    forkserver._forkserver.ensure_running = lambda: None

    def watch_client() -> None:
        while os.read(lifeline, 1):
            pass
        os.kill(os.getpid(), signal.SIGKILL)  # the client died (or was killed): so do we

    threading.Thread(target=watch_client, name="rlhfflow-client-watch", daemon=True).start()
    entry_point().main(args=argv, prog_name="rlhfflow", standalone_mode=True)


def entry_point() -> Any:
    """The command a fork becomes (the click group ``ENTRY_POINT`` names, imported by the
    server before it listens): named, not imported here, so that launching stays below
    the command line it launches."""
    module, _, attr = ENTRY_POINT.partition(":")
    return getattr(importlib.import_module(module), attr)


def _process_start() -> float:
    """When this process started (wall clock): the client's, for the run's start-up."""
    try:
        ticks = float(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()
