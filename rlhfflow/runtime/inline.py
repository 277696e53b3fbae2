"""Tasks run in this process (``InlineBackend``): the no-Dask baseline of
``benchmarks/overhead.py`` and of tests, called the same way as ``DaskBackend``."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlhfflow.runtime.backend import TaskFailed
from rlhfflow.runtime.worker.host import RunDef, WorkerHost, set_local_host, worker_device


class _Done:
    """The result (or error) of a task run inline."""

    __slots__ = ("key", "value", "error", "retried")

    def __init__(self, key: str, value: Any = None, error: BaseException | None = None,
                 retried: int = 0):
        self.key, self.value, self.error, self.retried = key, value, error, retried

    @property
    def status(self) -> str:
        """As a Dask future's: "finished", or "error" for a failed task."""
        return "finished" if self.error is None else "error"


def _resolve(obj: Any) -> Any:
    if isinstance(obj, _Done):
        if obj.error is not None:
            raise obj.error
        return obj.value
    if isinstance(obj, list):
        return [_resolve(o) for o in obj]
    if isinstance(obj, tuple):
        return tuple(_resolve(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _resolve(v) for k, v in obj.items()}
    return obj


class InlineBackend:
    """Runs every task at once, in this process, in submission order (dependencies are
    always submitted first). Same task functions, same retries; no Dask."""

    workers: Sequence[str] = ("inline",)
    env_workers: Sequence[str] = ()
    dashboard_link: str | None = None
    client = None
    cluster = None
    pipelined = False
    in_process = True

    def warm(self) -> list:
        """Nothing to import ahead: the in-process worker is this process."""
        return []

    def start(self, run: RunDef, torch_threads: int | None) -> None:
        """Install the in-process worker state."""
        if torch_threads:
            import torch

            torch.set_num_threads(torch_threads)
        set_local_host(WorkerHost(run, device=worker_device(run.settings.device)))

    def submit(self, fn: Callable, *args: Any, key: str,
               worker: str | Sequence[str] | None = None, retries: int = 0,
               priority: int = 0, kwargs: Mapping[str, Any] | None = None) -> _Done:
        """Run ``fn(*args, **kwargs)`` now; a failure is kept and raised where the result
        is used."""
        for attempt in range(retries + 1):
            try:
                return _Done(key, fn(*_resolve(args), **_resolve(dict(kwargs or {}))),
                             retried=attempt)
            except Exception as exc:  # noqa: BLE001 - reported by wait()
                if attempt == retries:
                    return _Done(key, error=exc, retried=attempt)
        raise AssertionError("unreachable")

    def retries_used(self, handles: Sequence[_Done]) -> int:
        """How many retries ``handles`` took, all together (a fused task's handle stands
        for each of its stages: counted once)."""
        return sum({h.key: h.retried for h in handles}.values())

    def place(self, data: Any, worker: str | None = None, key: str = "data") -> _Done:
        """Data is already here."""
        return _Done(key, data)

    def wait(self, handles: Sequence[_Done], pinned: Sequence[str] = (),
             tick: Callable[[], None] | None = None) -> None:
        """Raise ``TaskFailed`` for the first failed task (all have run: no ``tick``)."""
        for h in handles:
            if h.error is not None:
                raise TaskFailed(h.key, h.error)

    def gather(self, handles: Sequence[_Done], pinned: Sequence[str] = ()) -> list[Any]:
        """Results of finished tasks."""
        self.wait(handles)
        return [h.value for h in handles]

    def run_on_workers(self, fn: Callable, *args: Any,
                       workers: Sequence[str] | None = None) -> dict[str, Any]:
        """Call ``fn`` on the (only) worker (awaiting it if it is a coroutine)."""
        result = fn(*args)
        if inspect.iscoroutine(result):
            result = asyncio.run(result)
        return {"inline": result}

    def restart_workers(self) -> None:
        """The in-process worker keeps its process (and its gang) for good."""

    def check_alive(self, pinned: Sequence[str], grace: float = 0.0) -> None:
        """The in-process worker cannot be lost."""

    def cancel_all(self) -> None:
        """Nothing is ever queued inline."""

    def states(self, handles: Sequence[_Done]) -> list[str]:
        """Every task inline has run: ``memory`` (or ``erred``)."""
        return ["erred" if h.error is not None else "memory" for h in handles]

    def cancel(self, handles: Sequence[_Done]) -> None:
        """Nothing is ever queued inline."""

    def wait_for_workers(self, count: int, timeout: float) -> bool:
        """The in-process worker cannot be lost."""
        return True

    def close(self) -> None:
        """Drop the in-process worker state."""
        set_local_host(None)
