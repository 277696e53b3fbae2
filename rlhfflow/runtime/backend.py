"""Where tasks run: on a Dask cluster (``DaskBackend``, here; the embedded cluster it
starts is ``rlhfflow.runtime.cluster``'s) or in this process (``InlineBackend``, in
``rlhfflow.runtime.inline``: the no-Dask baseline of ``benchmarks/overhead.py`` and of
tests); the errors both raise.

The executor talks to both through the same handful of calls (``Backend``, the protocol
both implement), so the only difference between an in-process run and a Dask run is the
Dask layer itself.
"""

from __future__ import annotations

import logging
import queue
import time
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import dask

from rlhfflow.errors import RlhfflowError
from rlhfflow.monitor.workerlogs import WorkerOutput
from rlhfflow.plan.layout import default_torch_threads
from rlhfflow.runtime.cluster import DEVELOPER_LOGS, ENV_RESOURCE, local_cluster
from rlhfflow.runtime.worker.host import PLUGIN_NAME, RLHFWorkerPlugin, RunDef

logger = logging.getLogger(__name__)

#: How often a wait given a ``tick`` calls it (seconds): a stop request cancels what was
#: submitted ahead within this, before the update of the next iteration can start.
TICK_S = 0.2


@runtime_checkable
class Backend(Protocol):
    """Where a run's tasks go: what the executor, the monitor and the worker setup ask of
    ``DaskBackend`` and ``InlineBackend`` (no ``isinstance`` or ``getattr`` probing).

    Attributes:
        workers: the device workers' addresses (``("inline",)`` in process).
        env_workers: the CPU pool's workers (environment steps), empty without one.
        dashboard_link: the Dask dashboard's URL, or None.
        client: the Dask ``Client``, or None in process.
        cluster: the embedded cluster this backend started, or None.
        pipelined: submitted tasks run when their inputs exist (Dask), not at once in
            submission order (in process).
        in_process: tasks run in this process (no workers to lose, to name or to pool).
    """

    workers: Sequence[str]
    env_workers: Sequence[str]
    dashboard_link: str | None
    client: Any
    cluster: Any
    pipelined: bool
    in_process: bool

    def warm(self) -> list: ...
    def start(self, run: RunDef, torch_threads: int | None) -> None: ...
    def submit(self, fn: Callable, *args: Any, key: str,
               worker: str | Sequence[str] | None = None, retries: int = 0,
               priority: int = 0, kwargs: Mapping[str, Any] | None = None) -> Any: ...
    def retries_used(self, handles: Sequence[Any]) -> int: ...
    def place(self, data: Any, worker: str | None = None, key: str = "data") -> Any: ...
    def wait(self, handles: Sequence[Any], pinned: Sequence[str] = (),
             tick: Callable[[], None] | None = None) -> None: ...
    def gather(self, handles: Sequence[Any], pinned: Sequence[str] = ()) -> list[Any]: ...
    def run_on_workers(self, fn: Callable, *args: Any,
                       workers: Sequence[str] | None = None) -> dict[str, Any]: ...
    def restart_workers(self) -> None: ...
    def check_alive(self, pinned: Sequence[str], grace: float = 0.0) -> None: ...
    def cancel_all(self) -> None: ...
    def states(self, handles: Sequence[Any]) -> list[str]: ...
    def cancel(self, handles: Sequence[Any]) -> None: ...
    def wait_for_workers(self, count: int, timeout: float) -> bool: ...
    def close(self) -> None: ...


def _first_key(handles: Sequence[Any], status: str) -> str:
    return next((h.key for h in handles if h.status == status), "task")


class TaskFailed(RlhfflowError, RuntimeError):
    """A task failed (after its retries): carries the task key and the cause."""

    def __init__(self, key: str, cause: BaseException) -> None:
        self.key, self.cause = key, cause
        super().__init__(f"{key}: {type(cause).__name__}: {cause}")


class WorkerLost(RlhfflowError, RuntimeError):
    """A worker that holds resident state left the cluster."""


#: Coordinator data up to this size (a micro-batch of prompts, typically) rides inside
#: the messages of the tasks that use it instead of being scattered: a scatter is a round
#: trip through the scheduler to the worker's event loop, and a release of its key later,
#: while the worker computes (its event loop takes the GIL from the running task).
#: Measured on grpo-tiny's worker (``strace -c``): 285 -> 219 futex calls (GIL hand-offs)
#: and 21 -> 18 socket calls per iteration.
INLINE_DATA_BYTES = 1 << 20


def _why(address: str, wait: float = 1.0) -> str:
    """Why the worker at ``address`` ended, as its nanny (in this process, for an
    embedded cluster) saw it, waiting up to ``wait`` seconds for the nanny to notice:
    ``" (REASON)"``, or "" (a cluster of one's own, or a worker that did not end)."""
    from rlhfflow.runtime.nanny import loss_reason

    deadline = time.monotonic() + wait
    while (reason := loss_reason(address)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return f" ({reason})" if reason else ""


def data_bytes(data: Any) -> int:
    """Roughly the bytes of a dict of columns (tensors, arrays, lists of text or ids)."""
    total = 0
    for value in data.values() if isinstance(data, dict) else [data]:
        if hasattr(value, "nbytes"):
            total += int(value.nbytes)
        elif isinstance(value, (list, tuple)):
            total += sum(len(v) if isinstance(v, (str, bytes)) else 8 for v in value)
        else:
            total += 8
    return total


def _states(keys: list[str], dask_scheduler=None) -> dict[str, str]:
    """On the scheduler: the state of each of ``keys`` it still has."""
    return {k: dask_scheduler.tasks[k].state for k in keys if k in dask_scheduler.tasks}


def _retries_left(keys: list[str], dask_scheduler=None) -> dict[str, int]:
    """On the scheduler: the retries each of ``keys`` has left."""
    tasks = dask_scheduler.tasks
    return {k: tasks[k].retries for k in keys if k in tasks}


def _computation_groups_plugin():
    """A scheduler plugin (``distributed.SchedulerPlugin``, imported when needed) that
    keeps the task groups the scheduler's records hold to those it still has.

    A stage's tasks form one task group (``train_actor-12`` and ``train_actor-13`` are
    both ``train_actor``); when every task of a group was forgotten the group leaves the
    scheduler, and the stage's next task makes a new one. Three records kept each group
    for the run's life: the current "computation" (Dask starts a new one, of the last
    100, only when the cluster was idle, which a pipelined run rarely is), the current
    span (the default span lasts while tasks are in flight: all run long), and the
    dependencies of a group that lives on (a stage whose next task was submitted before
    the last one was forgotten). Measured in ppo-tiny: ~10 groups an iteration in the
    computation, and 0.1 an iteration in the span, each keeping the groups it depended
    on. The totals of computations and spans (the dashboard's, Dask's
    ``get_computations``) lose the forgotten groups."""
    from distributed import SchedulerPlugin

    def live_only(groups: set, live: dict) -> set:
        return {g for g in groups if live.get(g.name) is g}

    def live_or_last(groups: set, live: dict) -> set:
        # a span or computation with no group breaks Dask's totals (the "stop" of no
        # group: the dashboard's Fine Performance Metrics page): one that ended keeps its
        # last group, without the groups that one depended on
        kept = live_only(groups, live)
        if not kept and groups:
            last = max(groups, key=lambda g: g.stop)
            last.dependencies = set()
            kept = {last}
        return kept

    class ForgetFinishedGroups(SchedulerPlugin):
        name = "rlhfflow-computation-groups"
        idempotent = True  # one per scheduler, however many runs connect

        def update_graph(self, scheduler, **kwargs: Any) -> None:
            live = scheduler.task_groups
            for computation in scheduler.computations:
                if len(computation.groups) > 1:
                    computation.groups = live_or_last(computation.groups, live)
            spans = scheduler.extensions.get("spans")
            for span in getattr(spans, "spans", {}).values():
                if len(span.groups) > 1:
                    span.groups = live_or_last(span.groups, live)
            for group in live.values():
                group.dependencies = live_only(group.dependencies, live)

    return ForgetFinishedGroups()


def _workers_now(client) -> dict[str, Any]:
    """The scheduler's workers as it knows them now (address -> identity: name,
    resources), asked directly. Not ``Client.scheduler_info()``: it returns an attribute
    that the client's event loop overwrites every 2 s with a summary that lists no
    workers, and a reader whose thread waits for the cores after the answer came (a
    loaded machine) reads that summary instead: every worker "left the cluster"."""
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]


class DaskBackend:
    """Tasks on a Dask cluster: pinned to workers by address, named after stages."""

    pipelined = True
    in_process = False

    def __init__(self, client, cluster=None, output: WorkerOutput | None = None) -> None:
        self.client = client
        self.cluster = cluster
        self.output = output
        info = _workers_now(client)
        if not info:
            raise RuntimeError(f"the Dask cluster at {client.scheduler.address} has no workers")
        self.workers = self._device_workers(info)
        self.env_workers = self._env_workers(info)
        self.dashboard_link = client.dashboard_link
        self._submitted: weakref.WeakSet = weakref.WeakSet()
        self._retries: dict[str, int] = {}  # key -> retries allowed, for tasks that have any
        self._config = None  # the coordinator's Dask config while it runs (connect)
        try:
            client.register_plugin(_computation_groups_plugin())
        except Exception as exc:  # noqa: BLE001 - a scheduler without rlhfflow: unbounded
            logger.debug("rlhfflow: no computation-groups plugin on the scheduler: %s", exc)

    @staticmethod
    def _device_workers(info: dict[str, Any]) -> list[str]:
        # workers started with `--resources device=1` hold models; a cluster without that
        # resource anywhere is used whole (but for the CPU pool of environment steps)
        devices = [a for a in info if info[a].get("resources", {}).get("device", 0) >= 1]
        chosen = devices or [a for a in info
                             if info[a].get("resources", {}).get(ENV_RESOURCE, 0) < 1]
        return sorted(chosen, key=lambda a: (str(info[a].get("name")), a))

    @staticmethod
    def _env_workers(info: dict[str, Any]) -> list[str]:
        # the CPU pool for environment steps: workers with the `env` resource
        return sorted(a for a in info if info[a].get("resources", {}).get(ENV_RESOURCE, 0) >= 1)

    @classmethod
    def connect(cls, address: str | None, workers: int, log_dir: Path | None = None,
                **cluster_options: Any) -> DaskBackend:
        """Connect to ``address``, or start an embedded cluster of ``workers`` devices
        whose output goes to their logs in ``log_dir`` and, from there, to this
        process's standard error."""
        from distributed import Client

        if address:
            client = Client(address, timeout="20s")
            return cls(client)
        # following before the workers start: what a worker that fails to start says too
        output = WorkerOutput(log_dir) if log_dir is not None else None
        # read as each stream opens, workers that replace lost ones later included: set
        # for the backend's life (close() puts the caller's config back)
        logs = dask.config.set(DEVELOPER_LOGS)
        try:
            cluster = local_cluster(workers, log_dir=log_dir, **cluster_options)
            client = Client(cluster)
            client.wait_for_workers(len(cluster.workers), timeout=120)
            backend = cls(client, cluster, output)
        except BaseException:
            logs.__exit__(None, None, None)
            if output is not None:
                output.close()
            raise
        backend._config = logs
        return backend

    def warm(self) -> list:
        """Start importing what the stages need on every worker (tasks; wait for them
        with :meth:`wait` before installing the resident state)."""
        from rlhfflow.runtime.worker.preload import warm

        return [self.client.submit(warm, key=f"warm-imports-{i}", pure=False, workers=[w],
                                   allow_other_workers=False)
                for i, w in enumerate(self.workers)]

    def start(self, run: RunDef, torch_threads: int | None) -> None:
        """Give every worker its resident state (replacing a previous run's)."""
        if torch_threads is None and self.cluster is not None:
            # forked workers have the fork server's OMP_NUM_THREADS, not their share
            torch_threads = default_torch_threads(len(self.workers))
        self.install_plugin(RLHFWorkerPlugin(run, torch_threads), PLUGIN_NAME)

    def install_plugin(self, plugin: Any, name: str) -> None:
        """Register a worker plugin on every worker; ``WorkerLost`` if one of them dies
        as it gets it."""
        try:
            self.client.register_plugin(plugin, name=name)
        except OSError:
            # the scheduler's broadcast to a worker that died fails, and the call with
            # it: a worker frozen past the heartbeat timeout, woken, re-registered and
            # then killed by its nanny while a recovery installs the resident state
            self._check_alive(self.workers, grace=5.0)
            raise

    def submit(self, fn: Callable, *args: Any, key: str,
               worker: str | Sequence[str] | None = None, retries: int = 0,
               priority: int = 0, kwargs: Mapping[str, Any] | None = None):
        """Submit ``fn(*args, **kwargs)`` (futures inside either are replaced by their
        results, as Dask does); a pinned task runs only on ``worker`` (or on whichever of
        a list of workers the scheduler finds free first)."""
        workers = [worker] if isinstance(worker, str) else (list(worker) if worker else None)
        future = self.client.submit(fn, *args, **(kwargs or {}), key=key, pure=False,
                                    retries=retries, priority=priority, workers=workers,
                                    allow_other_workers=False)
        self._submitted.add(future)
        if retries:
            self._retries[key] = retries
        return future

    def retries_used(self, handles: Sequence[Any]) -> int:
        """How many retries ``handles`` (finished tasks the client still holds) took, all
        together: the scheduler counts a task's retries down as it uses them, so one call
        asks it for what is left. No call at all when none of them may be retried."""
        allowed = {h.key: self._retries.pop(h.key) for h in handles if h.key in self._retries}
        if not allowed:
            return 0
        left = self.client.run_on_scheduler(_retries_left, list(allowed))
        # a key the scheduler has forgotten took none we can know of: count it as unused
        return sum(n - left.get(key, n) for key, n in allowed.items())

    def place(self, data: Any, worker: str | None = None, key: str | None = None):
        """Make coordinator data (a dict of columns) available to the tasks that use it:
        up to ``INLINE_DATA_BYTES`` it is returned as it is and travels inside those
        tasks' own messages; larger, it is scattered to ``worker`` (where its first
        consumer runs) under ``key`` (its prefix is what the dashboard's progress bars
        show; else "dict")."""
        if data_bytes(data) <= INLINE_DATA_BYTES:
            return data
        # wrapped in a one-item mapping: Client.scatter spreads a bare dict value by value
        # under the dict's own keys, so every micro-batch (a dict of columns) would share
        # keys like "prompt_ids" and all but the first would silently get the first one's
        try:
            [future] = self.client.scatter({key or f"data-{uuid.uuid4().hex}": data},
                                           workers=[worker] if worker else None,
                                           hash=False).values()
        except Exception:
            if worker:  # the worker it was meant for may have died
                self._check_alive([worker], grace=5.0)
            raise
        return future

    def wait(self, handles: Sequence[Any], pinned: Sequence[str] = (),
             tick: Callable[[], None] | None = None) -> None:
        """Wait for ``handles``; raise ``TaskFailed`` at the first error, ``WorkerLost`` if a
        worker that holds models leaves (its pinned tasks would otherwise wait forever).
        ``tick`` is called about every ``TICK_S`` seconds meanwhile (the executor's stop
        request is acted on there, during the wait).

        ``handles`` come in dependency order (as the executor submits them): a failed task
        is blamed on the earliest failed handle, the one that raised."""
        # one callback per future rather than distributed.wait(FIRST_COMPLETED) in a loop,
        # which registers every pending future again after each completion (quadratic:
        # ~10% of the coordinator's CPU on the tiny demos)
        unique = list({h.key: h for h in handles}.values())
        finished: queue.SimpleQueue = queue.SimpleQueue()
        for h in unique:
            h.add_done_callback(finished.put)
        checked = time.monotonic()
        for _ in unique:
            while True:
                try:
                    f = finished.get(timeout=TICK_S if tick else 2)
                    break
                except queue.Empty:
                    if tick:
                        tick()
                    if time.monotonic() - checked >= 2:
                        self._check_alive(pinned)
                        checked = time.monotonic()
            if f.status in ("error", "cancelled"):
                # Dask fails every task downstream of a failed one too, with the same
                # exception, and reports them together in no order: take the earliest
                f = next(h for h in handles if h.status in ("error", "cancelled"))
                if f.status == "cancelled":
                    # Dask cancels what depended on data held by a worker that died
                    self._check_alive(pinned, grace=5.0)
                    raise TaskFailed(f.key, RuntimeError("task was cancelled"))
                cause = f.exception()
                if type(cause).__name__ == "KilledWorker":
                    raise WorkerLost(f"a worker died while running {f.key}")
                # Dask keeps the lineage of every result: when a worker holding one dies,
                # the scheduler runs the tasks that made it again, on the survivors, where
                # an old stage task fails (StaleWeights: its models have moved on). That
                # error can arrive before the 2 s check above notices the loss; the loss
                # is the cause. The scheduler drops the worker before it reschedules, so
                # no grace is needed.
                self._check_alive(pinned)
                raise TaskFailed(f.key, cause)

    def check_alive(self, pinned: Sequence[str], grace: float = 0.0) -> None:
        """Raise ``WorkerLost`` if one of ``pinned`` left (within ``grace`` seconds)."""
        self._check_alive(pinned, grace)

    def _check_alive(self, pinned: Sequence[str], grace: float = 0.0) -> None:
        """Raise ``WorkerLost`` if a worker holding models has left the cluster (waiting up
        to ``grace`` seconds for the scheduler to notice)."""
        if not pinned:
            return
        deadline = time.monotonic() + grace
        while True:
            alive = set(_workers_now(self.client))
            gone = [w for w in pinned if w not in alive]
            if gone:
                raise WorkerLost(f"worker {gone[0]} left the cluster while it held "
                                 f"resident models"
                                 f"{self._timed_out(gone[0]) or _why(gone[0])}")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.25)

    def _timed_out(self, worker: str) -> str:
        """What to say of a lost ``worker`` that its scheduler removed for sending no
        heartbeat within its ``worker-ttl``: that it may have been late, not dead, and
        what sets the limit (a cluster the user started keeps its own Dask config,
        which ``cluster.heartbeat_timeout_s`` does not reach); "" otherwise."""
        try:
            events = self.client.get_events("scheduler")
        except Exception:  # noqa: BLE001 - the reason is a courtesy; the loss stands
            return ""
        for _, event in reversed(events):
            if isinstance(event, dict) and event.get("action") == "worker-ttl-timed-out" \
                    and worker in event.get("workers", ()):
                limit = ("cluster.heartbeat_timeout_s" if self.cluster is not None else
                         "distributed.scheduler.worker-ttl in its scheduler's Dask config")
                return (f": the scheduler heard no heartbeat from it for {event['ttl']:g} s "
                        f"and removed it; a worker whose machine is loaded is late, not "
                        f"dead: set {limit} longer")
        return ""

    def gather(self, handles: Sequence[Any], pinned: Sequence[str] = ()) -> list[Any]:
        """Bring small results (metrics) to the coordinator. A result held by a worker
        that died in the meantime is lost: ``WorkerLost``. (``Client.gather`` would wait
        for it forever: the task that made it is pinned to the dead worker.)"""
        out = []
        for h in handles:
            while True:
                try:
                    out.append(h.result(timeout=2))
                    break
                except TimeoutError:
                    self._check_alive(pinned or self.workers)
                except Exception:
                    self._check_alive(pinned or self.workers, grace=5.0)
                    raise
        return out

    def run_on_workers(self, fn: Callable, *args: Any,
                       workers: Sequence[str] | None = None) -> dict[str, Any]:
        """Call ``fn`` on every worker, or on ``workers``, at once (out of band, not a
        task); a coroutine function is awaited in the workers' event loops."""
        try:
            return self.client.run(fn, *args, workers=list(workers) if workers else None)
        except Exception:
            self._check_alive(list(workers or self.workers), grace=5.0)
            raise

    def restart_workers(self) -> None:
        """Restart every worker process (their nannies start fresh ones): a process
        group whose member died cannot be repaired, only replaced with new processes."""
        self.client.restart(wait_for_workers=False)

    def states(self, handles: Sequence[Any]) -> list[str]:
        """Each task's state as the scheduler has it (``waiting``, ``queued``,
        ``processing``: sent to a worker, maybe running, ``memory``: done, ``erred``;
        ``forgotten``: no longer there), in one request. Data placed as it is (no
        future): ``memory``."""
        keys = [h.key for h in handles if hasattr(h, "key")]
        found = self.client.run_on_scheduler(_states, keys) if keys else {}
        return [found.get(h.key, "forgotten") if hasattr(h, "key") else "memory"
                for h in handles]

    def cancel(self, handles: Sequence[Any]) -> None:
        """Cancel ``handles`` and what depends on them: a task not started never runs; one
        running on a worker runs to its end there (a thread cannot be interrupted), and
        its result is dropped."""
        for h in handles:
            self._submitted.discard(h)
            self._retries.pop(h.key, None)
        if handles:
            self.client.cancel(list(handles), force=True)

    def cancel_all(self) -> None:
        """Cancel every task of this run that has not finished."""
        live = [f for f in list(self._submitted) if not f.done()]
        self._retries.clear()  # nothing cancelled is asked about afterwards
        if live:
            self.client.cancel(live, force=True)

    def wait_for_workers(self, count: int, timeout: float) -> bool:
        """Wait up to ``timeout`` s for ``count`` device workers (a nanny restarts a killed
        one). Then use whatever device workers there are; False if there are none."""
        deadline = time.monotonic() + timeout
        while True:
            workers = self._device_workers(_workers_now(self.client))
            if len(workers) >= count or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if workers:
            self.workers = workers
        return bool(workers)

    def close(self) -> None:
        """Cancel what is still queued (after a failure, the next iteration's tasks), free
        resident models, shut an embedded cluster down."""
        try:
            self._close()
        finally:
            if self._config is not None:
                self._config.__exit__(None, None, None)
                self._config = None

    def _close(self) -> None:
        try:
            self.cancel_all()
            if self.cluster is None:
                self.client.unregister_worker_plugin(PLUGIN_NAME)
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
        self.client.close()
        if self.cluster is not None:
            try:
                self.cluster.close()
            except AssertionError:
                # Dask's nanny asserts on closing a worker process it is (re)starting, a
                # worker lost just before: it must not replace the run's own outcome
                # (seen by benchmarks/chaos.py: a finished or failed run ended in it)
                pass
        if self.output is not None:  # after the workers: their last words too
            self.output.close()
