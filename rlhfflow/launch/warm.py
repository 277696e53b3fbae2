"""The warm process: ``rlhfflow run`` without paying for the imports each time.

Where a run's start-up goes on a 2-core machine: ~4 s importing torch, transformers and
Dask in the ``rlhfflow run`` process, ~6 s doing it again in the fork server the workers
come from (beside the first, on the other core). Neither depends on the pipeline. So the
first run leaves a *warm server* behind: a multiprocessing fork server, detached from the
terminal, that imported all of it once and listens on a socket of this user's. A later
``rlhfflow run`` is then a thin client (standard library only) that asks the server for
a fork, passes it its terminal (stdin, stdout, stderr), arguments, directory and
environment, and relays signals and the exit code; the fork is the coordinator, and the
run's workers are forks of the same server. ~0.3 s to import instead of ~4 + 6.

- **One server per installation and import-time environment** (``server_key``): the
  Python, rlhfflow's sources, the site-packages directories (``pip install`` changes
  them) and the environment variables that libraries read when imported (``OMP_*``,
  ``HF_*``, ``CUDA_*``, ...). Change any and the next run starts a new server; the old
  one exits when idle. Everything else of the environment is the client's, set in the
  fork before the run starts.
- **Idle exit**: a server with no run going exits ``RLHFFLOW_WARM`` seconds (default
  600) after its last use. ``RLHFFLOW_WARM=0`` turns it off: every run then imports for
  itself, as before. ``rlhfflow warm`` shows the servers; ``--stop`` stops them.
- **Crash behaviour as without it**: the coordinator dies with its client (a SIGKILL of
  ``rlhfflow run`` kills the run as before: its fork watches a pipe only the client
  holds), and workers die with their coordinator (Dask's nanny pipes).
- **Safety**: the socket lives in a directory only this user can enter
  (``$XDG_RUNTIME_DIR/rlhfflow`` or ``/tmp/rlhfflow-UID``, mode 0700, checked).
- **Never more than the caller may use**: a fork gets the client's nice value, CPU
  affinity, resource limits and umask (``rlhfflow.launch.caller``), applied before
  anything else, and so do the run's workers. Where the client may use more than the
  server (a lower nice value, a higher hard limit), its run starts cold instead, said in
  one line. The server's key includes the cgroup (one server per cgroup: a run never
  joins another job's), and under a batch scheduler or in a container the server is off
  unless ``RLHFFLOW_WARM`` is set.

Here: whether the server is on, its key and socket, the server itself and the workers'
adoption of it; a run as its fork (client and fork) is ``rlhfflow.launch.warmrun``.
Deliberately light: both import the standard library only, so the client starts in a
few tens of milliseconds.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rlhfflow.launch import caller

ENV_VAR = "RLHFFLOW_WARM"
"""Seconds an idle warm server stays; ``0`` turns the warm server off."""

DEFAULT_IDLE_S = 600.0
READY_TIMEOUT_S = 300.0
"""How long a client waits for a starting server's imports (a loaded machine: minutes)."""
STARTED_AT_VAR = "RLHFFLOW_COMMAND_STARTED"
"""Set by the client for its fork: when the command started (the run's start-up clock)."""
LOCK_FD_VAR = "RLHFFLOW_OUTPUT_LOCK_FD"
"""The descriptor of the output directory's lock that a run inherits from the process
holding it for it (``rlhfflow run --supervise``): a client hands it on to its fork."""

# environment variables read when a library is imported (so a server that imported with
# other values would run differently): part of the server's key, not passed to the fork
IMPORT_TIME_PREFIXES = ("OMP_", "MKL_", "OPENBLAS_", "KMP_", "GOMP_", "TORCH", "PYTORCH",
                        "CUDA", "NVIDIA", "HIP_", "ROCM", "HF_", "HUGGINGFACE", "TRANSFORMERS",
                        "TOKENIZERS", "DASK_", "DS_", "PYTHON", "LD_", "MALLOC_", "XDG_CACHE")

#: the command a fork becomes: ``rlhfflow``'s click group
ENTRY_POINT = "rlhfflow.cli.main:main"

# what the server imports before it listens: the coordinator's and the workers' code
PRELOAD = ("distributed", "rlhfflow.runtime.worker.warm_imports", ENTRY_POINT.partition(":")[0],
           "rlhfflow.runtime.executor", "rlhfflow.monitor.dashboard",
           "distributed.dashboard.scheduler")


def idle_seconds() -> float:
    """``RLHFFLOW_WARM`` as seconds (0: off); a value that is not a number: the default."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("", "1", "on", "true", "yes"):
        return DEFAULT_IDLE_S
    if value in ("off", "false", "no"):
        return 0.0
    try:
        return max(0.0, float(value))
    except ValueError:
        return DEFAULT_IDLE_S


BATCH_JOB_VARS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID")
CONTAINER_FILES = ("/.dockerenv", "/run/.containerenv")


def confined() -> str | None:
    """Why the warm server is off unless ``RLHFFLOW_WARM`` is set: inside a batch job
    (the scheduler accounts for, limits and cleans up the job's processes, and a server
    outliving the job would escape that) or a container (often gone with its command).
    None elsewhere."""
    for name in BATCH_JOB_VARS:
        if os.environ.get(name):
            return f"a batch job ({name} is set)"
    for path in CONTAINER_FILES:
        if os.path.exists(path):
            return f"a container ({path})"
    return None


_REFUSED: list[str] = []  # why this process's run could not be a fork (then: cold)


def supported() -> bool:
    """A platform with fork servers and Unix sockets (Linux, macOS)."""
    import multiprocessing

    return hasattr(socket, "AF_UNIX") and hasattr(os, "fork") and \
        "forkserver" in multiprocessing.get_all_start_methods()


def refuse(reason: str) -> None:
    """This process's run could not be a fork of the server (``reason``): it and any later
    one of this process run cold."""
    _REFUSED.append(reason)


def enabled() -> bool:
    """Whether runs of this process go through a warm server."""
    if _REFUSED or (not os.environ.get(ENV_VAR, "").strip() and confined()):
        return False
    return idle_seconds() > 0 and supported()


# ----------------------------------------------------------------------------- the key
def _tree_digest(root: Path, digest: Any) -> None:
    for path in sorted(root.rglob("*.py")):
        st = path.stat()
        digest.update(f"{path}:{st.st_mtime_ns}:{st.st_size}\n".encode())


def server_key() -> str:
    """What a server's imports depend on, hashed: a server of another key is never used."""
    import rlhfflow

    digest = hashlib.sha256()
    digest.update(f"{sys.executable}\n{sys.version}\n{os.getuid()}\n".encode())
    digest.update(repr(sys.flags).encode())
    _tree_digest(Path(rlhfflow.__file__).parent, digest)
    for entry in sys.path:  # installs and uninstalls change these directories
        if entry.endswith(("site-packages", "dist-packages")) and os.path.isdir(entry):
            digest.update(f"{entry}:{os.stat(entry).st_mtime_ns}\n".encode())
    for name in sorted(os.environ):
        if name.startswith(IMPORT_TIME_PREFIXES):
            digest.update(f"{name}={os.environ[name]}\n".encode())
    # forks stay in the server's cgroup: one server per cgroup, so that a run is never
    # accounted to (nor limited or killed with) another job's
    digest.update(_cgroup().encode())
    return digest.hexdigest()[:16]


def _cgroup() -> str:
    """This process's cgroups (``/proc/self/cgroup``; "" where there are none)."""
    try:
        return Path("/proc/self/cgroup").read_text()
    except OSError:
        return ""


def server_dir() -> Path:
    """This user's directory of warm servers (created 0700; refused if anyone else can
    enter it: a socket there runs code as this user)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "rlhfflow" if runtime and os.path.isdir(runtime) else None
    if base is None or len(str(base)) > 60:  # a socket's path has ~100 bytes at most
        base = Path(tempfile.gettempdir()) / f"rlhfflow-{os.getuid()}"
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = base.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise OSError(f"{base} is not a private directory of this user")
    return base


_KEY: list[str] = []


def socket_path() -> Path:
    """This installation's server socket (the key is taken once per process: the
    environment changes later, as ``DASK_LOGGING__DISTRIBUTED`` is set for the workers)."""
    if not _KEY:
        _KEY.append(server_key())
    return server_dir() / f"warm-{_KEY[0]}.sock"


def _info_path(sock: Path) -> Path:
    return sock.with_suffix(".json")


def connectable(sock: Path) -> bool:
    """A live server listens on ``sock``: the socket is the one its process bound, and
    that process runs. (Not by connecting: the fork server's loop takes any connection
    for a fork request, and an empty one ends it.)"""
    try:
        info = json.loads(_info_path(sock).read_text())
        if sock.stat().st_ino != info["inode"]:
            return False
        return _alive(int(info["pid"]))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


# -------------------------------------------------------------------------- the server
def start_server(sock: Path, idle_s: float) -> bool:
    """Start a warm server for ``sock`` in the background, detached from this terminal
    and process group, unless one is starting already. Returns whether this call
    started one."""
    claim = sock.with_suffix(".starting")
    try:
        fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        try:  # a claim older than any start-up is a leftover of a killed server
            if time.time() - claim.stat().st_mtime < 120:
                return False
            claim.unlink()
            fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except OSError:
            return False
    os.close(fd)
    root = str(Path(__file__).resolve().parents[1])
    for info in servers():  # this installation's idle servers of an older key: they go
        # (one with runs going stays until they end: their workers are its forks, and a
        # worker that dies is restarted through its socket)
        if info.get("root") == root and info.get("python") == sys.executable \
                and not _runs(int(info["pid"])):
            Path(info["socket"]).unlink(missing_ok=True)
    log = open(sock.with_suffix(".log"), "ab")  # noqa: SIM115 - handed to the child
    try:
        subprocess.Popen(
            [sys.executable, "-m", "rlhfflow.launch.warm", "serve", str(sock),
             str(idle_s)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            close_fds=True, cwd="/")
    finally:
        log.close()
    return True


def serve(sock: Path, idle_s: float) -> None:
    """The server's process: import, listen on ``sock``, fork what clients ask for, and
    exit after ``idle_s`` seconds without a run."""
    from multiprocessing import forkserver

    claim = sock.with_suffix(".starting")
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "critical")
    # forks inherit this: workers ignore the terminal's Ctrl-C (the coordinator decides
    # how a run stops); a coordinator fork installs its own handlers
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    started = time.perf_counter()
    try:
        for module in PRELOAD:
            __import__(module)
        listener = socket.socket(socket.AF_UNIX)
        staging = f"{sock}.{os.getpid()}"
        listener.bind(staging)
        os.chmod(staging, 0o600)
        listener.listen(64)
        inode = os.stat(staging).st_ino
        _info_path(sock).write_text(json.dumps({
            "pid": os.getpid(), "inode": inode, "started": time.time(),
            "root": str(Path(__file__).resolve().parents[1]),
            "python": sys.executable, "idle_s": idle_s,
            "imports_s": round(time.perf_counter() - started, 2)}))
        os.replace(staging, sock)  # atomically: a client sees a ready server or none
    finally:
        claim.unlink(missing_ok=True)
    # what the imports made stays as it is: kept out of the collector's passes, so a
    # fork's collections neither walk it nor copy its pages (written by the walk)
    gc.collect()
    gc.freeze()
    alive_r, alive_w = os.pipe()

    def watch() -> None:  # only stat, sleep and /proc: nothing a fork could inherit held
        while True:
            time.sleep(min(5.0, max(0.2, idle_s / 10)))
            try:
                st = sock.stat()
            except FileNotFoundError:  # removed (rlhfflow warm --stop)
                break
            if st.st_ino != inode:  # replaced by a newer server of the same key
                break
            if time.time() - st.st_mtime > idle_s and not _children():
                _remove(sock, inode)
                break
        while _children():  # runs going on: their exit codes reach their clients from here
            time.sleep(1.0)
        os.close(alive_w)  # the fork server's loop ends at the pipe's end

    threading.Thread(target=watch, name="rlhfflow-warm-idle", daemon=True).start()
    try:
        forkserver.main(listener.fileno(), alive_r, [])
    except SystemExit:
        pass


def _children() -> bool:
    """Whether this process has live children (a run, or its workers)."""
    return _runs(os.getpid())


def _runs(pid: int) -> bool:
    """Whether server ``pid`` has live children (a run, or its workers)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
        return bool(text.split())
    except FileNotFoundError:  # gone
        return False
    except OSError:
        import psutil

        try:
            return bool(psutil.Process(pid).children())
        except psutil.Error:
            return False


def _remove(sock: Path, inode: int) -> None:
    try:
        if sock.stat().st_ino == inode:
            sock.unlink()
            _info_path(sock).unlink(missing_ok=True)
    except FileNotFoundError:
        pass


def servers() -> list[dict[str, Any]]:
    """The warm servers of this user: socket, pid, when started, last use."""
    found = []
    for sock in sorted(server_dir().glob("warm-*.sock")):
        try:
            info = json.loads(_info_path(sock).read_text())
            info.update(socket=str(sock), last_used=sock.stat().st_mtime,
                        current=sock == socket_path())
        except (OSError, ValueError):
            continue
        found.append(info)
    return found


def stop_servers() -> int:
    """Stop every warm server of this user: each stops taking runs at once (its socket
    removed) and exits when the runs it started have ended. Returns how many."""
    found = servers()
    for info in found:
        sock = Path(info["socket"])
        sock.unlink(missing_ok=True)
        _info_path(sock).unlink(missing_ok=True)
    return len(found)


# ------------------------------------------------------------------- workers, clients
def adopt_for_workers(sock: Path, timeout: float) -> None:
    """Make this process's fork server the warm server at ``sock``: worker processes
    (Dask's nannies start them with the ``forkserver`` method) are then its forks.
    Connecting waits up to ``timeout`` seconds for a server that is still importing."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    with server._lock:
        if server._forkserver_alive_fd is None:
            # any descriptor does: forks get it as theirs, and the warm server never
            # reads it (its life is its own, see serve)
            server._forkserver_alive_fd = os.open(os.devnull, os.O_RDONLY)

        def wait_for_server() -> None:
            wait_ready(sock, timeout)
            server._forkserver_address = str(sock)
            touch(sock)

        server.ensure_running = wait_for_server  # replaces starting a server of its own
    # forks of the server take this process's nice value, affinity, limits and umask as
    # they start (the workers inherit this environment: rlhfflow.runtime.worker.process)
    os.environ[caller.ENV_VAR] = json.dumps(caller.capture())


def wait_ready(sock: Path, timeout: float) -> None:
    """Wait for the server at ``sock`` (started, maybe still importing) to listen."""
    deadline = time.monotonic() + timeout
    while not connectable(sock):
        # the server removes its claim once it listens, or when it fails
        if not sock.with_suffix(".starting").exists() and not connectable(sock):
            raise RuntimeError(f"the warm server failed to start (its log: "
                               f"{sock.with_suffix('.log')}); {ENV_VAR}=0 runs without it")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the warm server ({sock}) did not start within "
                               f"{timeout:.0f} s (is the machine overloaded?)")
        time.sleep(0.05)


def unadopt() -> None:
    """Undo ``adopt_for_workers``: this process's workers fork from a server of its own."""
    from multiprocessing import forkserver

    os.environ.pop(caller.ENV_VAR, None)
    server = forkserver._forkserver
    with server._lock:
        vars(server).pop("ensure_running", None)
        server._forkserver_address = None
        if server._forkserver_alive_fd is not None:
            os.close(server._forkserver_alive_fd)
            server._forkserver_alive_fd = None


def workers_server() -> str | None:
    """The socket of the warm server this process's workers are forks of (None: they
    are not; "" while its address is not known yet)."""
    from multiprocessing import forkserver

    if not adopted():
        return None
    return str(forkserver._forkserver._forkserver_address or "")


def adopted() -> bool:
    """Whether this process's fork server is a warm server (``adopt_for_workers``, or a
    coordinator forked from one)."""
    from multiprocessing import forkserver

    return "ensure_running" in vars(forkserver._forkserver)


def touch(sock: Path) -> None:
    """Mark the server used now (its idle clock)."""
    try:
        os.utime(sock)
    except OSError:
        pass


if __name__ == "__main__":  # python -m rlhfflow.launch.warm serve SOCKET IDLE_S
    if len(sys.argv) == 4 and sys.argv[1] == "serve":
        serve(Path(sys.argv[2]), float(sys.argv[3]))
    else:
        sys.exit("usage: python -m rlhfflow.launch.warm serve SOCKET IDLE_S")
