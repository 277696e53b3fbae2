"""Plans compile to data: every iteration becomes a list of typed tasks (``tasks``).

``TaskCompiler`` holds the dependency rules (streaming micro-batches, fusion, the model
edges within and across iterations, bounded staleness, gangs, shadows), each wait
recorded with its rule, and nothing else. ``schedule`` is the one order in which a run
compiles and finishes its iterations: the runtime submits its steps to Dask, and the
planner's simulator walks the same steps with estimated durations, so what is predicted
is what runs. No Dask here, so the rules are unit-tested in milliseconds.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from rlhfflow.config.graph import SOURCE
from rlhfflow.plan.loop import loop_steps
from rlhfflow.plan.placement import ExecutionPlan, inputs_of
from rlhfflow.plan.tasks import (
    AFTER,
    AHEAD_RELEASE,
    AHEAD_USERS,
    CHECKPOINT_LEVEL,
    GANG,
    INSTALLED,
    RELEASE,
    SAVED,
    SEQUENTIAL,
    STORE_LEVEL,
    TRAINED,
    TRANSFER_LEVEL,
    UPDATED,
    CheckpointTask,
    ExportTask,
    InstallTask,
    Part,
    Rule,
    SourceTask,
    StageTask,
    Storage,
    StoreTask,
    Task,
    Wait,
    priority,
)

if TYPE_CHECKING:
    from rlhfflow.config.graph import StageGraph
    from rlhfflow.config.pipeline import Pipeline

# what a task runs (each a type in ``rlhfflow.plan.tasks``; these are their ``kind``)
SOURCE_KIND, STAGE, STORE, EXPORT, INSTALL, CHECKPOINT = (
    SourceTask.kind, StageTask.kind, StoreTask.kind, ExportTask.kind, InstallTask.kind,
    CheckpointTask.kind)


def micro_batch_bounds(rows: int, micro_batches: int) -> list[tuple[int, int]]:
    """Contiguous ``(start, stop)`` row ranges of equal size (the last may be shorter);
    the size is the zarr chunk, so every micro-batch writes its own chunks."""
    size = -(-rows // max(1, min(micro_batches, rows)))
    return [(a, min(rows, a + size)) for a in range(0, rows, size)]


@dataclass
class IterationTasks:
    """The ids of one compiled iteration, by what later compilation refers to."""

    index: int
    rows: int
    bounds: dict[str, list[tuple[int, int]]]  # stage -> its micro-batches' rows
    handles: dict[str, list[str]] = field(default_factory=dict)  # stage -> task ids
    stores: list[str] = field(default_factory=list)  # per source micro-batch, in order
    stored_by: dict[tuple[int, int], str] = field(default_factory=dict)  # rows -> task
    syncs: dict[str, list[str]] = field(default_factory=dict)  # model -> install ids
    checkpoint: dict[str, list[str]] | None = None  # model -> checkpoint task ids

    def task_ids(self) -> list[str]:
        """The ids of every stage task of the iteration (its source excluded)."""
        return [i for n, ids in self.handles.items() if n != SOURCE for i in ids]


class TaskCompiler:
    """Compiles a pipeline's iterations under an execution plan into task specs.

    Stateful in the two things that carry across iterations: the version each model will
    have once the tasks compiled so far have run (``versions``), and the last gang
    compiled on each worker set (a gang waits for the previous one on the same workers).
    """

    def __init__(self, pipeline: Pipeline, plan: ExecutionPlan, versions: Mapping[str, int]
                 ) -> None:
        self.pipeline = pipeline
        self.graph = pipeline.graph
        self.plan = plan
        self.versions = dict(versions)
        self._gang_tail: dict[tuple[int, ...], list[str]] = {}
        self.releases: dict[str, list[str]] = defaultdict(list)  # trainer -> its users
        for user, trainer in self.graph.release_edges():
            self.releases[trainer].append(user)
        # trainer -> the stages that run ahead (max_staleness) on its model: iteration
        # k+lag's use of the weights of k must come before the update of k, upstream of
        # it in the iteration or not (generate is upstream of train_actor in its own
        # iteration, never in the next one's)
        self.ahead_users: dict[str, list[str]] = {
            t: [u for u in self.graph.users(self.graph.model_of(t), self.graph.loop_stages)
                if u != t and plan.stages[u].lag > 0]
            for t in self.graph.loop_stages if self.graph.nodes[t].trains}
        self.crossings: dict[str, list[str]] = defaultdict(list)  # user -> last trainers
        for trainer, user in self.graph.cross_iteration_edges():
            self.crossings[user].append(trainer)
        self.rank = upward_rank(self.graph)
        self.writers = [SOURCE] + [n for n in self.graph.loop_stages
                                   if self.graph.nodes[n].writes]

    # ----------------------------------------------------------------- iterations
    def begin(self, k: int, rows: int) -> tuple[IterationTasks, list[SourceTask]]:
        """Iteration ``k`` of ``rows`` rows: its micro-batch bounds per stage, and one
        source task per source micro-batch, placed next to the first stage's tasks."""
        data = self.pipeline.spec.data
        assert data is not None  # a pipeline with loop stages has a data section
        bounds = {SOURCE: micro_batch_bounds(rows, data.micro_batches)}
        for name, sp in self.plan.stages.items():
            if sp.micro_batches is not None:
                bounds[name] = micro_batch_bounds(rows, sp.micro_batches)
        first = self.plan.stages[self.graph.loop_stages[0]]
        specs = []
        for j, (a, b) in enumerate(bounds[SOURCE]):
            w = first.worker(j)
            specs.append(SourceTask(id=f"{SOURCE}-{k}-{j}", iteration=k, rows=(a, b),
                                    workers=() if w is None else (w,)))
        it = IterationTasks(k, rows, bounds, {SOURCE: [s.id for s in specs]})
        return it, specs

    def stages(self, it: IterationTasks, previous: IterationTasks | None, ahead: bool,
               later: IterationTasks | None = None) -> list[Task]:
        """The stage tasks of iteration ``it`` that run ahead (``ahead=True``: the
        generating model's inference with max_staleness > 0) or all the others.
        ``later`` is the iteration whose ahead stages were compiled last: this
        iteration's trainers (and weight installs) must wait for them, as they use the
        weights from before this update."""
        spec, k, handles = self.pipeline.spec, it.index, it.handles
        out: list[Task] = []
        for name in self.graph.loop_stages:
            sp = self.plan.stages[name]
            if name in handles or (sp.lag > 0) != ahead:
                continue
            group = self.plan.group(name)
            order = self._order(group, it, previous, later)
            retries = max(spec.stages[n].retries for n in group)
            nodes = [self.graph.nodes[n] for n in group]
            versions = {n.model: self.versions[n.model] for n in nodes if n.model}
            level = max(self.rank[n] for n in group)
            tasks = self._stage_tasks(group, it, order, versions, priority(k, level), retries)
            if self._stores_itself(group):
                tasks = [self._storing(t, group, it) for t in tasks]
            out += tasks
            ids = [t.id for t in tasks]
            for n, node in zip(group, nodes, strict=True):
                handles[n] = ids
                if node.trains:
                    self.versions[self.graph.model_of(n)] += 1
                    syncs = self._syncs(n, k, ids, later)
                    out += syncs
                    for s in syncs:
                        if isinstance(s, InstallTask):
                            it.syncs.setdefault(s.model, []).append(s.id)
        if not ahead and len(out) == 1 and isinstance(out[0], StageTask) and out[0].stores \
                and self.plan.n_workers == 1 and set(it.task_ids()) == {out[0].id}:
            # the whole iteration is this task on the only worker (no idle peer that
            # finished rows it handed over): its worker's timings are all of the
            # iteration's, and they come back with its result
            out = [replace(out[0], reports=True)]
        return out

    def _stores_itself(self, group: tuple[str, ...]) -> bool:
        """Whether the tasks of ``group`` write their own rows to the buffer: the group
        holds every stage that writes columns (so a store would read this task alone),
        and runs in its iteration's main turn (the coordinator creates the iteration's
        arrays before submitting it), not as a gang, not under ``sequential``."""
        sp = self.plan.stages[group[0]]
        return (not self.plan.sequential and not sp.gang and sp.lag == 0
                and set(self.writers[1:]) <= set(group))

    def _storing(self, task: StageTask, group: tuple[str, ...], it: IterationTasks
                 ) -> StageTask:
        """``task`` storing its rows itself, when they are one source micro-batch's."""
        if task.rows not in it.bounds[SOURCE]:
            return task
        it.stored_by[task.rows] = task.id
        # a stage outside the group reading what the group wrote needs the columns
        read = any(self.graph.producer(c, n) in group
                   for n in self.graph.loop_stages if n not in group
                   for c in self.graph.nodes[n].reads)
        return replace(task, storage=Storage.STAGE_TASK if read
                       else Storage.STAGE_TASK_NO_COLUMNS)

    def _order(self, group: tuple[str, ...], it: IterationTasks,
               previous: IterationTasks | None, later: IterationTasks | None) -> list[Wait]:
        """What a task of ``group`` waits for besides its inputs: the model edges."""
        order: list[Wait] = []
        for n in group:
            node = self.graph.nodes[n]
            for user in self.releases[n]:  # a trainer waits for the users of its model
                # fused before it (they run first in its own task), or run ahead (below)
                if user not in group and self.plan.stages[user].lag == 0:
                    order += _waits(it.handles[user], RELEASE, node.model)
            for user in self.ahead_users.get(n, ()):
                if later is not None and self._at_home(user):
                    order += _waits(later.handles[user], AHEAD_RELEASE, node.model)
            if previous is not None:
                order += [Wait(h, UPDATED, self.graph.nodes[t].model)
                          for t in self.crossings[n] for h in previous.handles[t]]
                # a shadow copy is used only once the new weights are installed on it
                for model in (node.model, *node.uses):
                    if model is not None:  # a model-free stage waits for no install
                        order += _waits(previous.syncs.get(model, []), INSTALLED, model)
                if node.trains and previous.checkpoint and \
                        node.model in previous.checkpoint:
                    # the update of k must not start before checkpoint k-1 saved it
                    order += _waits(previous.checkpoint[node.model], SAVED, node.model)
        if self.plan.sequential:
            order += _waits(self._barrier(it, group[0], previous), SEQUENTIAL)
        return order

    def _stage_tasks(self, group: tuple[str, ...], it: IterationTasks, order: list[Wait],
                     versions: dict[str, int], priority: int, retries: int
                     ) -> list[StageTask]:
        """The tasks of one stage group: one per micro-batch, one for the whole batch, or
        one per rank of a gang."""
        name, k = group[0], it.index
        sp = self.plan.stages[name]
        inputs = list(dict.fromkeys(x for n in group for x in inputs_of(self.graph, n)
                                    if x not in group))
        producers = list(dict.fromkeys(
            p for n in group for c in self.graph.nodes[n].reads
            # every column read has a producer: the spec refuses one nothing writes
            if (p := self.graph.producer(c, n)) is not None and p not in group))
        label = "+".join(group)
        # a stream starts episodes up to max_staleness ahead; one that reorders rows
        # may owe episodes as far behind
        ahead = self.plan.max_staleness if any(self.graph.nodes[n].streams for n in group) \
            else 0
        behind = ahead if any(self.graph.nodes[n].reorders for n in group) else 0
        streams = ahead
        if sp.micro_batches is None:
            parts = tuple(Part(tuple(it.handles[p])) for p in producers)
            waits = order + [Wait(h, AFTER) for x in inputs if x not in producers
                             for h in it.handles[x]]
            if sp.gang:
                return self._gang(name, k, parts, waits, versions, priority, it.rows)
            # a fused whole-batch group runs where its stages with a model run
            workers = next((w for n in group if (w := self.plan.stages[n].workers)), ())
            return [StageTask(id=f"{label}-{k}", iteration=k, stages=group, parts=parts,
                              waits=_unique(waits), workers=workers[:1], priority=priority,
                              retries=retries, rows=(0, it.rows), versions=versions,
                              ahead=ahead, behind=behind)]
        tasks = []
        for j, (a, b) in enumerate(it.bounds[name]):
            row_parts: list[Part] = []
            waits = list(order)
            for x in inputs:
                part, refs = self.rows_of(it, x, a, b)
                if x in producers:
                    row_parts.append(part)
                else:
                    waits += _waits(refs, AFTER)
            if SOURCE in producers:
                row_parts.append(self.rows_of(it, SOURCE, a, b)[0])
            # a stream's episodes stay on their worker: micro-batch j always runs there
            pinned = sp.worker(j) if streams else None
            tasks.append(StageTask(id=f"{label}-{k}-{j}", iteration=k, stages=group,
                                   parts=tuple(row_parts), waits=_unique(waits),
                                   workers=sp.workers if pinned is None else (pinned,),
                                   priority=priority, retries=retries, rows=(a, b),
                                   versions=versions, ahead=ahead, behind=behind))
        return tasks

    def _gang(self, name: str, k: int, parts: tuple[Part, ...], waits: list[Wait],
              versions: dict[str, int], priority: int, rows: int) -> list[StageTask]:
        """One task per worker of a gang, one rank each. A gang waits for the previous
        gang on the same workers, so two gangs never hold each other's workers while
        waiting in a collective (a deadlock with one thread each). No retries: one rank
        retried alone would wait for peers that already finished."""
        sp = self.plan.stages[name]
        waits = waits + _waits(self._gang_tail.get(sp.workers, []), GANG)
        tasks = [StageTask(id=f"{name}-{k}-r{rank}", iteration=k, stages=(name,), parts=parts,
                           waits=_unique(waits), workers=(w,), priority=priority, retries=0,
                           rows=(0, rows), versions=versions, gang=sp.workers, rank=rank)
                 for rank, w in enumerate(sp.workers)]
        self._gang_tail[sp.workers] = [t.id for t in tasks]
        return tasks

    def _syncs(self, trainer: str, k: int, trained: list[str],
               later: IterationTasks | None) -> list[Task]:
        """Send the weights ``trainer`` produced to the model's shadow copies (parameter
        reallocation): one export at the home, one versioned install per shadow, after
        the stages running ahead on that shadow (they use the weights it has now)."""
        out: list[Task] = []
        first = priority(k, TRANSFER_LEVEL)
        for t in self.plan.transfers_after(trainer):
            # a sharded model: each rank exports its part, each shadow puts them together
            sources = self.plan.homes[t.model] if self.sharded(t.model) else (t.source,)
            exports = [ExportTask(id=f"export-{k}-{t.model}" + (f"-r{r}" if r else ""),
                                  iteration=k, parts=(Part(tuple(trained)),), workers=(w,),
                                  priority=first, model=t.model)
                       for r, w in enumerate(sources)]
            out += exports
            for w in t.targets:
                users = [h for n, sp in self.plan.stages.items()
                         if later is not None and sp.lag and w in sp.workers
                         and self.graph.nodes[n].model == t.model
                         for h in later.handles.get(n, [])]
                out.append(InstallTask(id=f"realloc-{k}-{t.model}-w{w}", iteration=k,
                                       parts=(Part(tuple(e.id for e in exports)),),
                                       waits=tuple(_waits(users, AHEAD_USERS, t.model)),
                                       workers=(w,), priority=first, model=t.model,
                                       version=self.versions[t.model]))
        return out

    def stores(self, it: IterationTasks) -> list[StoreTask]:
        """One store task per source micro-batch (chunk-aligned rows of the buffer), on
        any worker (next to its data), except where one stage task wrote all of its rows
        and stores them itself (``_stores_itself``); the coordinator creates the arrays
        first. ``it.stores`` lists, per source micro-batch in order, the task that stores
        it."""
        k = it.index
        # fused stages share their tasks: take each group's results once
        writers = list({id(it.handles[w]): w for w in self.writers}.values())
        # sequential: the stores are the iteration's last stage
        after = tuple(_waits(it.handles[self.graph.loop_stages[-1]], SEQUENTIAL)) \
            if self.plan.sequential else ()
        specs = []
        it.stores = []
        for j, (a, b) in enumerate(it.bounds[SOURCE]):
            if (a, b) in it.stored_by:  # its producer's task writes these rows itself
                it.stores.append(it.stored_by[(a, b)])
                continue
            parts = tuple(self.rows_of(it, w, a, b)[0] for w in writers)
            specs.append(StoreTask(id=f"store-{k}-{j}", iteration=k, parts=parts, waits=after,
                                   priority=priority(k, STORE_LEVEL), rows=(a, b)))
            it.stores.append(specs[-1].id)
        return specs

    def checkpoint(self, k: int, after: Mapping[str, list[str]]) -> list[CheckpointTask]:
        """Tasks saving every loop-trained model into checkpoint ``k``, each after
        ``after[model]`` (the iteration's training tasks of that model): rank 0 of its
        gang saves it, and every rank its ZeRO shard when DeepSpeed trains it (a sharded
        model: every rank its optimizer part, and all gather the weights rank 0 saves)."""
        specs = []
        for m in self.graph.loop_trained():
            home = self.plan.homes[m]
            ranks = home if self.deepspeed(m) or self.sharded(m) else home[:1]
            waits = _waits(after.get(m, []), TRAINED, m)
            if self.sharded(m):
                # its ranks gather the weights in collectives on the gang's workers: they
                # take their turn among the gangs there, or another model's gang would
                # interleave its collectives with theirs (gloo: a size mismatch, a crash)
                waits += _waits(self._gang_tail.get(home, []), GANG)
            tasks = [CheckpointTask(id=f"checkpoint-{k}-{m}-r{rank}", iteration=k,
                                    waits=tuple(_unique(waits)), workers=(w,),
                                    priority=priority(k, CHECKPOINT_LEVEL), model=m, rank=rank)
                     for rank, w in enumerate(ranks)]
            if self.sharded(m):
                self._gang_tail[home] = [t.id for t in tasks]
            specs += tasks
        return specs

    def iteration_checkpoint(self, it: IterationTasks) -> list[CheckpointTask]:
        """Checkpoint ``it`` after its training tasks, if one is due after it."""
        every = self.pipeline.spec.checkpoint.every
        if not (every > 0 and (it.index + 1) % every == 0):
            return []
        trainers = {m: [h for t in self.graph.trainers(m) if t in it.handles
                        for h in it.handles[t]] for m in self.graph.loop_trained()}
        specs = self.checkpoint(it.index, trainers)
        it.checkpoint = {}
        for s in specs:
            it.checkpoint.setdefault(s.model, []).append(s.id)
        return specs

    def setup(self) -> list[StageTask]:
        """The once-stages (SFT, reward model), each on the first worker of its model,
        after the setup stages it lists in ``after``."""
        return [StageTask(id=name, iteration=-1, stages=(name,),
                          waits=tuple(_waits(self.graph.nodes[name].after, AFTER)),
                          workers=self.plan.stages[name].workers[:1],
                          retries=self.pipeline.spec.stages[name].retries)
                for name in self.graph.setup_stages]

    # ----------------------------------------------------------------- helpers
    def rows_of(self, it: IterationTasks, stage: str, a: int, b: int
                ) -> tuple[Part, list[str]]:
        """Rows ``[a, b)`` of ``stage``'s output in iteration ``it``: the input of a task
        (the micro-batches holding those rows, and the rows to take of their
        concatenation) and the ids it waits for."""
        hs = it.handles[stage]
        if stage != SOURCE and self.graph.nodes[stage].per_batch:
            return Part(tuple(hs), (a, b)), list(hs)
        bounds = it.bounds[stage]
        js = [j for j, (pa, pb) in enumerate(bounds) if pa < b and pb > a]
        start, stop = bounds[js[0]][0], bounds[js[-1]][1]
        rows = None if (a, b) == (start, stop) else (a - start, b - start)
        chosen = [hs[j] for j in js]
        return Part(tuple(chosen), rows), chosen

    def _barrier(self, it: IterationTasks, name: str, previous: IterationTasks | None
                 ) -> list[str]:
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
        homes = self.plan.homes.get(model, ()) if model is not None else ()
        return bool(set(sp.workers) & set(homes))

    def sharded(self, model: str) -> bool:
        """Whether a loop stage trains ``model`` sharded over its gang (``backend: fsdp``)."""
        return self.pipeline.trains_sharded(model)

    def deepspeed(self, model: str) -> bool:
        """Whether a loop stage trains ``model`` with DeepSpeed (sharded optimizer)."""
        return any(self.pipeline.spec.stages[t].backend == "deepspeed"
                   for t in self.graph.trainers(model))


def _waits(ids: Iterable[str], rule: Rule, model: str | None = None) -> list[Wait]:
    return [Wait(i, rule, model) for i in ids]


def _unique(waits: list[Wait]) -> tuple[Wait, ...]:
    """``waits`` without repeats, in order; a task waited for by two rules keeps both (the
    runtime waits for it once: ``Task.wait_ids``)."""
    return tuple(dict.fromkeys(waits))


def upward_rank(graph: StageGraph) -> dict[str, int]:
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
    return {n: min(r, TRANSFER_LEVEL - 1) for n, r in out.items()}


# --------------------------------------------------------------------------- schedule


@dataclass(frozen=True)
class Start:
    """The turn of ``iteration`` begins: where a run may stop."""

    iteration: int


@dataclass(frozen=True)
class Begin:
    """Iteration ``it`` begins: its prompts (``source``, to be placed with the
    iteration's batch) and the stages that run ahead of it (``ahead``)."""

    it: IterationTasks
    source: list[SourceTask]
    ahead: list[Task]


@dataclass(frozen=True)
class Main:
    """The rest of iteration ``it``: its ``stages``, its ``stores`` (the buffer's arrays
    must exist before either is submitted: a stage task may store its own rows) and,
    when one is due, its ``checkpoint``."""

    it: IterationTasks
    stages: list[Task]
    stores: list[StoreTask]
    checkpoint: list[CheckpointTask]


@dataclass(frozen=True)
class Finish:
    """Wait for iteration ``it`` and log it."""

    it: IterationTasks


Step = Start | Begin | Main | Finish


def schedule(compiler: TaskCompiler, first: int, iterations: int, rows: int,
             pipelined: bool = True) -> Iterator[Step]:
    """The run's steps for iterations ``first..iterations-1``, each iteration compiled in
    the order of ``loop_steps``: the one order the runtime submits and the simulator
    predicts. ``rows`` is the size of every iteration's batch."""
    # keyed by iteration; a step's ``previous``/``later`` of None finds nothing
    live: dict[int | None, IterationTasks] = {}
    for step in loop_steps(first, iterations, compiler.plan.max_staleness, pipelined):
        k = step.iteration
        if step.kind == "start":
            yield Start(k)
        elif step.kind == "ahead":
            it, source = compiler.begin(k, rows)
            live[k] = it
            yield Begin(it, source, compiler.stages(it, live.get(step.previous), ahead=True))
        elif step.kind == "main":
            it = live[k]
            stages = compiler.stages(it, live.get(step.previous), ahead=False,
                                     later=live.get(step.later))
            yield Main(it, stages, compiler.stores(it), compiler.iteration_checkpoint(it))
        else:
            yield Finish(live.pop(k))


def batch_rows(pipeline: Pipeline) -> int:
    """Rows of every iteration's batch: prompts times samples per prompt."""
    data = pipeline.spec.data
    assert data is not None  # a pipeline with loop stages has a data section
    return data.batch_size * data.samples_per_prompt


def compile_run(pipeline: Pipeline, plan: ExecutionPlan, versions: Mapping[str, int],
                iterations: int, first: int = 0, rows: int | None = None
                ) -> tuple[list[Task], list[int | None]]:
    """Every task of iterations ``first..iterations-1`` in the order the runtime submits
    them (``schedule``) and, per task, the iteration whose finish the run waits for before
    submitting it (None: submitted at the start)."""
    compiler = TaskCompiler(pipeline, plan, versions)
    rows = rows if rows is not None else batch_rows(pipeline)
    specs: list[Task] = []
    gates: list[int | None] = []
    gate: int | None = None
    for step in schedule(compiler, first, iterations, rows):
        new: list[Task] = []
        if isinstance(step, Begin):
            new = [*step.source, *step.ahead]
        elif isinstance(step, Main):
            new = [*step.stages, *step.stores, *step.checkpoint]
        elif isinstance(step, Finish):
            gate = step.it.index
        specs += new
        gates += [gate] * len(new)
    return specs, gates


def by_id(specs: Sequence[Task]) -> dict[str, Task]:
    """Specs by id (ids are unique within a run)."""
    out: dict[str, Any] = {}
    for s in specs:
        if s.id in out:
            raise ValueError(f"task id {s.id!r} compiled twice")
        out[s.id] = s
    return out
