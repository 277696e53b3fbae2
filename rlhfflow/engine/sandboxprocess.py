"""A sandboxed process (``rlhfflow.engine.sandbox``'s): the limits it runs under, the
backends that start it (bubblewrap, ``unshare``, a plain process) and what each protects,
the boot program that applies the limits and then waits on stdin for the one program it
runs, and the warm process that holds it started.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Literal


@dataclass(frozen=True)
class Limits:
    """What one sandboxed program may use. ``cpu_s`` CPU seconds and ``wall_s`` seconds
    of wall time; ``memory_mb`` of address space; ``file_mb`` per file written (and the
    size of its working directory under bubblewrap); ``processes`` alive at once (its own
    included); ``output_kb`` of stdout and stderr together before it is stopped;
    ``message_chars``: how much of its output the tool message keeps (the tail)."""

    cpu_s: float = 5.0
    wall_s: float = 10.0
    memory_mb: int = 512
    file_mb: int = 16
    processes: int = 16
    output_kb: int = 256
    message_chars: int = 2000


# --------------------------------------------------------------------------- backends


@dataclass(frozen=True)
class Backend:
    """How sandboxes start on this machine: the command before the interpreter, and one
    line on what it protects."""

    name: Literal["bwrap", "unshare", "process"]
    protects: str

    def command(self, interpreter: Path, workdir: Path | None, limits: Limits) -> list[str]:
        """The command line that starts the boot interpreter in the sandbox."""
        python = [str(interpreter), "-I", "-S", "-c", _BOOT]
        if self.name == "process":
            return python
        if self.name == "unshare":
            # a user namespace first (unprivileged), then the network one (no interfaces
            # but a down loopback) and the pid one, whose init takes every process with
            # it when it dies (--kill-child: when unshare dies)
            return ["unshare", "--user", "--net", "--pid", "--fork", "--kill-child", *python]
        binds = []
        for top in ("/usr", "/bin", "/lib", "/lib64", "/sbin"):
            path = Path(top)
            if path.is_symlink():
                binds += ["--symlink", os.readlink(path), top]
            elif path.is_dir():
                binds += ["--ro-bind", top, top]
        prefix = _prefix(interpreter)
        if not str(prefix).startswith("/usr/"):
            binds += ["--ro-bind", str(prefix), str(prefix)]
        size = str(limits.file_mb << 20)
        # --as-pid-1: the boot is the namespace's init, so bwrap reaps it itself (with a
        # reaper of its own as init, bwrap exited before the reaper, which was left to
        # the machine's init: a container's may never reap it)
        return ["bwrap", "--unshare-all", "--as-pid-1", "--die-with-parent", "--new-session",
                "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/work",
                "--setenv", "LANG", "C.UTF-8", *binds, "--proc", "/proc", "--dev", "/dev",
                "--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", "/work",
                "--chdir", "/work", *python]


def _prefix(interpreter: Path) -> Path:
    """The installation an interpreter's standard library lives under
    (``/usr/bin/python3`` -> ``/usr``)."""
    return interpreter.resolve().parent.parent


PROTECTS = {
    "bwrap": "bubblewrap: no network, only the system's files read-only and an empty "
             "working directory, a clean environment, its own process namespace, limits",
    "unshare": "bubblewrap not found; unshare fallback: no network, its own process "
               "namespace, a clean environment and limits, but the filesystem is NOT "
               "hidden: the code can read whatever its user may read (install bubblewrap)",
    "process": "neither bubblewrap nor user namespaces; process fallback: a clean "
               "environment, a fresh working directory and limits only: the code can use "
               "the network and read whatever its user may read (install bubblewrap)",
}


# --------------------------------------------------------------------------- the boot

#: What the sandboxed interpreter runs: it waits for its program on stdin (this is the
#: warm state), then limits itself and runs it as ``__main__``. The first line is the
#: limits: CPU seconds, address space, file size, processes, wall seconds.
_BOOT = r"""
import os, resource, signal
data = bytearray()
while True:
    chunk = os.read(0, 1 << 16)
    if not chunk:
        break
    data += chunk
if not data:
    os._exit(0)
head, _, source = bytes(data).partition(b"\n")
if os.getpid() == 1:
    # the namespace's init ignores the signals it has no handler for (RLIMIT_CPU's
    # SIGXCPU among them): the program runs as its child, and its end ends them all
    child = os.fork()
    if child:
        while True:
            pid, status = os.wait()
            if pid == child:
                code = os.waitstatus_to_exitcode(status)
                os._exit(code if code >= 0 else 128 - code)
cpu, memory, fsize, nproc, wall = map(int, head.split())
for res, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, memory, memory),
                        (resource.RLIMIT_FSIZE, fsize, fsize), (resource.RLIMIT_NPROC, nproc, nproc),
                        (resource.RLIMIT_CORE, 0, 0)):
    resource.setrlimit(res, (soft, hard))
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
os.close(null)
signal.alarm(wall + 2)  # a second net: a sandbox its parent forgot still ends
del data, chunk, head
import sys
sys.argv = ["main.py"]
namespace = {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}
try:
    exec(compile(source.decode("utf-8", "replace"), "main.py", "exec"), namespace)
except SystemExit:
    raise
except BaseException as exc:  # its traceback without this boot's frame
    import traceback
    traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
    sys.stderr.flush()
    os._exit(1)
# its output, then out without the interpreter's teardown (milliseconds of a call): the
# process and its files are thrown away
for stream in (sys.stdout, sys.stderr):
    try:
        stream.flush()
    except BaseException:  # the program closed or replaced it
        pass
os._exit(0)
"""


class WarmProcess:
    """One sandbox process, started, waiting on stdin for its program."""

    def __init__(self, command: list[str], workdir: Path | None, user: int | None,
                 sweep: bool) -> None:
        self.workdir, self.user, self.sweep = workdir, user, sweep
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            cwd=workdir, env=_clean_env(workdir), start_new_session=True,
            user=user, group=user, extra_groups=[] if user is not None else None)

    def kill(self) -> None:
        """End it and everything it started, and remove its working directory."""
        proc = self.proc
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        if self.sweep and self.user is not None:
            _kill_user(self.user)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None and not stream.closed:
                stream.close()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _clean_env(workdir: Path | None) -> dict[str, str]:
    """No inherited variables: no tracker keys, no tokens."""
    home = str(workdir) if workdir is not None else "/work"
    return {"PATH": "/usr/bin:/bin", "HOME": home, "LANG": "C.UTF-8"}


def _kill_user(user: int) -> None:
    """Kill every process of ``user`` (the process backend, run by root): one that left
    the process group (``setsid``) is still the sandbox's user. A process switched to
    that user kills all of them at once (``kill(-1)``), itself last."""
    subprocess.run(["/bin/sh", "-c", "kill -9 -1"], user=user, group=user, extra_groups=[],
                   env={"PATH": "/usr/bin:/bin"}, stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
