"""Tool calls that can always be stopped: each runs in a child interpreter
(:class:`ToolProcess`) that is killed, with everything it started, when the call takes
longer than its timeout. A thread cannot be stopped in Python: a hung call on one was
abandoned and stayed for the life of the process; a killed child leaves nothing.

Idle children are kept and reused (:func:`call`), so a call costs a pipe's round trip,
not an interpreter's start. The function travels pickled with each call (cloudpickle; a
function of the pipeline's own files or of a module outside the installed packages goes
by value, so the child need not import it). A child whose parent dies exits.
"""

from __future__ import annotations

import atexit
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from typing import Any

from rlhfflow.errors import RlhfflowError

#: The child: it answers ``(function, arguments)`` frames with ``("ok", text)`` or
#: ``("error", "Type: message")``; what the tool prints goes to stderr, not the pipe.
_CHILD = r"""
import json, os, pickle, struct, sys, threading, time
import cloudpickle
requests, replies = os.dup(0), os.dup(1)
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
os.dup2(2, 1)
parent = os.getppid()

def orphaned():  # the parent died without closing the pipe
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)

threading.Thread(target=orphaned, daemon=True).start()

def read(n):
    data = b""
    while len(data) < n:
        chunk = os.read(requests, n - len(data))
        if not chunk:
            os._exit(0)
        data += chunk
    return data

def write(reply):
    body = pickle.dumps(reply)
    os.write(replies, struct.pack("<Q", len(body)) + body)

write(("ready", ""))
while True:
    fn, arguments = cloudpickle.loads(read(struct.unpack("<Q", read(8))[0]))
    try:
        result = fn(**arguments)
        text = result if isinstance(result, str) else json.dumps(result, default=str)
        write(("ok", text))
    except BaseException as exc:
        write(("error", f"{type(exc).__name__}: {exc}"))
"""


class ToolTimeout(RlhfflowError):
    """The call took longer than its timeout; its process was killed."""


class ToolCrashed(RlhfflowError):
    """The tool's process died during the call (the tool exited or was killed)."""


class ToolFailed(RlhfflowError):
    """What a tool raises to answer ``error: <message>`` counted under its own ``kind``
    (the sandbox's ``timeout``, ``memory``, ...) instead of ``exception``."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.message = message.removeprefix("error: ")
        self.kind = kind


class ToolProcess:
    """One child interpreter that runs tool calls, one at a time."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        # its own session: a kill takes what the tool started with it
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, start_new_session=True)
        self.ready = False

    def call(self, payload: bytes, timeout_s: float) -> tuple[str, str]:
        """``("ok", text)`` or ``("error", "Type: message")`` of the pickled call
        ``payload``; ``ToolTimeout`` after ``timeout_s`` (the process is then killed),
        ``ToolCrashed`` if it died. The time it takes to start is not the tool's."""
        if not self.ready:
            self._reply(60.0)
            self.ready = True
        try:
            self.proc.stdin.write(struct.pack("<Q", len(payload)) + payload)
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise ToolCrashed(self._died()) from None
        return self._reply(timeout_s)

    def _reply(self, timeout_s: float) -> tuple[str, str]:
        deadline = time.monotonic() + timeout_s
        head = self._read(8, deadline)
        return pickle.loads(self._read(struct.unpack("<Q", head)[0], deadline))

    def _read(self, n: int, deadline: float) -> bytes:
        fd, data = self.proc.stdout.fileno(), b""
        poller = select.poll()  # not select(): a worker may hold more than 1024 descriptors
        poller.register(fd, select.POLLIN)
        while len(data) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(1000 * left):
                self.kill()
                raise ToolTimeout
            chunk = os.read(fd, n - len(data))
            if not chunk:
                raise ToolCrashed(self._died())
            data += chunk
        return data

    def _died(self) -> str:
        self.kill()
        status = self.proc.returncode
        if status is not None and status < 0:
            try:
                return f"the tool's process was killed by {signal.Signals(-status).name}"
            except ValueError:
                pass
        return f"the tool's process exited with status {status}"

    def kill(self) -> None:
        """Kill it and everything it started; reap it."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


_idle: list[ToolProcess] = []
_all: set[ToolProcess] = set()
_lock = threading.Lock()


def call(payload: bytes, timeout_s: float) -> tuple[str, str]:
    """Run the pickled call ``payload`` (``pickled(fn, arguments)``) in an idle tool
    process (started if none is idle) and give it back after; a timeout or a crash
    kills it and raises (:class:`ToolTimeout`, :class:`ToolCrashed`)."""
    with _lock:
        process = _idle.pop() if _idle else None
    if process is None:
        process = ToolProcess()
        with _lock:
            _all.add(process)
    try:
        reply = process.call(payload, timeout_s)
    except BaseException:
        process.kill()
        with _lock:
            _all.discard(process)
        raise
    with _lock:
        _idle.append(process)
    return reply


def live() -> int:
    """How many tool processes this process holds (idle or in a call)."""
    with _lock:
        return len(_all)


@atexit.register
def close_all() -> None:
    """Kill every tool process (at exit: an idle child would exit on its own)."""
    with _lock:
        processes = list(_all)
        _all.clear()
        _idle.clear()
    for process in processes:
        process.kill()


_INSTALLED = tuple(p for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"],
                               sysconfig.get_paths()["platlib"]} if p)


def pickled(fn: Callable[..., Any], arguments: dict[str, Any]) -> bytes:
    """``(fn, arguments)`` as a tool process takes them. A function of a module outside
    the standard library and the installed packages (the pipeline's files, a test
    module, ``__main__``) goes by value: the child needs to import only what it uses."""
    import cloudpickle

    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    with _pickling:  # the registry is global: one registration at a time
        by_value = module is not None and module.__name__ != "__main__" \
            and module.__name__ not in cloudpickle.list_registry_pickle_by_value() \
            and not str(getattr(module, "__file__", "") or "").startswith(_INSTALLED)
        if by_value:
            cloudpickle.register_pickle_by_value(module)
        try:
            return cloudpickle.dumps((fn, arguments))
        finally:
            if by_value:
                cloudpickle.unregister_pickle_by_value(module)


_pickling = threading.Lock()
