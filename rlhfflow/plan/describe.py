"""An execution plan in words, as ``rlhfflow plan`` prints it: where each model lives,
where each stage runs and how its batch is split, what overlaps, and which weights move."""

from __future__ import annotations

from collections.abc import Sequence

from rlhfflow.config.graph import StageGraph, StageNode
from rlhfflow.config.pipeline import Pipeline
from rlhfflow.plan.placement import ExecutionPlan, StagePlan


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _ws(workers: tuple[int, ...]) -> str:
    return ",".join(str(w) for w in workers)


def plan_text(plan: ExecutionPlan, pipeline: Pipeline) -> str:
    """The plan as ``rlhfflow plan`` prints it: groups, models, stages, overlap and the
    weights that move."""
    spec = pipeline.spec
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
    sharded = frozenset(n for n, st in spec.stages.items() if st.backend == "fsdp")
    lines += [_stage_line(plan, pipeline.graph.nodes[name], name in sharded)
              for name in pipeline.graph.order]
    lines.append("overlap:")
    lines += _overlap_lines(plan, [n for n in plan.stages
                                   if pipeline.graph.nodes[n].streams],
                            [n for n in plan.stages if pipeline.graph.nodes[n].reorders])
    lines.append("weights moved:")
    lines += _moved_lines(plan, pipeline.graph, sharded)
    return "\n".join(lines)


def _stage_line(plan: ExecutionPlan, node: StageNode, sharded: bool = False) -> str:
    """One stage of the plan: its type, where it runs and how its batch is split
    (``sharded``: it trains its model sharded over its gang, ``backend: fsdp``)."""
    name, sp, group = node.name, plan.stages[node.name], plan.group(node.name)
    where, split = _where_and_split(node, sp, group)
    if sharded and sp.gang and len(sp.workers) > 1:
        split = (f"sharded over {len(sp.workers)} workers (backend: fsdp): each minibatch "
                 f"split {len(sp.workers)} ways, weights gathered a layer at a time")
    tag = " [shadow]" if sp.shadow else ""
    if len(group) > 1 and group[0] != name:
        tag += f" [fused into {group[0]}]"
    if sp.lag:
        tag += f" [ahead {sp.lag}]"
    kind = "setup" if node.once else node.type
    return f"  {name:<14} {kind:<12} {where:<14} {split}{tag}"


def _where_and_split(node: StageNode, sp: StagePlan, group: tuple[str, ...]
                     ) -> tuple[str, str]:
    """Where a stage runs and how its batch is split among its tasks, in words."""
    n_mb = sp.micro_batches or 1
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
        if len(sp.workers) > 1 and node.streams:
            split += ", micro-batch j always on the same one (its episodes stay there)"
        elif len(sp.workers) > 1:
            split += ", each on whichever of them is free"
        if n_mb < len(sp.workers):
            split += f" (only {n_mb} of {len(sp.workers)} workers busy: raise " \
                     f"micro_batches)"
    return where, split


def _overlap_lines(plan: ExecutionPlan, streams: list[str],
                   reorders: Sequence[str] = ()) -> list[str]:
    """What runs at the same time: streaming, stages ahead, episodes streamed (by the
    stages ``streams``, in finish order by ``reorders``), fused stages."""
    if plan.sequential:
        return ["  sequential: each stage waits for the whole previous one, each "
                "iteration for the previous one (no streaming, fusion or overlap)"]
    lines = ["  streaming: each micro-batch moves on as soon as it is ready; "
             "iteration k+1 starts as soon as its inputs exist"]
    if plan.max_staleness and streams:
        lines.append(f"  max_staleness {plan.max_staleness}: {', '.join(streams)} streams "
                     f"episodes: iteration k's task starts those of the next "
                     f"{plan.max_staleness} iteration(s) as room frees and they go on across the weight "
                     f"updates (each token records the policy version that sampled it)")
        if reorders:
            lines.append(f"  finish order: {', '.join(reorders)} returns the groups that "
                         f"finished first, whichever iteration's prompts they answer; a "
                         f"group started on weights {plan.max_staleness} version(s) back is "
                         f"taken first (the bound), so a step waits for those, or for "
                         f"enough finished groups")
    elif plan.max_staleness:
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
    return lines


def _moved_lines(plan: ExecutionPlan, graph: StageGraph, sharded: frozenset[str] = frozenset()
                 ) -> list[str]:
    """The weights sent to shadows and the gradients all-reduced (a sharded trainer's:
    weights gathered in the forward and backward, gradients reduce-scattered), per
    iteration."""
    lines = []
    moved = False
    for t in plan.transfers:
        moved = True
        lines.append(f"  {t.model}: after {t.after}, worker {t.source} -> {_ws(t.targets)}: "
                     f"{_size(t.nbytes)} x {len(t.targets)} = {_size(t.nbytes * len(t.targets))}"
                     f" per iteration")
    for name, sp in plan.stages.items():
        if sp.gang:
            moved = True
            m, n = graph.model_of(name), len(sp.workers)
            if n == 1:
                continue
            if name in sharded:
                moves = int(plan.model_bytes.get(m, 0) * 3 * (n - 1) / n)
                lines.append(f"  {m}: {name} gathers weights (forward, backward) and "
                             f"reduce-scatters gradients over workers {_ws(sp.workers)}: "
                             f"{_size(moves)} per worker per optimizer step")
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
