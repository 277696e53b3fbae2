"""The embedded cluster's worker process as it starts: a Dask worker preload
(``distributed.worker.preload``, set by ``local_cluster``), run before the worker takes
any task.

- A worker forked from a warm server takes the nice value, CPU affinity, resource limits
  and umask of the command that started the run (``rlhfflow.launch.caller``), every
  thread of it; a cold run's workers have them already.
- What the worker writes (user code's prints, logging and warnings, a traceback) goes to
  its log, ``OUT/logs/worker-N.log`` (``WORKER_LOG_VAR``), which the coordinator copies to
  its own terminal as it grows (``rlhfflow.runtime.workerlogs``): a warm server's fork
  has no terminal of the caller's, and a log outlives the run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from rlhfflow.launch.caller import apply_from_environment

WORKER_LOG_VAR = "RLHFFLOW_WORKER_LOG"
"""The file a worker's standard output and error go to (set per worker by
``local_cluster``); unset: where they were."""


def dask_setup(worker: Any) -> None:
    """Dask's preload hook: called once as the worker starts."""
    apply_from_environment()
    log = os.environ.get(WORKER_LOG_VAR)
    if log:
        send_output_to(Path(log))


def send_output_to(path: Path) -> None:
    """Make ``path`` (appended to) this process's standard output and error, both the
    descriptors (what native code and child processes write) and Python's streams."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        if stream is not None and hasattr(stream, "reconfigure"):
            # a file is block-buffered: a print would wait for the buffer to fill
            stream.reconfigure(line_buffering=True)
