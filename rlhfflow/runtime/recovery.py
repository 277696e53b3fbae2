"""Recovery from a lost worker: the executor's loop and setup stages, redone on the
workers there are. A worker that held models left the cluster (``WorkerLost``); the run
waits for workers (a nanny restarts a killed one), goes back to its last checkpoint (the
setup stages: to their start), reinstalls the resident state everywhere and goes on, at
most ``cluster.max_restarts`` times. How many restarts are left and which checkpoint the
run goes back to are the ``Coordinator``'s to decide; this module does the I/O.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rlhfflow.config.loader import Pipeline
from rlhfflow.engine.resident import ModelConfig
from rlhfflow.monitor.workerlogs import record_recovery
from rlhfflow.plan.placement import ExecutionPlan, PlanError
from rlhfflow.runtime.backend import WorkerLost
from rlhfflow.runtime.checkpointing import Checkpointer, cut_back
from rlhfflow.runtime.coordinator import Coordinator, CutBack, LostWorker, Recovering
from rlhfflow.runtime.failures import RunError
from rlhfflow.runtime.prepared import loop_models
from rlhfflow.runtime.runstate import damaged_line, inexact_resume
from rlhfflow.storage import ExperienceBuffer, MetricsLog


class Recovery:
    """The executor's recovery from a lost worker (``Executor`` is one): the loop and the
    setup stages retried on the workers there are, the run cut back to its last
    checkpoint. Uses the executor's state (declared below) and its ``_run_loop``,
    ``_run_setup``, ``_start_workers``, ``_perform`` and ``_say``."""

    pipeline: Pipeline
    backend: Any
    out: Path
    plan: ExecutionPlan | None
    log: MetricsLog
    buffer: ExperienceBuffer | None
    checkpointer: Checkpointer
    coordinator: Coordinator
    models: dict[str, ModelConfig]
    initial_models: dict[str, ModelConfig]

    def _run_with_recovery(self, first: int) -> list[dict[str, Any]]:
        """The loop; when a worker holding models is lost, resume from the last
        checkpoint on the workers there are (at most ``cluster.max_restarts`` times).
        Returns this run's metrics records, as kept in metrics.jsonl."""
        start = first
        while True:
            try:
                self._run_loop(first)
                break
            except WorkerLost as exc:
                first = self._recover_from(exc)
        return [r for r in self.log.read() if r.get("iteration", -1) >= start]

    def _recover_from(self, exc: WorkerLost) -> int:
        """``_recover``, once more for each worker lost while recovering (each counts as
        a restart); returns the next iteration."""
        while True:
            self._count_restart(exc)
            try:
                return self._recover(exc)
            except WorkerLost as again:
                exc = again

    def _run_setup_with_recovery(self) -> dict[str, Any]:
        """The setup stages; when a worker holding models is lost, redo them from their
        start on the workers there are (the restarts count with the loop's)."""
        while True:
            try:
                return self._run_setup()
            except WorkerLost as exc:
                self._restart_setup(exc)

    def _restart_setup(self, exc: WorkerLost) -> None:
        """Back to before the setup stages on the workers there are, once more for each
        worker lost meanwhile (each counts as a restart)."""
        while True:
            self._count_restart(exc)
            self._say(f"rlhfflow: {exc}; redoing the setup stages from their start")
            try:
                self._await_workers(exc)
                self.models = dict(self.initial_models)  # as before the setup stages
                self._start_workers()
                return
            except WorkerLost as again:
                exc = again

    def _count_restart(self, exc: WorkerLost) -> None:
        """One more recovery, or a ``RunError`` past ``cluster.max_restarts`` (the
        coordinator's decision)."""
        self._perform(self.coordinator.handle(LostWorker(str(exc))))

    def _recover(self, exc: Exception) -> int:
        """After a worker was lost: wait for workers, cut the run back to its last
        checkpoint, reinstall the resident state everywhere; returns the next iteration."""
        self._say(f"rlhfflow: {exc}; recovering from the last checkpoint")
        lost_at = time.time()
        self._await_workers(exc)
        checkpoint, damaged = self.checkpointer.store.latest_whole()
        if damaged:
            self._say(f"rlhfflow: {damaged_line(damaged, checkpoint)}")
        [cut] = self.coordinator.handle(Recovering(checkpoint.iteration if checkpoint
                                                   else None))
        assert isinstance(cut, CutBack)
        keep = cut.keep
        # before the cut: the iterations logged when the worker was lost (the report
        # marks the recovery on its curves)
        logged = max((r["iteration"] for r in self.log.read()
                      if isinstance(r.get("iteration"), int)), default=-1)
        record_recovery(self.out, logged, keep, str(exc), lost_at)
        cut_back(self.out, keep, self.buffer)
        self.models = loop_models(self.pipeline, self.initial_models, checkpoint)
        try:
            self._start_workers()
        except PlanError as err:  # fewer workers came back than the placement needs
            raise RunError(
                f"{exc}; {len(self.backend.workers)} worker(s) came back within "
                f"cluster.worker_timeout_s={self.pipeline.spec.cluster.worker_timeout_s:g}, "
                f"and {err.path}: {err.message}; the run can be resumed from its last "
                "checkpoint") from None
        self._say(f"rlhfflow: resuming {cut.where} on {len(self.backend.workers)} worker(s)")
        if checkpoint is not None and inexact_resume(self.pipeline):
            self._say(f"rlhfflow: {inexact_resume(self.pipeline)}")
        return cut.next_iteration

    def _await_workers(self, exc: Exception) -> None:
        """Cancel what was queued and wait up to ``cluster.worker_timeout_s`` for the
        workers (a nanny restarts a killed one); a ``RunError`` if none is left."""
        timeout = self.pipeline.spec.cluster.worker_timeout_s
        self.backend.cancel_all()
        if self.plan is not None and self.plan.gangs:
            # the survivors' process groups include the dead worker: start afresh
            self.backend.restart_workers()
        if not self.backend.wait_for_workers(len(self.backend.workers), timeout):
            raise RunError(f"{exc}; no worker came back within cluster.worker_timeout_s="
                           f"{timeout:g}; the run can be resumed from its last checkpoint"
                           ) from None
