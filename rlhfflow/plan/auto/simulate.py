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
from typing import TYPE_CHECKING, Any

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
    d = cost.device
    sim = Simulation(specs=specs)
    index = {s.id: i for i, s in enumerate(specs)}
    remaining = {s.id: len(s.needs()) for s in specs}
    users: dict[str, list[str]] = defaultdict(list)
    for s in specs:
        for r in s.needs():
            users[r].append(s.id)
    per_iteration: dict[int, int] = defaultdict(int)
    for s in specs:
        if not isinstance(s, SourceTask):
            per_iteration[s.iteration] += 1
    gated: dict[int | None, list[str]] = defaultdict(list)
    for s, g in zip(specs, gates, strict=True):
        gated[g].append(s.id)
    released: set[str] = set()
    ready_at: dict[str, float] = {}  # task -> when its inputs are all there
    where: dict[str, int] = {}  # task -> worker it ran on
    finish: dict[str, float] = {}
    ready: list[tuple[int, int, str]] = []  # (-priority, order, id)
    pending: list[tuple[float, int, str]] = []  # (time it becomes ready, order, id)
    # (end time, order, running key, version): an end is stale once the speed changed
    events: list[tuple[float, int, str, int]] = []
    busy = [False] * n_workers  # holding a task (a gang rank waiting for its peers too)
    computing: set[int] = set()  # workers whose task computes now
    running: dict[str, dict[str, Any]] = {}  # task (or gang) -> its remaining work
    started: dict[str, float] = {}
    busy_time = [0.0] * n_workers
    gang_started: dict[tuple, list[str]] = defaultdict(list)
    done_count: dict[int, int] = defaultdict(int)
    last_end: dict[int, float] = defaultdict(float)
    now = 0.0

    def release(ids: list[str], at: float) -> None:
        for i in ids:
            released.add(i)
            if remaining[i] == 0:
                heapq.heappush(pending, (max(at, ready_at.get(i, 0.0)), index[i], i))

    spec_of = {s.id: s for s in specs}
    allowed_of = {s.id: frozenset(s.workers) if s.workers else None for s in specs}
    move_of = {s.id: cost.transfer_seconds(cost.result_bytes(s.rows[1] - s.rows[0]))
               for s in specs}
    latency = d["latency_s"]

    def complete(task_id: str, t: float) -> None:
        spec = spec_of[task_id]
        finish[task_id] = t
        moving = not isinstance(spec, SourceTask)
        if moving:
            done_count[spec.iteration] += 1
            last_end[spec.iteration] = max(last_end[spec.iteration], t)
            if done_count[spec.iteration] == per_iteration[spec.iteration]:
                end = t + d["finish_s"]
                sim.finishes[spec.iteration] = end
                release(gated.get(spec.iteration, []), end)
        w = where.get(task_id, -1)
        here, there = t + latency, t + latency + move_of[task_id]
        for u in users[task_id]:
            remaining[u] -= 1
            allowed = allowed_of[u]
            at = there if moving and allowed is not None and w not in allowed else here
            if at > ready_at.get(u, 0.0):
                ready_at[u] = at
            if remaining[u] == 0 and u in released:
                heapq.heappush(pending, (ready_at[u], index[u], u))

    def crowded() -> bool:
        """Whether the computing workers' threads fill every core, so that the tasks
        share them with the coordinator (on a contended layout). One worker of two
        computing leaves the coordinator a core of its own: the tasks of an interleaved
        plan mostly run so, measured as fast as alone."""
        return contended and len(computing) * threads >= cost.cores

    def push_end(key: str, job: dict[str, Any], slowed: bool) -> None:
        job["version"] += 1
        end = now + max(0.0, job["left"]) * (job["ratio"] if slowed else 1.0)
        heapq.heappush(events, (end, job["order"], key, job["version"]))

    def respeed(was: bool) -> None:
        """After the computing workers changed: if that changed whether the cores are
        shared, progress every running task's work to now at the old speed and
        estimate its end at the new one (only then: ends otherwise stand)."""
        slowed = crowded()
        if slowed == was:
            return
        for key, job in running.items():
            job["left"] -= (now - job["since"]) / (job["ratio"] if was else 1.0)
            job["since"] = now
            push_end(key, job, slowed)

    def start(key: str, spec: Task, ids: list[str], workers: list[int]) -> None:
        """``ids`` (one task, or a gang's ranks on ``workers``) start computing now."""
        fast = _duration(spec, cost, threads, False)
        slow = _duration(spec, cost, threads, True) if contended else fast
        was = crowded()
        job = running[key] = {"ids": ids, "workers": workers, "left": fast, "since": now,
                              "ratio": slow / fast if fast > 0 else 1.0, "version": 0,
                              "order": index[ids[0]]}
        computing.update(workers)
        for i in ids:
            started[i] = now
        push_end(key, job, crowded())
        respeed(was)

    def choose(spec: Task) -> int | None:
        allowed = spec.workers or tuple(range(n_workers))
        free = [w for w in allowed if not busy[w]]
        if not free:
            return None
        if not spec.workers:  # next to most of its inputs
            votes: dict[int, int] = defaultdict(int)
            for r in spec.needs():
                if r in where:
                    votes[where[r]] += 1
            return max(free, key=lambda w: (votes.get(w, 0), -w))
        return free[0]

    release(gated.get(None, []), 0.0)
    while pending or ready or events:
        while pending and pending[0][0] <= now + 1e-12:
            _, order, i = heapq.heappop(pending)
            heapq.heappush(ready, (-specs[order].priority, order, i))
        # start every ready task that finds a free worker, highest priority first
        skipped = []
        while ready:
            item = heapq.heappop(ready)
            spec = specs[item[1]]
            if isinstance(spec, SourceTask):
                complete(spec.id, now)
                continue
            w = choose(spec)
            if w is None:
                skipped.append(item)
                continue
            busy[w] = True
            where[spec.id] = w
            if isinstance(spec, StageTask) and spec.gang:  # a rank computes once every rank is there (collectives)
                group = (spec.iteration, spec.stages, spec.gang)
                gang_started[group].append(spec.id)
                if len(gang_started[group]) == len(spec.gang):
                    ranks = gang_started.pop(group)
                    start(spec.id, spec, ranks, [where[r] for r in ranks])
                continue
            start(spec.id, spec, [spec.id], [w])
        for item in skipped:
            heapq.heappush(ready, item)
        # advance to the next end or readiness
        while events and events[0][3] != running.get(events[0][2], {}).get("version"):
            heapq.heappop(events)  # an end estimated before the speed changed
        times = [t for t in (events[0][0] if events else None,
                             pending[0][0] if pending else None) if t is not None]
        if not times:
            break  # nothing can move (cannot happen for a compiled run)
        now = max(now, min(times))
        ended = []
        while events and events[0][0] <= now + 1e-12:
            _, _, key, version = heapq.heappop(events)
            if running.get(key, {}).get("version") == version:
                ended.append(key)
        if ended:
            was = crowded()
            done = []
            for key in ended:
                job = running.pop(key)
                computing.difference_update(job["workers"])
                for i in job["ids"]:
                    w = where[i]
                    busy[w] = False
                    sim.intervals[i] = (w, started[i], now)
                    busy_time[w] += now - started[i]
                    done.append(i)
            respeed(was)
            for i in done:
                complete(i, now)
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
