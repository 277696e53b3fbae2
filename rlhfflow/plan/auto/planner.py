"""``placement: auto``: the planner searches execution plans and picks the fastest that
fits, as ReaL (arXiv 2406.14088) does with its runtime estimator and plan search.

A candidate is a strategy (co-located, interleaved, disaggregated; the model homes and
gangs follow from it and from ``placement.groups/models/stages``), a split of the batch
into micro-batches, fusion on or off, and, on the embedded cluster, the number of workers
(up to ``cluster.workers``) and torch threads per worker. A ``data.micro_batches``,
``overlap.fuse`` or ``cluster.torch_threads`` written in the file is kept as written. Each candidate's plan compiles to the task specs the
executor would submit; the simulator walks them with the cost model's durations, and the
memory estimate drops plans that do not fit. The search never changes what is computed:
``max_staleness``, the algorithm and its hyperparameters, explicit placements and
per-stage micro-batches are the user's. Small spaces are searched exhaustively; large
ones (many workers) by coordinate descent from the best strategy, under a time budget.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhfflow.config.pipeline import derive
from rlhfflow.plan.auto.costmodel import CostModel, Profile, ProfileError
from rlhfflow.plan.auto.fitting import (
    check_memory,
    describe_fit,
    does_not_fit,
    memory_fits,
    rows_per_task,
    worker_capacity,
)
from rlhfflow.plan.auto.simulate import Simulation, simulate
from rlhfflow.plan.layout import default_torch_threads, layouts
from rlhfflow.plan.placement import STRATEGIES, ExecutionPlan, PlanError, make_plan
from rlhfflow.plan.tasks import SourceTask, StageTask

if TYPE_CHECKING:
    from rlhfflow.config.pipeline import Pipeline

SEARCH_BUDGET_S = 1.5
FINAL_RUNNERS = 6  # candidates simulated again at full length before the choice
#: What the planner adds per task of an iteration when it ranks candidates (not to their
#: predictions): each task is messages through the scheduler to a worker's event loop,
#: which takes the GIL from the task computing there, a cost the simulator does not see.
#: Measured on ppo-tiny (2 runs): interleaved unfused (15 tasks per iteration) predicted
#: 7 and 4 ms faster than fused (9 tasks), measured 10 and 42 ms slower: 3-8 ms per task.
#: So a plan wins with more tasks only where its predicted gain pays for them.
RANK_TASK_S = 2e-3


@dataclass
class Candidate:
    """One plan the planner considered."""

    strategy: str
    workers: int
    threads: int
    micro_batches: int
    fuse: bool
    embedded: bool = True  # the layout (workers x threads) is the planner's to set
    contended: bool = False  # embedded workers' threads fill every core (CostModel.contended)
    plan: ExecutionPlan | None = None
    simulation: Simulation | None = None
    memory: list[float] = field(default_factory=list)
    capacity: float = 0.0
    problem: str | None = None  # why it cannot run (does not fit, invalid placement)
    error: PlanError | None = None  # the placement error behind ``problem``, if one
    #: memory settings the planner chose because nothing fit without them
    #: (``stages.NAME.backend: fsdp``, ``models.NAME.gradient_checkpointing: true``)
    fits: dict[str, Any] = field(default_factory=dict)

    @property
    def simulated(self) -> Simulation:
        """The simulation of a candidate that was simulated (every one that can run)."""
        if self.simulation is None:
            raise ValueError(f"{self.describe()}: not simulated")
        return self.simulation

    @property
    def predicted_s(self) -> float:
        return self.simulation.iteration_s if self.simulation else float("inf")

    @property
    def updates(self) -> dict[str, Any]:
        """The spec keys that make a pipeline run this candidate."""
        out = {"placement.strategy": self.strategy, "data.micro_batches": self.micro_batches,
               "overlap.fuse": self.fuse}
        if self.embedded:
            out.update({"cluster.workers": self.workers, "cluster.torch_threads": self.threads})
        return {**out, **self.fits}

    def describe(self) -> str:
        """One line: strategy, layout, split, fusion."""
        return (f"{self.strategy} on {self.workers} worker(s) x {self.threads} thread(s), "
                f"{self.micro_batches} micro-batch(es), {'fused' if self.fuse else 'unfused'}"
                + "".join(f", {describe_fit(k)}" for k in self.fits))


@dataclass
class PlanChoice:
    """The planner's answer: the candidates, best first, and the pipeline to run."""

    candidates: list[Candidate]
    pipeline: Any
    cost: CostModel
    search_s: float
    exhaustive: bool

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    def why_slower(self, other: Candidate) -> str:
        """Why ``other`` loses to the best candidate, in a few words: the stage whose
        work grew most, and idle workers."""
        if other.problem:
            return other.problem
        best = self.best
        if other.predicted_s < best.predicted_s:
            extra = tasks_per_iteration(other) - tasks_per_iteration(best)
            return (f"predicted faster, but with {extra:.1f} more tasks per iteration "
                    f"(ranked at {RANK_TASK_S * 1e3:g} ms each for the scheduling the "
                    f"simulator leaves out)")
        mine, theirs = self.stage_work(best), self.stage_work(other)
        parts = []
        worst = max(theirs, key=lambda s: theirs[s] - mine.get(s, 0.0), default=None)
        if worst is not None and theirs[worst] - mine.get(worst, 0.0) > \
                0.02 * best.predicted_s:
            parts.append(f"{worst} takes {theirs[worst] - mine.get(worst, 0.0):+.2f}s of "
                         f"work per iteration")
        busy = other.simulated.busy_frac
        if busy and min(busy) < 0.6 * max(busy):
            parts.append("workers unevenly busy (" + "/".join(f"{b:.2f}" for b in busy) + ")")
        return "; ".join(parts) or "more waiting between stages (dependencies, latency)"

    def stage_work(self, c: Candidate) -> dict[str, float]:
        """Task seconds per stage in one iteration of ``c`` (fused stages apart; a gang
        counts every rank)."""
        out: dict[str, float] = defaultdict(float)
        iterations = len(c.simulated.finishes) or 1
        for spec in c.simulated.specs:
            if not isinstance(spec, StageTask):
                continue
            rows = spec.rows[1] - spec.rows[0]
            gang = len(spec.gang) or 1
            for stage in spec.stages:
                out[stage] += self.cost.stage_seconds(stage, rows, c.threads, gang,
                                                      c.contended) / iterations
        return out


def _layouts(pipeline: Pipeline, n_workers: int | None, cores: int, measured: bool
             ) -> list[tuple[int, int]]:
    cluster = pipeline.spec.cluster
    if n_workers is not None:  # a given cluster: its workers, their threads
        threads = cluster.torch_threads or (default_torch_threads(n_workers, cores)
                                            if cluster.address is None else 1)
        return [(n_workers, threads)]

    if cluster.torch_threads:
        return [(cluster.workers, cluster.torch_threads)]
    # each worker count with the cores split between the workers, a core left to the
    # coordinator and the scheduler where there are enough (CostModel.contended)
    split = [(w, default_torch_threads(w, cores)) for w in range(1, cluster.workers + 1)]
    if not measured:
        # more threads than that (2 threads on 2 cores beside the coordinator measured
        # 1.4x slower, not faster) only where a profile measured them
        return split
    return list(dict.fromkeys(layouts(cores, cluster.workers) + split))


def choose_plan(pipeline: Pipeline, profile: Profile | None = None,
                n_workers: int | None = None, cores: int | None = None,
                budget_s: float = SEARCH_BUDGET_S, vary: bool = True) -> PlanChoice:
    """Search the plans of ``pipeline`` and return them ranked, with the pipeline that
    runs the best. ``n_workers``: plan for a cluster of that many workers (external, or
    planned for); None: the embedded cluster, whose layout is searched too (on ``cores``
    cores, default this machine's). ``vary=False`` searches the strategy only. Raises
    ``PlanError`` when no plan fits."""
    started = time.perf_counter()
    cost = CostModel(pipeline, profile, cores=cores)
    cores = cost.cores
    spec = pipeline.spec
    assert spec.data is not None  # a pipeline with loop stages has a data section
    rows = spec.data.batch_size * spec.data.samples_per_prompt
    strategies = [spec.placement.strategy] if spec.placement.strategy != "auto" else \
        list(STRATEGIES)
    # what the file sets explicitly is the user's; only defaults are searched
    vary_fuse = vary and "fuse" not in spec.overlap.model_fields_set and \
        not spec.overlap.sequential
    vary_split = vary and "micro_batches" not in spec.data.model_fields_set
    fuse_options = [True, False] if vary_fuse else [spec.overlap.fuse]
    data = spec.data

    def candidates(fits: dict[str, Any]) -> list[Candidate]:
        space = []
        for workers, threads in _layouts(pipeline, n_workers, cores, cost.profiled):
            splits = sorted({min(rows, m) for m in (workers, 2 * workers, 4 * workers,
                                                     data.micro_batches)}) \
                if vary_split else [data.micro_batches]
            for strategy, micro, fuse in itertools.product(strategies, splits, fuse_options):
                embedded = pipeline.spec.cluster.address is None
                # on this machine's own cluster (not one planned larger than it)
                space.append(Candidate(strategy, workers, threads, micro, fuse, embedded,
                                       embedded and workers <= cores and
                                       cost.contended(workers, threads), fits=dict(fits)))
        return space

    space = candidates({})
    tasks = sum(c.micro_batches for c in space) * len(pipeline.graph.loop_stages)
    exhaustive = tasks <= 4000
    evaluated = _search(pipeline, space, cost, profile, tasks, started + budget_s)
    if spec.placement.strategy == "auto" and all(c.problem for c in evaluated):
        # nothing fits as written: the memory settings the file leaves to the planner
        # (sharding a trained model, checkpointing its activations), in order of cost
        for fits in memory_fits(pipeline):
            space = candidates(fits)
            evaluated += _search(pipeline, space, cost, profile, tasks, started + budget_s)
            if not all(c.problem for c in evaluated):
                break
    ranked = sorted(evaluated, key=lambda c: (c.problem is not None, c.predicted_s))
    if exhaustive and tasks > 1000:
        # a large space is simulated over 4 iterations, whose steady gaps are 2 and may
        # still carry the pipeline's filling: the front runners again over 6, as a
        # smaller space and a hand strategy are, so predictions compare alike
        for c in ranked[:FINAL_RUNNERS]:
            if c.simulation is not None:
                _evaluate(pipeline, c, cost, profile, iterations=6)
        ranked = sorted(evaluated, key=lambda c: (c.problem is not None, c.predicted_s))
    if not ranked or ranked[0].problem:
        placement = [c.error for c in ranked if c.error is not None]
        if len(placement) == len(ranked) and placement:
            raise placement[0]  # the user's placement, whatever the strategy: its key
        why = next((c.problem for c in ranked if c.error is None), "no candidate")
        raise PlanError(pipeline.source, "placement.strategy",
                        f"no plan fits the cluster ({why})")
    ranked = rank_with_task_cost(ranked)
    best = ranked[0]
    return PlanChoice(ranked, derive(pipeline, best.updates), cost,
                      time.perf_counter() - started, exhaustive)


def _search(pipeline: Pipeline, space: list[Candidate], cost: CostModel,
            profile: Profile | None, tasks: int, deadline: float) -> list[Candidate]:
    """Evaluate ``space`` (exhaustively, or by coordinate descent when it is large);
    the candidates evaluated."""
    if tasks <= 4000:
        for c in space:
            _evaluate(pipeline, c, cost, profile, iterations=6 if tasks <= 1000 else 4)
    else:
        _descend(pipeline, space, cost, profile, deadline)
    return [c for c in space if c.simulation is not None or c.problem]


def tasks_per_iteration(c: Candidate) -> float:
    """The tasks (not counting prompt batches) one iteration of ``c`` compiles to."""
    specs = [s for s in c.simulated.specs if s.iteration >= 0 and not isinstance(s, SourceTask)]
    return len(specs) / max(1, len({s.iteration for s in specs}))


def rank_with_task_cost(ranked: list[Candidate]) -> list[Candidate]:
    """``ranked`` (fastest prediction first) with the candidate that is fastest once each
    task of its iterations counts ``RANK_TASK_S`` on top moved to the front."""
    fits = [c for c in ranked if c.problem is None and c.simulation is not None]
    if not fits:
        return ranked
    pick = min(fits, key=lambda c: c.predicted_s + RANK_TASK_S * tasks_per_iteration(c))
    return [pick, *(c for c in ranked if c is not pick)]


def resolve_plan(pipeline: Pipeline, n_workers: int, model_bytes: Mapping[str, int] | None = None
                 ) -> ExecutionPlan:
    """The execution plan of ``pipeline`` on ``n_workers`` workers: ``make_plan`` of its
    strategy, or with ``placement.strategy: auto``, of the strategy the planner picks (the
    strategy only: what else the planner may choose, micro-batches, fusion and workers, is
    resolved by ``choose_plan`` before a run, into a concrete pipeline)."""
    if pipeline.spec.placement.strategy == "auto":
        plan = choose_strategy(pipeline, n_workers).plan
        assert plan is not None  # the best candidate has a plan
        return plan
    return make_plan(pipeline, n_workers, model_bytes)


def choose_strategy(pipeline: Pipeline, n_workers: int, profile: Profile | None = None
                    ) -> Candidate:
    """The best concrete strategy for ``pipeline`` on ``n_workers`` workers, everything
    else as the pipeline says (``make_plan`` of ``placement.strategy: auto``)."""
    spec = pipeline.spec
    if spec.data is None:  # setup stages only: nothing to overlap
        candidate = Candidate("colocated", n_workers, 1, 1, True)
        candidate.plan = make_plan(derive(pipeline, {"placement.strategy": "colocated"}),
                                   n_workers)
        return candidate
    if profile is None:
        profile = load_profile(pipeline, quiet=True)
    return choose_plan(pipeline, profile, n_workers=n_workers, vary=False).best


def _evaluate(pipeline: Pipeline, c: Candidate, cost: CostModel, profile: Profile | None,
              iterations: int = 6) -> None:
    run = derive(pipeline, c.updates)
    try:
        c.plan = make_plan(run, c.workers, {m: s.nbytes for m, s in cost.shapes.items()})
    except PlanError as exc:
        c.problem, c.error = exc.message, exc
        return
    per_task = rows_per_task(run, c.plan)
    sized = cost.with_pipeline(run)
    parts = sized.memory_parts(c.plan, per_task)
    c.memory = [sum(p.values()) for p in parts]
    c.capacity = worker_capacity(run, c.workers, profile)
    over = [w for w, m in enumerate(c.memory) if m > c.capacity]
    if over:
        w = max(over, key=lambda i: c.memory[i])
        c.problem = does_not_fit(run, sized, c.plan, per_task, w, parts[w], c.capacity)
        return
    c.simulation = simulate(run, c.plan, cost, c.threads, iterations=iterations,
                            contended=c.contended)


def _descend(pipeline: Pipeline, space: list[Candidate], cost: CostModel, profile: Profile | None,
             deadline: float) -> None:
    """Coordinate descent over (strategy, layout, split, fusion): evaluate each strategy's
    default, then from the best, change one setting at a time while that helps and time
    is left."""
    key: dict[tuple[str | int | bool, ...], Candidate] = {
        (c.strategy, c.workers, c.threads, c.micro_batches, c.fuse): c for c in space}
    firsts: dict[str, Candidate] = {}
    for c in space:
        firsts.setdefault(c.strategy, c)
    for c in firsts.values():
        _evaluate(pipeline, c, cost, profile, iterations=4)
    done = [c for c in firsts.values() if c.simulation]
    if not done:
        return
    best = min(done, key=lambda c: c.predicted_s)
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        here = (best.strategy, best.workers, best.threads, best.micro_batches, best.fuse)
        for i, value in [(i, v) for i in range(5) for v in {k[i] for k in key}]:
            if time.perf_counter() >= deadline:
                break
            other = key.get(here[:i] + (value,) + here[i + 1:])
            if other is None or other.simulation or other.problem:
                continue
            _evaluate(pipeline, other, cost, profile, iterations=4)
            if other.simulation and other.predicted_s < best.predicted_s:
                best, improved = other, True
                break


def default_profile_path(pipeline: Pipeline) -> Path:
    """Where ``rlhfflow profile`` writes a pipeline's profile and the planner looks for
    it: ``placement.profile``, else ``profiles/NAME.json`` beside the pipeline file."""
    explicit = pipeline.spec.placement.profile
    if explicit:
        return pipeline.resolve(explicit)
    return pipeline.base_dir / "profiles" / f"{pipeline.name}.json"


def load_profile(pipeline: Pipeline, quiet: bool = False) -> Profile | None:
    """The pipeline's profile, or None when there is none (the analytic model is used).
    A ``placement.profile`` that cannot be read is a ``PlanError`` naming the key; a
    broken default-location profile too (unless ``quiet``)."""
    path = default_profile_path(pipeline)
    if not path.exists() and not pipeline.spec.placement.profile:
        return None
    try:
        return Profile.load(path)
    except ProfileError as exc:
        if quiet and not pipeline.spec.placement.profile:
            return None
        raise PlanError(pipeline.source, "placement.profile", str(exc)) from None


def plan_for_cli(pipeline: Pipeline, profile: Profile | None, workers: int | None) -> PlanChoice:
    """What ``rlhfflow plan`` shows: with ``auto`` the planner's ranking, else the one
    plan of the file's strategy with its prediction. ``workers`` plans for that many
    workers; without it, the embedded cluster's layouts are searched (a file naming a
    scheduler is planned for its ``cluster.workers``)."""
    cluster = pipeline.spec.cluster
    n = workers if workers is not None else (cluster.workers if cluster.address else None)
    if pipeline.spec.data is None:  # setup stages only: nothing to simulate
        only = choose_strategy(pipeline, n or cluster.workers)
        return PlanChoice([only], derive(pipeline, {"placement.strategy": only.strategy}),
                          CostModel(pipeline, profile), 0.0, True)
    if pipeline.spec.placement.strategy == "auto":
        return choose_plan(pipeline, profile, n_workers=n)
    return choose_plan(pipeline, profile, n_workers=n or cluster.workers, vary=False)


def check_fits(pipeline: Pipeline, profile: Profile | None = None,
               n_workers: int | None = None) -> None:
    """Refuse, with one line (``PlanError``), a pipeline whose embedded cluster's
    ``cluster.memory_limit`` no plan fits: with a chosen strategy, its plan
    (``check_memory``, as ``rlhfflow run`` checks it before starting a cluster); under
    ``auto``, every plan the planner tries, sharded and checkpointed ones included
    (``choose_plan`` on ``n_workers``, None: the embedded cluster's layouts). What
    ``rlhfflow validate`` checks of memory. Nothing without a limit, without loop
    stages, or on an external cluster (its workers' limits are their own)."""
    spec = pipeline.spec
    if spec.cluster.memory_limit in ("auto", "0", 0) or spec.data is None or \
            spec.cluster.address is not None:
        return
    if spec.placement.strategy == "auto":
        choose_plan(pipeline, profile, n_workers=n_workers)
    else:
        check_memory(pipeline, spec.cluster.workers)


def describe_choice(choice: PlanChoice, profile: Profile | None, candidates: int = 0
                    ) -> list[str]:
    """The prediction, memory, timeline and runners-up of a plan choice, as text."""
    best, cost = choice.best, choice.cost
    if best.simulation is None:
        return ["predicted: nothing to predict (no iterations, setup stages only)"]
    if cost.profiled:
        assert profile is not None  # a cost model is profiled by the profile given
        missing = cost.unmeasured()
        source = (f"the profile of {len(profile.observations)} measured task(s) on "
                  f"{profile.machine.get('cpu')}" + (
                      f"; no measurement of {', '.join(missing)}, costed by the analytic "
                      f"model" if missing else ""))
    else:
        source = "the analytic cost model" + (f" ({cost.warning})" if cost.warning else
                                              "; measure with `rlhfflow profile FILE`")
    lines = [f"predicted: {best.predicted_s:.3f} s per iteration ({best.threads} torch "
             f"thread(s) per worker), from {source}"]
    if len(choice.candidates) > 1:
        how = "all of them" if choice.exhaustive else "guided search"
        lines.append(f"planner: chose {best.describe()}, out of {len(choice.candidates)} "
                     f"plans ({how}, {choice.search_s:.2f}s)")
    if best.fits:
        same = [c for c in choice.candidates if c.problem and not c.fits and
                c.describe() == replace(best, fits={}).describe()]
        unfit = next((c.problem for c in same), "")
        lines.append("planner: no plan fits memory as the file is written" +
                     (f" ({unfit})" if unfit else "") + "; it chose " +
                     ", ".join(describe_fit(k) for k in best.fits))
    lines.append("memory (estimated peak per worker): " + ", ".join(
        f"w{w} {m / 2**20:.0f} MiB" for w, m in enumerate(best.memory))
        + f" of {best.capacity / 2**30:.1f} GiB each")
    steady = sorted(best.simulation.finishes)
    k = steady[len(steady) // 2] if steady else 0
    lines.append(f"timeline of one steady iteration (simulated iteration {k}):")
    lines += best.simulation.timeline(k, best.workers)
    if candidates and len(choice.candidates) > 1:
        lines.append("candidates:")
        for i, c in enumerate(choice.candidates[:candidates + 1]):
            if c.problem:
                lines.append(f"  {i + 1}. {c.describe()}: {c.problem}")
            elif c is best:
                lines.append(f"  {i + 1}. {c.describe()}: {c.predicted_s:.3f} s (chosen)")
            else:
                slower = c.predicted_s / best.predicted_s - 1
                lines.append(f"  {i + 1}. {c.describe()}: {c.predicted_s:.3f} s "
                             f"({slower:+.0%}): {choice.why_slower(c)}")
    return lines
