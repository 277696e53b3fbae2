"""Model-written code run in a sandbox: each call its own process, with no network, a
fresh working directory, the rest of the filesystem read-only or absent, a clean
environment, limits on CPU time, wall time, memory, file size, processes and output, and
everything it started killed when it ends.

A :class:`Sandbox` runs a program and says what happened (:class:`Outcome`). Where it runs
depends on what the machine allows (:func:`pick_backend`): bubblewrap (``bwrap``) for the full
isolation; without it util-linux ``unshare`` for the network and process namespaces only
(the filesystem stays readable wherever its user may read); without that a plain child
process with the limits. Each backend says in one line at start-up what it protects
(``Backend.protects``), and docs/how-to/sandbox.md holds the whole account.

A call does not pay for an interpreter's start: ``warm`` processes per sandbox wait, started
and limited, for their program on stdin (``WarmProcess``; it, the limits, the backends'
commands and the boot program are ``rlhfflow.engine.sandboxprocess``'s); every call takes
one and starts its replacement, so a process never runs two programs (nothing one left
behind can reach the next). ``python`` is the tool that runs one program; :class:`CodeTests` the
environment that scores a program by the fraction of a record's tests it passes.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import re
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlhfflow.engine.sandboxprocess import PROTECTS, Backend, Limits, WarmProcess
from rlhfflow.engine.toolprocess import ToolFailed

log = logging.getLogger(__name__)

#: Run by root, each sandbox process runs as a user of its own (root ignores the process
#: limit and may read every file; a user of its own lets the process backend kill all it
#: started, and only that, with ``kill(-1)``). Each process that starts sandboxes has its
#: own block of users (:func:`sandbox_uids`), so two workers on a machine never share
#: one. No files belong to them.
UID_BASE = 1_000_000_000
UIDS_PER_PROCESS = 512
_next_uid = iter(range(1 << 62))


def sandbox_uids(pid: int | None = None) -> range:
    """The users the sandboxes of process ``pid`` (this one by default) run as, when it
    runs as root: a block of its own (pids are below 2**22, so the users stay below
    2**32 - 1)."""
    start = UID_BASE + (os.getpid() if pid is None else pid) * UIDS_PER_PROCESS
    return range(start, start + UIDS_PER_PROCESS)


@dataclass(frozen=True)
class Outcome:
    """What a sandboxed program did. ``kind`` is ``"ok"`` (exit status 0) or why it
    failed: ``"exit"`` (a non-zero status), ``"timeout"`` (wall time), ``"cpu"``,
    ``"memory"``, ``"file_size"``, ``"processes"``, ``"output"``, ``"signal"`` (killed
    by a signal it did not get from its limits), ``"sandbox"`` (the sandbox itself did
    not start). ``message`` is what a tool shows the model."""

    kind: str
    message: str
    status: int | None
    stdout: str
    stderr: str
    seconds: float


# --------------------------------------------------------------------------- backends


@functools.lru_cache(maxsize=4)
def pick_backend(wanted: str = "auto", interpreter: str | None = None) -> Backend:
    """The strongest sandbox this machine starts (``wanted``: ``"auto"``, or one of
    ``"bwrap"``, ``"unshare"``, ``"process"`` to insist on it; one that does not work
    here raises). Tried once per process: a probe program must run in it. The choice is
    logged once, with what it protects."""
    python = Path(interpreter or default_interpreter())
    names = ["bwrap", "unshare", "process"] if wanted == "auto" else [wanted]
    problems = []
    for name in names:
        candidate = Backend(name, PROTECTS[name])
        problem = _probe(candidate, python)
        if problem is None:
            log.warning("sandbox: %s", candidate.protects)
            return candidate
        problems.append(f"{name}: {problem}")
        log.debug("sandbox: %s does not start here: %s", name, problem)
    # e.g. run by root with no /usr/bin/python3: the sandbox's user cannot reach the one
    # under root's home
    raise RuntimeError(f"no sandbox starts {python} here ({'; '.join(problems)})")


def _probe(candidate: Backend, python: Path) -> str | None:
    if candidate.name != "process" and shutil.which(candidate.name) is None:
        return f"{candidate.name} is not installed"
    try:
        outcome = Sandbox(Limits(wall_s=30), backend=candidate, interpreter=python,
                          warm=0).run("print('ready')")
    except OSError as exc:
        return str(exc)
    return None if outcome.stdout == "ready\n" else \
        f"{outcome.kind}: {(outcome.stderr or outcome.message).strip()[-200:]}"


def default_interpreter() -> Path:
    """The interpreter for sandboxed Python: the system's ``/usr/bin/python3`` where it
    exists (its standard library is the only one mounted), else the one running here."""
    system = Path("/usr/bin/python3")
    if system.exists():
        return system
    import sys

    return Path(sys.executable).resolve()


# --------------------------------------------------------------------------- the sandbox

_live: set[Sandbox] = set()


class Sandbox:
    """Runs programs, one process each (see the module's docstring). ``warm`` processes
    are kept started; a sandbox is safe to share between threads."""

    def __init__(self, limits: Limits | None = None, backend: Backend | None = None,
                 interpreter: Path | str | None = None, warm: int = 2) -> None:
        self.limits = limits or Limits()
        self.interpreter = Path(interpreter or default_interpreter())
        self.backend = backend or pick_backend("auto", str(self.interpreter))
        self.warm = warm
        self.root = os.geteuid() == 0
        self._lock = threading.Lock()
        self._ready: list[WarmProcess] = []
        _live.add(self)

    def _start(self) -> WarmProcess:
        # (a user is taken again after UIDS_PER_PROCESS starts: its processes were killed
        # at the end of their call)
        user = sandbox_uids()[next(_next_uid) % UIDS_PER_PROCESS] if self.root else None
        workdir = None
        if self.backend.name != "bwrap":
            workdir = Path(tempfile.mkdtemp(prefix="rlhfflow-sandbox-"))
            if user is not None:
                os.chown(workdir, user, user)
        return WarmProcess(self.backend.command(self.interpreter, workdir, self.limits), workdir,
                     user, sweep=self.backend.name == "process")

    def _take(self) -> WarmProcess:
        with self._lock:
            while self._ready:
                warm = self._ready.pop(0)
                if warm.proc.poll() is None:
                    return warm
                warm.kill()
        return self._start()

    def prepare(self) -> None:
        """Start the warm processes now (before the first call)."""
        self._refill()

    def _refill(self) -> None:
        """Start the warm processes that are missing (while a program runs: its start
        then costs the call nothing)."""
        with self._lock:
            missing = self.warm - len(self._ready)
        started = [self._start() for _ in range(missing)]
        with self._lock:
            self._ready += started

    def close(self) -> None:
        """Stop the warm processes."""
        with self._lock:
            ready, self._ready = self._ready, []
        for warm in ready:
            warm.kill()
        _live.discard(self)

    def run(self, source: str, language: str = "python") -> Outcome:
        """Run ``source`` (a program in ``language``; only ``"python"`` today) and say
        what happened. Never raises for what the program does."""
        if language != "python":
            raise ValueError(f"no sandbox for {language!r} yet (only 'python')")
        limits = self.limits
        started = time.perf_counter()
        try:
            warm = self._take()
        except OSError as exc:
            return Outcome("sandbox", f"error: the sandbox did not start: {exc}", None,
                           "", "", 0.0)
        head = (f"{max(1, round(limits.cpu_s))} {limits.memory_mb << 20} "
                f"{limits.file_mb << 20} {limits.processes} {max(1, round(limits.wall_s))}\n")
        try:
            stdout, stderr, stopped = _exchange(warm.proc, (head + source).encode(), limits,
                                                self._refill)
        finally:
            status = warm.proc.poll()
            warm.kill()  # and whatever the program left running
        if status is None:
            status = warm.proc.returncode
        seconds = time.perf_counter() - started
        return _judge(stopped, status, stdout, stderr, seconds, limits)


def _exchange(proc: subprocess.Popen, program: bytes, limits: Limits,
              meanwhile: Callable[[], None]) -> tuple[bytes, bytes, str | None]:
    """Send the program, call ``meanwhile``, read the program's output until it exits or
    a limit stops it: ``(stdout, stderr, stopped)``, ``stopped`` the limit
    (``"timeout"``, ``"output"``)."""
    try:
        proc.stdin.write(program)
        proc.stdin.close()
    except BrokenPipeError:  # it died waiting: its stderr says why
        pass
    deadline = time.monotonic() + limits.wall_s
    meanwhile()
    cap = limits.output_kb << 10
    streams = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    poller = select.poll()  # not select(): a worker may hold more than 1024 descriptors
    for fd in streams:
        poller.register(fd, select.POLLIN)
    open_fds = set(streams)
    exited = None
    while open_fds:
        left = deadline - time.monotonic()
        if left <= 0:
            return bytes(streams[proc.stdout.fileno()]), \
                bytes(streams[proc.stderr.fileno()]), "timeout"
        readable = [fd for fd, _ in poller.poll(1000 * min(left, 0.05))]
        for fd in readable:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                open_fds.discard(fd)
                poller.unregister(fd)
            streams[fd] += chunk
        if sum(len(b) for b in streams.values()) > cap:
            return bytes(streams[proc.stdout.fileno()]), \
                bytes(streams[proc.stderr.fileno()]), "output"
        if exited is None and proc.poll() is not None:
            exited = time.monotonic()
        # what stays open after the exit belongs to a child it left (killed next): the
        # program's end is its process's exit, not its pipes' EOF
        if exited is not None and (not readable or time.monotonic() - exited > 0.1):
            break
    return bytes(streams[proc.stdout.fileno()]), bytes(streams[proc.stderr.fileno()]), None


_SIGNALS = {signal.SIGXCPU: "cpu", signal.SIGXFSZ: "file_size"}


def _judge(stopped: str | None, status: int | None, stdout: bytes, stderr: bytes,
           seconds: float, limits: Limits) -> Outcome:
    """The outcome of a program from how it ended and what it wrote."""
    out = stdout.decode("utf-8", "replace")
    err = stderr.decode("utf-8", "replace")
    tail = limits.message_chars
    # bwrap and unshare report a child's death by signal N as status 128 + N
    signum = -status if status is not None and status < 0 else \
        status - 128 if status is not None and 128 < status < 160 else None
    if stopped == "timeout":
        kind, why = "timeout", f"timeout after {limits.wall_s:g} s"
    elif stopped == "output":
        kind, why = "output", f"output limit ({limits.output_kb} KB)"
    elif status == 0:
        message = out[-tail:] if not err else f"{out}\n[stderr]\n{err}"[-tail:]
        return Outcome("ok", message, status, out, err, seconds)
    elif signum in _SIGNALS or (signum == signal.SIGKILL and "MemoryError" not in err
                                and seconds < limits.wall_s and _cpu_spent(seconds, limits)):
        kind = _SIGNALS.get(signum, "cpu")
        why = f"CPU time limit ({limits.cpu_s:g} s)" if kind == "cpu" else \
            f"file size limit ({limits.file_mb} MB)"
    elif "MemoryError" in err or "Cannot allocate memory" in err:
        kind, why = "memory", f"memory limit ({limits.memory_mb} MB)"
    elif "File too large" in err or "No space left on device" in err:
        kind, why = "file_size", f"file size limit ({limits.file_mb} MB)"
    elif "Resource temporarily unavailable" in err and ("fork" in err or "spawn" in err
                                                          or "BlockingIOError" in err):
        kind, why = "processes", f"process limit ({limits.processes})"
    elif signum is not None:
        kind, why = "signal", f"killed by {_signal_name(signum)}"
    elif _sandbox_failed(err):
        kind, why = "sandbox", "the sandbox did not start"
    else:
        kind, why = "exit", f"exit status {status}"
    message = f"error: {why}"
    if err.strip():
        message += "\n" + err.strip()[-tail:]
    elif out.strip():
        message += "\n" + out.strip()[-tail:]
    return Outcome(kind, message, status, out, err, seconds)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _cpu_spent(seconds: float, limits: Limits) -> bool:
    """Whether a SIGKILL came from RLIMIT_CPU's hard limit: the program ran at least its
    CPU seconds (wall time bounds CPU time from above for one process)."""
    return seconds >= limits.cpu_s


def _sandbox_failed(err: str) -> bool:
    return err.startswith(("bwrap:", "unshare:"))


@atexit.register
def _close_all() -> None:
    for sandbox in list(_live):
        sandbox.close()


# --------------------------------------------------------------------------- the tool


@dataclass(frozen=True)
class SandboxSettings:
    """A stage's sandbox: its limits, the backend (``"auto"``: the strongest that starts
    here) and the warm processes kept per worker process."""

    limits: Limits = field(default_factory=Limits)
    backend: str = "auto"
    warm: int = 2


class SandboxParams(BaseModel):
    """Limits of the sandbox that runs model-written code (the ``python`` tool,
    ``rlhfflow.engine.sandbox:python``; docs/how-to/sandbox.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpu_s: Annotated[float, Field(gt=0, description="CPU seconds of one program")] = 5.0
    wall_s: Annotated[float, Field(gt=0, description="wall seconds of one program")] = 10.0
    memory_mb: Annotated[int, Field(ge=64, description="address space of one program, "
                                                       "MiB")] = 512
    file_mb: Annotated[int, Field(gt=0, description="MiB of one file it writes (and of "
                                                    "its working directory)")] = 16
    processes: Annotated[int, Field(gt=0, description="processes alive at once")] = 16
    output_kb: Annotated[int, Field(gt=0, description="KiB of output before it is "
                                                      "stopped")] = 256
    backend: Literal["auto", "bwrap", "unshare", "process"] = Field(
        "auto", description="'auto': the strongest that starts on the machine")
    warm: Annotated[int, Field(ge=0, description="sandboxes kept started per process")] = 2

    def settings(self) -> SandboxSettings:
        """The engine's form of these settings."""
        limits = Limits(cpu_s=self.cpu_s, wall_s=self.wall_s, memory_mb=self.memory_mb,
                        file_mb=self.file_mb, processes=self.processes,
                        output_kb=self.output_kb)
        return SandboxSettings(limits, self.backend, self.warm)


_settings: ContextVar[SandboxSettings | None] = ContextVar("sandbox_settings", default=None)
_sandboxes: dict[SandboxSettings, Sandbox] = {}
_sandboxes_lock = threading.Lock()


def sandbox_for(settings: SandboxSettings) -> Sandbox:
    """The process's sandbox for ``settings`` (its warm processes shared by the calls)."""
    with _sandboxes_lock:
        if settings not in _sandboxes:
            _sandboxes[settings] = Sandbox(settings.limits, pick_backend(settings.backend),
                                           warm=settings.warm)
        return _sandboxes[settings]


@contextmanager
def using(settings: SandboxSettings):
    """Run the sandbox tools called inside with ``settings`` (the tool environment sets
    its stage's; a model cannot pass limits as an argument)."""
    token = _settings.set(settings)
    try:
        yield
    finally:
        _settings.reset(token)


def python(code: str) -> str:
    """Run a Python 3 program in a sandbox (no network, no files but its own, limited
    time and memory) and return what it printed.

    Args:
        code: the program's source; print the values you want to see
    """
    outcome = sandbox_for(_settings.get() or SandboxSettings()).run(code, "python")
    if outcome.kind != "ok":
        raise ToolFailed(outcome.message, outcome.kind)
    return outcome.message


#: the tool already runs in a sandbox process of its own: no tool process around it
python.sandboxed = True


# --------------------------------------------------------------------------- tests as reward

CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)

_HARNESS = """
{code}

import json as _json
_passed = 0
for _test in _json.loads({tests!r}):
    try:
        exec(_test, dict(globals()))
        _passed += 1
    except BaseException:
        pass
print("\\n{marker}" + _json.dumps(_passed))
"""


class CodeTests:
    """An environment that scores the model's program by the record's tests: the last
    fenced code block of its turn (the whole turn without one) runs in the sandbox with
    each of ``record[tests_key]`` (a list of Python snippets, e.g. ``"assert f(2) == 4"``)
    after it; the reward is the fraction that passed. One turn; ``info`` holds
    ``passed``, ``tests`` and ``errors_<kind>`` of a run that failed. The program runs in
    the same process as its tests, so it can tamper with them (the sandbox protects the
    machine, not the score): keep tests the program cannot see for a held-out score."""

    def __init__(self, tests_key: str = "tests", backend: str = "auto", warm: int = 2,
                 **limits: Any) -> None:
        self.tests_key = tests_key
        self.settings = SandboxSettings(Limits(**limits), backend, warm)
        self.tests: list[str] = []

    def reset(self, record: dict[str, Any]) -> list:
        """Keep the record's tests."""
        tests = record.get(self.tests_key, [])
        self.tests = json.loads(tests) if isinstance(tests, str) else list(tests)
        return []

    def step(self, text: str) -> tuple[str, float, bool, dict]:
        """Run the program with the tests."""
        blocks = CODE_BLOCK.findall(text)
        code = blocks[-1] if blocks else text
        marker = f"__tests_passed_{os.urandom(8).hex()}__ "
        program = _HARNESS.format(code=code, tests=json.dumps(self.tests), marker=marker)
        outcome = sandbox_for(self.settings).run(program)
        passed = 0
        found = outcome.stdout.rpartition(marker)[2].strip()
        if outcome.kind == "ok" and found.isdigit():
            passed = int(found)
        info = {"passed": passed, "tests": len(self.tests)}
        if outcome.kind != "ok":
            info[f"errors_{outcome.kind}"] = 1
        return outcome.message.replace(marker, ""), passed / max(1, len(self.tests)), \
            True, info


def run_many(sandbox: Sandbox, sources: Sequence[str]) -> list[Outcome]:
    """Run ``sources`` one after another (for benchmarks and tests)."""
    return [sandbox.run(source) for source in sources]
