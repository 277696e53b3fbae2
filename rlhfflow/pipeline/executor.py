"""The dataflow executor: every stage of every iteration becomes named tasks chained by
futures, so each task starts as soon as its inputs exist.

Per iteration: the prompts are split into micro-batches; micro-batch stages (generate,
score, log-probs, values) get one task per micro-batch (their own ``micro_batches``), on
the workers that hold their model (whichever is free); whole-batch stages (advantages,
training) get one task. A task waits only for the micro-batches of its inputs that hold
its rows, so a micro-batch streams through the stages as soon as it exists. Consecutive
stages the plan fuses run as one task. Edges come from the columns a stage reads, its
``after`` list, and the model edges of the graph (a trainer waits for the other users of
its model; next iteration's users wait for the trainer). Iteration k+1 is submitted while
k runs, so the scheduler starts it the moment the new weights exist; with
``overlap.max_staleness: N`` the generating model's inference of iteration k+N is
submitted with iteration k and runs on the weights of N updates before. Priorities put
older iterations first and, within one, the stages with the longest path ahead of them.
Experience is written to zarr by ``store`` tasks on the workers that hold it; the
coordinator owns the metadata and commits an iteration once it is complete.
"""

from __future__ import annotations

import errno
import math
import sys
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhfflow.pipeline.backend import DaskBackend, InlineBackend, TaskFailed, WorkerLost
from rlhfflow.pipeline.graph import SOURCE
from rlhfflow.pipeline.loader import Pipeline
from rlhfflow.pipeline.plan import ExecutionPlan, PlanError, inputs_of, make_plan, model_sizes
from rlhfflow.pipeline.runstate import (
    Resume,
    RunStateError,
    StartPoint,
    identity_digest,
    pipeline_identity,
    prepare_output,
)
from rlhfflow.pipeline.source import PromptSource, micro_batch_bounds
from rlhfflow.pipeline.worker import (
    RunDef,
    StageDef,
    StageFailed,
    checkpoint_task,
    export_weights_task,
    gang_port,
    install_weights_task,
    join_gang_task,
    part,
    pop_timings,
    save_model_task,
    stage_task,
    store_task,
    update_model_configs,
)
from rlhfflow.stages import ModelConfig, slice_batch
from rlhfflow.stages.models import build_char_tokenizer, build_tiny_model, save_model
from rlhfflow.storage import (
    Checkpoint,
    CheckpointStore,
    ColumnSpec,
    ExperienceBuffer,
    MetricsLog,
)


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


@dataclass
class _Iteration:
    """The handles of one submitted iteration."""

    index: int
    handles: dict[str, list[Any]]
    bounds: dict[str, list[tuple[int, int]]]  # stage -> its micro-batches' rows
    rows: int
    prompt_len: int
    stores: list[Any] = field(default_factory=list)
    checkpoint: tuple[Path, dict[str, list[Any]]] | None = None
    syncs: dict[str, list[Any]] = field(default_factory=dict)  # model -> install tasks


def run_pipeline(pipeline: Pipeline, progress: bool = True, inline: bool = False,
                 overwrite: bool = False, resume: Resume = "auto", force: bool = False,
                 stop: threading.Event | None = None) -> RunResult:
    """Run ``pipeline`` on its cluster (``cluster.address``, or an embedded cluster) or,
    with ``inline=True``, in this process without Dask.

    An output directory holding a run of the same pipeline is resumed from its last
    checkpoint (``resume="auto"``); ``overwrite`` starts afresh. Setting ``stop`` asks the
    run to finish the iteration in flight, save a checkpoint and return.
    """
    try:
        out, start = prepare_output(pipeline, overwrite, resume, force)
    except RunStateError as exc:
        raise RunError(str(exc)) from None
    cluster = pipeline.spec.cluster
    if inline:
        backend = InlineBackend()
    else:
        try:
            backend = DaskBackend.connect(
                cluster.address, cluster.workers, host=cluster.host,
                dashboard_address=cluster.dashboard_address,
                memory_limit=cluster.memory_limit, torch_threads=cluster.torch_threads,
                device=cluster.device)
        except OSError as exc:
            raise RunError(f"cannot reach the Dask scheduler at {cluster.address}: {exc}"
                           ) from None
        except RuntimeError as exc:  # e.g. cluster.device: cuda on a machine without one
            raise RunError(str(exc)) from None
    try:
        return Executor(pipeline, backend, out, progress, start, stop).run()
    except WorkerLost as exc:  # outside the loop (setup, final save): no recovery there
        raise RunError(f"{exc}; run again to resume from the last checkpoint") from None
    except RunError:
        raise
    except Exception as exc:  # the coordinator's own writes: metrics, buffer metadata, ...
        if _is_disk_full(exc):
            raise RunError(_disk_full(exc, "the coordinator")) from None
        raise
    finally:
        backend.close()


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
    """Submits a pipeline's tasks to a backend, iteration after iteration."""

    def __init__(self, pipeline: Pipeline, backend, output_dir: Path, progress: bool = True,
                 start: StartPoint | None = None, stop: threading.Event | None = None):
        self.pipeline = pipeline
        self.graph = pipeline.graph
        self.backend = backend
        self.out = output_dir
        self.progress = progress
        self.start = start or StartPoint(None, resumed=False)
        self.stop = stop
        self.log = MetricsLog(output_dir / "metrics.jsonl")
        self.checkpoints = CheckpointStore(output_dir / "checkpoints")
        self.timings: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.plan: ExecutionPlan | None = None
        self.addresses: list[str] = []
        self.model_bytes = model_sizes(pipeline)
        self.versions: dict[str, int] = {}  # the version each model has once submitted
        self._gang_tail: dict[tuple[int, ...], list[Any]] = {}  # last gang per worker set
        self.summary: dict[str, Any] = {}
        self.models: dict[str, ModelConfig] = {}
        self.initial_models: dict[str, ModelConfig] = {}
        self.last_checkpoint = self.start.checkpoint.iteration if self.start.checkpoint else -1
        # the graph's model edges, by the stage that waits on them
        self.releases: dict[str, list[str]] = defaultdict(list)  # trainer -> its users
        for user, trainer in self.graph.release_edges():
            self.releases[trainer].append(user)
        self.crossings: dict[str, list[str]] = defaultdict(list)  # user -> last trainers
        for trainer, user in self.graph.cross_iteration_edges():
            self.crossings[user].append(trainer)
        # what each iteration stores: every non-text column, and the stages writing them
        self.stored = {c: col for c, col in self.graph.columns().items() if col.dtype != "str"}
        self.writers = [SOURCE] + [n for n in self.graph.loop_stages
                                   if self.graph.nodes[n].writes]
        self.rank = _upward_rank(self.graph)
        # busy time per worker: finished compute intervals not yet past a window
        self._busy: dict[int, list[tuple[float, float]]] = defaultdict(list)
        self._window_start = time.time()

    # ----------------------------------------------------------------- set-up
    def run(self) -> RunResult:
        """Materialise models, place them, run the setup stages, then the iterations;
        recover from a lost worker by resuming from the last checkpoint."""
        spec = self.pipeline.spec
        checkpoint = self.start.checkpoint
        if self.graph.loop_stages and spec.iterations > 0:
            # prompts first: a bad prompts file stops the run before any cluster work
            generate_model = self.graph.nodes[self.graph.of_type("generate")[0]].model
            self.source = PromptSource.from_pipeline(self.pipeline, generate_model)
            self._list_skipped_prompts()
            self.buffer = ExperienceBuffer(self.out / "buffer.zarr")
        self.initial_models = self._model_configs()
        if checkpoint is not None:
            self.initial_models = self._after_setup(self.initial_models)
        self.models = self._from_checkpoint(self.initial_models, checkpoint)
        self._start_workers()
        result = RunResult(self.out, dashboard=self.backend.dashboard_link)
        first = self.start.next_iteration
        how = f"resuming after iteration {first - 1}" if checkpoint else (
            "resuming from the start (no checkpoint yet)" if self.start.resumed else "")
        self._say(f"rlhfflow: {self.pipeline.name}: {spec.iterations} iterations on "
                  f"{len(self.backend.workers)} worker(s); output {self.out}"
                  + (f"; {how}" if how else ""))
        if self.backend.dashboard_link:
            self._say(f"rlhfflow: Dask dashboard: {self.backend.dashboard_link}")
        if self.graph.setup_stages and checkpoint is None:
            result.setup_metrics = self._run_setup()
        if self.graph.loop_stages and first < spec.iterations:
            result.metrics = self._run_with_recovery(first)
        result.summary = self.summary
        result.stopped = bool(self.stop and self.stop.is_set())
        if not result.stopped:
            self._save_final()
        return result

    def _run_with_recovery(self, first: int) -> list[dict[str, Any]]:
        """The loop; when a worker holding models is lost, resume from the last
        checkpoint on the workers there are (at most ``cluster.max_restarts`` times).
        Returns this run's metrics records, as kept in metrics.jsonl."""
        start, restarts = first, 0
        while True:
            try:
                self._run_loop(first)
                break
            except WorkerLost as exc:
                restarts += 1
                if restarts > self.pipeline.spec.cluster.max_restarts:
                    raise RunError(f"{exc}; gave up after {restarts - 1} restart(s); the run "
                                   f"can be resumed from its last checkpoint") from None
                first = self._recover(exc)
        return [r for r in self.log.read() if r.get("iteration", -1) >= start]

    def _start_workers(self) -> None:
        """Place models on the current workers and (re)install the resident state."""
        spec = self.pipeline.spec
        self.addresses = list(self.backend.workers)
        self.plan = make_plan(self.pipeline, len(self.addresses), self.model_bytes)
        self._check_gang_batches()
        self.versions = {m: c.version for m, c in self.models.items()}
        self._gang_tail.clear()
        run = RunDef(stages=self._stage_defs(), models=self.models, algorithm=spec.algorithm,
                     seed=spec.seed, settings={"temperature": self.pipeline.rollout_temperature,
                                               "base_dir": str(self.pipeline.base_dir),
                                               "device": spec.cluster.device})
        self.backend.start(run, spec.cluster.torch_threads)
        self._join_gangs()

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

    def _address(self, index: int | None) -> str | None:
        return None if index is None else self.addresses[index]

    def _home(self, model: str) -> str:
        """The worker holding the master copy of ``model`` (rank 0 of its gang)."""
        return self.addresses[self.plan.homes[model][0]]

    def _model_configs(self) -> dict[str, ModelConfig]:
        """Each model's config, building ``tiny:`` models into OUTPUT/models/NAME/init."""
        spec = self.pipeline.spec
        paths: dict[str, str] = {}
        for name, model in spec.models.items():
            if model.tiny is not None:
                path = self.out / "models" / name / "init"
                if not (path / "config.json").is_file():  # a resumed run keeps its own
                    tiny = model.tiny
                    tok = build_char_tokenizer()
                    module = build_tiny_model(
                        tok, model.head, seed=spec.seed if tiny.seed is None else tiny.seed,
                        arch=tiny.arch, n_layer=tiny.layers, hidden=tiny.hidden,
                        n_head=tiny.heads, max_positions=tiny.max_positions)
                    save_model(module, tok, path)
                paths[name] = str(path)
            elif model.path is not None:
                paths[name] = str(self.pipeline.resolve(model.path))
        configs = {}
        for name, model in spec.models.items():
            configs[name] = ModelConfig(
                name=name, head=model.head, init_path=paths[self.pipeline.model_root(name)],
                trainable=model.trainable, optimizer=model.optimizer.model_dump(),
                dtype=model.dtype)
        return configs

    def _stage_defs(self) -> dict[str, StageDef]:
        defs = {}
        for name, node in self.graph.nodes.items():
            stage = self.pipeline.spec.stages[name]
            ds = stage.deepspeed.model_dump() if stage.deepspeed else None
            defs[name] = StageDef(node.type, self.pipeline.params[name], node.model, node.reads,
                                  backend=stage.backend, deepspeed=ds)
        return defs

    def _deepspeed(self, model: str) -> bool:
        """Whether a loop stage trains ``model`` with DeepSpeed (sharded optimizer)."""
        return any(self.pipeline.spec.stages[t].backend == "deepspeed"
                   for t in self.graph.trainers(model))

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
                out[name] = _replace(models[name],
                                     init_path=str(self.out / "models" / root / "setup"))
        return out

    def _from_checkpoint(self, models: dict[str, ModelConfig], checkpoint: Checkpoint | None
                         ) -> dict[str, ModelConfig]:
        """Configs of the models trained in the loop, taken from ``checkpoint``."""
        if checkpoint is None:
            return dict(models)
        out = dict(models)
        versions = checkpoint.state.get("versions", {})
        for name in self._loop_trained():
            weights, optimizer = checkpoint.model_dir(name), checkpoint.optimizer_file(name)
            shards = list(optimizer.parent.glob(f"{optimizer.stem}.zero-rank*.pt"))
            if not (weights / "config.json").is_file() or not (optimizer.is_file() or shards):
                raise RunError(f"{checkpoint.path}: corrupt checkpoint (no weights or "
                               f"optimizer state of {name!r}); delete it to resume from the "
                               f"one before")
            out[name] = _replace(models[name], init_path=str(weights),
                                 optimizer_state=str(optimizer),
                                 version=int(versions.get(name, 0)))
        return out

    def _loop_trained(self) -> list[str]:
        """Models that a loop stage trains (their state changes every iteration)."""
        return list(dict.fromkeys(self.graph.nodes[n].model for n in self.graph.loop_stages
                                  if self.graph.nodes[n].trains))

    def _run_setup(self) -> dict[str, Any]:
        """Run the once-stages (SFT, reward model), save what they trained, and point
        every model copied ``from:`` one of them at the trained weights."""
        handles: dict[str, Any] = {}
        for name in self.graph.setup_stages:
            node = self.graph.nodes[name]
            after = [handles[a] for a in node.after]
            handles[name] = self.backend.submit(
                stage_task, name, -1, [], after, key=f"{name}-{_token()}",
                worker=self._address(self.plan.stages[name].worker(0)),
                retries=self.pipeline.spec.stages[name].retries)
        metrics = self._wait_and_gather(handles, iteration=None)
        for name, value in metrics.items():
            self._say(f"rlhfflow: setup {name}: " + _format_stats(value))
        saves = [self.backend.submit(save_model_task, model, str(self.out / "models" / model
                                                                 / "setup"),
                                     [handles[stage]], key=f"save-{_token()}",
                                     worker=self._address(self.plan.stages[stage].worker(0)))
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
        """Iterations ``first`` .. ``iterations - 1``; then a checkpoint of the last one."""
        spec = self.pipeline.spec
        records = []
        # iteration k+1 is submitted before k is finished, so the scheduler starts it the
        # moment its inputs exist (inline backends run tasks at submission: no overlap);
        # stages that run ahead (max_staleness N) are submitted N iterations earlier
        lag = self.plan.max_staleness
        live: dict[int, _Iteration] = {}
        previous: _Iteration | None = None
        self._window_start = time.time()
        self._busy.clear()
        for k in range(first, spec.iterations):
            if self.stop is not None and self.stop.is_set():
                in_flight = f"iteration {previous.index}" if previous else "nothing"
                self._say(f"rlhfflow: stopping: finishing {in_flight} in flight, then "
                          f"saving a checkpoint")
                break
            for i in range(k, min(k + lag, spec.iterations - 1) + 1):
                if i not in live:
                    live[i] = self._begin(i)
                    self._submit_stages(live[i], previous, ahead=True)
            current = live.pop(k)
            self._submit_stages(current, previous, ahead=False, later=live.get(k + lag))
            if previous is not None:
                records.append(self._finish(previous))
            previous = current
            if not self.backend.pipelined:
                records.append(self._finish(current))
                previous = None
        if previous is not None:
            records.append(self._finish(previous))
        last = records[-1]["iteration"] if records else first - 1
        if last > self.last_checkpoint:
            self._publish_checkpoint(last, self._submit_checkpoint(last, {}))
        self._summarise(records)

    def _recover(self, exc: Exception) -> int:
        """After a worker was lost: wait for workers, cut the run back to its last
        checkpoint, reinstall the resident state everywhere; returns the next iteration."""
        timeout = self.pipeline.spec.cluster.worker_timeout_s
        self._say(f"rlhfflow: {exc}; recovering from the last checkpoint")
        self.backend.cancel_all()
        if self.plan is not None and self.plan.gangs:
            # the survivors' process groups include the dead worker: start afresh
            self.backend.restart_workers()
        if not self.backend.wait_for_workers(len(self.backend.workers), timeout):
            raise RunError(f"{exc}; no worker came back within cluster.worker_timeout_s="
                           f"{timeout:g}; the run can be resumed from its last checkpoint"
                           ) from None
        checkpoint = self.checkpoints.latest()
        keep = checkpoint.iteration if checkpoint else -1
        self.buffer.truncate(keep)
        self.log.truncate(keep)
        self.checkpoints.truncate(keep)
        self.checkpoints.clean_leftovers()
        self.timings.clear()
        self.last_checkpoint = keep
        self.models = self._from_checkpoint(self.initial_models, checkpoint)
        self._start_workers()
        self._say(f"rlhfflow: resuming after iteration {keep} on "
                  f"{len(self.backend.workers)} worker(s)")
        return keep + 1

    # ----------------------------------------------------------------- checkpoints
    def _checkpoint_due(self, k: int) -> bool:
        every = self.pipeline.spec.checkpoint.every
        return every > 0 and (k + 1) % every == 0

    def _submit_checkpoint(self, k: int, after: dict[str, list[Any]]
                           ) -> tuple[Path, dict[str, list[Any]]]:
        """Tasks saving every loop-trained model into a new checkpoint directory, each
        after ``after[model]`` (the iteration's training tasks of that model): rank 0 of
        its gang saves it, and every rank its ZeRO shard when DeepSpeed trains it."""
        directory = self.checkpoints.begin(k)
        handles = {}
        for m in self._loop_trained():
            ranks = self.plan.homes[m] if self._deepspeed(m) else self.plan.homes[m][:1]
            handles[m] = [self.backend.submit(checkpoint_task, m, str(directory),
                                              after.get(m, []), rank,
                                              key=f"checkpoint-{k}-{_token()}",
                                              worker=self.addresses[w],
                                              priority=-k * 1000)
                          for rank, w in enumerate(ranks)]
        return directory, handles

    def _publish_checkpoint(self, k: int, pending: tuple[Path, dict[str, list[Any]]]) -> None:
        """Wait for a checkpoint's tasks, then make it visible (state.json last, rename)."""
        directory, handles = pending
        self._wait_and_gather({f"checkpoint[{m}]": h for m, hs in handles.items() for h in hs},
                              k, gather=False)
        saved = {m: self.backend.gather(hs[:1])[0] for m, hs in handles.items()}
        state = {"versions": {m: r["version"] for m, r in saved.items()},
                 "seed": self.pipeline.spec.seed,
                 "prompts_consumed": (k + 1) * self.pipeline.spec.data.batch_size,
                 "kl_coef": self.pipeline.spec.algorithm.kl_coef,
                 "pipeline_digest": identity_digest(pipeline_identity(self.pipeline)),
                 "created": time.time()}
        self.checkpoints.publish(directory, k, state)
        self.checkpoints.prune(self.pipeline.spec.checkpoint.keep)
        self.last_checkpoint = k

    def _begin(self, k: int) -> _Iteration:
        """Iteration ``k``'s prompts, split into the micro-batches of every stage and
        placed next to the first stage's tasks."""
        batch = self.source.batch(k)
        rows = len(batch["prompt_ids"])
        bounds = {SOURCE: micro_batch_bounds(rows, self.pipeline.spec.data.micro_batches)}
        for name, sp in self.plan.stages.items():
            if sp.micro_batches is not None:
                bounds[name] = micro_batch_bounds(rows, sp.micro_batches)
        first = self.plan.stages[self.graph.loop_stages[0]]
        handles: dict[str, list[Any]] = {
            SOURCE: [self.backend.scatter(slice_batch(batch, a, b),
                                          self._address(first.worker(j)))
                     for j, (a, b) in enumerate(bounds[SOURCE])]}
        return _Iteration(k, handles, bounds, rows, batch["prompt_ids"].shape[1])

    def _submit_stages(self, it: _Iteration, previous: _Iteration | None, ahead: bool,
                       later: _Iteration | None = None) -> None:
        """Submit the stages of iteration ``it`` that run ahead (``ahead=True``: the
        generating model's inference with max_staleness > 0) or all the others; returns
        at once. ``later`` is the iteration whose ahead stages were submitted last: this
        iteration's trainers (and weight installs) must wait for them, as they use the
        weights from before this update."""
        spec, k, handles = self.pipeline.spec, it.index, it.handles
        sequential = self.plan.sequential
        for name in self.graph.loop_stages:
            sp = self.plan.stages[name]
            if name in handles or (sp.lag > 0) != ahead:
                continue
            group = self.plan.group(name)
            nodes = [self.graph.nodes[n] for n in group]
            inputs = [x for n in group for x in inputs_of(self.graph, n) if x not in group]
            inputs = list(dict.fromkeys(inputs))
            producers = list(dict.fromkeys(
                p for n in group for c in self.graph.nodes[n].reads
                if (p := self.graph.producer(c, n)) not in group))
            order: list[Any] = []
            for n, node in zip(group, nodes, strict=True):
                for user in self.releases[n]:
                    if self.plan.stages[user].lag == 0:
                        order += handles[user]
                    elif later is not None and self._at_home(user):
                        order += later.handles[user]
                if previous is not None:
                    order += [h for t in self.crossings[n] for h in previous.handles[t]]
                    # a shadow copy is used only once the new weights are installed on it
                    order += previous.syncs.get(node.model, [])
                    if node.trains and previous.checkpoint and \
                            node.model in previous.checkpoint[1]:
                        # the update of k must not start before checkpoint k-1 saved it
                        order += previous.checkpoint[1][node.model]
            if sequential:
                order += self._barrier(it, name, previous)
            retries = max(spec.stages[n].retries for n in group)
            versions = {node.model: self.versions[node.model] for node in nodes if node.model}
            priority = -k * 1000 + max(self.rank[n] for n in group)
            label = "+".join(group)
            task = group if len(group) > 1 else name
            if sp.micro_batches is None:
                parts = [part(handles[p]) for p in producers]
                deps = order + [h for x in inputs if x not in producers for h in handles[x]]
                if sp.gang:
                    out = self._submit_gang(name, k, parts, deps, versions, priority)
                else:
                    out = [self.backend.submit(
                        stage_task, task, k, parts, deps, versions,
                        key=f"{label}-{k}-{_token()}", worker=self._address(sp.worker(0)),
                        retries=retries, priority=priority)]
            else:
                out = []
                where = self._addresses(sp.workers)
                for j, (a, b) in enumerate(it.bounds[name]):
                    parts, deps = [], list(order)
                    for x in inputs:
                        inp, hs = self._rows_of(it, x, a, b)
                        deps += hs
                        if x in producers:
                            parts.append(inp)
                    if SOURCE in producers:
                        parts.append(self._rows_of(it, SOURCE, a, b)[0])
                    out.append(self.backend.submit(
                        stage_task, task, k, parts, deps, versions,
                        key=f"{label}-{k}-{j}-{_token()}", worker=where, retries=retries,
                        priority=priority))
            for n, node in zip(group, nodes, strict=True):
                handles[n] = out
                if node.trains:
                    self.versions[node.model] += 1
                    it.syncs.update(self._submit_syncs(n, k, out, later))
        if ahead:
            return
        it.stores = self._submit_stores(it)
        if self._checkpoint_due(k):
            trainers = {m: [h for t in self.graph.trainers(m) if t in handles
                            for h in handles[t]] for m in self._loop_trained()}
            it.checkpoint = self._submit_checkpoint(k, trainers)

    def _barrier(self, it: _Iteration, name: str, previous: _Iteration | None) -> list[Any]:
        """``overlap.sequential``: what a stage waits for besides its inputs: the whole
        previous stage, or for the first stage all of the previous iteration."""
        loop = self.graph.loop_stages
        i = loop.index(name)
        if i > 0:
            return list(it.handles[loop[i - 1]])
        if previous is None:
            return []
        return [h for hs in previous.handles.values() for h in hs] + previous.stores + \
            [h for hs in previous.syncs.values() for h in hs]

    def _at_home(self, stage: str) -> bool:
        """Whether ``stage`` may run on a worker where its model is trained."""
        sp = self.plan.stages[stage]
        model = self.graph.nodes[stage].model
        return bool(set(sp.workers) & set(self.plan.homes.get(model, ())))

    def _addresses(self, workers: tuple[int, ...]) -> list[str] | None:
        """The addresses a task may run on (None: any worker)."""
        return [self.addresses[w] for w in workers] or None

    def _rows_of(self, it: _Iteration, stage: str, a: int, b: int
                 ) -> tuple[dict[str, Any], list[Any]]:
        """Rows ``[a, b)`` of ``stage``'s output in iteration ``it``: the input of a task
        (the results of the micro-batches holding those rows, and the rows to take of
        their concatenation) and the handles it waits for."""
        hs = it.handles[stage]
        if stage != SOURCE and self.graph.nodes[stage].per_batch:
            return part(hs, (a, b)), list(hs)
        bounds = it.bounds[stage]
        js = [j for j, (pa, pb) in enumerate(bounds) if pa < b and pb > a]
        start, stop = bounds[js[0]][0], bounds[js[-1]][1]
        rows = None if (a, b) == (start, stop) else (a - start, b - start)
        chosen = [hs[j] for j in js]
        return part(chosen, rows), chosen

    def _submit_gang(self, name: str, k: int, parts: list, deps: list,
                     versions: dict[str, int], priority: int) -> list[Any]:
        """One task per worker of a gang, one rank each. A gang waits for the previous
        gang on the same workers, so two gangs never hold each other's workers while
        waiting in a collective (a deadlock with one thread each)."""
        sp = self.plan.stages[name]
        members = [self.addresses[w] for w in sp.workers]
        deps = deps + self._gang_tail.get(sp.workers, [])
        # no retries: one rank retried alone would wait for peers that already finished
        tasks = [self.backend.submit(stage_task, name, k, parts, deps, versions,
                                     tuple(members), key=f"{name}-{k}-r{rank}-{_token()}",
                                     worker=address, priority=priority)
                 for rank, address in enumerate(members)]
        self._gang_tail[sp.workers] = tasks
        return tasks

    def _submit_syncs(self, trainer: str, k: int, trained: list[Any],
                      later: _Iteration | None) -> dict[str, list[Any]]:
        """Send the weights ``trainer`` produced to the model's shadow copies (parameter
        reallocation): one export at the home, one versioned install per shadow, after
        the stages running ahead on that shadow (they use the weights it has now)."""
        out = {}
        for t in self.plan.transfers_after(trainer):
            export = self.backend.submit(export_weights_task, t.model, k, trained,
                                         key=f"export-{k}-{_token()}",
                                         worker=self.addresses[t.source],
                                         priority=-k * 1000 + 999)
            out[t.model] = []
            for w in t.targets:
                users = [h for n, sp in self.plan.stages.items()
                         if later is not None and sp.lag and w in sp.workers
                         and self.graph.nodes[n].model == t.model
                         for h in later.handles.get(n, [])]
                out[t.model].append(self.backend.submit(
                    install_weights_task, export, self.versions[t.model], k, users,
                    key=f"realloc-{k}-{_token()}", worker=self.addresses[w],
                    priority=-k * 1000 + 999))
        return out

    def _submit_stores(self, it: _Iteration) -> list[Any]:
        """Create the iteration's arrays (coordinator) and one store task per micro-batch."""
        k = it.index
        lengths = {"prompt": it.prompt_len, "response": self._response_len()}
        schema = {c: ColumnSpec(col.dtype, (lengths[col.length],) if col.length else ())
                  for c, col in self.stored.items()}
        bounds = it.bounds[SOURCE]
        chunk = bounds[0][1] - bounds[0][0]
        self.buffer.begin_iteration(k, it.rows, schema, chunk_rows=chunk,
                                    attrs={"pipeline": self.pipeline.name})
        stores = []
        writers = list({id(it.handles[w]): w for w in self.writers}.values())  # fused: once
        # sequential: the stores are the iteration's last stage
        after = list(it.handles[self.graph.loop_stages[-1]]) if self.plan.sequential else []
        for j, (a, b) in enumerate(bounds):
            parts = [self._rows_of(it, w, a, b)[0] for w in writers]
            stores.append(self.backend.submit(
                store_task, str(self.out / "buffer.zarr"), k, a, parts, list(self.stored),
                after, key=f"store-{k}-{j}-{_token()}", priority=-k * 1000 - 1))
        return stores

    def _response_len(self) -> int:
        return max(int(self.pipeline.params[n].max_new_tokens)
                   for n in self.graph.of_type("generate"))

    def _finish(self, it: _Iteration) -> dict[str, Any]:
        """Wait for iteration ``it``, commit its experience, log its metrics."""
        handles = dict(it.handles)
        handles.pop(SOURCE)
        trainers = {n: handles[n][0] for n in self.graph.loop_stages
                    if self.graph.nodes[n].trains}
        all_handles = {f"{n}[{j}]": h for n, hs in handles.items() for j, h in enumerate(hs)}
        all_handles.update({f"store[{j}]": h for j, h in enumerate(it.stores)})
        installs = [h for hs in it.syncs.values() for h in hs]
        all_handles.update({f"realloc[{j}]": h for j, h in enumerate(installs)})
        self._wait_and_gather(all_handles, it.index, gather=False)
        partials = self.backend.gather(it.stores)
        train_stats = dict(zip(trainers, self.backend.gather(list(trainers.values())),
                               strict=True))
        moved = self.backend.gather(installs)
        self.buffer.commit(it.index)
        record = self._record(it, partials, train_stats, moved)
        self.log.append(record)
        self._report(record)
        if it.checkpoint is not None:
            self._publish_checkpoint(it.index, it.checkpoint)
        return record

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

    # ----------------------------------------------------------------- metrics
    def _collect_timings(self) -> dict[int, list[tuple[float, float]]]:
        """Pull the workers' task intervals: per-iteration stage times, and per worker the
        finished intervals (kept for the busy fraction); returns the running ones."""
        # timings are diagnostics: a worker that died with its timings loses them
        running: dict[int, list[tuple[float, float]]] = {}
        for address, report in self.backend.run_on_workers(pop_timings).items():
            w = self.addresses.index(address) if address in self.addresses else None
            for iteration, stage, start, stop in report["done"]:
                self.timings[iteration][stage] += stop - start
                if w is not None:  # busy fractions are of the device workers
                    self._busy[w].append((start, stop))
            if w is None:
                continue
            running[w] = [(start, report["now"]) for _, _, start in report["running"]]
        return running

    def _busy_fractions(self, running: dict[int, list[tuple[float, float]]], start: float,
                        stop: float) -> list[float]:
        """Per worker, the fraction of ``[start, stop]`` it spent computing."""
        fractions = []
        for w in range(len(self.addresses)):
            spans = sorted((max(a, start), min(b, stop))
                           for a, b in self._busy[w] + running.get(w, []))
            busy, reach = 0.0, start
            for a, b in spans:
                a = max(a, reach)
                if b > a:
                    busy += b - a
                    reach = b
            fractions.append(round(busy / max(stop - start, 1e-9), 4))
            self._busy[w] = [(a, b) for a, b in self._busy[w] if b > stop]
        return fractions

    def _record(self, it: _Iteration, partials: list[dict[str, float]],
                train: dict[str, dict[str, Any]], moved: list[dict[str, float]]
                ) -> dict[str, Any]:
        running = self._collect_timings()
        now = time.time()
        iteration_s = now - self._window_start
        busy = self._busy_fractions(running, self._window_start, now)
        self._window_start = now
        total = defaultdict(float)
        for p in partials:
            for key, value in p.items():
                total[key] += value
        n = total["rows"]
        scored = total.get("scored", 0.0)
        mean = total["score_sum"] / scored if scored else None
        std = math.sqrt(max(0.0, total["score_sq"] / scored - mean ** 2)) if mean is not None \
            else None
        stats = {k: v for s in train.values() for k, v in s.items()}
        kl_mean = total["kl_sum"] / total["tokens"] if "kl_sum" in total and total["tokens"] \
            else stats.get("kl_loss")
        stage_s = {k: round(v, 4) for k, v in self.timings.pop(it.index, {}).items()}
        return {
            "iteration": it.index, "samples": int(n),
            "samples_skipped": int(total.get("skipped", 0)),
            "reward_mean": mean, "reward_std": std, "kl_mean": kl_mean,
            "policy_loss": stats.get("policy_loss"), "value_loss": stats.get("value_loss"),
            "clip_frac": stats.get("clip_frac"), "approx_kl": stats.get("approx_kl"),
            "response_length_mean": total["length_sum"] / n if n else None,
            "tokens_generated": int(total["tokens"]),
            "staleness_mean": stats.get("staleness_mean"),
            "staleness_max": stats.get("staleness_max"),
            "iteration_s": round(iteration_s, 4),
            "stage_s": stage_s,
            "overlap": round(sum(stage_s.values()) / max(iteration_s, 1e-9), 4),
            "busy_frac": busy,
            "realloc_bytes": int(sum(m["nbytes"] for m in moved)),
            "realloc_s": round(max((m["seconds"] for m in moved), default=0.0), 4),
            "train": train,
        }

    def _summarise(self, records: list[dict[str, Any]]) -> None:
        """The overlap the run achieved, over its steady iterations (not the first, which
        loads the models, nor the last, which has nothing left to overlap with): kept in
        ``self.summary`` and printed."""
        steady = records[1:-1] if len(records) > 2 else records
        if not steady:
            return

        def mean(xs):
            return sum(xs) / len(xs)

        busy = [mean([r["busy_frac"][w] for r in steady])
                for w in range(len(steady[0]["busy_frac"]))]
        stale = [r["staleness_max"] for r in records if r.get("staleness_max") is not None]
        self.summary = {
            "iterations": len(steady),
            "iteration_s": round(mean([r["iteration_s"] for r in steady]), 4),
            "overlap": round(mean([r["overlap"] for r in steady]), 4),
            "busy_frac": [round(b, 4) for b in busy],
            "staleness_max": max(stale) if stale else None,
        }
        workers = ", ".join(f"w{w} {b:.2f}" for w, b in enumerate(busy))
        stale_text = f"; staleness max {max(stale)}" if stale else ""
        self._say(f"rlhfflow: overlap {self.summary['overlap']:.2f} (sum of stage times / "
                  f"iteration wall time, mean over {len(steady)} iteration(s)); busy: "
                  f"{workers}{stale_text}")

    def _report(self, r: dict[str, Any]) -> None:
        total = self.pipeline.spec.iterations
        done = r["iteration"] + 1
        width = 20
        bar = "#" * (done * width // total) + "-" * (width - done * width // total)
        reward = f"{r['reward_mean']:.3f}" if r["reward_mean"] is not None else "-"
        kl = f"{r['kl_mean']:.4f}" if r["kl_mean"] is not None else "-"
        skipped = f"  skipped {r['samples_skipped']}" if r["samples_skipped"] else ""
        self._say(f"[{bar}] {done:>4}/{total}  reward {reward}  kl {kl}  "
                  f"len {r['response_length_mean']:.1f}  {r['iteration_s']:.2f}s{skipped}")

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


def _replace(config: ModelConfig, **changes: Any) -> ModelConfig:
    from dataclasses import replace

    return replace(config, **changes)


def _format_stats(stats: dict[str, Any]) -> str:
    return "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                     for k, v in stats.items())


def _upward_rank(graph) -> dict[str, int]:
    """Per loop stage, the length (in stages) of the longest path from it to the end of
    the iteration, and for a trainer on through the next iteration's users of its model
    (the next rollout waits for the actor's update): the priority of its tasks within
    an iteration, so the critical path goes first. Always below 1000."""
    consumers: dict[str, list[str]] = defaultdict(list)
    for name in graph.loop_stages:
        for x in inputs_of(graph, name):
            consumers[x].append(name)
    rank: dict[str, int] = {}
    for name in reversed(graph.loop_stages):
        rank[name] = 1 + max((rank[c] for c in consumers[name] if c in rank), default=0)
    out = dict(rank)
    for trainer, user in graph.cross_iteration_edges():
        out[trainer] = max(out[trainer], rank[trainer] + rank[user])
    return {n: min(r, 998) for n, r in out.items()}
