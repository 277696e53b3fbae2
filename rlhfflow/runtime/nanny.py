"""The embedded cluster's nanny: Dask's, which also says why a worker process ended.

Dask's nanny starts a new worker when one's process ends, and says why only on its own
logger, which the run keeps off the terminal. A worker killed by the kernel's OOM killer
(SIGKILL) or ended by the nanny at its memory limit writes nothing itself, so its log
(``OUT/logs/worker-N.log``) ended empty and nothing said why the run lost it.
``WatchedNanny`` appends the reason to the worker's log: the exit status or signal as
the nanny saw it, and the worker's memory at the nanny's last sample beside its limit
and the machine's available memory. It also keeps the reason by worker address
(``loss_reason``), which the backend adds to the lost worker's error.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import psutil
from distributed import Nanny
from distributed.core import Status
from tornado.ioloop import PeriodicCallback

from rlhfflow.runtime.worker.process import WORKER_LOG_VAR

#: Why each worker process of this process's nannies ended, by the worker's address.
LOSSES: dict[str, str] = {}
#: A worker this close to its memory limit (or the machine to its end) when it died
#: of a signal is said to have died of memory.
NEAR = 0.9


class WatchedNanny(Nanny):
    """Dask's nanny; a worker process that ends unasked gets a line in its log saying
    why (``exit_reason``), and ``LOSSES`` the same words."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._killing = False
        # (pid, rss, machine's available memory, time) at the last sample
        self._sample: tuple[int, int, int, float] | None = None
        monitor = self.periodic_callbacks.get("memory_monitor")
        if monitor is not None:  # sampled when Dask's monitor samples: no timer of our own
            self.periodic_callbacks["memory_monitor"] = PeriodicCallback(
                self._watch_memory, monitor.callback_time)

    def _watch_memory(self) -> None:
        """Note the worker's memory and the machine's, then Dask's memory monitor."""
        process = self.process.process if self.process is not None else None
        if process is not None and process.pid is not None:
            try:
                rss = psutil.Process(process.pid).memory_info().rss
                self._sample = (process.pid, rss, psutil.virtual_memory().available,
                                time.monotonic())
            except psutil.Error:
                pass
        self.memory_manager.memory_monitor(self)

    async def kill(self, *args: Any, **kwargs: Any) -> None:
        """Dask's: a process ended by it (a restart, the cluster closing) was asked to."""
        self._killing = True
        try:
            await super().kill(*args, **kwargs)
        finally:
            self._killing = False

    async def _on_worker_exit(self, exitcode: int) -> None:
        if not self._killing and self.status == Status.running:
            self._report_exit(exitcode)
        await super()._on_worker_exit(exitcode)

    def _report_exit(self, exitcode: int) -> None:
        manager = self.memory_manager
        pid, rss, available, when = self._sample or (None, None, None, None)
        reason = exit_reason(
            exitcode, rss=rss, limit=manager.memory_limit, available=available,
            total=psutil.virtual_memory().total,
            ended_by_nanny=pid is not None and manager._last_terminated_pid == pid,
            terminate_at=manager.memory_terminate_fraction,
            sampled_s=None if when is None else time.monotonic() - when)
        if self.worker_address:
            LOSSES[self.worker_address] = reason
        log = self.env.get(WORKER_LOG_VAR)
        if log:
            try:
                with open(log, "a", encoding="utf-8") as out:
                    out.write(f"rlhfflow: worker {self.name} (pid {pid or '?'}) ended: "
                              f"{reason}; its nanny starts a new one\n")
            except OSError:
                pass


def loss_reason(address: str) -> str | None:
    """Why the process of the worker at ``address`` ended, when a nanny of this process
    saw it end unasked; None if none did."""
    return LOSSES.get(address)


def exit_reason(exitcode: int, *, rss: int | None = None, limit: int | None = None,
                available: int | None = None, total: int | None = None,
                ended_by_nanny: bool = False, terminate_at: float | bool = 0.95,
                sampled_s: float | None = None) -> str:
    """Why a worker process ended, in words: its exit status or signal, and its memory
    (``rss`` bytes at the nanny's last sample, ``sampled_s`` seconds before it ended)
    against its ``limit`` and the machine's ``available`` of ``total`` memory.
    ``ended_by_nanny``: the nanny ended it for passing ``terminate_at`` of its limit."""
    if ended_by_nanny and rss is not None and limit:
        return (f"the nanny ended it (SIGTERM) as its memory, {_gib(rss)}, passed "
                f"{terminate_at:.0%} of the worker's {_gib(limit)} limit "
                f"(cluster.memory_limit)")
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        said = f"killed by {name}"
    else:
        said = f"exited with status {exitcode}"
    if rss is None:
        return said
    memory = f"{_gib(rss)} of its {_gib(limit)} limit" if limit else _gib(rss)
    when = f" {sampled_s:.1f} s before it ended" if sampled_s is not None else ""
    machine = f"; the machine had {_gib(available)} of {_gib(total)} available" \
        if available is not None and total else ""
    out = f"{said}; its memory was {memory}{when}{machine}"
    starved = (limit and rss >= NEAR * limit) or (
        available is not None and total and available <= (1 - NEAR) * total)
    if exitcode == -signal.SIGKILL and starved:
        out += ("; near the limit: most likely the kernel's OOM killer (`dmesg` says); "
                "give the workers more memory (cluster.memory_limit, fewer workers on the "
                "machine) or the stages less to hold (more data.micro_batches)")
    elif exitcode == -signal.SIGKILL:
        out += "; SIGKILL comes from the kernel's OOM killer or a `kill -9` (`dmesg` says)"
    return out


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f} GiB"
