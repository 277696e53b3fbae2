"""What a device worker keeps between tasks: its resident state, and the calls the
coordinator makes on it out of band (``Client.run``).

``WorkerHost`` keeps the models (a ``ModelStore``), stage objects and task timings of
one worker between tasks. On Dask it is owned by ``RLHFWorkerPlugin`` (a WorkerPlugin,
not an Actor: docs/design/worker.md); in process it is a module global. The task
functions (``rlhfflow.runtime.worker.tasks``) find it with ``current_host()`` and are
plain functions of their inputs, so Dask can retry them.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from distributed import WorkerPlugin

from rlhfflow.engine import machine
from rlhfflow.engine.resident import ModelConfig, ModelStore
from rlhfflow.errors import RlhfflowError
from rlhfflow.runtime.worker.rebalance import announce, nothing_else_to_do
from rlhfflow.sdk import (
    IterationMetric,
    RunSettings,
    Stage,
    StageContext,
    create_stage,
)

PLUGIN_NAME = "rlhfflow"


@dataclass(frozen=True)
class StageDef:
    """A stage as a worker needs it: its class's import path (``type``, so plugin types
    need only be importable on the worker), typed params and model name, and the
    figures it declares (``Stage.iteration_metrics``), which a store task sums."""

    type: str
    params: Any
    model: str | None
    reads: tuple[str, ...] = ()
    backend: str = "torch"
    deepspeed: Mapping[str, Any] | None = None
    metrics: tuple[IterationMetric, ...] = ()


@dataclass(frozen=True)
class RunDef:
    """Everything workers need to know about a run (sent once, with the plugin)."""

    stages: Mapping[str, StageDef]
    models: Mapping[str, ModelConfig]
    algorithm: Any
    seed: int
    settings: RunSettings = field(default_factory=RunSettings)

    def __post_init__(self) -> None:
        object.__setattr__(self, "settings", RunSettings.of(self.settings))


class UpdateGate:
    """Where a task that updates a model (a trainer, a weight install) asks to begin, so
    that a stop decides on every worker at once which iterations' updates run.

    A stop first ``hold``s the gate at the iteration in flight: an update of a later
    iteration that arrives waits, and the gate answers which later iterations' updates
    already began (those cannot be undone). The coordinator then ``settle``s it at the
    last iteration it finishes: waiting updates up to it go on, later ones are refused
    (``UpdateRefused``; their tasks were cancelled). Without a stop it never waits."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._limit: int | None = None
        self._held = False
        self._begun: set[int] = set()

    def enter(self, iteration: int) -> None:
        """An update of ``iteration`` begins now, or waits for the stop's decision, or
        is refused."""
        with self._cond:
            while self._held and self._limit is not None and iteration > self._limit:
                self._cond.wait()
            if self._limit is not None and iteration > self._limit:
                raise UpdateRefused(f"the run stopped after iteration {self._limit}: "
                                    f"the update of iteration {iteration} is not made")
            self._begun.add(iteration)

    def hold(self, done: int) -> list[int]:
        """Updates after iteration ``done`` wait; the iterations after it whose updates
        already began here."""
        with self._cond:
            self._limit, self._held = done, True
            return sorted(i for i in self._begun if i > done)

    def settle(self, through: int) -> None:
        """Updates up to iteration ``through`` go on; later ones are refused."""
        with self._cond:
            self._limit, self._held = through, False
            self._cond.notify_all()


class WorkerHost:
    """Resident state of one worker: models, stage objects, timings of finished tasks."""

    def __init__(self, run: RunDef, device: str = "cpu",
                 torch_threads: int | None = None) -> None:
        self.run = run
        self.torch_threads = torch_threads
        self.store = ModelStore(run.models, device=device)
        self._stages: dict[str, Stage] = {}
        self.timings: list[tuple[int, str, float, float, int]] = []
        self.running: dict[int, tuple[int, str, float]] = {}  # thread id -> task started
        self._lock = threading.Lock()
        self._env_executor = None
        self.updates = UpdateGate()

    def env_executor(self):
        """The executor of environment steps on the run's CPU pool (``RunSettings.env_pool``):
        each call is a Dask task that only a pool worker takes, or None without a pool.

        The calling task does not secede while it waits for them: it decodes its other
        rows meanwhile, and a seceded task lets the next task onto this worker's one
        thread, to share the model and the cores with it (checked on a 1-thread worker:
        after ``secede`` the next task started at once beside it, and ``rejoin`` then
        waited for that task to end)."""
        resource = self.run.settings.env_pool
        if resource is None:
            return None
        if self._env_executor is None:
            from distributed import get_client

            self._env_executor = get_client().get_executor(resources={resource: 1},
                                                           pure=False)
        return self._env_executor

    def stage(self, name: str) -> Stage:
        """The stage object ``name`` (created once per worker)."""
        if name not in self._stages:
            d = self.run.stages[name]
            self._stages[name] = create_stage(d.type, name, d.params, self.run.algorithm,
                                              d.model, backend=d.backend,
                                              deepspeed=d.deepspeed)
        return self._stages[name]

    def context(self, iteration: int) -> StageContext:
        """The context stages see in ``iteration``."""
        return StageContext(iteration=iteration, seed=self.run.seed, models=self.store,
                            algorithm=self.run.algorithm, settings=self.run.settings)

    def record(self, iteration: int, stage: str, start: float, stop: float,
               rows: int = 0) -> None:
        """Remember a task's compute interval (wall clock, seconds since the epoch) and
        the rows it worked on (what the planner's cost model is fitted to)."""
        with self._lock:
            self.timings.append((iteration, stage, start, stop, rows))

    def record_part(self, iteration: int, stage: str, part: str, start: float,
                    stop: float) -> None:
        """Remember an interval of work that ran beside a task of ``stage`` (its
        environment steps), as ``STAGE/PART`` with no rows: the task timeline shows it,
        the busy fractions and the profile leave it out."""
        self.record(iteration, f"{stage}/{part}", start, stop)

    @contextmanager
    def timed(self, iteration: int, stage: str, rows: int = 0):
        """Record the compute interval of the block; while it runs it is reported as
        running (so the busy time of a window that ends mid-task is not lost)."""
        start = time.time()
        thread = threading.get_ident()
        topic = self.run.settings.rows_topic
        if topic:  # sample reallocation: peers may stop handing rows to this worker
            announce(topic, False, self.store.loaded())
        with self._lock:
            self.running[thread] = (iteration, stage, start)
        try:
            yield
        finally:
            with self._lock:
                self.running.pop(thread, None)
                self.timings.append((iteration, stage, start, time.time(), rows))
            if topic:
                if nothing_else_to_do():
                    announce(topic, True, self.store.loaded())

    def pop_timings(self) -> dict[str, list]:
        """Hand the finished intervals to the coordinator (and forget them), with the
        tasks still running as ``(iteration, stage, start)`` and the process's peak
        resident set since the last call (``peak_rss``, bytes; None where unknown)."""
        with self._lock:
            out, self.timings = self.timings, []
            running = list(self.running.values())
        return {"done": out, "running": running, "now": time.time(),
                "peak_rss": machine.peak_rss(reset=True)}

    def close(self) -> None:
        """Drop the models so their memory is freed."""
        self.store.models.clear()
        self._stages.clear()
        gc.collect()


class RLHFWorkerPlugin(WorkerPlugin):
    """Owns a ``WorkerHost`` on every Dask worker for the life of a run."""

    name = PLUGIN_NAME

    def __init__(self, run: RunDef, torch_threads: int | None = None) -> None:
        self.run = run
        self.torch_threads = torch_threads
        self.host: WorkerHost | None = None

    def setup(self, worker) -> None:
        """Size torch's thread pool to this worker's share of the cores; create the host."""
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        self.host = WorkerHost(self.run, device=worker_device(self.run.settings.device),
                               torch_threads=self.torch_threads)

    def teardown(self, worker) -> None:
        """Free the resident models."""
        if self.host is not None:
            self.host.close()
            self.host = None


def worker_device(requested: str | None) -> str:
    """``cluster.device`` as a torch device: ``cpu`` stays on CPU even where a GPU is
    visible; ``auto`` takes this worker's GPU when there is one."""
    if requested == "cpu":
        return "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("cluster.device is 'cuda' but this worker sees no CUDA device")
    return "cuda" if torch.cuda.is_available() else "cpu"


_LOCAL_HOST: WorkerHost | None = None


def set_local_host(host: WorkerHost | None) -> None:
    """Install the host used when tasks run in this process (no Dask)."""
    global _LOCAL_HOST
    _LOCAL_HOST = host


def current_host(dask_worker=None) -> WorkerHost:
    """The host of the worker running the current task (or of ``dask_worker``, for
    functions run out of band with ``Client.run``), or the in-process one."""
    try:
        from distributed import get_worker

        worker = dask_worker if dask_worker is not None else get_worker()
        plugin = worker.plugins.get(PLUGIN_NAME)
    except ValueError:  # not inside a Dask worker
        plugin = None
    if plugin is not None and plugin.host is not None:
        threads = plugin.host.torch_threads
        # torch keeps a thread's OpenMP size from its first parallel op: a task thread
        # that ran torch before the plugin's setup (in the event loop's thread) sized its
        # pool would keep the forked default (all the cores, per worker) for good
        if threads and dask_worker is None and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        return plugin.host
    if _LOCAL_HOST is None:
        raise RuntimeError("no rlhfflow worker state here: register RLHFWorkerPlugin first")
    return _LOCAL_HOST


class UpdateRefused(RlhfflowError, RuntimeError):
    """An update of an iteration after the one a stop finishes (its task was cancelled)."""


def worker_address(dask_worker=None) -> str:
    """This Dask worker's address, or "inline" outside one."""
    try:
        from distributed import get_worker

        return (dask_worker or get_worker()).address
    except ValueError:  # not inside a Dask worker
        return "inline"


# --------------------------------------------------------------------------- out of band


def hold_updates(done: int, dask_worker=None) -> list[int]:
    """A stop's first step on a worker (``UpdateGate.hold``), run out of band."""
    return current_host(dask_worker).updates.hold(done)


def settle_updates(through: int, dask_worker=None) -> None:
    """A stop's second step on a worker (``UpdateGate.settle``), run out of band."""
    current_host(dask_worker).updates.settle(through)


async def join_gang_task(members: list[str], master: str, port: int, timeout_s: float,
                         dask_worker=None) -> int:
    """Join the data-parallel gang ``members`` (run on all of them at once, out of band
    with ``Client.run``); blocking rendezvous in a thread, so the worker stays alive."""
    import asyncio

    from rlhfflow.engine.parallel import join_gang

    host = current_host(dask_worker)
    gang = await asyncio.to_thread(join_gang, tuple(members), worker_address(dask_worker),
                                   master, port, timeout_s, host.store.device)
    return gang.rank


def gang_port(host: str, dask_worker=None) -> int:
    """A free port on this worker's host for a gang's rendezvous."""
    from rlhfflow.engine.parallel import free_port

    return free_port(host)


def update_model_configs(configs: Mapping[str, ModelConfig], dask_worker=None) -> None:
    """Point models at new initial weights (after the setup stages trained them)."""
    host = current_host(dask_worker)
    for config in configs.values():
        host.store.update_config(config)


def pop_timings(dask_worker=None) -> dict[str, list]:
    """Collect this worker's task timings (called on every worker by the coordinator)."""
    return current_host(dask_worker).pop_timings()


def resident_models(dask_worker=None) -> dict[str, dict[str, int]]:
    """Loaded models with their versions and load counts (for tests and diagnostics)."""
    store = current_host(dask_worker).store
    return {name: {"version": m.version, "loads": store.loads.get(name, 0)}
            for name, m in store.models.items()}
