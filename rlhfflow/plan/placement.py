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

from rlhfflow.config.pipeline import Pipeline
from rlhfflow.errors import SpecError, did_you_mean
from rlhfflow.plan.shapes import model_shapes

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

    def to_text(self, pipeline: Pipeline) -> str:
        """A human-readable plan (``rlhfflow plan``)."""
        return "\n".join(_describe(self, pipeline))


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

    def resolve(ref, key: str) -> tuple[int, ...]:
        if isinstance(ref, str):
            if ref not in groups:
                hint = did_you_mean(ref, groups) if groups else ""
                known = f"; groups: {', '.join(groups)}" if groups else \
                    "; no placement.groups are defined"
                raise PlanError(file, key, f"unknown group {ref!r}{hint or known}")
            return groups[ref]
        indexes = [ref] if isinstance(ref, int) else list(ref)
        for i in indexes:
            if i >= n_workers:
                raise PlanError(file, key, f"worker index {i}, but the cluster has "
                                           f"{n_workers} worker(s) (0..{n_workers - 1})")
        return tuple(sorted(set(indexes)))

    used = [m for m in spec.models if graph.users(m)]
    homes: dict[str, tuple[int, ...]] = {
        m: resolve(ref, f"placement.models.{m}") for m, ref in placement.models.items()
        if m in used}
    rest = [m for m in used if m not in homes]
    if placement.strategy == "colocated":
        homes.update({m: tuple(range(n_workers)) for m in rest})
    elif placement.strategy == "disaggregated":
        homes.update({m: groups["train"] for m in rest})
    else:
        blocks = list(groups.values()) if groups else _blocks(n_workers, len(used))
        load = [sum(sizes.get(m, 0) for m in homes if homes[m] == b) for b in blocks]
        # trainable models first (they carry optimizer state), then the largest
        for m in sorted(rest, key=lambda m: (not spec.models[m].trainable, -sizes.get(m, 0),
                                             used.index(m))):
            if pipeline.lora_base(m) in homes:  # a view of a LoRA model's base: beside it
                homes[m] = homes[pipeline.lora_base(m)]
                continue
            i = min(range(len(blocks)), key=lambda i: (load[i], i))
            homes[m] = blocks[i]
            load[i] += sizes.get(m, 0)

    overlap = spec.overlap
    staleness = 0 if overlap.sequential else overlap.max_staleness
    # with staleness, the generating model's inference runs ahead on older weights
    ahead_models = {graph.nodes[g].model for g in graph.generators()
                    if staleness and graph.nodes[g].model in spec.models
                    and spec.models[graph.nodes[g].model].trainable}
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
        if explicit is not None:
            workers = resolve(explicit, key)
        elif placement.strategy == "disaggregated" and (node.generates or ahead):
            # behaviour log-probs are computed next to generation, with its weights
            workers = groups["rollout"]
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

    plan_replicas = {m: tuple(sorted(w)) for m, w in replicas.items()}
    _check_gangs(file, stages, graph)
    transfers = []
    for m in used:
        targets = tuple(w for w in plan_replicas[m] if w not in homes[m])
        trainers = [t for t in graph.trainers(m) if not graph.nodes[t].once]
        if targets and trainers and spec.models[m].trainable:
            nbytes = sizes.get(m, 0)
            if spec.models[m].lora is not None:  # a LoRA model moves its adapters only
                nbytes = model_shapes(pipeline)[m].moved_bytes
            transfers.append(Transfer(m, trainers[-1], homes[m][0], targets, nbytes))
    fused = () if overlap.sequential or not overlap.fuse else _fuse(pipeline, stages)
    return ExecutionPlan(placement.strategy, n_workers, groups, homes, plan_replicas, stages,
                         tuple(transfers), sizes, fused, staleness, overlap.sequential)


def _micro_batches(pipeline: Pipeline, name: str) -> int | None:
    """The micro-batches of a loop stage that works on micro-batches (None otherwise)."""
    node, spec = pipeline.graph.nodes[name], pipeline.spec
    if node.per_batch or node.once or spec.data is None:
        return None
    rows = spec.data.batch_size * spec.data.samples_per_prompt
    return min(rows, spec.stages[name].micro_batches or spec.data.micro_batches)


def inputs_of(graph, name: str) -> list[str]:
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
    groups: list[dict] = []
    for name in graph.loop_stages:
        sp = stages[name]
        whole = sp.micro_batches is None
        if whole and (sp.gang or not graph.nodes[name].per_batch):
            continue
        waits = set(inputs_of(graph, name))
        joined = None
        if spec.stages[name].fuse:
            for g in reversed(groups):
                # a group of one micro-batch is a whole batch: whole-batch stages join it
                kind = g["whole"] == whole and sp.micro_batches == g["mb"] or \
                    whole and g["mb"] == 1
                if not kind or not g["fuse"] or sp.lag != g["lag"] or \
                        graph.nodes[name].every != g["every"]:
                    continue
                if whole:
                    # next to the group in the compile order, so compiling the group
                    # at its first stage moves no stage past another's tasks
                    if graph.loop_stages.index(g["order"][-1]) + 1 != \
                            graph.loop_stages.index(name):
                        continue
                    # nothing after an update in its task: the next rollout waits for
                    # the new weights, not for more work (and each update's metrics
                    # stay its own)
                    if any(graph.nodes[m].trains for m in g["members"]):
                        continue
                    place = not sp.workers or not g["workers"] or sp.workers == g["workers"]
                    first = stages[g["order"][0]]
                    if first.micro_batches is not None:
                        # a group of micro-batch stages may have skipped stages of the
                        # loop (a micro-batch stage joins any earlier group): it is
                        # compiled at its first stage, so this stage's waits must all
                        # come before that, which holds when the group is a contiguous
                        # run of the loop; and its tasks run where its first stage says,
                        # so a stage with a model joins only a group whose first stage
                        # runs exactly where it does
                        loop = graph.loop_stages
                        span = loop[loop.index(g["order"][0]):loop.index(name)]
                        place = place and set(span) == g["members"] and \
                            (not sp.workers or sp.workers == first.workers)
                    new = waits - g["members"] - g["waits"]
                    # no new wait on a member's consumer (a cycle), and no other
                    # consumer of a member made to wait for this stage's work (PPO's
                    # critic update would wait for the actor's)
                    consumers = {c for c in graph.loop_stages if c != name and
                                 c not in g["members"] and graph.upstream(c) & g["members"]}
                    ok = not any(graph.upstream(x) & g["members"] for x in new) and \
                        all(name in graph.upstream(c) for c in consumers)
                else:
                    place = sp.workers == g["workers"] or (not sp.workers and g["workers"])
                    ok = waits <= g["members"] | g["waits"]
                if place and ok:
                    joined = g
                    break
        if joined is None:
            groups.append({"members": {name}, "order": [name], "waits": waits,
                           "workers": sp.workers, "mb": sp.micro_batches, "lag": sp.lag,
                           "fuse": spec.stages[name].fuse, "whole": whole,
                           "every": graph.nodes[name].every})
        else:
            joined["members"].add(name)
            joined["order"].append(name)
            joined["waits"] |= waits - joined["members"]
            joined["workers"] = joined["workers"] or sp.workers
            joined["whole"] = joined["whole"] or whole  # no micro-batch stage after it
    return tuple(tuple(g["order"]) for g in groups if len(g["order"]) > 1)


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
            taken = set(groups.get("train", ()))
            free = [i for i in range(n_workers) if i not in taken]
            groups["rollout"] = tuple(free[:max(1, len(free) // 2)]) if taken else \
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


def _check_gangs(file, stages: Mapping[str, StagePlan], graph) -> None:
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


def model_sizes(pipeline: Pipeline) -> dict[str, int]:
    """Parameter bytes of every model, from its config (built on the meta device; 0 for
    a model not on disk yet)."""
    return {name: shape.nbytes for name, shape in model_shapes(pipeline).items()}


# --------------------------------------------------------------------------- text


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _ws(workers: tuple[int, ...]) -> str:
    return ",".join(str(w) for w in workers)


def _describe(plan: ExecutionPlan, pipeline: Pipeline) -> list[str]:
    spec, graph = pipeline.spec, pipeline.graph
    rows = spec.data.batch_size * spec.data.samples_per_prompt if spec.data else 0
    micro = spec.data.micro_batches if spec.data else 1
    lines = [f"plan: {pipeline.name}: strategy {plan.strategy} on {plan.n_workers} "
             f"worker(s); {rows} rows per iteration in {micro} micro-batch(es)"]
    if plan.groups:
        lines.append("groups:")
        lines += [f"  {g:<14} workers {_ws(w)}" for g, w in plan.groups.items()]
    lines.append("models:")
    for m, home in plan.homes.items():
        shadows = plan.shadows(m)
        extra = ""
        if shadows:
            extra = (f"; shadow on {_ws(shadows)}" if spec.models[m].trainable
                     else f"; replica on {_ws(shadows)}")
        lines.append(f"  {m:<14} workers {_ws(home)} ({_size(plan.model_bytes.get(m, 0))}, "
                     f"{'trained' if spec.models[m].trainable else 'frozen'}){extra}")
    lines.append("stages:")
    for name in graph.order:
        node, sp = graph.nodes[name], plan.stages[name]
        n_mb = sp.micro_batches or 1
        group = plan.group(name)
        if not sp.workers and len(group) > 1:
            where = "with its group"
            split = "whole batch" if sp.micro_batches is None else f"{n_mb} micro-batch(es)"
        elif not sp.workers:
            where, split = "any worker", ("whole batch" if node.per_batch else
                                          f"{n_mb} micro-batch(es), on whichever worker "
                                          f"is free")
        elif sp.gang and len(sp.workers) == 1:
            where, split = f"worker {sp.workers[0]}", "whole batch (a gang of one)"
        elif sp.gang:
            where = f"workers {_ws(sp.workers)}"
            split = (f"data-parallel gang of {len(sp.workers)}: each minibatch split "
                     f"{len(sp.workers)} ways, gradients all-reduced")
        elif node.once or node.per_batch:
            where, split = f"worker {sp.workers[0]}", "whole batch"
        else:
            where = f"worker{'s' if len(sp.workers) > 1 else ''} {_ws(sp.workers)}"
            split = f"{n_mb} micro-batch(es)"
            if len(sp.workers) > 1:
                split += ", each on whichever of them is free"
            if n_mb < len(sp.workers):
                split += f" (only {n_mb} of {len(sp.workers)} workers busy: raise " \
                         f"micro_batches)"
        tag = " [shadow]" if sp.shadow else ""
        if len(group) > 1 and group[0] != name:
            tag += f" [fused into {group[0]}]"
        if sp.lag:
            tag += f" [ahead {sp.lag}]"
        kind = "setup" if node.once else node.type
        lines.append(f"  {name:<14} {kind:<12} {where:<14} {split}{tag}")
    lines.append("overlap:")
    if plan.sequential:
        lines.append("  sequential: each stage waits for the whole previous one, each "
                     "iteration for the previous one (no streaming, fusion or overlap)")
    else:
        lines.append("  streaming: each micro-batch moves on as soon as it is ready; "
                     "iteration k+1 starts as soon as its inputs exist")
        if plan.max_staleness:
            ahead = [n for n, sp in plan.stages.items() if sp.lag]
            lines.append(f"  max_staleness {plan.max_staleness}: {', '.join(ahead)} of "
                         f"iteration k run with the actor of iteration k-{plan.max_staleness}"
                         f" (behaviour log-probs kept for the PPO ratio)")
        else:
            lines.append("  max_staleness 0: strictly on-policy")
        for g in plan.fused:
            per = "iteration" if plan.stages[g[0]].micro_batches in (None, 1) else "micro-batch"
            lines.append(f"  fused: {' + '.join(g)} (one task per {per})")
        if not plan.fused:
            lines.append("  fused: none")
    lines.append("weights moved:")
    moved = False
    for t in plan.transfers:
        moved = True
        lines.append(f"  {t.model}: after {t.after}, worker {t.source} -> {_ws(t.targets)}: "
                     f"{_size(t.nbytes)} x {len(t.targets)} = {_size(t.nbytes * len(t.targets))}"
                     f" per iteration")
    for name, sp in plan.stages.items():
        if sp.gang:
            moved = True
            m, n = graph.nodes[name].model, len(sp.workers)
            if n == 1:
                continue
            ring = int(plan.model_bytes.get(m, 0) * 2 * (n - 1) / n)
            lines.append(f"  {m}: {name} all-reduces gradients over workers {_ws(sp.workers)}: "
                         f"{_size(ring)} per worker per optimizer step")
    if not moved:
        lines.append("  none: every model is updated where it is used")
    loads = {m: len(r) for m, r in plan.replicas.items() if len(r) > 1}
    if loads:
        lines.append("  (at start, each copy loads from disk: "
                     + ", ".join(f"{m} x{n}" for m, n in loads.items()) + ")")
    return lines
