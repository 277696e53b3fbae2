"""The execution plan: for every stage, the workers it runs on and how its batch is split
among them; for every model, the workers that hold it; and which weights move where.

Strategies (arXiv 2312.11819), for ``W`` device workers:

- ``colocated``: every model on every worker; micro-batch stages spread their
  micro-batches over all workers, training stages run as one data-parallel gang over all.
- ``interleaved``: models get exclusive worker groups (``min(W, models)`` equal blocks,
  or the ``placement.groups``), balanced by parameter bytes, so the stages of models that
  do not depend on each other (reference, reward, critic) run at once.
- ``disaggregated``: generation runs on the ``rollout`` group on a *shadow* of its model;
  everything else is co-located on the ``train`` group; after each update the new weights
  are sent to the shadows (parameter reallocation, ReaL arXiv 2406.14088).

``placement.models`` and ``placement.stages`` override the strategy per model or stage.
A model's *home* is where it is trained; a stage placed outside its model's home runs on a
replica (a frozen model is just loaded there; a trained one is a shadow kept in sync).

The plan also fixes the overlap (``overlap:``): which stages run *ahead* (with
``max_staleness: N``, the inference of the generating model for iteration k+N is
submitted with iteration k and uses the actor of N updates before), each micro-batch
stage's split (``micro_batches``), and which consecutive stages are *fused*: micro-batch
stages into one task per micro-batch, whole-batch stages (``advantages + train_actor``)
into one task per iteration.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rlhfflow.config.graph import StageGraph
from rlhfflow.config.pipeline import Pipeline
from rlhfflow.config.shapes import model_shapes
from rlhfflow.config.spec import WorkerRef
from rlhfflow.errors import SpecError, did_you_mean

STRATEGIES = ("colocated", "interleaved", "disaggregated")
"""The concrete strategies; ``auto`` picks one of them (``rlhfflow.plan.auto.planner``)."""


class PlanError(SpecError):
    """A placement that cannot be carried out on the cluster at hand."""


@dataclass(frozen=True)
class StagePlan:
    """Where one stage runs.

    Attributes:
        workers: worker indexes; empty for stages without a model (any worker).
        gang: a data-parallel training gang over ``workers`` (one task per worker, sharing
            a torch.distributed process group; each minibatch is split among them).
        shadow: runs on a copy of a trained model that is synced after each update.
        micro_batches: how many micro-batches the stage splits the batch into (None for
            whole-batch stages); each micro-batch is one task.
        lag: iterations the stage runs ahead of training (``overlap.max_staleness`` for
            the generating model's inference, else 0).
    """

    name: str
    workers: tuple[int, ...]
    gang: bool = False
    shadow: bool = False
    micro_batches: int | None = None
    lag: int = 0

    def worker(self, micro_batch: int) -> int | None:
        """The worker of micro-batch ``micro_batch`` (round robin), or None for any."""
        return self.workers[micro_batch % len(self.workers)] if self.workers else None


@dataclass(frozen=True)
class Transfer:
    """Weights sent after ``after`` updated ``model``: from ``source`` to each target."""

    model: str
    after: str
    source: int
    targets: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class ExecutionPlan:
    """The plan of a pipeline on ``n_workers`` device workers (indexes into the sorted
    worker addresses)."""

    strategy: str
    n_workers: int
    groups: Mapping[str, tuple[int, ...]]
    homes: Mapping[str, tuple[int, ...]]
    replicas: Mapping[str, tuple[int, ...]]
    stages: Mapping[str, StagePlan]
    transfers: tuple[Transfer, ...]
    model_bytes: Mapping[str, int]
    fused: tuple[tuple[str, ...], ...] = ()
    max_staleness: int = 0
    sequential: bool = False

    def group(self, stage: str) -> tuple[str, ...]:
        """The stages fused with ``stage`` into one task (itself alone if none)."""
        return next((g for g in self.fused if stage in g), (stage,))

    @property
    def gangs(self) -> tuple[tuple[int, ...], ...]:
        """The distinct worker sets of data-parallel gangs (one process group each)."""
        return tuple(dict.fromkeys(s.workers for s in self.stages.values() if s.gang))

    def shadows(self, model: str) -> tuple[int, ...]:
        """Workers holding a synced copy of trained ``model`` outside its home."""
        return tuple(w for w in self.replicas.get(model, ()) if w not in self.homes[model])

    def transfers_after(self, stage: str) -> list[Transfer]:
        """The weight transfers that follow ``stage``."""
        return [t for t in self.transfers if t.after == stage]


def make_plan(pipeline: Pipeline, n_workers: int,
              model_bytes: Mapping[str, int] | None = None) -> ExecutionPlan:
    """The execution plan of ``pipeline`` on ``n_workers`` device workers.

    ``model_bytes`` (parameter bytes per model) balances interleaved groups and sizes the
    transfers; it is computed from the model configs when not given. Raises ``PlanError``
    (file, key, what is wrong) for a placement the cluster cannot hold.
    """
    spec, graph, file = pipeline.spec, pipeline.graph, pipeline.source
    placement = spec.placement
    if n_workers < 1:
        raise PlanError(file, "cluster.workers", "the cluster has no device worker")
    if placement.strategy == "auto":
        raise ValueError("make_plan needs a concrete strategy: resolve placement.strategy "
                         "'auto' first (rlhfflow.plan.auto.planner.resolve_plan)")
    sizes = dict(model_bytes) if model_bytes is not None else model_sizes(pipeline)
    groups = _groups(pipeline, n_workers)
    refs = _WorkerRefs(file, groups, n_workers)
    used = [m for m in spec.models if graph.users(m)]
    homes = _homes(pipeline, refs, used, sizes)
    overlap = spec.overlap
    staleness = 0 if overlap.sequential else overlap.max_staleness
    stages, replicas = _stage_plans(pipeline, refs, homes, staleness)
    plan_replicas = {m: tuple(sorted(w)) for m, w in replicas.items()}
    _check_gangs(file, stages, graph)
    _check_sharded(pipeline, stages, homes)
    transfers = _transfers(pipeline, used, homes, plan_replicas, sizes)
    fused = () if overlap.sequential or not overlap.fuse else _fuse(pipeline, stages)
    return ExecutionPlan(placement.strategy, n_workers, groups, homes, plan_replicas, stages,
                         tuple(transfers), sizes, fused, staleness, overlap.sequential)


@dataclass(frozen=True)
class _WorkerRefs:
    """The workers of a cluster of ``n_workers`` as a pipeline file names them: a group
    of ``groups``, a worker index or a list of indexes."""

    file: Path
    groups: Mapping[str, tuple[int, ...]]
    n_workers: int

    def resolve(self, ref: WorkerRef, key: str) -> tuple[int, ...]:
        """The sorted worker indexes ``ref`` (at ``key`` of the file) names."""
        groups, n_workers = self.groups, self.n_workers
        if isinstance(ref, str):
            if ref not in groups:
                hint = did_you_mean(ref, groups) if groups else ""
                known = f"; groups: {', '.join(groups)}" if groups else \
                    "; no placement.groups are defined"
                raise PlanError(self.file, key, f"unknown group {ref!r}{hint or known}")
            return groups[ref]
        indexes = [ref] if isinstance(ref, int) else list(ref)
        for i in indexes:
            if i >= n_workers:
                raise PlanError(self.file, key, f"worker index {i}, but the cluster has "
                                                f"{n_workers} worker(s) (0..{n_workers - 1})")
        return tuple(sorted(set(indexes)))


def _homes(pipeline: Pipeline, refs: _WorkerRefs, used: list[str], sizes: Mapping[str, int]
           ) -> dict[str, tuple[int, ...]]:
    """Where each model in ``used`` lives (is trained): where ``placement.models`` puts
    it, else where the strategy does (interleaved: blocks balanced by ``sizes``)."""
    spec = pipeline.spec
    placement = spec.placement
    homes: dict[str, tuple[int, ...]] = {
        m: refs.resolve(ref, f"placement.models.{m}") for m, ref in placement.models.items()
        if m in used}
    rest = [m for m in used if m not in homes]
    if placement.strategy == "colocated":
        homes.update({m: tuple(range(refs.n_workers)) for m in rest})
    elif placement.strategy == "disaggregated":
        homes.update({m: refs.groups["train"] for m in rest})
    else:
        blocks = list(refs.groups.values()) if refs.groups else \
            _blocks(refs.n_workers, len(used))
        load = [sum(sizes.get(m, 0) for m in homes if homes[m] == b) for b in blocks]
        # trainable models first (they carry optimizer state), then the largest
        for m in sorted(rest, key=lambda m: (not spec.models[m].trainable, -sizes.get(m, 0),
                                             used.index(m))):
            base = pipeline.lora_base(m)
            if base in homes:  # a view of a LoRA model's base: beside it
                homes[m] = homes[base]
                continue
            i = min(range(len(blocks)), key=lambda i: (load[i], i))
            homes[m] = blocks[i]
            load[i] += sizes.get(m, 0)
    return homes


def _stage_plans(pipeline: Pipeline, refs: _WorkerRefs, homes: Mapping[str, tuple[int, ...]],
                 staleness: int) -> tuple[dict[str, StagePlan], dict[str, set[int]]]:
    """Where each stage runs, and the workers that then hold each model (its home, its
    replicas and shadows)."""
    spec, graph, file = pipeline.spec, pipeline.graph, pipeline.source
    placement = spec.placement
    # with staleness, the generating model's inference runs ahead on older weights; a
    # generator that streams runs its episodes ahead itself, its tasks in order
    ahead_models = {model for g in graph.generators()
                    if staleness and (model := graph.nodes[g].model) in spec.models
                    and spec.models[model].trainable and not graph.nodes[g].streams}
    stages: dict[str, StagePlan] = {}
    replicas: dict[str, set[int]] = {m: set(h) for m, h in homes.items()}
    for name in graph.order:
        node = graph.nodes[name]
        key = f"placement.stages.{name}"
        explicit = placement.stages.get(name)
        if node.model is None:
            if explicit is not None:
                raise PlanError(file, key, f"stage {name!r} has no model: it runs on any "
                                           f"worker, next to its inputs")
            stages[name] = StagePlan(name, (), micro_batches=_micro_batches(pipeline, name))
            continue
        home = homes[node.model]
        if node.trains:
            if explicit is not None:
                raise PlanError(file, key, f"a training stage runs where its model lives; "
                                           f"place the model instead "
                                           f"(placement.models.{node.model})")
            if node.once:  # setup stages train once, on one worker; replicas reload
                stages[name] = StagePlan(name, home[:1])
            else:
                deepspeed = spec.stages[name].backend == "deepspeed"  # needs a group even alone
                stages[name] = StagePlan(name, home, gang=len(home) > 1 or deepspeed)
            continue
        ahead = node.model in ahead_models and not node.per_batch
        # a view of the base of a LoRA model trained sharded: beside its whole copies
        base = pipeline.lora_base(node.model)
        on_shadow = base is not None and pipeline.trains_sharded(base)
        if explicit is not None:
            workers = refs.resolve(explicit, key)
        elif placement.strategy == "disaggregated" and (node.generates or ahead or on_shadow):
            # behaviour log-probs are computed next to generation, with its weights
            workers = refs.groups["rollout"]
        else:
            workers = home
        trained = spec.models[node.model].trainable
        shadow = trained and not set(workers) <= set(home)
        stages[name] = StagePlan(name, workers, shadow=shadow,
                                 micro_batches=_micro_batches(pipeline, name),
                                 lag=staleness if ahead else 0)
        replicas[node.model].update(workers)
        for other in node.uses:  # a draft model is needed (and kept current) there too
            replicas.setdefault(other, set(homes.get(other, ()))).update(workers)
    return stages, replicas


def _transfers(pipeline: Pipeline, used: list[str], homes: Mapping[str, tuple[int, ...]],
               replicas: Mapping[str, tuple[int, ...]], sizes: Mapping[str, int]
               ) -> list[Transfer]:
    """The weights sent after each update of a trained model to its copies outside its
    home (a LoRA model's adapters only)."""
    spec, graph = pipeline.spec, pipeline.graph
    transfers = []
    for m in used:
        targets = tuple(w for w in replicas[m] if w not in homes[m])
        trainers = [t for t in graph.trainers(m) if not graph.nodes[t].once]
        if targets and trainers and spec.models[m].trainable:
            nbytes = sizes.get(m, 0)
            if spec.models[m].lora is not None:  # a LoRA model moves its adapters only
                nbytes = model_shapes(pipeline)[m].moved_bytes
            transfers.append(Transfer(m, trainers[-1], homes[m][0], targets, nbytes))
    return transfers


def _micro_batches(pipeline: Pipeline, name: str) -> int | None:
    """The micro-batches of a loop stage that works on micro-batches (None otherwise)."""
    node, spec = pipeline.graph.nodes[name], pipeline.spec
    if node.per_batch or node.once or spec.data is None:
        return None
    rows = spec.data.batch_size * spec.data.samples_per_prompt
    return min(rows, spec.stages[name].micro_batches or spec.data.micro_batches)


def inputs_of(graph: StageGraph, name: str) -> list[str]:
    """The stages whose tasks a task of ``name`` waits for in the same iteration: the
    producers of the columns it reads, then its ``after`` list (no ``SOURCE``)."""
    from rlhfflow.config.graph import SOURCE

    node = graph.nodes[name]
    producers = [graph.producer(c, name) for c in node.reads]
    return [s for s in dict.fromkeys([*producers, *node.after]) if s and s != SOURCE]


def _fuse(pipeline: Pipeline, stages: Mapping[str, StagePlan]) -> tuple[tuple[str, ...], ...]:
    """Groups of stages that run as one task: micro-batch stages one task per
    micro-batch, whole-batch stages one task per iteration.

    Greedy, in dependency order: a stage joins an earlier group of its kind (a
    whole-batch stage only the group just before it, which may be micro-batch stages
    run as one micro-batch: the whole batch) when both run on the same workers (a stage
    with no model goes where the group's stages go, and the reverse), with the same
    micro-batches and lag. A micro-batch stage joins only when every stage of the
    iteration it waits for is in the group or already waited for by it. A whole-batch
    stage may bring new waits, on stages that wait for no member (so ``advantages +
    train_actor`` waits for the reference log-probs too, which the update waited for
    anyway, and saves the task hop between them), when no other stage would then wait
    for more than it did and no update is followed by more work in its task. Either way
    the fused task waits for nothing that waits for it, so fusion cannot make a cycle;
    it does take on its members' waits for the previous iteration's updates of their
    models (a fused ``ref_logprob + values`` waits for the critic's update too). Gangs
    and setup stages stay alone. Only groups of two or more are returned.
    """
    spec, graph = pipeline.spec, pipeline.graph
    groups: list[_FuseGroup] = []
    for name in graph.loop_stages:
        sp = stages[name]
        whole = sp.micro_batches is None
        if whole and (sp.gang or not graph.nodes[name].per_batch):
            continue
        waits = set(inputs_of(graph, name))
        joined = None
        if spec.stages[name].fuse:
            joined = next((g for g in reversed(groups)
                           if g.admits(graph, stages, name, waits)), None)
        if joined is None:
            groups.append(_FuseGroup({name}, [name], waits, sp.workers, sp.micro_batches,
                                     sp.lag, spec.stages[name].fuse, whole,
                                     graph.nodes[name].every))
        else:
            joined.add(name, sp, waits)
    return tuple(tuple(g.order) for g in groups if len(g.order) > 1)


@dataclass
class _FuseGroup:
    """Stages that run as one task (``_fuse``), and what the task waits for and where
    it runs."""

    members: set[str]
    order: list[str]
    #: the stages of the iteration the group's task waits for (none of its members)
    waits: set[str]
    workers: tuple[int, ...]
    micro_batches: int | None
    lag: int
    fuse: bool
    #: it has a whole-batch stage: no micro-batch stage may join after it
    whole: bool
    every: int

    def admits(self, graph: StageGraph, stages: Mapping[str, StagePlan], name: str,
               waits: set[str]) -> bool:
        """Whether stage ``name``, which waits for ``waits``, may join the group."""
        sp = stages[name]
        whole = sp.micro_batches is None
        # a group of one micro-batch is a whole batch: whole-batch stages join it
        kind = self.whole == whole and sp.micro_batches == self.micro_batches or \
            whole and self.micro_batches == 1
        if not kind or not self.fuse or sp.lag != self.lag or \
                graph.nodes[name].every != self.every:
            return False
        if not whole:
            place = sp.workers == self.workers or (not sp.workers and bool(self.workers))
            return place and waits <= self.members | self.waits
        return self._admits_whole(graph, stages, name, waits)

    def _admits_whole(self, graph: StageGraph, stages: Mapping[str, StagePlan], name: str,
                      waits: set[str]) -> bool:
        sp = stages[name]
        # next to the group in the compile order, so compiling the group
        # at its first stage moves no stage past another's tasks
        if graph.loop_stages.index(self.order[-1]) + 1 != graph.loop_stages.index(name):
            return False
        # nothing after an update in its task: the next rollout waits for
        # the new weights, not for more work (and each update's metrics
        # stay its own)
        if any(graph.nodes[m].trains for m in self.members):
            return False
        place = not sp.workers or not self.workers or sp.workers == self.workers
        first = stages[self.order[0]]
        if first.micro_batches is not None:
            # a group of micro-batch stages may have skipped stages of the
            # loop (a micro-batch stage joins any earlier group): it is
            # compiled at its first stage, so this stage's waits must all
            # come before that, which holds when the group is a contiguous
            # run of the loop; and its tasks run where its first stage says,
            # so a stage with a model joins only a group whose first stage
            # runs exactly where it does
            loop = graph.loop_stages
            span = loop[loop.index(self.order[0]):loop.index(name)]
            place = place and set(span) == self.members and \
                (not sp.workers or sp.workers == first.workers)
        new = waits - self.members - self.waits
        # no new wait on a member's consumer (a cycle), and no other
        # consumer of a member made to wait for this stage's work (PPO's
        # critic update would wait for the actor's)
        consumers = {c for c in graph.loop_stages if c != name and
                     c not in self.members and graph.upstream(c) & self.members}
        ok = not any(graph.upstream(x) & self.members for x in new) and \
            all(name in graph.upstream(c) for c in consumers)
        return place and ok

    def add(self, name: str, sp: StagePlan, waits: set[str]) -> None:
        """Stage ``name`` (planned as ``sp``, waiting for ``waits``) joins the group."""
        self.members.add(name)
        self.order.append(name)
        self.waits |= waits - self.members
        self.workers = self.workers or sp.workers
        self.whole = self.whole or sp.micro_batches is None  # no micro-batch stage after it


def _groups(pipeline: Pipeline, n_workers: int) -> dict[str, tuple[int, ...]]:
    """``placement.groups`` as worker indexes (fractions laid out one after the other),
    plus the ``rollout``/``train`` groups of the disaggregated strategy."""
    spec, file = pipeline.spec, pipeline.source
    groups: dict[str, tuple[int, ...]] = {}
    cursor = 0
    for name, ref in spec.placement.groups.items():
        key = f"placement.groups.{name}"
        if isinstance(ref, float):
            size = max(1, round(ref * n_workers))
            if cursor + size > n_workers:
                taken = ", ".join(groups) or "none"
                raise PlanError(file, key, f"no worker left: {ref:g} of {n_workers} "
                                           f"worker(s) is {size}, but groups before it "
                                           f"({taken}) already take {cursor}")
            groups[name] = tuple(range(cursor, cursor + size))
            cursor += size
        else:
            for i in ref:
                if i >= n_workers:
                    raise PlanError(file, key, f"worker index {i}, but the cluster has "
                                               f"{n_workers} worker(s) (0..{n_workers - 1})")
            groups[name] = tuple(sorted(set(ref)))
    if spec.placement.strategy == "disaggregated":
        if n_workers < 2:
            raise PlanError(file, "placement.strategy", "disaggregated needs at least 2 "
                                                        "workers (generation and training "
                                                        "apart); the cluster has 1")
        if "rollout" not in groups:
            training = set(groups.get("train", ()))
            free = [i for i in range(n_workers) if i not in training]
            groups["rollout"] = tuple(free[:max(1, len(free) // 2)]) if training else \
                tuple(range(max(1, n_workers // 2)))
        if "train" not in groups:
            groups["train"] = tuple(i for i in range(n_workers) if i not in groups["rollout"])
        for name in ("rollout", "train"):
            if not groups[name]:
                raise PlanError(file, f"placement.groups.{name}",
                                f"the {name} group has no worker")
    return groups


def _blocks(n_workers: int, n_models: int) -> list[tuple[int, ...]]:
    """``min(n_workers, n_models)`` contiguous blocks of near-equal size."""
    count = max(1, min(n_workers, n_models))
    base, extra = divmod(n_workers, count)
    blocks, start = [], 0
    for i in range(count):
        size = base + (1 if i < extra else 0)
        blocks.append(tuple(range(start, start + size)))
        start += size
    return blocks


def _check_gangs(file: Path, stages: Mapping[str, StagePlan], graph: StageGraph) -> None:
    """Each worker belongs to at most one gang's process group: gangs share all their
    workers or none."""
    seen: dict[tuple[int, ...], str] = {}
    for name, plan in stages.items():
        if not plan.gang:
            continue
        for workers, other in seen.items():
            if workers != plan.workers and set(workers) & set(plan.workers):
                model, other_model = graph.nodes[name].model, graph.nodes[other].model
                raise PlanError(file, f"placement.models.{model}",
                                f"training on workers {list(plan.workers)} overlaps the "
                                f"training of {other_model!r} on {list(workers)}; trained "
                                f"models must share all their workers or none")
        seen.setdefault(plan.workers, name)


def _check_sharded(pipeline: Pipeline, stages: Mapping[str, StagePlan],
                   homes: Mapping[str, tuple[int, ...]]) -> None:
    """A model trained with ``backend: fsdp`` is sharded over at least two workers, and
    only its training runs there: any other forward on a shard would be a collective
    the other ranks never join (its generation and inference run on shadows)."""
    spec, graph, file = pipeline.spec, pipeline.graph, pipeline.source
    for name, stage in spec.stages.items():
        model = graph.nodes[name].model if name in graph.nodes else None
        if model is not None and stage.deepspeed is not None and \
                stage.deepspeed.zero_stage == 3 and len(homes[model]) > 1:
            # each rank then holds a slice of every weight, and the forwards of other
            # stages and the transfers to shadows read whole ones: a colocated PPO run
            # hung before its first iteration (2026-11-28, 2 CPU workers)
            raise PlanError(file, f"stages.{name}.deepspeed.zero_stage", f"ZeRO-3 "
                            f"partitions model {model!r} over workers "
                            f"{list(homes[model])}, which rlhfflow's forwards and weight "
                            f"transfers do not gather; shard it with backend: fsdp "
                            f"(docs/how-to/sharded-training.md), or use zero_stage 2")
        if stage.backend != "fsdp" or model is None:
            continue
        home = homes[model]
        if len(home) < 2:
            raise PlanError(file, f"stages.{name}.backend", f"backend: fsdp shards model "
                            f"{model!r} over its workers, and it has one ({list(home)}); "
                            f"give it 2 or more (placement.models.{model} or the train "
                            f"group), or use backend: torch")
        # a frozen view of a LoRA model's base is that model's weights too
        views = [m for m in spec.models if pipeline.lora_base(m) == model]
        for used in (model, *views):
            for user in graph.users(used):
                node = graph.nodes[user]
                if node.trains or not set(stages[user].workers) & set(home):
                    continue
                what = f"model {used!r}" + (f" (the base of {model!r})" if used != model
                                            else "")
                raise PlanError(file, f"placement.stages.{user}", f"stage {user!r} uses "
                                f"{what}, sharded on workers {list(home)} (stage {name!r}, "
                                f"backend: fsdp): run it elsewhere, on a shadow "
                                f"(placement.strategy: disaggregated, or "
                                f"placement.stages.{user}: rollout)")




def model_sizes(pipeline: Pipeline) -> dict[str, int]:
    """Parameter bytes of every model, from its config (built on the meta device; 0 for
    a model not on disk yet)."""
    return {name: shape.nbytes for name, shape in model_shapes(pipeline).items()}
