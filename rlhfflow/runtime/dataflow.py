"""The thin step from task specs to tasks: each ``TaskSpec`` becomes one backend task
(a Dask future, or a result run inline) whose arguments are the futures of the specs it
refers to. Nothing here decides a dependency; ``rlhfflow.plan.compiler`` does.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from rlhfflow.plan.compiler import (
    CHECKPOINT,
    EXPORT,
    INSTALL,
    SOURCE_KIND,
    STAGE,
    STORE,
    Part,
    TaskSpec,
)
from rlhfflow.runtime.worker.host import (
    StoreRows,
    checkpoint_task,
    export_weights_task,
    install_weights_task,
    part,
    stage_task,
    store_task,
)
from rlhfflow.stages import Batch, slice_batch


class Dataflow:
    """Submits task specs to ``backend`` and keeps the handle of every live spec id.

    ``addresses`` maps the plan's worker indexes to worker addresses; ``buffer_path``
    and ``stored`` are where store tasks write and which columns.
    """

    def __init__(self, backend, addresses: Sequence[str], buffer_path: str | None = None,
                 stored: Iterable[str] = ()) -> None:
        self.backend = backend
        self.addresses = list(addresses)
        self.buffer_path = buffer_path
        self.stored = list(stored)
        self.handles: dict[str, Any] = {}
        self._iteration: dict[str, int] = {}

    def submit(self, specs: Iterable[TaskSpec], batch: Batch | None = None,
               directory: str | None = None) -> list[Any]:
        """Submit ``specs`` in order (each after the specs it refers to); ``batch`` is
        the iteration's source data for source specs, ``directory`` the checkpoint being
        assembled for checkpoint specs. Returns their handles."""
        out = []
        for spec in specs:
            handle = self._submit(spec, batch, directory)
            self.handles[spec.id] = handle
            self._iteration[spec.id] = spec.iteration
            out.append(handle)
        return out

    def __getitem__(self, ids: Iterable[str]) -> list[Any]:
        """The handles of ``ids``."""
        return [self.handles[i] for i in ids]

    def forget_before(self, iteration: int) -> None:
        """Drop the handles of iterations before ``iteration`` (nothing refers to them
        any more), so Dask can release their results."""
        for key in [k for k, i in self._iteration.items() if 0 <= i < iteration]:
            del self.handles[key], self._iteration[key]

    def clear(self) -> None:
        """Forget every handle (after a recovery cut the run back)."""
        self.handles.clear()
        self._iteration.clear()

    # ----------------------------------------------------------------- one spec
    def _submit(self, spec: TaskSpec, batch: Batch | None, directory: str | None) -> Any:
        k = spec.iteration
        if spec.kind == SOURCE_KIND:
            where = self.addresses[spec.workers[0]] if spec.workers else None
            # named for the dashboard: "scatter-prompts" on its progress bars, not "dict"
            return self.backend.place(slice_batch(batch, *spec.rows), where,
                                      key=f"scatter-prompts-{k}-{uuid.uuid4().hex[:8]}")
        waits = self[spec.waits]
        if spec.kind == STAGE:
            task = spec.stages if len(spec.stages) > 1 else spec.stages[0]
            args = [task, k, self._parts(spec.parts), waits, dict(spec.versions)]
            args.append(tuple(self.addresses[w] for w in spec.gang) if spec.gang else None)
            if spec.stores:
                args.append(StoreRows(self.buffer_path, spec.rows[0], tuple(self.stored),
                                      spec.returns_rows, spec.reports))
            return self._task(spec, stage_task, *args)
        if spec.kind == STORE:
            return self._task(spec, store_task, self.buffer_path, k, spec.rows[0],
                              self._parts(spec.parts), self.stored, waits)
        if spec.kind == EXPORT:
            return self._task(spec, export_weights_task, spec.model, k,
                              self[spec.parts[0].refs])
        if spec.kind == INSTALL:
            [export] = self[spec.parts[0].refs]
            return self._task(spec, install_weights_task, export, spec.version, k, waits)
        if spec.kind == CHECKPOINT:
            return self._task(spec, checkpoint_task, spec.model, directory, waits, spec.rank)
        raise ValueError(f"task {spec.id!r}: unknown kind {spec.kind!r}")

    def _task(self, spec: TaskSpec, fn, *args: Any) -> Any:
        return self.backend.submit(fn, *args, key=f"{spec.id}-{uuid.uuid4().hex[:8]}",
                                   worker=self._where(spec), retries=spec.retries,
                                   priority=spec.priority)

    def _parts(self, parts: tuple[Part, ...]) -> list[dict[str, Any]]:
        return [part(self[p.refs], p.rows) for p in parts]

    def _where(self, spec: TaskSpec) -> list[str] | None:
        """The addresses a task may run on (None: any worker)."""
        return [self.addresses[w] for w in spec.workers] or None
