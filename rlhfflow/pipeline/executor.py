"""The dataflow executor: every stage of every iteration becomes named tasks chained by
futures, so each task starts as soon as its inputs exist.

Per iteration: the prompts are split into micro-batches; micro-batch stages (generate,
score, log-probs, values) get one task per micro-batch, pinned to the worker that holds
their model; whole-batch stages (advantages, training) get one task. Edges come from the
columns a stage reads, its ``after`` list, and the model edges of the graph (a trainer
waits for the other users of its model; next iteration's users wait for the trainer).
Iteration k+1 is submitted while k runs, so the scheduler starts it the moment the new
weights exist. Experience is written to zarr by ``store`` tasks on the workers that hold
it; the coordinator owns the metadata and commits an iteration once it is complete.
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
from rlhfflow.pipeline.plan import ExecutionPlan, PlanError, make_plan, model_sizes
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


@dataclass
class _Iteration:
    """The handles of one submitted iteration."""

    index: int
    handles: dict[str, list[Any]]
    stores: list[Any]
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
        # moment its inputs exist (inline backends run tasks at submission: no overlap)
        previous: _Iteration | None = None
        self._last_done = time.perf_counter()
        for k in range(first, spec.iterations):
            if self.stop is not None and self.stop.is_set():
                in_flight = f"iteration {previous.index}" if previous else "nothing"
                self._say(f"rlhfflow: stopping: finishing {in_flight} in flight, then "
                          f"saving a checkpoint")
                break
            current = self._submit(k, previous)
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
                                              worker=self.addresses[w], priority=-k)
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

    def _submit(self, k: int, previous: _Iteration | None) -> _Iteration:
        """Submit every task of iteration ``k``; returns at once."""
        spec = self.pipeline.spec
        batch = self.source.batch(k)
        rows = len(batch["prompt_ids"])
        bounds = micro_batch_bounds(rows, spec.data.micro_batches)
        first = self.plan.stages[self.graph.loop_stages[0]]
        handles: dict[str, list[Any]] = {
            SOURCE: [self.backend.scatter(slice_batch(batch, a, b),
                                          self._address(first.worker(j)))
                     for j, (a, b) in enumerate(bounds)]}
        syncs: dict[str, list[Any]] = {}
        for name in self.graph.loop_stages:
            node, sp = self.graph.nodes[name], self.plan.stages[name]
            producers = list(dict.fromkeys(self.graph.producer(c, name) for c in node.reads))
            order: list[Any] = [a for a in node.after if a not in producers]
            order += [h for u in self.releases[name] for h in handles[u]]
            if previous is not None:
                order += [h for t in self.crossings[name] for h in previous.handles[t]]
                # a shadow copy is used only once the new weights are installed on it
                order += previous.syncs.get(node.model, [])
                if node.trains and previous.checkpoint and node.model in previous.checkpoint[1]:
                    # the update of k must not start before checkpoint k-1 saved the model
                    order += previous.checkpoint[1][node.model]
            retries = spec.stages[name].retries
            versions = {node.model: self.versions[node.model]} if node.model else None
            if node.per_batch:
                parts = [part(handles[p]) for p in producers]
                deps = [h for a in order for h in (handles[a] if isinstance(a, str) else [a])]
                if sp.gang:
                    handles[name] = self._submit_gang(name, k, parts, deps, versions)
                else:
                    handles[name] = [self.backend.submit(
                        stage_task, name, k, parts, deps, versions,
                        key=f"{name}-{k}-{_token()}", worker=self._address(sp.worker(0)),
                        retries=retries, priority=-k)]
                if node.trains:
                    self.versions[node.model] += 1
                    syncs.update(self._submit_syncs(name, k, handles[name]))
                continue
            handles[name] = []
            for j, (a, b) in enumerate(bounds):
                parts = [self._mb_part(handles, p, j, a, b) for p in producers]
                deps = [h for x in order
                        for h in (self._mb_handles(handles, x, j) if isinstance(x, str)
                                  else [x])]
                handles[name].append(self.backend.submit(
                    stage_task, name, k, parts, deps, versions,
                    key=f"{name}-{k}-{j}-{_token()}", worker=self._address(sp.worker(j)),
                    retries=retries, priority=-k))
        stores = self._submit_stores(k, rows, bounds, batch, handles)
        checkpoint = None
        if self._checkpoint_due(k):
            trainers = {m: [h for t in self.graph.trainers(m) if t in handles
                            for h in handles[t]] for m in self._loop_trained()}
            checkpoint = self._submit_checkpoint(k, trainers)
        return _Iteration(k, handles, stores, checkpoint, syncs)

    def _submit_gang(self, name: str, k: int, parts: list, deps: list,
                     versions: dict[str, int]) -> list[Any]:
        """One task per worker of a gang, one rank each. A gang waits for the previous
        gang on the same workers, so two gangs never hold each other's workers while
        waiting in a collective (a deadlock with one thread each)."""
        sp = self.plan.stages[name]
        members = [self.addresses[w] for w in sp.workers]
        deps = deps + self._gang_tail.get(sp.workers, [])
        # no retries: one rank retried alone would wait for peers that already finished
        tasks = [self.backend.submit(stage_task, name, k, parts, deps, versions,
                                     tuple(members), key=f"{name}-{k}-r{rank}-{_token()}",
                                     worker=address, priority=-k)
                 for rank, address in enumerate(members)]
        self._gang_tail[sp.workers] = tasks
        return tasks

    def _submit_syncs(self, trainer: str, k: int, trained: list[Any]) -> dict[str, list[Any]]:
        """Send the weights ``trainer`` produced to the model's shadow copies (parameter
        reallocation): one export at the home, one versioned install per shadow."""
        out = {}
        for t in self.plan.transfers_after(trainer):
            export = self.backend.submit(export_weights_task, t.model, k, trained,
                                         key=f"export-{k}-{_token()}",
                                         worker=self.addresses[t.source], priority=-k)
            out[t.model] = [self.backend.submit(
                install_weights_task, export, self.versions[t.model], k,
                key=f"realloc-{k}-{_token()}", worker=self.addresses[w], priority=-k)
                for w in t.targets]
        return out

    def _mb_part(self, handles, producer: str, j: int, a: int, b: int) -> dict[str, Any]:
        """Micro-batch ``j`` of ``producer``'s output (a slice of a whole-batch output)."""
        if producer == SOURCE or not self.graph.nodes[producer].per_batch:
            return part([handles[producer][j]])
        return part(handles[producer], (a, b))

    def _mb_handles(self, handles, stage: str, j: int) -> list[Any]:
        """What micro-batch ``j`` waits for of ``stage``: its own micro-batch, or all of
        a whole-batch stage."""
        if stage == SOURCE or not self.graph.nodes[stage].per_batch:
            return [handles[stage][j]]
        return list(handles[stage])

    def _submit_stores(self, k, rows, bounds, batch, handles) -> list[Any]:
        """Create the iteration's arrays (coordinator) and one store task per micro-batch."""
        lengths = {"prompt": batch["prompt_ids"].shape[1], "response": self._response_len()}
        schema = {c: ColumnSpec(col.dtype, (lengths[col.length],) if col.length else ())
                  for c, col in self.stored.items()}
        chunk = bounds[0][1] - bounds[0][0]
        self.buffer.begin_iteration(k, rows, schema, chunk_rows=chunk,
                                    attrs={"pipeline": self.pipeline.name})
        stores = []
        for j, (a, b) in enumerate(bounds):
            parts = [self._mb_part(handles, w, j, a, b) for w in self.writers]
            stores.append(self.backend.submit(
                store_task, str(self.out / "buffer.zarr"), k, a, parts, list(self.stored),
                key=f"store-{k}-{j}-{_token()}", priority=-k))
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
        now = time.perf_counter()
        record = self._record(it, partials, train_stats, now - self._last_done, moved)
        self._last_done = now
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
            stage = exc.key.split("-")[0]
            if _is_disk_full(exc.cause):
                raise RunError(_disk_full(exc.cause, f"stage {stage!r}")) from None
            where = f" in iteration {iteration}" if iteration is not None else " (setup)"
            retries = self.pipeline.spec.stages[stage].retries if stage in \
                self.pipeline.spec.stages else 0
            tried = f" after {retries + 1} attempts" if retries else ""
            raise RunError(f"stage {stage!r} failed{where}{tried}: "
                           f"{type(exc.cause).__name__}: {exc.cause}") from exc.cause
        if not gather:
            return {}
        return dict(zip(handles, self.backend.gather(list(handles.values())), strict=True))

    # ----------------------------------------------------------------- metrics
    def _collect_timings(self) -> None:
        # timings are diagnostics: a worker that died with its timings loses them
        for intervals in self.backend.run_on_workers(pop_timings).values():
            for iteration, stage, start, stop in intervals:
                self.timings[iteration][stage] += stop - start

    def _record(self, it: _Iteration, partials: list[dict[str, float]],
                train: dict[str, dict[str, Any]], iteration_s: float,
                moved: list[dict[str, float]]) -> dict[str, Any]:
        self._collect_timings()
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
        return {
            "iteration": it.index, "samples": int(n),
            "samples_skipped": int(total.get("skipped", 0)),
            "reward_mean": mean, "reward_std": std, "kl_mean": kl_mean,
            "policy_loss": stats.get("policy_loss"), "value_loss": stats.get("value_loss"),
            "clip_frac": stats.get("clip_frac"), "approx_kl": stats.get("approx_kl"),
            "response_length_mean": total["length_sum"] / n if n else None,
            "tokens_generated": int(total["tokens"]),
            "iteration_s": round(iteration_s, 4),
            "stage_s": {k: round(v, 4) for k, v in self.timings.pop(it.index, {}).items()},
            "realloc_bytes": int(sum(m["nbytes"] for m in moved)),
            "realloc_s": round(max((m["seconds"] for m in moved), default=0.0), 4),
            "train": train,
        }

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
