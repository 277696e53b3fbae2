"""The workers' output: each embedded worker writes its standard output and error (user
code's prints, logging and warnings, a traceback) to ``OUT/logs/worker-N.log``
(``rlhfflow.runtime.worker.process``); the coordinator copies what they write to its
own standard error as it comes (``WorkerOutput``), so that it reaches the terminal of
whoever started the run whether the workers are its children or forks of a warm server;
``rlhfflow report`` shows the end of each log (``log_tails``). A worker lost mid-run (its
nanny writes why in its log: ``rlhfflow.runtime.nanny``) and the recovery that followed
are recorded in ``OUT/recoveries.jsonl`` (``record_recovery``), which the report marks.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import IO, Any

from rlhfflow.storage.metrics import MetricsLog

LOG_DIRECTORY = "logs"
"""The run directory's folder of worker logs."""
RECOVERIES_FILE = "recoveries.jsonl"
"""The run directory's record of its recoveries from lost workers (never cut back)."""


def worker_log(log_dir: Path, index: int) -> Path:
    """The log of the embedded cluster's worker ``index`` (``device-INDEX``)."""
    return log_dir / f"worker-{index}.log"


def _logs(log_dir: Path) -> list[Path]:
    return sorted(log_dir.glob("worker-*.log"), key=lambda p: (len(p.name), p.name))


class WorkerOutput:
    """Copies what is appended to the worker logs in ``log_dir`` to ``stream`` (default:
    this process's standard error), whole lines, every ``interval`` seconds, in a
    background thread, until ``close`` (which copies the rest). What the logs held before
    (an earlier run of a resumed directory) is not copied."""

    def __init__(self, log_dir: Path, stream: IO[str] | None = None,
                 interval: float = 0.2) -> None:
        self.log_dir = log_dir
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        self.offsets = {path: path.stat().st_size for path in _logs(log_dir)}
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="rlhfflow-worker-output",
                                        daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        while not self._closed.wait(self.interval):
            self.copy()

    def copy(self, partial: bool = False) -> None:
        """Copy what was appended since the last call (with ``partial``, a last line
        without its newline too, ended)."""
        for path in _logs(self.log_dir):
            start = self.offsets.get(path, 0)
            try:
                with open(path, "rb") as log:
                    log.seek(start)
                    data = log.read()
            except OSError:
                continue
            if not partial:
                data = data[:data.rfind(b"\n") + 1]
            if not data:
                continue
            self.offsets[path] = start + len(data)
            text = data.decode(errors="replace")
            try:
                self.stream.write(text if text.endswith("\n") else text + "\n")
                self.stream.flush()
            except (OSError, ValueError):  # the terminal is gone: the logs keep it all
                self._closed.set()
                return

    def close(self) -> None:
        """Stop following; copy what is left (call it after the workers ended)."""
        self._closed.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        self.copy(partial=True)


def log_tails(run_dir: Path, lines: int = 20) -> dict[str, list[str]]:
    """The last ``lines`` lines of each worker log of the run in ``run_dir``, by file name
    ({} when there are none)."""
    tails = {}
    for path in _logs(run_dir / LOG_DIRECTORY):
        try:
            text = path.read_bytes()[-65536:].decode(errors="replace")
        except OSError:
            continue
        tails[path.name] = text.splitlines()[-lines:]
    return tails


def record_recovery(run_dir: Path, logged: int, resumed_after: int, cause: str,
                    when: float) -> None:
    """Record that the run in ``run_dir`` lost a worker (``cause``, the run's line about
    it) at ``when`` (a time stamp), with iterations up to ``logged`` in metrics.jsonl,
    and went back to its checkpoint of ``resumed_after`` (-1: the start)."""
    MetricsLog(run_dir / RECOVERIES_FILE).append(
        {"time": round(when, 3), "logged": logged, "resumed_after": resumed_after,
         "cause": cause})


def recoveries(run_dir: Path) -> list[dict[str, Any]]:
    """The recoveries recorded in ``run_dir``, oldest first ([] for none)."""
    try:
        return MetricsLog(run_dir / RECOVERIES_FILE).read()
    except (OSError, ValueError):
        return []
