"""The fork server the embedded cluster's worker processes come from.

Deliberately light (the standard library only, and nothing of rlhfflow's heavy
modules): ``rlhfflow run`` starts the server before it imports anything else, so
the server's imports (torch, transformers' model classes, Dask; ``warm_imports``) run
beside the coordinator's own from the first second, not after them.
"""

from __future__ import annotations

import os
import signal
import threading

READY_TIMEOUT_S = 300.0
"""How long the embedded cluster waits for the fork server's imports (seconds)."""


def start_fork_server() -> bool:
    """Start the fork server the embedded cluster's worker processes come from, if the
    platform has one, importing ``rlhfflow.runtime.worker.warm_imports`` in it. Call it as early
    as possible: it imports in its own process, beside the coordinator's imports. Returns
    whether workers can be forked from it (idempotent; later calls return at once).

    Environment variables read at a library's load (``OMP_NUM_THREADS``) are the fork
    server's, so the workers set their torch threads themselves (``RLHFWorkerPlugin``);
    per-worker variables (``CUDA_VISIBLE_DEVICES``) are set in each worker before CUDA is
    initialised (torch initialises it lazily)."""
    import multiprocessing
    from multiprocessing import forkserver

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    from rlhfflow.launch import caller, warm

    if warm.adopted():  # this process's forks come from a warm server already
        return True
    if warm.enabled():
        sock = warm.socket_path()
        if warm.connectable(sock) or sock.with_suffix(".starting").exists():
            # a warm server is up (or importing): the workers are its forks
            warm.adopt_for_workers(sock, READY_TIMEOUT_S)
            return True
    # the workers are forks of a server of this process: they have its nice value,
    # affinity, limits and umask already, not those another process handed down
    os.environ.pop(caller.ENV_VAR, None)
    # the workers' logging config is the fork server's, read as it imports distributed:
    # keep their chatter off the user's terminal (as local_cluster does for spawned ones)
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "critical")
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["distributed", "rlhfflow.runtime.worker.warm_imports"])
    # the server's children inherit its SIGINT disposition: ignored (see sigint_ignored)
    with sigint_ignored():
        forkserver.ensure_running()
    return True



def wait_fork_server(timeout: float = READY_TIMEOUT_S) -> None:
    """Return once the fork server has finished its imports and forks processes.

    Dask gives a worker ``death_timeout`` (30 s) to start, and a forked worker's start
    includes waiting for the server's imports: on a loaded machine they alone can take
    longer (6-9 s of CPU), which failed runs with a bare ``TimeoutError``. Forking one
    process that exits at once waits for them here, under a limit of its own; past it,
    a ``TimeoutError`` that says what was waited for."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    done = threading.Event()
    failed: list[BaseException] = []

    def fork_one() -> None:
        try:
            process = context.Process(target=_exit_at_once, name="rlhfflow-forkserver-ready")
            process.start()  # blocks until the server reads the request: its imports done
            process.join()
        except BaseException as exc:  # noqa: BLE001 - reported by the waiting thread
            failed.append(exc)
        finally:
            done.set()

    threading.Thread(target=fork_one, name="rlhfflow-forkserver-wait", daemon=True).start()
    if not done.wait(timeout):
        raise TimeoutError(f"the worker processes' fork server did not finish importing "
                           f"torch, transformers and Dask within {timeout:.0f} s (is the "
                           f"machine overloaded?)")
    if failed:
        raise failed[0]


def _exit_at_once() -> None:
    """The process ``wait_fork_server`` forks."""


class sigint_ignored:
    """Spawn worker processes with SIGINT ignored (they inherit it): a Ctrl-C in the
    terminal reaches the whole process group, and the coordinator, not each worker,
    decides how a run stops."""

    def __enter__(self) -> None:
        self.previous = None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, signal.SIG_IGN)

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
