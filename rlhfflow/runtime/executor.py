"""The run's lifecycle: the executor materialises the models, places them, starts the
workers' resident state, runs the setup stages, then the iterations, recovers from a lost
worker by going back to the last checkpoint (``rlhfflow.runtime.recovery``), and saves the
trained models.

What each iteration's tasks are (micro-batches streaming through the stages, fusion, the
model edges within and across iterations, bounded staleness, gangs, weight syncs to
shadows, stores, checkpoints) is decided by ``rlhfflow.plan.compiler`` as plain task
specs; ``rlhfflow.runtime.dataflow`` submits them to Dask; ``checkpointing`` and
``telemetry`` keep checkpoints and measurements. The loop follows ``schedule``:
iteration k+1 is submitted while k runs, so the scheduler starts it the moment the new
weights exist.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhfflow.config.graph import SOURCE
from rlhfflow.config.shapes import model_shapes
from rlhfflow.engine.resident import ModelConfig
from rlhfflow.monitor import RunMonitor
from rlhfflow.plan.auto.planner import PlanChoice, resolve_plan
from rlhfflow.plan.compiler import (
    Begin,
    IterationTasks,
    Main,
    Start,
    TaskCompiler,
    batch_rows,
    schedule,
)
from rlhfflow.plan.flops import stage_work
from rlhfflow.plan.placement import ExecutionPlan
from rlhfflow.runtime.backend import Backend, TaskFailed
from rlhfflow.runtime.budget import score_error_budget
from rlhfflow.runtime.checkpointing import Checkpointer
from rlhfflow.runtime.coordinator import (
    Abandon,
    Action,
    AnnounceStop,
    Commit,
    Coordinator,
    CutBack,
    Fail,
    IterationCommitted,
    IterationSubmitted,
    LoopDrained,
    LoopStarted,
    PlanStop,
    PublishCheckpoint,
    Retry,
    SaveCheckpoint,
    Say,
    ScheduleEnded,
    StageFailed,
    StopPlanned,
    StopRequested,
)
from rlhfflow.runtime.dataflow import Dataflow, taken_before
from rlhfflow.runtime.evaluation import evaluation_summary
from rlhfflow.runtime.failures import RunError
from rlhfflow.runtime.models import after_setup, setup_trained
from rlhfflow.runtime.prepared import PreparedRun
from rlhfflow.runtime.recovery import Recovery
from rlhfflow.runtime.runstate import identity_digest, inexact_resume, pipeline_identity
from rlhfflow.runtime.stopping import plan_stop, stop_line, wait_estimate
from rlhfflow.runtime.telemetry import (
    StartupClock,
    Telemetry,
    dashboard_moved,
    machine_peaks,
    prediction_line,
    progress_line,
    summarise,
)
from rlhfflow.runtime.worker.host import (
    RunDef,
    hold_updates,
    settle_updates,
    update_model_configs,
)
from rlhfflow.runtime.worker.tasks import (
    PROMPT_TEXTS,
    RESPONSE_TEXTS,
    TaskResult,
    save_model_task,
)
from rlhfflow.runtime.worker.tasks import StageFailed as StageTaskFailed
from rlhfflow.runtime.workers import (
    build_tiny_models,
    check_gang_batches,
    env_pool,
    join_gangs,
    layout,
    rows_topic,
    stage_defs,
)
from rlhfflow.sdk import IterationMetric, RunSettings
from rlhfflow.storage import ColumnSpec, MetricsLog, link_model

logger = logging.getLogger(__name__)


@dataclass
class RunResult:
    """What a finished run leaves behind."""

    output_dir: Path
    metrics: list[dict[str, Any]] = field(default_factory=list)
    setup_metrics: dict[str, Any] = field(default_factory=dict)
    dashboard: str | None = None
    stopped: bool = False
    summary: dict[str, Any] = field(default_factory=dict)
    already_done: int | None = None  # a finished run had this many iterations: none run


TEXT_COLUMNS = ("prompt_text", "prompt_fields")
"""Source text columns the coordinator stores in the buffer (as utf-8 with offsets)."""


class Executor(Recovery):
    """Runs a prepared pipeline on a backend: the run's lifecycle (models, workers, setup
    stages, the iteration loop, recovery, the final save). The driver of the run: what
    each iteration's tasks are comes from ``TaskCompiler``; what to do next (commit,
    publish a checkpoint, stop, recover, fail) from the ``Coordinator``, fed what
    happened; ``Dataflow`` submits the tasks; ``Checkpointer`` and ``Telemetry`` keep
    checkpoints and measurements; recovery's I/O is its ``Recovery`` base's."""

    def __init__(self, prepared: PreparedRun, backend: Backend, progress: bool = True,
                 stop: threading.Event | None = None, *, digest: str | None = None,
                 choice: PlanChoice | None = None, clock: StartupClock | None = None):
        """``prepared``: by ``prepare_run``; ``digest``: of the pipeline file as written
        (a resume compares it; default: of the prepared pipeline); ``choice``: what
        ``placement: auto`` chose, if it did; ``clock``: the start-up clock, started with
        the process."""
        pipeline = prepared.pipeline
        self.pipeline = pipeline
        self.graph = pipeline.graph
        self.backend = backend
        self.out = prepared.out
        self.progress = progress
        self.start = prepared.start
        self.stop = stop
        self.source = prepared.source
        self.buffer = prepared.buffer
        self.log = MetricsLog(self.out / "metrics.jsonl")
        self.telemetry = Telemetry(backend, self.out, self._declared_metrics())
        self.plan: ExecutionPlan | None = None
        self.addresses: list[str] = []
        self.shapes = model_shapes(pipeline)
        self.model_bytes = {name: shape.nbytes for name, shape in self.shapes.items()}
        self.summary: dict[str, Any] = {}
        self.initial_models: dict[str, ModelConfig] = prepared.initial_models
        self.models: dict[str, ModelConfig] = prepared.models
        self.tiny = prepared.tiny  # tiny models to build on a worker: tiny_models
        checkpoint = self.start.checkpoint
        self.coordinator = Coordinator(pipeline.spec.cluster.max_restarts,
                                       last_checkpoint=checkpoint.iteration
                                       if checkpoint else -1)
        self.digest = digest or identity_digest(pipeline_identity(pipeline))
        self.choice = choice
        # what each iteration stores: every non-text column
        self.stored = {c: col for c, col in self.graph.columns().items() if col.dtype != "str"}
        self.reorders = any(self.graph.nodes[n].reorders for n in self.graph.loop_stages)
        # per iteration begun, what its stores need: the prompt width and the text columns
        self._begun: dict[int, tuple[int, dict[str, list[str]]]] = {}
        # per iteration submitted whole and not committed yet, its tasks
        self._submitted: dict[int, IterationTasks] = {}
        self.clock = clock or StartupClock()
        self.first_iteration_s: float | None = None
        # made by ``_start_workers``, again on each recovery (the workers' addresses)
        self.compiler: TaskCompiler
        self.dataflow: Dataflow
        self.checkpointer: Checkpointer
        self.monitor: RunMonitor

    # ----------------------------------------------------------------- set-up
    def _declared_metrics(self) -> list[IterationMetric]:
        """The figures the stages declare for the record (``Stage.iteration_metrics``)."""
        return [m for node in self.graph.nodes.values() for m in node.metrics]

    def run(self) -> RunResult:
        """Materialise models, place them, run the setup stages, then the iterations;
        recover from a lost worker by resuming from the last checkpoint."""
        spec = self.pipeline.spec
        checkpoint = self.start.checkpoint
        self._start_workers()
        # after the workers' state: it sets each worker's torch threads, which a torch op
        # run before would fix at the forked default (all cores) for the task thread,
        # 2 spinning OpenMP threads per worker on 2 cores, iterations 10x slower
        build_tiny_models(self.backend, self.tiny)
        self.tiny = {}
        self.clock.mark("models")  # the resident state installed, tiny models built
        result = RunResult(self.out, dashboard=self.backend.dashboard_link)
        first = self.start.next_iteration
        how = f"resuming after iteration {first - 1}" if checkpoint else (
            "resuming from the start (no checkpoint yet)" if self.start.resumed else "")
        self._say(f"rlhfflow: {self.pipeline.name}: {spec.iterations} iterations on "
                  f"{len(self.backend.workers)} worker(s); output {self.out}"
                  + (f"; {how}" if how else ""))
        if self.start.fallback_line():
            self._say(f"rlhfflow: {self.start.fallback_line()}")
        if checkpoint is not None and first < spec.iterations and inexact_resume(self.pipeline):
            self._say(f"rlhfflow: {inexact_resume(self.pipeline)}")
        if self.backend.dashboard_link:
            moved = dashboard_moved(spec.cluster.dashboard_address,
                                     self.backend.dashboard_link) \
                if self.backend.cluster is not None else ""
            self._say(f"rlhfflow: Dask dashboard: {self.backend.dashboard_link}{moved}")
        self.monitor = RunMonitor(self.pipeline, self.backend, self.out, self._say,
                                  resumed=self.start.resumed, first=first)
        if self.choice is not None:
            c = self.choice
            self._say(f"rlhfflow: plan (placement auto): {c.best.describe()}; predicted "
                      f"{c.best.predicted_s:.3f} s/iteration ({c.cost.source()}; "
                      f"`rlhfflow plan FILE --candidates 5` shows why)")
            if c.cost.warning:
                self._say(f"rlhfflow: warning: {c.cost.warning}")
        try:
            if self.graph.setup_stages and checkpoint is None:
                result.setup_metrics = self._run_setup_with_recovery()
            if self.graph.loop_stages and first < spec.iterations:
                self._count_flops()
                result.metrics = self._run_with_recovery(first)
        except BaseException:  # the logging: sinks see the run fail (rlhfflow.monitor)
            self.monitor.close(failed=True)
            raise
        self.monitor.close()
        result.summary = self.summary
        if self.first_iteration_s is not None:
            self.summary["startup_s"] = round(self.clock.total, 3)
            self.summary["startup"] = {name: round(sec, 3) for name, sec in self.clock.phases}
            self.summary["first_iteration_s"] = round(self.first_iteration_s, 3)
        result.stopped = bool(self.stop and self.stop.is_set())
        if not result.stopped:
            self._save_final()
        return result

    def _count_flops(self) -> None:
        """Have the telemetry count each iteration's model FLOPs and MFU, against the
        matmul peaks of this machine (measured now on its first run, then cached)."""
        work = stage_work(self.pipeline, self.shapes)
        if work:
            self.telemetry.count_flops(work, machine_peaks(
                self.pipeline, self._layout(), tuple(w.dtype for w in work)))

    def _start_workers(self) -> None:
        """Place models on the current workers, (re)install the resident state, and
        start compiling from the models' current versions."""
        spec = self.pipeline.spec
        self.addresses = list(self.backend.workers)
        self.plan = resolve_plan(self.pipeline, len(self.addresses), self.model_bytes)
        check_gang_batches(self.pipeline, self.plan)
        self.compiler = TaskCompiler(self.pipeline, self.plan,
                                     {m: c.version for m, c in self.models.items()})
        # a streaming stage's tasks get the next iterations' rows: the source's batches
        self.dataflow = Dataflow(self.backend, self.addresses, str(self.out / "buffer.zarr"),
                                 self.stored, lambda k: self.source.batch(k)
                                 if k < self.pipeline.spec.iterations else None)
        self.checkpointer = Checkpointer(self.pipeline, self.out, self.dataflow,
                                         self._wait_for, self.digest)
        settings = RunSettings(temperature=self.pipeline.rollout_temperature,
                               base_dir=str(self.pipeline.base_dir),
                               buffer=str(self.out / "buffer.zarr"),
                               device=spec.cluster.device,
                               rows_topic=rows_topic(self.pipeline, self.plan, self.backend,
                                                     self._layout()["threads"] or 1,
                                                     self.choice),
                               env_pool=env_pool(self.pipeline, self.backend),
                               iterations=spec.iterations)
        run = RunDef(stages=stage_defs(self.pipeline), models=self.models,
                     algorithm=spec.algorithm, seed=spec.seed, settings=settings)
        self.backend.start(run, spec.cluster.torch_threads)
        join_gangs(self.backend, self.plan, self.addresses,
                   spec.cluster.collective_timeout_s)

    def _layout(self) -> dict[str, Any]:
        return layout(self.pipeline, self.plan, len(self.addresses))

    def _home(self, model: str) -> str:
        """The worker holding the master copy of ``model`` (rank 0 of its gang)."""
        return self.addresses[self.plan.homes[model][0]]

    # ----------------------------------------------------------------- setup stages
    def _run_setup(self) -> dict[str, Any]:
        """Run the once-stages (SFT, reward model), save what they trained, and point
        every model copied ``from:`` one of them at the trained weights."""
        specs = self.compiler.setup()
        handles = dict(zip([s.id for s in specs], self.dataflow.submit(specs), strict=True))
        metrics = {name: result.columns for name, result in
                   self._wait_and_gather(handles, iteration=None).items()}
        for name, value in metrics.items():
            self._say(f"rlhfflow: setup {name}: " + _format_stats(value))
        saves = [self.backend.submit(save_model_task, model, str(self.out / "models" / model
                                                                 / "setup"),
                                     [handles[stage]], key=f"save-{_token()}",
                                     worker=self.addresses[self.plan.stages[stage].workers[0]])
                 for model, stage in setup_trained(self.pipeline).items()]
        self.backend.wait(saves)
        self.initial_models = after_setup(self.pipeline, self.out, self.initial_models)
        self.models = dict(self.initial_models)
        self.backend.run_on_workers(update_model_configs, self.models)
        MetricsLog(self.out / "setup.jsonl").append({"setup": metrics})
        return metrics

    # ----------------------------------------------------------------- the loop
    def _run_loop(self, first: int) -> None:
        """Iterations ``first`` .. ``iterations - 1`` in the order of ``loop_steps``; then
        a checkpoint of the last one."""
        spec = self.pipeline.spec
        # each record is appended to metrics.jsonl and published as it is made; none is
        # kept here (a few KB each: 0.01 MB an iteration of a long run's coordinator)
        self._submitted = {}
        if self.reorders and first > 0:
            self.dataflow.resume(first, taken_before(self.buffer, first,
                                                     self.plan.max_staleness))
        self._perform(self.coordinator.handle(LoopStarted(first)))
        self.telemetry.restart(self.addresses, self._layout())
        for step in schedule(self.compiler, first, spec.iterations, batch_rows(self.pipeline),
                             self.backend.pipelined):
            if isinstance(step, Start):
                if self.stop is not None and self.stop.is_set():
                    self._stop_ahead(self.coordinator.last)
                    break
            elif isinstance(step, Begin):
                self._begin(step)
            elif isinstance(step, Main):
                self._submit_main(step)
            else:
                self._perform([Commit(step.it.index)])
                self.dataflow.forget_before(step.it.index)
        self._perform(self.coordinator.handle(ScheduleEnded()))
        self._perform(self.coordinator.handle(LoopDrained()))
        self._summarise(first)

    def _summarise(self, first: int) -> None:
        """Say the summaries of this loop's records."""
        # the summaries, once, from the file: this loop's records
        records = [r for r in self.log.read() if r.get("iteration", -1) >= first]
        evaluation = evaluation_summary(self.graph, records)
        if evaluation is not None:  # a run that only generates and scores
            self.summary["evaluation"], line = evaluation
            self._say(line)
        summary = summarise(records)
        if summary is not None:
            self.summary.update(summary[0])
            self._say(summary[1])
            if self.choice is not None and len(records) > 2:
                self.summary["predicted_iteration_s"] = round(self.choice.best.predicted_s, 4)
                self._say(prediction_line(self.choice, self.summary["iteration_s"],
                                          self.pipeline.source, self.out))

    def _begin(self, step: Begin) -> None:
        """An iteration's prompts, placed next to the first stage's tasks, and the stages
        that run ahead."""
        k = step.it.index
        batch = self.source.batch(k)
        if len(batch["prompt_ids"]) != step.it.rows:
            raise RunError(f"iteration {k} has {len(batch['prompt_ids'])} rows, "
                           f"{step.it.rows} were compiled")
        # the coordinator keeps the iteration's text (prompts, record fields) for the
        # buffer: zarr metadata and ragged text are its to write
        # a stage that reorders rows returns other iterations' prompts too: the width
        # any prompt may take
        width = max(batch["prompt_ids"].shape[1], self.pipeline.spec.data.max_prompt_tokens) \
            if self.reorders else batch["prompt_ids"].shape[1]
        self._begun[k] = (width,
                          {c: list(batch[c]) for c in TEXT_COLUMNS if c in batch})
        self.dataflow.submit(step.source, batch)
        self.dataflow.submit(step.ahead)

    def _submit_main(self, step: Main) -> None:
        """The iteration's arrays (the coordinator creates them), then the rest of the
        iteration's stages, its stores and, when due, its checkpoint."""
        it = step.it
        k = it.index
        prompt_len, texts = self._begun.pop(k)
        lengths = {"prompt": prompt_len, "response": self.graph.response_tokens}
        schema = {c: ColumnSpec(col.dtype, (lengths[col.length],) if col.length else ())
                  for c, col in self.stored.items()}
        chunk = it.bounds[SOURCE][0][1] - it.bounds[SOURCE][0][0]
        self.buffer.begin_iteration(k, it.rows, schema, chunk_rows=chunk,
                                    attrs={"pipeline": self.pipeline.name})
        self.buffer.write_text(k, texts)
        # after the arrays: a stage task may store its own rows (StageTask.stores)
        self.dataflow.submit(step.stages)
        self.dataflow.submit(step.stores)
        self.checkpointer.submit(k, step.checkpoint)
        self._submitted[k] = it
        # the versions the models have once iteration k is done (its update compiled)
        self._perform(self.coordinator.handle(IterationSubmitted(
            k, self.compiler.versions, bool(step.checkpoint), self.plan.max_staleness)))

    def _perform(self, actions: list[Action]) -> None:
        """Do what the coordinator decided, in order (``Retry`` and ``CutBack`` are the
        recovery's to do, where it asked)."""
        for action in actions:
            match action:
                case Commit(k):
                    self._finish(self._submitted.pop(k))
                case PublishCheckpoint(k, expected):
                    self.checkpointer.publish(k, expected)
                case SaveCheckpoint(k, expected):
                    self.checkpointer.submit(k, self.compiler.checkpoint(k, {}))
                    self.checkpointer.publish(k, expected)
                case PlanStop(done, waiting, unfinished):
                    self._plan_stop(done, waiting, unfinished)
                case Abandon(iterations):
                    for k in iterations:
                        self._submitted.pop(k, None)
                        self.checkpointer.pending.pop(k, None)  # its directory: cleaned at resume
                case AnnounceStop(done, waiting, plan, cancelled, tasks):
                    self._say(stop_line(done, waiting, plan, cancelled, tasks,
                                        lambda iterations, stages: wait_estimate(
                                            self.log.read(), iterations, stages)))
                case Say(line):
                    self._say(line)
                case Fail():
                    raise action.error()
                case Retry() | CutBack():
                    pass

    def _stop_ahead(self, done: int, waiting: bool = False) -> None:
        """A stop was requested, finishing iteration ``done`` (``waiting``: the one in
        flight, else the last finished): the coordinator decides whether there is
        anything to cancel (``_plan_stop``) and what to say."""
        submitted_after = any(task.iteration > done for task in self.dataflow.tasks().values())
        self._perform(self.coordinator.handle(StopRequested(done, waiting, submitted_after)))

    def _plan_stop(self, done: int, waiting: bool, unfinished: tuple[int, ...]) -> None:
        """Cancel what was submitted for the iterations after ``done``, the next
        iteration's tasks and the stages run ahead, except what cannot be undone
        (``plan_stop``); the coordinator then gives up the iterations cancelled."""
        tasks = self.dataflow.tasks()
        ids = [i for i, task in tasks.items() if task.iteration > done]
        # the workers hold updates after ``done`` and say which began: a task the
        # scheduler still shows as waiting may have started its update meanwhile
        begun = {k for found in self.backend.run_on_workers(
            hold_updates, done, workers=self.addresses or None).values() for k in found}
        states = dict(zip(ids, self.backend.states(self.dataflow[ids]), strict=True))
        stop = plan_stop(done, unfinished, tasks, states,
                         lambda task: any(self.graph.nodes[n].trains
                                          for n in getattr(task, "stages", ())), begun)
        self.backend.cancel([h for h in self.dataflow[stop.cancel] if hasattr(h, "key")])
        # updates up to the last iteration finished go on; later ones are refused
        self.backend.run_on_workers(settle_updates, max([done, *stop.finish]),
                                    workers=self.addresses or None)
        self.dataflow.forget(stop.cancel)
        self._perform(self.coordinator.handle(StopPlanned(done, waiting, stop, tasks)))

    def _finish(self, it: IterationTasks) -> None:
        """Wait for iteration ``it``, commit its experience, log its metrics; then the
        coordinator decides (a checkpoint to publish, an error budget spent)."""
        handles = {n: self.dataflow[ids] for n, ids in it.handles.items() if n != SOURCE}
        trainers = {n: handles[n][0] for n in self.graph.loop_stages
                    if self.graph.nodes[n].trains}
        reporters = {n: handles[n][0] for n in self.graph.loop_stages
                     if self.graph.nodes[n].reports}
        stores = self.dataflow[it.stores]
        installs = self.dataflow[[i for ids in it.syncs.values() for i in ids]]
        all_handles = {f"{n}[{j}]": h for n, hs in handles.items() for j, h in enumerate(hs)}
        all_handles.update({f"store[{j}]": h for j, h in enumerate(stores)})
        all_handles.update({f"realloc[{j}]": h for j, h in enumerate(installs)})
        # a stop requested meanwhile cancels what was submitted after this iteration
        # at once: before the next iteration's update can start
        tick = (lambda: self._stop_ahead(it.index, waiting=True) if self.stop.is_set()
                else None) \
            if self.stop is not None else None
        self._wait_and_gather(all_handles, it.index, gather=False, tick=tick)
        # each result once: a task that stored its own rows is also the iteration's
        # trainer (every fetch is a request the worker's event loop serves)
        wanted = list({id(h): h for h in [*stores, *trainers.values(), *reporters.values(),
                                          *installs]}.values())
        results = dict(zip(map(id, wanted), self.backend.gather(wanted), strict=True))
        # a store's result, or a stage task's that stored its own rows
        stored = [results[id(h)] for h in stores]
        partials = [r.stored for r in stored]
        # an iteration that is one task brings its worker's timings (StageTask.reports)
        timings = [r.timings for r in stored if r.timings is not None]
        texts = {name: [t for r in stored for t in r.texts.get(name, [])]
                 for name in (*RESPONSE_TEXTS, *PROMPT_TEXTS)}
        # in row order: one store per micro-batch, in order
        texts = {name: rows for name, rows in texts.items() if len(rows) == it.rows}
        if texts:
            self.buffer.write_text(it.index, texts)
        train_stats = {n: self._statistics(n, results[id(h)]) for n, h in trainers.items()}
        reported = {n: self._statistics(n, results[id(h)]) for n, h in reporters.items()}
        moved = [results[id(h)] for h in installs]
        retried = self.backend.retries_used(list(all_handles.values()))
        self.buffer.commit(it.index)
        record = self.telemetry.record(it.index, partials, train_stats, moved, retried,
                                       reported, timings)
        self.log.append(record)
        self.monitor.iteration(record)
        self._say(progress_line(record, self.pipeline.spec.iterations))
        if self.first_iteration_s is None:  # the first of this process: start-up is over
            self.first_iteration_s = time.time() - self.clock.last
            self._say(self.clock.line(self.first_iteration_s))
        problem = score_error_budget(self.pipeline, self.out, it.index, record["score_errors"])
        self._perform(self.coordinator.handle(IterationCommitted(it.index, problem)))

    def _statistics(self, stage: str, result: TaskResult) -> dict[str, Any]:
        """A stage's statistics from its task's result, without the columns of the
        stages fused into that task (they go to the buffer, not to the metrics)."""
        columns = {c for n in self.plan.group(stage) for c in self.graph.nodes[n].writes}
        return {k: v for k, v in result.columns.items() if k not in columns}

    def _wait_for(self, handles: dict[str, Any], iteration: int | None) -> None:
        self._wait_and_gather(handles, iteration, gather=False)

    def _wait_and_gather(self, handles: dict[str, Any], iteration: int | None,
                         gather: bool = True, tick: Callable[[], None] | None = None
                         ) -> dict[str, Any]:
        try:
            self.backend.wait(list(handles.values()), pinned=self.addresses, tick=tick)
        except TaskFailed as exc:
            if self.plan.gangs:
                # a gang's survivors fail in their collective when a peer dies: that is
                # the lost worker (recoverable), not the stage's fault
                self.backend.check_alive(self.addresses, grace=5.0)
            task, cause = self.dataflow.task_of(exc.key), exc.cause
            # the task's label (fused stages joined by +); a key submitted outside the
            # dataflow (a model build or save) names itself
            stage = task.label if task is not None else exc.key.rpartition("-")[0]
            retries = task.retries if task is not None else 0
            if isinstance(cause, StageTaskFailed):  # one stage of a fused task
                stage, cause = cause.stage, cause.cause
            workers = tuple(self.addresses[w] for w in task.workers) \
                if task and not self.backend.in_process else ()
            self._perform(self.coordinator.handle(
                StageFailed(stage, cause, iteration, retries, workers)))
        if not gather:
            return {}
        return dict(zip(handles, self.backend.gather(list(handles.values())), strict=True))

    def _save_final(self) -> None:
        """Save every trainable model in transformers format under OUTPUT/models/NAME/final:
        hard links to the last checkpoint's weights where it holds exactly them (the
        weights stored once: 1.1 GB less for a 135M model), else saved by its home (a
        sharded model: gathered by all its ranks, saved by the first)."""
        trainable = [m for m in self.plan.homes if self.pipeline.spec.models[m].trainable]
        linked = self._final_in_checkpoint(trainable)
        for m in linked:
            link_model(linked[m], self.out / "models" / m / "final")
        left = [m for m in trainable if m not in linked]
        plain = [m for m in left if not self.compiler.sharded(m)]
        # a sharded model is gathered by all its ranks in collectives: one such model at
        # a time, or two models' gathers on the same workers would interleave (as the
        # compiler chains a sharded model's checkpoints with the gangs there)
        for group in ([plain] if plain else []) + [[m] for m in left if m not in plain]:
            self.backend.wait([
                self.backend.submit(save_model_task, m, str(self.out / "models" / m / "final"),
                                    [], key=f"save-{_token()}", worker=self.addresses[w])
                for m in group
                for w in self.plan.homes[m][:None if self.compiler.sharded(m) else 1]])

    def _final_in_checkpoint(self, models: list[str]) -> dict[str, Path]:
        """The weights directory in the last checkpoint of each of ``models`` whose final
        weights it holds: the checkpoint of the last iteration, saved at the version the
        model ends with (what the compiled tasks leave it at)."""
        checkpoint = self.checkpointer.store.latest()
        if checkpoint is None or checkpoint.iteration != self.pipeline.spec.iterations - 1:
            return {}
        saved = checkpoint.state.get("versions", {})
        return {m: checkpoint.model_dir(m) for m in models
                if m in saved and saved[m] == self.compiler.versions.get(m)
                and (checkpoint.model_dir(m) / "config.json").is_file()}

    def _say(self, line: str) -> None:
        if self.progress:
            logger.info(line)


def _token() -> str:
    return uuid.uuid4().hex[:8]


def _format_stats(stats: dict[str, Any]) -> str:
    return "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                     for k, v in stats.items())

