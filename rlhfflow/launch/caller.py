"""What the caller of ``rlhfflow run`` may use, carried to the processes of its run.

A run started cold is the caller's process and its children: they get the caller's nice
value, CPU affinity, resource limits and umask from it. A run forked from a warm server
(``rlhfflow.launch.warm``) would get the server's instead, which another command with
other settings may have started. So the client sends its own (``capture``) with its
arguments, and every process of the run applies them (``apply``) before anything else:
the coordinator fork as it starts, each worker as it starts (``ENV_VAR``, which the
workers inherit from the coordinator).

Applying can fail where the caller may use *more* than the server: a lower nice value, a
higher hard limit, CPUs outside the server's cpuset. A fork cannot take those, so the run
is refused by the server and starts cold instead (``CannotApply``).

Deliberately light: the standard library only.
"""

from __future__ import annotations

import json
import os
import resource
from collections.abc import Callable
from typing import Any

ENV_VAR = "RLHFFLOW_CALLER"
"""The caller's attributes (JSON, from ``capture``) in the environment of a warm run's
processes; each worker applies them as it starts."""


class CannotApply(OSError):
    """This process cannot take the caller's attributes (one line saying which)."""


def _limits() -> dict[str, int]:
    return {name: getattr(resource, name) for name in sorted(dir(resource))
            if name.startswith("RLIMIT_")}


def capture() -> dict[str, Any]:
    """This process's nice value, CPU affinity, resource limits and umask."""
    mask = os.umask(0o022)
    os.umask(mask)
    return {"nice": os.getpriority(os.PRIO_PROCESS, 0),
            "affinity": sorted(os.sched_getaffinity(0)),
            "rlimits": {name: list(resource.getrlimit(value))
                        for name, value in _limits().items()},
            "umask": mask}


def _each_thread(action: Callable[[int], None]) -> None:
    """``action(tid)`` for every thread of this process: on Linux the nice value and the
    affinity are a thread's, and threads started already keep theirs."""
    try:
        tids = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            action(tid)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def apply(attributes: dict[str, Any]) -> None:
    """Give this process, every thread of it, the caller's ``attributes`` (``capture``).
    ``CannotApply`` names the first one it cannot take (then some may be applied)."""
    nice = int(attributes["nice"])
    if nice != os.getpriority(os.PRIO_PROCESS, 0):
        try:
            _each_thread(lambda tid: os.setpriority(os.PRIO_PROCESS, tid, nice))
        except PermissionError:
            raise CannotApply(f"the warm server runs at nice {os.getpriority(os.PRIO_PROCESS, 0)}"
                              f", and its forks cannot lower it to this command's {nice}"
                              ) from None
    cpus = set(attributes["affinity"])
    if cpus != os.sched_getaffinity(0):
        try:
            _each_thread(lambda tid: os.sched_setaffinity(tid, cpus))
        except OSError as exc:
            raise CannotApply(f"the warm server's forks cannot use this command's CPUs "
                              f"{sorted(cpus)} ({exc.strerror})") from None
    limits = _limits()
    for name, (soft, hard) in attributes["rlimits"].items():
        if name not in limits or resource.getrlimit(limits[name]) == (soft, hard):
            continue
        try:
            resource.setrlimit(limits[name], (soft, hard))
        except (ValueError, OSError):
            raise CannotApply(f"the warm server's forks cannot take this command's {name} "
                              f"limit {_limit(soft)}:{_limit(hard)} (the server's hard "
                              f"limit is {_limit(resource.getrlimit(limits[name])[1])})"
                              ) from None
    os.umask(int(attributes["umask"]))


def _limit(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else str(value)


def apply_from_environment() -> bool:
    """Apply the attributes in ``ENV_VAR``, if set (a worker of a warm run). Returns
    whether there were any."""
    text = os.environ.get(ENV_VAR)
    if not text:
        return False
    apply(json.loads(text))
    return True
