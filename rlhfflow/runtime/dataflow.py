"""The thin step from tasks to backend tasks: each ``rlhfflow.plan.tasks.Task`` becomes
one backend task (a Dask future, or a result run inline) whose arguments are the futures
of the tasks it refers to, dispatched on the task's type. Nothing here decides a
dependency; ``rlhfflow.plan.compiler`` does. Every backend key maps back to its task
(``task_of``), so a failure is attributed without parsing the key.
"""

from __future__ import annotations

import functools
import inspect
import logging
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import singledispatchmethod
from typing import Any

from rlhfflow.engine.batch import slice_batch
from rlhfflow.plan.tasks import (
    CheckpointTask,
    ExportTask,
    InstallTask,
    Part,
    SourceTask,
    StageTask,
    StoreTask,
    Task,
)
from rlhfflow.runtime.backend import TaskFailed
from rlhfflow.runtime.worker.tasks import (
    REORDERED,
    StoreRows,
    checkpoint_task,
    export_weights_task,
    install_weights_task,
    part,
    stage_task,
    store_task,
)
from rlhfflow.sdk import Batch

logger = logging.getLogger(__name__)

#: A task's ``waits`` (model edges: a trainer after the users of its model, the next
#: generate after the trainer) are Dask dependencies, and Dask keeps every released task
#: that a live task still depends on (its lineage, to recompute lost data). Iteration k's
#: tasks wait for k-1's, so the lineage of the newest iteration reached back to iteration
#: 0: a run's scheduler and workers kept every task's state and arguments, 0.3 MB an
#: iteration on ppo-tiny's coordinator. A wait is only an order, so a wait for a task
#: that has finished is left out; and every ``LINEAGE_EVERY`` iterations a task waits
#: for the tasks of earlier iterations here, before it is submitted, so that no
#: dependency crosses that iteration and what is older can be forgotten. rlhfflow does
#: not use the lineage: a lost worker is recovered from the last checkpoint.
LINEAGE_EVERY = 10


class Dataflow:
    """Submits task specs to ``backend`` and keeps the handle of every live spec id.

    ``addresses`` maps the plan's worker indexes to worker addresses; ``buffer_path``
    and ``stored`` are where store tasks write and which columns; ``prompts(k)`` is
    iteration k's source batch (None past the run's end), for the tasks of a stage that
    streams, which get the next iterations' rows (``StageTask.ahead``).
    """

    def __init__(self, backend, addresses: Sequence[str], buffer_path: str | None = None,
                 stored: Iterable[str] = (),
                 prompts: Callable[[int], Batch | None] | None = None) -> None:
        self.backend = backend
        self.prompts = prompts
        self.addresses = list(addresses)
        self.buffer_path = buffer_path
        self.stored = list(stored)
        self.handles: dict[str, Any] = {}
        #: for a stage that reorders rows: the iteration a resume or recovery went on
        #: from, and the episodes (``(iteration, prompt_index, sample_index)``) the
        #: iterations before it took (``resume``)
        self.first = 0
        self.taken: frozenset[tuple[int, int, int]] = frozenset()
        self._iteration: dict[str, int] = {}
        self._specs: dict[str, Task] = {}  # id -> task
        self._tasks: dict[str, Task] = {}  # backend key -> task

    def submit(self, specs: Iterable[Task], batch: Batch | None = None,
               directory: str | None = None) -> list[Any]:
        """Submit ``specs`` in order (each after the specs it refers to); ``batch`` is
        the iteration's source data for source specs, ``directory`` the checkpoint being
        assembled for checkpoint specs. Returns their handles."""
        out = []
        for spec in specs:
            handle = self._submit(spec, batch=batch, directory=directory)
            self.handles[spec.id] = handle
            self._iteration[spec.id] = spec.iteration
            self._specs[spec.id] = spec
            out.append(handle)
        return out

    def task_of(self, key: str) -> Task | None:
        """The task a backend key was submitted for (None: not one of this dataflow's)."""
        return self._tasks.get(key)

    def __getitem__(self, ids: Iterable[str]) -> list[Any]:
        """The handles of ``ids``."""
        return [self.handles[i] for i in ids]

    def tasks(self) -> dict[str, Task]:
        """The tasks whose handles are held (not forgotten), by id."""
        return dict(self._specs)

    def forget_before(self, iteration: int) -> None:
        """Drop the handles of iterations before ``iteration`` (nothing refers to them
        any more), so Dask can release their results."""
        self.forget([i for i, k in self._iteration.items() if 0 <= k < iteration])

    def forget(self, ids: Iterable[str]) -> None:
        """Drop the handles of ``ids`` (done with, or cancelled)."""
        keys = set()
        for i in ids:
            keys.add(getattr(self.handles.pop(i), "key", None))
            del self._iteration[i], self._specs[i]
        self._tasks = {k: t for k, t in self._tasks.items() if k not in keys}

    def clear(self) -> None:
        """Forget every handle (after a recovery cut the run back)."""
        self.handles.clear()
        self._iteration.clear()
        self._specs.clear()
        self._tasks.clear()

    # ----------------------------------------------------------------- one task
    @singledispatchmethod
    def _submit(self, spec: Task, **context: Any) -> Any:
        raise TypeError(f"task {spec.id!r}: no way to submit a {type(spec).__name__}")

    @_submit.register
    def _(self, spec: SourceTask, *, batch: Batch | None, **context: Any) -> Any:
        where = self.addresses[spec.workers[0]] if spec.workers else None
        # named for the dashboard: "scatter-prompts" on its progress bars, not "dict"
        return self.backend.place(slice_batch(batch, *spec.rows), where,
                                  key=f"scatter-prompts-{spec.iteration}-{uuid.uuid4().hex[:8]}")

    def waits(self, spec: Task) -> list[Any]:
        """The handles of what ``spec`` waits for (only to run after them), without those
        that have finished; at an iteration that cuts the lineage (``LINEAGE_EVERY``),
        the tasks of earlier iterations are first waited for here. A wait that failed
        stays, for the task to fail with it as Dask reports it; a lost worker is raised
        (``WorkerLost``: the executor recovers)."""
        cut = spec.iteration - spec.iteration % LINEAGE_EVERY
        out = []
        for i in spec.wait_ids():
            handle = self.handles[i]
            if _status(handle) != "finished" and self._iteration.get(i, cut) < cut:
                try:
                    # pinned: a task pinned to a worker that died would wait forever
                    self.backend.wait([handle], pinned=self.addresses)
                except TaskFailed:  # reported, with its stage, where the iteration waits
                    pass
            if _status(handle) != "finished":
                out.append(handle)
        return out

    @_submit.register
    def _(self, spec: StageTask, **context: Any) -> Any:
        store = StoreRows(self.buffer_path, spec.rows[0], tuple(self.stored), spec.storage,
                          spec.reports) if spec.stores else None
        return self._task(
            spec, stage_task, name=spec.stages if len(spec.stages) > 1 else spec.stages[0],
            iteration=spec.iteration, parts=self._parts(spec.parts), after=self.waits(spec),
            versions=dict(spec.versions),
            gang=tuple(self.addresses[w] for w in spec.gang) if spec.gang else None,
            store=store, **({"ahead": self._ahead(spec)} if spec.ahead else {}),
            **(self._behind(spec) if spec.behind else {}))

    def _ahead(self, spec: StageTask) -> list[tuple[int, Batch]]:
        """The task's rows of the next ``spec.ahead`` iterations (those the run has)."""
        assert self.prompts is not None, "a streaming stage's task needs the prompts"
        out = []
        for j in range(spec.iteration + 1, spec.iteration + 1 + spec.ahead):
            batch = self.prompts(j)
            if batch is None:
                break
            out.append((j, slice_batch(batch, *spec.rows)))
        return out

    def resume(self, first: int, taken: frozenset[tuple[int, int, int]]) -> None:
        """The run goes on from iteration ``first`` after a resume or a recovery, the
        iterations before it having taken the episodes ``taken``."""
        self.first, self.taken = first, taken

    def _behind(self, spec: StageTask) -> dict[str, Any]:
        """For a stage that reorders rows: the staleness bound; its rows of the
        ``spec.behind`` iterations before that came before the run went on from a
        checkpoint (episodes it may still owe that no stream holds: those of later
        iterations it started itself), and what the run took before that."""
        assert self.prompts is not None, "a streaming stage's task needs the prompts"
        k = spec.iteration
        behind = [(j, slice_batch(batch, *spec.rows))
                  for j in range(max(0, k - spec.behind), min(k, self.first))
                  if (batch := self.prompts(j)) is not None]
        taken = frozenset(key for key in self.taken if key[0] >= k - spec.behind)
        return {"behind": behind, "taken": taken, "staleness": spec.behind}

    @_submit.register
    def _(self, spec: StoreTask, **context: Any) -> Any:
        return self._task(spec, store_task, path=self.buffer_path, iteration=spec.iteration,
                          start_row=spec.rows[0], parts=self._parts(spec.parts),
                          columns=self.stored, after=self.waits(spec))

    @_submit.register
    def _(self, spec: ExportTask, **context: Any) -> Any:
        return self._task(spec, export_weights_task, model=spec.model,
                          iteration=spec.iteration, after=self[spec.parts[0].refs])

    @_submit.register
    def _(self, spec: InstallTask, **context: Any) -> Any:
        exports = self[spec.parts[0].refs]  # a sharded model's: one per rank
        payload = exports[0] if len(exports) == 1 else exports
        return self._task(spec, install_weights_task, payload=payload, version=spec.version,
                          iteration=spec.iteration, after=self.waits(spec))

    @_submit.register
    def _(self, spec: CheckpointTask, *, directory: str | None, **context: Any) -> Any:
        return self._task(spec, checkpoint_task, model=spec.model, directory=directory,
                          after=self.waits(spec), rank=spec.rank)

    def _task(self, spec: Task, fn: Callable[..., Any], **kwargs: Any) -> Any:
        """Submit ``fn(**kwargs)`` for ``spec``; the arguments are checked against
        ``fn``'s signature first (``check_arguments``), so a wrong name fails here, at
        submission, not on a worker."""
        check_arguments(fn, kwargs)
        key = f"{spec.id}-{uuid.uuid4().hex[:8]}"
        self._tasks[key] = spec
        logger.debug("rlhfflow: submit %s (priority %d) on %s", key, spec.priority,
                     ", ".join(self._where(spec) or ["any worker"]))
        return self.backend.submit(fn, key=key, worker=self._where(spec),
                                   retries=spec.retries, priority=spec.priority,
                                   kwargs=kwargs)

    def _parts(self, parts: tuple[Part, ...]) -> list[dict[str, Any]]:
        return [part(self[p.refs], p.rows) for p in parts]

    def _where(self, spec: Task) -> list[str] | None:
        """The addresses a task may run on (None: any worker)."""
        return [self.addresses[w] for w in spec.workers] or None


def check_arguments(fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> None:
    """Raise ``TypeError`` naming ``fn`` and the argument where ``kwargs`` do not fit
    ``fn``'s signature: an unknown name, or a required argument missing."""
    signature = _signature(fn)
    for name in kwargs:
        if name not in signature.parameters:
            raise TypeError(f"{fn.__name__}() has no argument {name!r} (it takes "
                            f"{', '.join(signature.parameters)})")
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        raise TypeError(f"{fn.__name__}(): {exc}") from None


@functools.cache
def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(fn)


def _status(handle: Any) -> str:
    """A handle's status as a Dask future's; data placed as it is (a micro-batch that
    rides inside its tasks' messages) is there: "finished"."""
    return getattr(handle, "status", "finished")


def taken_before(buffer, first: int, staleness: int) -> frozenset[tuple[int, int, int]]:
    """For a stage that reorders rows, the episodes (``(iteration, prompt_index,
    sample_index)``) the iterations before ``first`` took that a task from ``first`` on
    could meet again (an episode it may still owe from the ``staleness`` iterations
    before, or a later one an earlier task took), read from ``buffer`` as a resumed or
    recovered run finds it: they are not played again."""
    done = set(buffer.iterations())
    out: set[tuple[int, int, int]] = set()
    for k in range(max(0, first - 2 * staleness), first):
        if k in done:
            rows = buffer.read(k, [REORDERED, "prompt_index", "sample_index"])
            out.update(zip(*(rows[c].tolist() for c in (REORDERED, "prompt_index",
                                                          "sample_index")), strict=True))
    return frozenset(key for key in out if key[0] >= first - staleness)
