"""The run's lifecycle: the executor materialises the models, places them, starts the
workers' resident state, runs the setup stages, then the iterations, recovers from a lost
worker by going back to the last checkpoint, and saves the trained models.

What each iteration's tasks are (micro-batches streaming through the stages, fusion, the
model edges within and across iterations, bounded staleness, gangs, weight syncs to
shadows, stores, checkpoints) is decided by ``rlhfflow.plan.compiler`` as plain task
specs; ``rlhfflow.runtime.dataflow`` submits them to Dask; ``checkpointing`` and
``telemetry`` keep checkpoints and measurements. The loop follows ``loop_steps``:
iteration k+1 is submitted while k runs, so the scheduler starts it the moment the new
weights exist.
"""

from __future__ import annotations

import errno
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from rlhfflow.config.graph import SOURCE
from rlhfflow.config.loader import Pipeline, derive
from rlhfflow.data.source import PromptSource
from rlhfflow.engine.models import save_tiny_model
from rlhfflow.monitor import RunMonitor
from rlhfflow.monitor.workerlogs import LOG_DIRECTORY
from rlhfflow.plan.auto.planner import PlanChoice, choose_plan, load_profile, resolve_plan
from rlhfflow.plan.compiler import IterationTasks, TaskCompiler, loop_steps
from rlhfflow.plan.layout import default_torch_threads
from rlhfflow.plan.placement import ExecutionPlan, PlanError, model_sizes
from rlhfflow.runtime.backend import (
    DaskBackend,
    InlineBackend,
    TaskFailed,
    WorkerLost,
    _cuda_count,
)
from rlhfflow.runtime.budget import score_error_budget
from rlhfflow.runtime.checkpointing import (
    Checkpointer,
    CorruptCheckpoint,
    cut_back,
    models_from_checkpoint,
)
from rlhfflow.runtime.dataflow import Dataflow
from rlhfflow.runtime.evaluation import evaluation_summary
from rlhfflow.runtime.runstate import (
    Resume,
    RunStateError,
    StartPoint,
    already_done,
    identity_digest,
    inexact_resume,
    output_lock,
    pipeline_identity,
    prepare_output,
)
from rlhfflow.runtime.telemetry import StartupClock, Telemetry, progress_line, summarise
from rlhfflow.runtime.worker.host import (
    STORED,
    TIMINGS,
    RunDef,
    StageDef,
    StageFailed,
    gang_port,
    join_gang_task,
    save_model_task,
    update_model_configs,
)
from rlhfflow.stages import ModelConfig
from rlhfflow.storage import Checkpoint, ColumnSpec, ExperienceBuffer, MetricsLog


class RunError(RuntimeError):
    """The run cannot go on: names the stage, the iteration and the cause."""


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


def run_pipeline(pipeline: Pipeline, progress: bool = True, inline: bool = False,
                 overwrite: bool = False, resume: Resume = "auto", force: bool = False,
                 stop: threading.Event | None = None) -> RunResult:
    """Run ``pipeline`` on its cluster (``cluster.address``, or an embedded cluster) or,
    with ``inline=True``, in this process without Dask.

    An output directory holding a run of the same pipeline is resumed from its last
    checkpoint (``resume="auto"``); ``overwrite`` starts afresh. Setting ``stop`` asks the
    run to finish the iteration in flight, save a checkpoint and return. The run holds
    its output directory for its whole life: ``OutputInUse`` if another run does.
    """
    with output_lock(pipeline.output_dir):
        return _run_pipeline(pipeline, progress, inline, overwrite, resume, force, stop)


def _run_pipeline(pipeline: Pipeline, progress: bool, inline: bool, overwrite: bool,
                  resume: Resume, force: bool, stop: threading.Event | None) -> RunResult:
    clock = StartupClock()
    clock.mark("load")  # since the process started: imports, reading and checking FILE
    try:
        out, start = prepare_output(pipeline, overwrite, resume, force)
    except RunStateError as exc:
        raise RunError(str(exc)) from None
    done = already_done(pipeline, start)
    if done is not None:  # a finished run asked for no more iterations: start nothing
        return RunResult(out, already_done=done)
    digest = identity_digest(pipeline_identity(pipeline))
    auto = pipeline.spec.placement.strategy == "auto" and pipeline.spec.data is not None
    choice = None
    if auto and inline:  # one in-process worker: every strategy is the same plan
        pipeline = derive(pipeline, {"placement.strategy": "colocated"})
        auto = False
    elif auto and pipeline.spec.cluster.address is None:
        # the embedded cluster's workers and threads are the planner's to choose
        gpus = 0 if pipeline.spec.cluster.device == "cpu" else _cuda_count()
        workers = min(pipeline.spec.cluster.workers, gpus) if gpus else None
        choice = choose_plan(pipeline, load_profile(pipeline), n_workers=workers)
        pipeline = choice.pipeline
        clock.mark("plan")
    cluster = pipeline.spec.cluster
    # the coordinator's own preparation (the prompts, the buffer) overlaps the embedded
    # cluster's start (its workers are forks of a server importing torch and the model
    # classes since the command began); an external cluster's plan depends on its
    # workers, so there it comes after connecting
    early = None if inline or cluster.address else Executor(pipeline, None, out, progress,
                                                             start, stop)
    with ThreadPoolExecutor(1, thread_name_prefix="rlhfflow-prepare") as pool:
        prepared = pool.submit(early.prepare) if early is not None else None
        try:
            backend = _connect(cluster, inline, out / LOG_DIRECTORY)
        except BaseException:
            if prepared is not None:
                prepared.cancel()
                wait([prepared])
            raise
        try:
            # the workers import torch and the stages while this process prepares
            warming = backend.warm() if early is not None else []
            if prepared is not None:
                prepared.result()
            backend.wait(warming)
        except BaseException as exc:
            backend.close()
            if isinstance(exc, Exception) and _is_disk_full(exc):
                raise RunError(_disk_full(exc, "the coordinator")) from None
            raise
    clock.mark("cluster" if early is None else "cluster + prompts")
    try:
        if auto and choice is None:  # a given cluster: plan for the workers it has
            choice = choose_plan(pipeline, load_profile(pipeline),
                                 n_workers=len(backend.workers))
            pipeline = choice.pipeline
        executor = early or Executor(pipeline, None, out, progress, start, stop)
        executor.attach(backend)
        executor.digest = digest  # of the file as written: what a resume compares
        executor.choice = choice
        executor.clock = clock
        return executor.run()
    except WorkerLost as exc:  # past the recoveries, or in the final save
        raise RunError(f"{exc}; run again to resume from the last checkpoint") from None
    except RunError:
        raise
    except Exception as exc:  # the coordinator's own writes: metrics, buffer metadata, ...
        if _is_disk_full(exc):
            raise RunError(_disk_full(exc, "the coordinator")) from None
        raise
    finally:
        backend.close()


def _shown(path: Path) -> str:
    """``path`` as a user would type it here: relative to the working directory when
    inside it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _dashboard_moved(wanted: str, link: str) -> str:
    """The note for an embedded cluster's dashboard that Dask served on another port than
    ``cluster.dashboard_address`` asked for (it was taken), or ""."""
    port = wanted.rpartition(":")[2]
    served = urlsplit(link).port
    if port in ("", "0") or served is None or port == str(served):
        return ""
    return f" (port {port} is in use, another run?)"


def _connect(cluster, inline: bool, log_dir: Path):
    """The backend: in process, a running scheduler, or an embedded cluster (whose
    workers' output goes to their logs in ``log_dir``, and on to this terminal)."""
    if inline:
        return InlineBackend()
    try:
        return DaskBackend.connect(
            cluster.address, cluster.workers, log_dir=log_dir, host=cluster.host,
            dashboard_address=cluster.dashboard_address,
            memory_limit=cluster.memory_limit, torch_threads=cluster.torch_threads,
            device=cluster.device)
    except OSError as exc:  # TimeoutError too: workers that did not start in time
        if cluster.address:
            raise RunError(f"cannot reach the Dask scheduler at {cluster.address}: {exc}"
                           ) from None
        raise RunError(cluster_failure(exc)) from None
    except RuntimeError as exc:  # e.g. cluster.device: cuda on a machine without one
        raise RunError(str(exc)) from None


def cluster_failure(exc: OSError) -> str:
    """Why the embedded cluster did not start, in one line: the error, the file it is
    about, and, when the workers were to be forks of a warm server, how to do without."""
    from rlhfflow.launch import warm

    text = str(exc) or type(exc).__name__
    server = warm.workers_server()
    # a socket's errors name no file: the one the workers come from, if it is a server's
    filename = getattr(exc, "filename", None) or (server if exc.errno else None)
    if filename and str(filename) not in text:
        text += f": {filename}"
    if server is not None:
        text += f"; the workers come from a warm server: {warm.ENV_VAR}=0 runs without it"
    return f"the embedded cluster did not start: {text}"


TEXT_COLUMNS = ("prompt_text", "prompt_fields")
"""Source text columns the coordinator stores in the buffer (as utf-8 with offsets)."""


def _is_disk_full(exc: BaseException) -> bool:
    """ENOSPC, however a library wraps it (safetensors and zarr keep only the message)."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return True
    text = str(exc)
    return "No space left on device" in text or "os error 28" in text


def _disk_full(exc: BaseException, who: str) -> str:
    filename = getattr(exc, "filename", None)
    where = f" writing {filename}" if filename else ""
    return (f"no space left on device: {who} failed{where}; free space and run the same "
            f"command again to resume from the last checkpoint")


class Executor:
    """Runs a pipeline on a backend: the run's lifecycle (models, workers, setup stages,
    the iteration loop, recovery, the final save). What each iteration's tasks are comes
    from ``TaskCompiler``; ``Dataflow`` submits them; ``Checkpointer`` and ``Telemetry``
    keep checkpoints and measurements."""

    def __init__(self, pipeline: Pipeline, backend, output_dir: Path, progress: bool = True,
                 start: StartPoint | None = None, stop: threading.Event | None = None):
        self.pipeline = pipeline
        self.graph = pipeline.graph
        self.backend = backend
        self.prepared = False
        self.out = output_dir
        self.progress = progress
        self.start = start or StartPoint(None, resumed=False)
        self.stop = stop
        self.log = MetricsLog(output_dir / "metrics.jsonl")
        self.telemetry = Telemetry(backend, output_dir) if backend is not None else None
        self.plan: ExecutionPlan | None = None
        self.addresses: list[str] = []
        self.model_bytes = model_sizes(pipeline)
        self.summary: dict[str, Any] = {}
        self.models: dict[str, ModelConfig] = {}
        self.initial_models: dict[str, ModelConfig] = {}
        self.last_checkpoint = self.start.checkpoint.iteration if self.start.checkpoint else -1
        self.digest = identity_digest(pipeline_identity(pipeline))
        self.choice: PlanChoice | None = None  # what placement: auto chose, if it did
        # what each iteration stores: every non-text column
        self.stored = {c: col for c, col in self.graph.columns().items() if col.dtype != "str"}
        # per iteration begun, what its stores need: the prompt width and the text columns
        self._begun: dict[int, tuple[int, dict[str, list[str]]]] = {}
        self.restarts = 0  # recoveries from lost workers so far, setup and loop together
        self.tiny: dict[str, dict[str, Any]] = {}  # tiny models to build: tiny_models
        self.clock = StartupClock()  # run_pipeline passes its own, started with the process
        self.first_iteration_s: float | None = None

    # ----------------------------------------------------------------- set-up
    def attach(self, backend) -> None:
        """Run on ``backend`` (an executor may be prepared before its cluster is up)."""
        self.backend = backend
        self.telemetry = Telemetry(backend, self.out)

    def prepare(self) -> None:
        """What the coordinator readies before any worker is needed: the prompts (a bad
        prompts file stops the run before any cluster work), the buffer, and the models'
        configs (``tiny:`` models are built later, by a worker). Needs no backend."""
        if self.prepared:
            return
        spec = self.pipeline.spec
        checkpoint = self.start.checkpoint
        if self.graph.loop_stages and spec.iterations > 0:
            generate_model = self.graph.nodes[self.graph.generators()[0]].model
            self.source = PromptSource.from_pipeline(self.pipeline, generate_model)
            self._list_skipped_prompts()
            self.buffer = ExperienceBuffer(self.out / "buffer.zarr")
        self.initial_models = self._model_configs()
        if checkpoint is not None:
            self.initial_models = self._after_setup(self.initial_models)
        self.models = self._from_checkpoint(self.initial_models, checkpoint)
        self.prepared = True

    def run(self) -> RunResult:
        """Materialise models, place them, run the setup stages, then the iterations;
        recover from a lost worker by resuming from the last checkpoint."""
        spec = self.pipeline.spec
        checkpoint = self.start.checkpoint
        if not self.prepared:
            self.prepare()
            self.clock.mark("prompts")
        self._start_workers()
        # after the workers' state: it sets each worker's torch threads, which a torch op
        # run before would fix at the forked default (all cores) for the task thread,
        # 2 spinning OpenMP threads per worker on 2 cores, iterations 10x slower
        self._build_tiny_models()
        self.clock.mark("models")  # the resident state installed, tiny models built
        result = RunResult(self.out, dashboard=self.backend.dashboard_link)
        first = self.start.next_iteration
        how = f"resuming after iteration {first - 1}" if checkpoint else (
            "resuming from the start (no checkpoint yet)" if self.start.resumed else "")
        self._say(f"rlhfflow: {self.pipeline.name}: {spec.iterations} iterations on "
                  f"{len(self.backend.workers)} worker(s); output {self.out}"
                  + (f"; {how}" if how else ""))
        if checkpoint is not None and first < spec.iterations and inexact_resume(self.pipeline):
            self._say(f"rlhfflow: {inexact_resume(self.pipeline)}")
        if self.backend.dashboard_link:
            moved = _dashboard_moved(spec.cluster.dashboard_address,
                                     self.backend.dashboard_link) \
                if getattr(self.backend, "cluster", None) is not None else ""
            self._say(f"rlhfflow: Dask dashboard: {self.backend.dashboard_link}{moved}")
        self.monitor = RunMonitor(self.pipeline, self.backend, self.out, self._say)
        if self.choice is not None:
            c = self.choice
            source = "profile" if c.cost.profiled else "analytic cost model"
            self._say(f"rlhfflow: plan (placement auto): {c.best.describe()}; predicted "
                      f"{c.best.predicted_s:.3f} s/iteration ({source}; "
                      f"`rlhfflow plan FILE --candidates 5` shows why)")
            if c.cost.warning:
                self._say(f"rlhfflow: warning: {c.cost.warning}")
        if self.graph.setup_stages and checkpoint is None:
            result.setup_metrics = self._run_setup_with_recovery()
        if self.graph.loop_stages and first < spec.iterations:
            try:
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
                self._count_restart(exc)
                first = self._recover(exc)
        return [r for r in self.log.read() if r.get("iteration", -1) >= start]

    def _run_setup_with_recovery(self) -> dict[str, Any]:
        """The setup stages; when a worker holding models is lost, redo them from their
        start on the workers there are (the restarts count with the loop's)."""
        while True:
            try:
                return self._run_setup()
            except WorkerLost as exc:
                self._count_restart(exc)
                self._say(f"rlhfflow: {exc}; redoing the setup stages from their start")
                self._await_workers(exc)
                self.models = dict(self.initial_models)  # as before the setup stages
                self._start_workers()

    def _count_restart(self, exc: WorkerLost) -> None:
        """One more recovery, or a ``RunError`` past ``cluster.max_restarts``."""
        self.restarts += 1
        if self.restarts > self.pipeline.spec.cluster.max_restarts:
            raise RunError(f"{exc}; gave up after {self.restarts - 1} restart(s); the run "
                           f"can be resumed from its last checkpoint") from None

    def _start_workers(self) -> None:
        """Place models on the current workers, (re)install the resident state, and
        start compiling from the models' current versions."""
        spec = self.pipeline.spec
        self.addresses = list(self.backend.workers)
        self.plan = resolve_plan(self.pipeline, len(self.addresses), self.model_bytes)
        self._check_gang_batches()
        self.compiler = TaskCompiler(self.pipeline, self.plan,
                                     {m: c.version for m, c in self.models.items()})
        self.dataflow = Dataflow(self.backend, self.addresses, str(self.out / "buffer.zarr"),
                                 self.stored)
        self.checkpointer = Checkpointer(self.pipeline, self.out, self.dataflow,
                                         self._wait_for, self.digest)
        run = RunDef(stages=self._stage_defs(), models=self.models, algorithm=spec.algorithm,
                     seed=spec.seed, settings={"temperature": self.pipeline.rollout_temperature,
                                               "base_dir": str(self.pipeline.base_dir),
                                               "buffer": str(self.out / "buffer.zarr"),
                                               "device": spec.cluster.device,
                                               "rows_topic": self._rows_topic()})
        self.backend.start(run, spec.cluster.torch_threads)
        self._join_gangs()

    def _rows_topic(self) -> str | None:
        """The event topic of sample reallocation (``rebalance``): set when a generating
        stage with ``params.migrate`` runs as micro-batch tasks on several Dask workers
        and, under ``placement: auto``, its tasks are predicted to take ``MIN_TASK_S``
        or more."""
        from rlhfflow.runtime.worker.rebalance import MIN_TASK_S

        if not isinstance(self.backend, DaskBackend):
            return None
        spec = self.pipeline.spec
        rows = spec.data.batch_size * spec.data.samples_per_prompt if spec.data else 0
        threads = self._layout()["threads"] or 1
        for name, sp in self.plan.stages.items():
            if not (self.graph.nodes[name].generates and len(sp.workers) > 1 and
                    sp.micro_batches and sp.micro_batches > 1 and not sp.gang and
                    getattr(self.pipeline.params[name], "migrate", False)):
                continue
            # placement: auto knows what a task costs: too short a task cannot repay
            # a handover, nor the announcements every task then makes
            if self.choice is not None and self.choice.cost.stage_seconds(
                    name, max(rows // sp.micro_batches, 1), threads) < MIN_TASK_S:
                continue
            return f"rlhfflow-rows-{uuid.uuid4().hex[:12]}"
        return None

    def _layout(self) -> dict[str, Any]:
        """Torch threads per worker (None: unknown, on an external cluster) and the size of
        each training gang: what the task intervals were measured under."""
        cluster = self.pipeline.spec.cluster
        threads = cluster.torch_threads
        if threads is None and cluster.address is None:
            threads = default_torch_threads(len(self.addresses))
        return {"workers": len(self.addresses), "threads": threads,
                "gangs": {n: len(sp.workers) for n, sp in self.plan.stages.items() if sp.gang}}

    def _check_gang_batches(self) -> None:
        """Every rank of a gang needs rows in every minibatch."""
        spec = self.pipeline.spec
        if spec.data is None:
            return
        rows = spec.data.batch_size * spec.data.samples_per_prompt
        for name, sp in self.plan.stages.items():
            minibatches = getattr(self.pipeline.params[name], "minibatches", 1)
            if sp.gang and rows // minibatches < len(sp.workers):
                raise PlanError(self.pipeline.source, f"stages.{name}.params.minibatches",
                                f"{rows} rows in {minibatches} minibatches leave fewer rows "
                                f"per minibatch than the {len(sp.workers)} workers training "
                                f"it; use fewer minibatches or a larger batch")

    def _join_gangs(self) -> None:
        """Create each gang's process group on all its members at once (out of band)."""
        timeout = self.pipeline.spec.cluster.collective_timeout_s
        for workers in self.plan.gangs:
            members = [self.addresses[i] for i in workers]
            host = _host_of(members[0])
            port = self.backend.run_on_workers(gang_port, host, workers=members[:1])
            port = next(iter(port.values()))
            self.backend.run_on_workers(join_gang_task, members, host, port, timeout,
                                        workers=members)

    def _home(self, model: str) -> str:
        """The worker holding the master copy of ``model`` (rank 0 of its gang)."""
        return self.addresses[self.plan.homes[model][0]]

    def _model_configs(self) -> dict[str, ModelConfig]:
        """Each model's config; ``tiny:`` models are built by ``_build_tiny_models``."""
        self.tiny = tiny_models(self.pipeline, self.out)
        return model_configs(self.pipeline, self.out, build=False)

    def _build_tiny_models(self) -> None:
        """Build the ``tiny:`` models not built yet, as tasks on the workers: their
        processes imported transformers' model classes already, and the coordinator
        never needs them (~2.5 s of CPU at start-up on 2 cores)."""
        if not self.tiny:
            return
        workers = self.backend.workers
        names = {f"build-{_token()}": name for name in self.tiny}
        handles = [self.backend.submit(partial(save_tiny_model, **self.tiny[name]), key=key,
                                       worker=workers[i % len(workers)])
                   for i, (key, name) in enumerate(names.items())]
        try:
            self.backend.wait(handles, pinned=list(workers))
        except TaskFailed as exc:
            name = names[exc.key]
            if _is_disk_full(exc.cause):
                raise RunError(_disk_full(exc.cause, f"building model {name!r}")) from None
            raise RunError(f"building the tiny model {name!r}: {type(exc.cause).__name__}: "
                           f"{exc.cause}") from exc.cause
        self.tiny = {}

    def _stage_defs(self) -> dict[str, StageDef]:
        defs = {}
        for name, node in self.graph.nodes.items():
            stage = self.pipeline.spec.stages[name]
            ds = stage.deepspeed.model_dump() if stage.deepspeed else None
            # by import path, so a plugin type needs no registration on the workers
            defs[name] = StageDef(node.impl or node.type, self.pipeline.params[name],
                                  node.model, node.reads,
                                  backend=stage.backend, deepspeed=ds)
        return defs

    # ----------------------------------------------------------------- setup stages
    def _setup_trained(self) -> dict[str, str]:
        """Model -> the setup stage that trains it."""
        return {self.graph.nodes[n].model: n for n in self.graph.setup_stages}

    def _after_setup(self, models: dict[str, ModelConfig]) -> dict[str, ModelConfig]:
        """Configs pointing every model trained by a setup stage, and every model copied
        ``from:`` one, at the weights the setup stage saved (OUTPUT/models/NAME/setup)."""
        trained = self._setup_trained()
        out = dict(models)
        for name in models:
            root = name if name in trained else self.pipeline.model_root(name)
            if root in trained:
                out[name] = replace(models[name],
                                    init_path=str(self.out / "models" / root / "setup"))
        return out

    def _from_checkpoint(self, models: dict[str, ModelConfig], checkpoint: Checkpoint | None
                         ) -> dict[str, ModelConfig]:
        """Configs of the models trained in the loop, taken from ``checkpoint``."""
        try:
            return models_from_checkpoint(models, self.graph.loop_trained(), checkpoint)
        except CorruptCheckpoint as exc:
            raise RunError(str(exc)) from None

    def _run_setup(self) -> dict[str, Any]:
        """Run the once-stages (SFT, reward model), save what they trained, and point
        every model copied ``from:`` one of them at the trained weights."""
        specs = self.compiler.setup()
        handles = dict(zip([s.id for s in specs], self.dataflow.submit(specs), strict=True))
        metrics = self._wait_and_gather(handles, iteration=None)
        for name, value in metrics.items():
            self._say(f"rlhfflow: setup {name}: " + _format_stats(value))
        saves = [self.backend.submit(save_model_task, model, str(self.out / "models" / model
                                                                 / "setup"),
                                     [handles[stage]], key=f"save-{_token()}",
                                     worker=self.addresses[self.plan.stages[stage].workers[0]])
                 for model, stage in self._setup_trained().items()]
        self.backend.wait(saves)
        self.initial_models = self._after_setup(self.initial_models)
        self.models = dict(self.initial_models)
        self.backend.run_on_workers(update_model_configs, self.models)
        MetricsLog(self.out / "setup.jsonl").append({"setup": metrics})
        return metrics

    # ----------------------------------------------------------------- the loop
    def _list_skipped_prompts(self) -> None:
        if self.source.skipped:
            listing = self.out / "skipped_prompts.txt"
            listing.write_text("\n".join(self.source.skipped) + "\n", encoding="utf-8")
            self._say(f"rlhfflow: skipped {len(self.source.skipped)} bad prompt(s) "
                      f"(data.on_bad_prompt: skip), listed in {listing}; first: "
                      f"{self.source.skipped[0]}")

    def _run_loop(self, first: int) -> None:
        """Iterations ``first`` .. ``iterations - 1`` in the order of ``loop_steps``; then
        a checkpoint of the last one."""
        spec = self.pipeline.spec
        records: list[dict[str, Any]] = []
        live: dict[int, IterationTasks] = {}
        unfinished: list[int] = []
        self.telemetry.restart(self.addresses, self._layout())
        for step in loop_steps(first, spec.iterations, self.plan.max_staleness,
                               self.backend.pipelined):
            k = step.iteration
            if step.kind == "start":
                if self.stop is not None and self.stop.is_set():
                    in_flight = f"iteration {unfinished[-1]}" if unfinished else "nothing"
                    self._say(f"rlhfflow: stopping: finishing {in_flight} in flight, then "
                              f"saving a checkpoint")
                    break
            elif step.kind == "ahead":
                live[k] = self._begin(k, live.get(step.previous))
            elif step.kind == "main":
                self._submit_main(live[k], live.get(step.previous), live.get(step.later))
                unfinished.append(k)
            else:
                records.append(self._finish(live.pop(k)))
                unfinished.remove(k)
                self.dataflow.forget_before(k)
        for k in unfinished:  # stopped: the iteration in flight
            records.append(self._finish(live.pop(k)))
        last = records[-1]["iteration"] if records else first - 1
        if last > self.last_checkpoint:
            self.checkpointer.submit(last, self.compiler.checkpoint(last, {}))
            self._publish_checkpoint(last)
        evaluation = evaluation_summary(self.graph, records)
        if evaluation is not None:  # a run that only generates and scores
            self.summary["evaluation"], line = evaluation
            self._say(line)
        summary = summarise(records)
        if summary is not None:
            self.summary.update(summary[0])
            self._say(summary[1])
            if self.choice is not None and len(records) > 2:
                predicted, measured = self.choice.best.predicted_s, self.summary["iteration_s"]
                self.summary["predicted_iteration_s"] = round(predicted, 4)
                error = measured / predicted - 1
                hint = ""
                if abs(error) > 0.15 and not self.choice.cost.profiled:
                    # the analytic model's constants are another machine's: measure this one
                    hint = (f"; chosen with the analytic cost model: `rlhfflow profile "
                            f"{_shown(self.pipeline.source)} --from-run {_shown(self.out)}` "
                            f"makes a profile of this machine from this run")
                self._say(f"rlhfflow: iteration time: predicted {predicted:.3f} s, measured "
                          f"{measured:.3f} s ({error:+.0%}){hint}")

    def _begin(self, k: int, previous: IterationTasks | None) -> IterationTasks:
        """Iteration ``k``: its prompts, placed next to the first stage's tasks, and the
        stages that run ahead."""
        batch = self.source.batch(k)
        # the coordinator keeps the iteration's text (prompts, record fields) for the
        # buffer: zarr metadata and ragged text are its to write
        self._begun[k] = (batch["prompt_ids"].shape[1],
                          {c: list(batch[c]) for c in TEXT_COLUMNS if c in batch})
        it, source = self.compiler.begin(k, len(batch["prompt_ids"]))
        self.dataflow.submit(source, batch)
        self.dataflow.submit(self.compiler.stages(it, previous, ahead=True))
        return it

    def _submit_main(self, it: IterationTasks, previous: IterationTasks | None,
                     later: IterationTasks | None) -> None:
        """The iteration's arrays (the coordinator creates them), then the rest of
        iteration ``it``'s stages, its stores and, when due, its checkpoint."""
        k = it.index
        prompt_len, texts = self._begun.pop(k)
        lengths = {"prompt": prompt_len, "response": self._response_len()}
        schema = {c: ColumnSpec(col.dtype, (lengths[col.length],) if col.length else ())
                  for c, col in self.stored.items()}
        chunk = it.bounds[SOURCE][0][1] - it.bounds[SOURCE][0][0]
        self.buffer.begin_iteration(k, it.rows, schema, chunk_rows=chunk,
                                    attrs={"pipeline": self.pipeline.name})
        self.buffer.write_text(k, texts)
        # after the arrays: a stage task may store its own rows (TaskSpec.stores)
        self.dataflow.submit(self.compiler.stages(it, previous, ahead=False, later=later))
        self.dataflow.submit(self.compiler.stores(it))
        self.checkpointer.submit(k, self.compiler.iteration_checkpoint(it))

    def _recover(self, exc: Exception) -> int:
        """After a worker was lost: wait for workers, cut the run back to its last
        checkpoint, reinstall the resident state everywhere; returns the next iteration."""
        self._say(f"rlhfflow: {exc}; recovering from the last checkpoint")
        self._await_workers(exc)
        checkpoint = self.checkpointer.store.latest()
        keep = checkpoint.iteration if checkpoint else -1
        cut_back(self.out, keep, self.buffer)
        self.last_checkpoint = keep
        self.models = self._from_checkpoint(self.initial_models, checkpoint)
        self._start_workers()
        where = f"after iteration {keep}" if checkpoint else "from the start"
        self._say(f"rlhfflow: resuming {where} on {len(self.backend.workers)} worker(s)")
        if checkpoint is not None and inexact_resume(self.pipeline):
            self._say(f"rlhfflow: {inexact_resume(self.pipeline)}")
        return keep + 1

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

    def _publish_checkpoint(self, k: int) -> None:
        self.checkpointer.publish(k)
        self.last_checkpoint = k

    def _response_len(self) -> int:
        return self.graph.response_tokens

    def _finish(self, it: IterationTasks) -> dict[str, Any]:
        """Wait for iteration ``it``, commit its experience, log its metrics."""
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
        self._wait_and_gather(all_handles, it.index, gather=False)
        # each result once: a task that stored its own rows is also the iteration's
        # trainer (every fetch is a request the worker's event loop serves)
        wanted = list({id(h): h for h in [*stores, *trainers.values(), *reporters.values(),
                                          *installs]}.values())
        results = dict(zip(map(id, wanted), self.backend.gather(wanted), strict=True))
        # a stage task that stored its own rows returns the store's sums with its result
        partials = [r[STORED] if STORED in r else r for r in (results[id(h)] for h in stores)]
        # an iteration that is one task brings its worker's timings (TaskSpec.reports)
        timings = [p.pop(TIMINGS) for p in partials if TIMINGS in p]
        responses = [t for p in partials for t in p.pop("response_text", [])]
        if len(responses) == it.rows:  # in row order: one store per micro-batch, in order
            self.buffer.write_text(it.index, {"response_text": responses})
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
        if problem:  # after the record: the iteration is committed, a resume keeps it
            raise RunError(problem)
        if it.index in self.checkpointer.pending:
            self._publish_checkpoint(it.index)
        return record

    def _statistics(self, stage: str, result: dict[str, Any]) -> dict[str, Any]:
        """A stage's statistics from its task's result, without the columns of the
        stages fused into that task (they go to the buffer, not to the metrics)."""
        columns = {c for n in self.plan.group(stage) for c in self.graph.nodes[n].writes}
        return {k: v for k, v in result.items() if k not in columns and k != STORED}

    def _wait_for(self, handles: dict[str, Any], iteration: int | None) -> None:
        self._wait_and_gather(handles, iteration, gather=False)

    def _wait_and_gather(self, handles: dict[str, Any], iteration: int | None,
                         gather: bool = True) -> dict[str, Any]:
        try:
            self.backend.wait(list(handles.values()), pinned=self.addresses)
        except TaskFailed as exc:
            if self.plan.gangs:
                # a gang's survivors fail in their collective when a peer dies: that is
                # the lost worker (recoverable), not the stage's fault
                self.backend.check_alive(self.addresses, grace=5.0)
            stage, cause = exc.key.split("-")[0], exc.cause
            # a fused task is retried as often as the most retried stage in it
            retries = max((self.pipeline.spec.stages[s].retries for s in stage.split("+")
                           if s in self.pipeline.spec.stages), default=0)
            if isinstance(cause, StageFailed):  # one stage of a fused task
                stage, cause = cause.stage, cause.cause
            if _is_disk_full(cause):
                raise RunError(_disk_full(cause, f"stage {stage!r}")) from None
            where = f" in iteration {iteration}" if iteration is not None else " (setup)"
            tried = f" after {retries + 1} attempts" if retries else ""
            raise RunError(f"stage {stage!r} failed{where}{tried}: "
                           f"{type(cause).__name__}: {cause}") from cause
        if not gather:
            return {}
        return dict(zip(handles, self.backend.gather(list(handles.values())), strict=True))

    def _save_final(self) -> None:
        """Save every trainable model in transformers format under OUTPUT/models/NAME/final."""
        saves = [self.backend.submit(save_model_task, m, str(self.out / "models" / m / "final"),
                                     [], key=f"save-{_token()}", worker=self._home(m))
                 for m in self.plan.homes if self.pipeline.spec.models[m].trainable]
        self.backend.wait(saves)

    def _say(self, line: str) -> None:
        if self.progress:
            print(line, file=sys.stderr, flush=True)


def _host_of(address: str) -> str:
    """The host of a worker address (``tcp://10.0.0.5:4321`` -> ``10.0.0.5``)."""
    from urllib.parse import urlsplit

    return urlsplit(address).hostname or "127.0.0.1"


def _token() -> str:
    return uuid.uuid4().hex[:8]


def _format_stats(stats: dict[str, Any]) -> str:
    return "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                     for k, v in stats.items())


def tiny_models(pipeline: Pipeline, out: Path) -> dict[str, dict[str, Any]]:
    """The ``tiny:`` models still to build, by name: the keyword arguments of
    ``save_tiny_model`` (into OUT/models/NAME/init; a resumed run keeps its own)."""
    spec = pipeline.spec
    builds = {}
    for name, model in spec.models.items():
        path = out / "models" / name / "init"
        if model.tiny is not None and not (path / "config.json").is_file():
            tiny = model.tiny
            builds[name] = {"path": str(path), "head": model.head,
                            "seed": spec.seed if tiny.seed is None else tiny.seed,
                            "arch": tiny.arch, "n_layer": tiny.layers, "hidden": tiny.hidden,
                            "n_head": tiny.heads, "max_positions": tiny.max_positions}
    return builds


def model_configs(pipeline: Pipeline, out: Path, build: bool = True
                  ) -> dict[str, ModelConfig]:
    """Each model's config; ``tiny:`` models live in OUT/models/NAME/init, built here
    unless ``build`` is false (a run builds them on a worker: ``tiny_models``)."""
    spec = pipeline.spec
    if build:
        for kwargs in tiny_models(pipeline, out).values():
            save_tiny_model(**kwargs)
    paths: dict[str, str] = {}
    for name, model in spec.models.items():
        if model.tiny is not None:
            paths[name] = str(out / "models" / name / "init")
        elif model.path is not None:
            paths[name] = pipeline.model_source(model.path)
    return {name: ModelConfig(name=name, head=model.head,
                              init_path=paths[pipeline.model_root(name)],
                              trainable=model.trainable,
                              optimizer=model.optimizer.model_dump(), dtype=model.dtype)
            for name, model in spec.models.items()}
