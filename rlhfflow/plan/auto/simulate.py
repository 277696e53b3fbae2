"""The planner's simulator: walks the task specs a plan compiles to, with durations from
the cost model, the way Dask runs them.

Each device worker runs one task at a time; among the ready tasks a free worker takes the
one with the highest priority (then the earliest submitted), as Dask's scheduler does; a
task restricted to workers waits for one of them, an unrestricted one runs where most of
its inputs are. A dependency adds Dask's latency, and a transfer when the producer ran on
another worker. The ranks of a gang hold their workers from their own start until the
whole gang is done (they meet in collectives). On a layout whose workers' threads
fill every core, tasks are slowed by the coordinator (``contention``) only while the
computing workers fill them, and run at full speed otherwise (their ends re-estimated
when that changes). Iterations are released in the run loop's
order (``loop_steps``): the tasks compiled after iteration j's finish wait for it plus the
coordinator's time to finish an iteration. The predicted iteration time is the mean gap
between consecutive iteration finishes over the steady ones (not the first or last), as
``rlhfflow run`` measures it.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field
from functools import singledispatch
from typing import TYPE_CHECKING

from rlhfflow.plan.auto.costmodel import CostModel
from rlhfflow.plan.compiler import compile_run
from rlhfflow.plan.tasks import (
    CheckpointTask,
    ExportTask,
    InstallTask,
    SourceTask,
    StageTask,
    StoreTask,
    Task,
)

if TYPE_CHECKING:
    from rlhfflow.config.pipeline import Pipeline
    from rlhfflow.plan.placement import ExecutionPlan


@dataclass
class Simulation:
    """The outcome of simulating a plan: per task its worker and interval, per iteration
    its finish time, and the steady iteration time."""

    intervals: dict[str, tuple[int, float, float]] = field(default_factory=dict)
    finishes: dict[int, float] = field(default_factory=dict)
    iteration_s: float = 0.0
    busy_frac: list[float] = field(default_factory=list)
    specs: list[Task] = field(default_factory=list)

    def timeline(self, iteration: int, n_workers: int, width: int = 64) -> list[str]:
        """A text Gantt chart of ``iteration`` per worker: one letter per stage."""
        start = self.finishes.get(iteration - 1, 0.0)
        stop = self.finishes.get(iteration, start)
        span = max(stop - start, 1e-9)
        letters: dict[str, str] = {}
        rows = [["."] * width for _ in range(n_workers)]
        by_id = {s.id: s for s in self.specs}
        for task_id, (w, a, b) in sorted(self.intervals.items(), key=lambda x: x[1][1]):
            if w < 0 or b <= start or a >= stop:
                continue
            label = by_id[task_id].label
            letter = letters.setdefault(label, _letter(label, letters))
            lo = int((max(a, start) - start) / span * width)
            hi = max(lo + 1, int((min(b, stop) - start) / span * width))
            for x in range(lo, min(hi, width)):
                rows[w][x] = letter
        lines = [f"  w{w:<3}|{''.join(r)}|" for w, r in enumerate(rows)]
        legend = ", ".join(f"{v} {k}" for k, v in letters.items())
        lines.append(f"  {'':4} 0{'':{width - 8}}{span:6.2f}s")
        lines.append(f"  legend: {legend}")
        return lines


def _letter(label: str, used: dict[str, str]) -> str:
    taken = set(used.values())
    for c in label.replace("+", "").replace("_", "") + "abcdefghijklmnopqrstuvwxyz":
        for candidate in (c.upper(), c.lower()):
            if candidate not in taken:
                return candidate
    return "#"


def simulate(pipeline: Pipeline, plan: ExecutionPlan, cost: CostModel, threads: int,
             iterations: int = 6, rows: int | None = None, contended: bool = False
             ) -> Simulation:
    """Simulate ``iterations`` iterations of ``pipeline`` under ``plan`` with ``threads``
    torch threads per worker, on cores shared with the coordinator (``contended``) or
    not."""
    versions = {m: 0 for m in pipeline.spec.models}
    specs, gates = compile_run(pipeline, plan, versions, iterations, rows=rows)
    return _run(specs, gates, plan.n_workers, cost, threads, iterations, contended,
                pipeline.spec.checkpoint.every)


@singledispatch
def _duration(spec: Task, cost: CostModel, threads: int, contended: bool) -> float:
    return 0.0  # a source task: the prompts are placed, not computed


@_duration.register
def _(spec: StageTask, cost: CostModel, threads: int, contended: bool) -> float:
    rows = spec.rows[1] - spec.rows[0]
    gang = len(spec.gang) if spec.gang else 1
    store = cost.stage_seconds("store", rows, threads, contended=contended) \
        if spec.stores else 0.0
    return store + sum(cost.stage_seconds(s, rows, threads, gang, contended)
                       for s in spec.stages)


@_duration.register
def _(spec: StoreTask, cost: CostModel, threads: int, contended: bool) -> float:
    return cost.stage_seconds("store", spec.rows[1] - spec.rows[0], threads,
                              contended=contended)


@_duration.register(ExportTask)
@_duration.register(InstallTask)
def _(spec: ExportTask | InstallTask, cost: CostModel, threads: int, contended: bool
      ) -> float:
    shape = cost.shapes.get(spec.model)
    return cost.transfer_seconds(shape.moved_bytes if shape else 0) / 2


@_duration.register
def _(spec: CheckpointTask, cost: CostModel, threads: int, contended: bool) -> float:
    return cost.checkpoint_seconds(spec.model)


def _amortized(iterations: list[int], gaps: list[float], saved: set[int], every: int
               ) -> float:
    """The mean iteration time with one checkpoint per ``every`` iterations, from
    simulated ``gaps`` (of ``iterations``, checkpointed where in ``saved``): the median
    gap of iterations neither saving nor right after a save, plus the window's time
    beyond that per checkpoint in it, spread over ``every`` iterations. (A short window
    would otherwise weigh a checkpoint by its own length: one in 4 gaps instead of 5.)"""
    plain = sorted(g for k, g in zip(iterations, gaps, strict=True)
                   if k not in saved and k - 1 not in saved)
    count = sum(1 for k in iterations if k in saved)
    if not plain or not count:
        return sum(gaps) / len(gaps)
    base = plain[len(plain) // 2]
    return base + (sum(gaps) - base * len(gaps)) / (count * every)


def _run(specs: list[Task], gates: list[int | None], n_workers: int, cost: CostModel,
         threads: int, iterations: int, contended: bool = False,
         checkpoint_every: int = 0) -> Simulation:
    simulator = _Simulator(specs, gates, n_workers, cost, threads, contended)
    simulator.run()
    return _summarize(simulator.sim, simulator.busy_time, checkpoint_every)


@dataclass
class _Job:
    """A running task, or a gang's ranks: the work it has ``left`` at full speed as of
    ``since``, and how much longer it takes slowed (``ratio``)."""

    ids: list[str]
    workers: list[int]
    left: float
    since: float
    ratio: float
    order: int
    #: bumped at each end estimate: an event of an older one is stale
    version: int = 0


class _Simulator:
    """One simulation's state (the workers, the tasks waiting, ready and running), changed
    by one method per event: tasks released by an iteration's finish (``release``), a task
    done (``complete``), tasks started on free workers (``dispatch``), running tasks'
    ends (``end``); ``run`` advances the clock from one event to the next."""

    def __init__(self, specs: list[Task], gates: list[int | None], n_workers: int,
                 cost: CostModel, threads: int, contended: bool) -> None:
        self.specs = specs
        self.n_workers, self.cost, self.threads, self.contended = \
            n_workers, cost, threads, contended
        self.sim = Simulation(specs=specs)
        self.index = {s.id: i for i, s in enumerate(specs)}
        self.spec_of = {s.id: s for s in specs}
        self.allowed_of = {s.id: frozenset(s.workers) if s.workers else None for s in specs}
        self.move_of = {s.id: cost.transfer_seconds(cost.result_bytes(s.rows[1] - s.rows[0]))
                        for s in specs}
        self.remaining = {s.id: len(s.needs()) for s in specs}
        self.users: dict[str, list[str]] = defaultdict(list)
        for s in specs:
            for r in s.needs():
                self.users[r].append(s.id)
        self.per_iteration: dict[int, int] = defaultdict(int)
        for s in specs:
            if not isinstance(s, SourceTask):
                self.per_iteration[s.iteration] += 1
        self.gated: dict[int | None, list[str]] = defaultdict(list)
        for s, g in zip(specs, gates, strict=True):
            self.gated[g].append(s.id)
        self.released: set[str] = set()
        self.ready_at: dict[str, float] = {}  # task -> when its inputs are all there
        self.where: dict[str, int] = {}  # task -> worker it ran on
        self.ready: list[tuple[int, int, str]] = []  # (-priority, order, id)
        self.pending: list[tuple[float, int, str]] = []  # (time it becomes ready, order, id)
        # (end time, order, running key, version): an end is stale once the speed changed
        self.events: list[tuple[float, int, str, int]] = []
        # holding a task (a gang rank waiting for its peers too)
        self.busy = [False] * n_workers
        self.computing: set[int] = set()  # workers whose task computes now
        self.running: dict[str, _Job] = {}  # task (or gang) -> its remaining work
        self.started: dict[str, float] = {}
        self.busy_time = [0.0] * n_workers
        self.gang_started: dict[tuple[int, tuple[str, ...], tuple[int, ...]], list[str]] = \
            defaultdict(list)
        self.done_count: dict[int, int] = defaultdict(int)
        self.now = 0.0

    def run(self) -> None:
        """Release the ungated tasks, then move from event to event until none is left."""
        self.release(self.gated.get(None, []), 0.0)
        while self.pending or self.ready or self.events:
            while self.pending and self.pending[0][0] <= self.now + 1e-12:
                _, order, i = heapq.heappop(self.pending)
                heapq.heappush(self.ready, (-self.specs[order].priority, order, i))
            self.dispatch()
            # advance to the next end or readiness
            while self.events and self.events[0][3] != self._version(self.events[0][2]):
                heapq.heappop(self.events)  # an end estimated before the speed changed
            times = [t for t in (self.events[0][0] if self.events else None,
                                 self.pending[0][0] if self.pending else None)
                     if t is not None]
            if not times:
                break  # nothing can move (cannot happen for a compiled run)
            self.now = max(self.now, min(times))
            ended = []
            while self.events and self.events[0][0] <= self.now + 1e-12:
                _, _, key, version = heapq.heappop(self.events)
                if self._version(key) == version:
                    ended.append(key)
            if ended:
                self.end(ended)

    def _version(self, key: str) -> int | None:
        job = self.running.get(key)
        return job.version if job is not None else None

    def release(self, ids: list[str], at: float) -> None:
        """An iteration's finish at ``at`` lets ``ids`` (compiled after it) run."""
        for i in ids:
            self.released.add(i)
            if self.remaining[i] == 0:
                heapq.heappush(self.pending, (max(at, self.ready_at.get(i, 0.0)),
                                              self.index[i], i))

    def complete(self, task_id: str, t: float) -> None:
        """Task ``task_id`` is done at ``t``: its iteration may finish, and its users'
        inputs arrive after Dask's latency (and a transfer, from another worker)."""
        spec = self.spec_of[task_id]
        moving = not isinstance(spec, SourceTask)
        if moving:
            self.done_count[spec.iteration] += 1
            if self.done_count[spec.iteration] == self.per_iteration[spec.iteration]:
                end = t + self.cost.device["finish_s"]
                self.sim.finishes[spec.iteration] = end
                self.release(self.gated.get(spec.iteration, []), end)
        w = self.where.get(task_id, -1)
        latency = self.cost.device["latency_s"]
        here, there = t + latency, t + latency + self.move_of[task_id]
        for u in self.users[task_id]:
            self.remaining[u] -= 1
            allowed = self.allowed_of[u]
            at = there if moving and allowed is not None and w not in allowed else here
            if at > self.ready_at.get(u, 0.0):
                self.ready_at[u] = at
            if self.remaining[u] == 0 and u in self.released:
                heapq.heappush(self.pending, (self.ready_at[u], self.index[u], u))

    def dispatch(self) -> None:
        """Start every ready task that finds a free worker, highest priority first."""
        skipped = []
        while self.ready:
            item = heapq.heappop(self.ready)
            spec = self.specs[item[1]]
            if isinstance(spec, SourceTask):
                self.complete(spec.id, self.now)
                continue
            w = self.choose(spec)
            if w is None:
                skipped.append(item)
                continue
            self.busy[w] = True
            self.where[spec.id] = w
            # a gang's rank computes once every rank is there (they meet in collectives)
            if isinstance(spec, StageTask) and spec.gang:
                group = (spec.iteration, spec.stages, spec.gang)
                self.gang_started[group].append(spec.id)
                if len(self.gang_started[group]) == len(spec.gang):
                    ranks = self.gang_started.pop(group)
                    self.start(spec.id, spec, ranks, [self.where[r] for r in ranks])
                continue
            self.start(spec.id, spec, [spec.id], [w])
        for item in skipped:
            heapq.heappush(self.ready, item)

    def choose(self, spec: Task) -> int | None:
        """The free worker ``spec`` runs on (one it is restricted to, else the one with
        most of its inputs), or None."""
        allowed = spec.workers or tuple(range(self.n_workers))
        free = [w for w in allowed if not self.busy[w]]
        if not free:
            return None
        if not spec.workers:  # next to most of its inputs
            votes: dict[int, int] = defaultdict(int)
            for r in spec.needs():
                if r in self.where:
                    votes[self.where[r]] += 1
            return max(free, key=lambda w: (votes.get(w, 0), -w))
        return free[0]

    def start(self, key: str, spec: Task, ids: list[str], workers: list[int]) -> None:
        """``ids`` (one task, or a gang's ranks on ``workers``) start computing now."""
        fast = _duration(spec, self.cost, self.threads, False)
        slow = _duration(spec, self.cost, self.threads, True) if self.contended else fast
        was = self.crowded()
        job = self.running[key] = _Job(ids, workers, left=fast, since=self.now,
                                       ratio=slow / fast if fast > 0 else 1.0,
                                       order=self.index[ids[0]])
        self.computing.update(workers)
        for i in ids:
            self.started[i] = self.now
        self.push_end(key, job, self.crowded())
        self.respeed(was)

    def end(self, keys: list[str]) -> None:
        """The running ``keys`` end now: their workers are free, their tasks done."""
        was = self.crowded()
        done = []
        for key in keys:
            job = self.running.pop(key)
            self.computing.difference_update(job.workers)
            for i in job.ids:
                w = self.where[i]
                self.busy[w] = False
                self.sim.intervals[i] = (w, self.started[i], self.now)
                self.busy_time[w] += self.now - self.started[i]
                done.append(i)
        self.respeed(was)
        for i in done:
            self.complete(i, self.now)

    def crowded(self) -> bool:
        """Whether the computing workers' threads fill every core, so that the tasks
        share them with the coordinator (on a contended layout). One worker of two
        computing leaves the coordinator a core of its own: the tasks of an interleaved
        plan mostly run so, measured as fast as alone."""
        return self.contended and len(self.computing) * self.threads >= self.cost.cores

    def push_end(self, key: str, job: _Job, slowed: bool) -> None:
        """Estimate ``job``'s end from now at the speed ``slowed`` says."""
        job.version += 1
        end = self.now + max(0.0, job.left) * (job.ratio if slowed else 1.0)
        heapq.heappush(self.events, (end, job.order, key, job.version))

    def respeed(self, was: bool) -> None:
        """After the computing workers changed: if that changed whether the cores are
        shared, progress every running task's work to now at the old speed and
        estimate its end at the new one (only then: ends otherwise stand)."""
        slowed = self.crowded()
        if slowed == was:
            return
        for key, job in self.running.items():
            job.left -= (self.now - job.since) / (job.ratio if was else 1.0)
            job.since = self.now
            self.push_end(key, job, slowed)


def _summarize(sim: Simulation, busy_time: list[float], checkpoint_every: int
               ) -> Simulation:
    """``sim`` with its iteration time (steady gaps between finishes, checkpoints
    amortized) and each worker's busy share."""
    specs = sim.specs
    finishes = [sim.finishes[k] for k in sorted(sim.finishes)]
    gaps = [b - a for a, b in zip(finishes, finishes[1:], strict=False)]
    steady = gaps[:-1] if len(gaps) > 1 else gaps  # as the run: not the last iteration
    sim.iteration_s = sum(steady) / len(steady) if steady else (finishes[-1] if finishes else 0)
    saved = {s.iteration for s in specs if isinstance(s, CheckpointTask)}
    if steady and saved and checkpoint_every > 1:
        sim.iteration_s = _amortized(sorted(sim.finishes)[1:len(steady) + 1], steady, saved,
                                     checkpoint_every)
    total = finishes[-1] if finishes else 1.0
    sim.busy_frac = [round(b / max(total, 1e-9), 4) for b in busy_time]
    return sim
