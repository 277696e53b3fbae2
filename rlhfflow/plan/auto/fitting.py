"""Whether a plan fits its workers' memory, and what would (docs/concepts/planner.md):
the bytes a worker may hold (its limit at Dask's pause fraction), the memory settings the
planner may choose itself when nothing fits (sharding a trainer, checkpointing its
activations), and the one line that refuses a plan over ``cluster.memory_limit``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from rlhfflow.config.pipeline import derive
from rlhfflow.plan.auto.costmodel import CostModel, Profile
from rlhfflow.plan.placement import ExecutionPlan, PlanError, make_plan

if TYPE_CHECKING:
    from rlhfflow.config.pipeline import Pipeline


def worker_capacity(pipeline: Pipeline, workers: int, profile: Profile | None) -> float:
    """Bytes one worker may hold: ``cluster.memory_limit``, else the device memory the
    profile recorded (a GPU's), else this machine's memory split between the workers.
    Of a worker's own limit, the share below which Dask keeps it running tasks
    (``distributed.worker.memory.pause``, 80% by default): a worker over it pauses, and
    a gang with a paused rank waits for ever (measured: a sharded run at 80% of a
    650 MB limit made no progress in 7 minutes)."""
    from dask.utils import parse_bytes

    limit = pipeline.spec.cluster.memory_limit
    if limit not in ("auto", "0", 0):
        try:
            return float(parse_bytes(limit)) * pause_fraction()
        except (ValueError, TypeError):
            pass
    if profile is not None and profile.device.get("memory_bytes"):
        return float(profile.device["memory_bytes"])
    import os

    import psutil

    # this machine's memory, split among the workers it could run (a cluster planned
    # larger than the machine is assumed to have machines like it)
    return float(psutil.virtual_memory().total / max(1, min(workers, os.cpu_count() or 1))
                 ) * pause_fraction()


def pause_fraction() -> float:
    """The share of its memory limit at which a Dask worker pauses (stops starting tasks):
    ``distributed.worker.memory.pause``, else the nanny's ``terminate`` (1 when neither
    is set)."""
    import dask

    # Dask's defaults where distributed (whose config holds them) is not imported yet
    for key, default in (("pause", 0.8), ("terminate", 0.95)):
        value = dask.config.get(f"distributed.worker.memory.{key}", default)
        if value not in (False, None):
            return float(value)
    return 1.0


def shardable(pipeline: Pipeline) -> list[str]:
    """The training stages the planner may shard (``backend: fsdp``): a loop
    ``train_actor``/``train_critic`` whose ``backend`` the file leaves unset, of a model
    in float32 or bfloat16 (what validation accepts under fsdp); a LoRA model's frozen
    base is sharded with its adapters."""
    spec = pipeline.spec
    out = []
    for name in pipeline.graph.loop_stages:
        stage, node = spec.stages[name], pipeline.graph.nodes[name]
        if not node.trains or node.model is None or "backend" in stage.model_fields_set:
            continue
        model = spec.models[node.model]
        if stage.type in ("train_actor", "train_critic") and model.dtype != "float16" \
                and model.trainable:
            out.append(name)
    return out


def memory_fits(pipeline: Pipeline) -> list[dict[str, Any]]:
    """The memory settings the planner tries, in order, when no plan fits as written:
    every shardable trainer sharded, then also each trained model's activations
    checkpointed (where the file leaves ``gradient_checkpointing`` unset)."""
    stages = shardable(pipeline)
    models = sorted({pipeline.graph.model_of(n) for n in pipeline.graph.loop_stages
                     if pipeline.graph.nodes[n].trains})
    checkpoint = {f"models.{m}.gradient_checkpointing": True for m in models
                  if not pipeline.spec.models[m].gradient_checkpointing and
                  "gradient_checkpointing" not in pipeline.spec.models[m].model_fields_set}
    sharded = {f"stages.{n}.backend": "fsdp" for n in stages}
    out = [fits for fits in (sharded, {**sharded, **checkpoint}) if fits]
    return [f for i, f in enumerate(out) if f not in out[:i]]


def describe_fit(key: str) -> str:
    """A memory setting the planner chose, in a few words."""
    parts = key.split(".")
    if parts[-1] == "backend":
        return f"{parts[1]} sharded (backend: fsdp)"
    return f"{parts[1]} gradient checkpointing"


def rows_per_task(run: Pipeline, plan: ExecutionPlan) -> dict[str, int]:
    """The rows of one task of each stage of ``plan``."""
    assert run.spec.data is not None  # a pipeline with loop stages has a data section
    rows = run.spec.data.batch_size * run.spec.data.samples_per_prompt
    return {n: (rows if sp.micro_batches is None else -(-rows // sp.micro_batches))
            for n, sp in plan.stages.items()}


def derive_fits(run: Pipeline, fits: Mapping[str, Any]) -> Pipeline:
    """``run`` with memory settings changed; a stage's params (``stages.NAME.params.KEY``)
    in its typed params too, which ``derive`` keeps."""
    tried = derive(run, fits)
    params = dict(tried.params)
    for key, value in fits.items():
        parts = key.split(".")
        if parts[0] == "stages" and len(parts) == 4 and parts[2] == "params":
            params[parts[1]] = params[parts[1]].model_copy(update={parts[3]: value})
    return replace(tried, params=params)


def check_memory(pipeline: Pipeline, n_workers: int) -> None:
    """Refuse a pipeline whose plan (its own strategy, on ``n_workers`` workers) does not
    fit ``cluster.memory_limit`` where one is set: a ``PlanError`` of one line
    (:func:`does_not_fit`). Without a limit nothing is checked (the machine's memory
    split between the workers is the planner's guess, not a limit the workers keep)."""
    limit = pipeline.spec.cluster.memory_limit
    if limit in ("auto", "0", 0) or pipeline.spec.data is None or \
            pipeline.spec.placement.strategy == "auto":
        return
    cost = CostModel(pipeline)
    plan = make_plan(pipeline, n_workers, {m: s.nbytes for m, s in cost.shapes.items()})
    per_task = rows_per_task(pipeline, plan)
    parts = cost.memory_parts(plan, per_task)
    capacity = worker_capacity(pipeline, n_workers, None)
    need = [sum(p.values()) for p in parts]
    w = max(range(len(need)), key=lambda i: need[i])
    if need[w] > capacity:
        raise PlanError(pipeline.source, "cluster.memory_limit",
                        does_not_fit(pipeline, cost, plan, per_task, w, parts[w], capacity))


def does_not_fit(run: Pipeline, cost: CostModel, plan: ExecutionPlan,
                 per_task: Mapping[str, int], w: int, parts: Mapping[str, float],
                 capacity: float) -> str:
    """One line: worker ``w`` needs this much (of what), over the limit, and what would
    fit there (the settings tried on this plan: sharding, checkpointing, more
    micro-batches or minibatches; LoRA named where a trained model's state is the
    most of it)."""
    limit = run.spec.cluster.memory_limit
    source = "cluster.memory_limit" if limit not in ("auto", "0", 0) else \
        "the machine's memory split between the workers"
    held = ", ".join(f"{k} {size(v)}" for k, v in parts.items() if v > 0)
    text = (f"does not fit: worker {w} needs {size(sum(parts.values()))} ({held}) over its "
            f"{size(capacity)} limit ({source}, at Dask's pause fraction "
            f"{pause_fraction():g})")
    remedies = []
    for fits in _remedies(run, plan, w):
        try:
            tried = derive_fits(run, fits)
            other = make_plan(tried, plan.n_workers, {m: s.nbytes for m, s in
                                                      cost.shapes.items()})
        except PlanError:
            continue
        need = max(cost.with_pipeline(tried).memory(other, rows_per_task(tried, other)))
        if need <= capacity:  # on every worker
            remedies.append(", ".join(f"{k}: {str(v).lower()}" for k, v in fits.items()) +
                            f" ({size(need)})")
    if remedies:
        text += "; would fit: " + "; or ".join(remedies)
    else:
        text += "; no one of backend: fsdp, gradient_checkpointing, more minibatches or " \
            "micro-batches fits alone"
    trained = [m for m, home in plan.homes.items() if w in home and
               run.spec.models[m].trainable and run.spec.models[m].lora is None]
    if trained and parts.get("trainer", 0) > parts.get("work", 0):
        text += f"; models.{trained[0]}.lora trains adapters only"
    return text


def size(nbytes: float) -> str:
    """Bytes in GiB (1 GiB and more) or MiB, for a memory line."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _remedies(run: Pipeline, plan: ExecutionPlan, w: int) -> list[dict[str, Any]]:
    """Settings that lower worker ``w``'s need, one change each: shard a trainer there
    over its home, checkpoint a trained model's activations, twice the rows' split."""
    out: list[dict[str, Any]] = []
    graph, spec = run.graph, run.spec
    for name in graph.loop_stages:
        node = graph.nodes[name]
        if not node.trains or node.model is None or w not in plan.stages[name].workers:
            continue
        model = spec.models[node.model]
        if spec.stages[name].backend == "torch" and model.dtype != "float16":
            out.append({f"stages.{name}.backend": "fsdp"})
            if spec.placement.strategy != "disaggregated":  # generation on a shadow
                out.append({"placement.strategy": "disaggregated",
                            f"stages.{name}.backend": "fsdp"})
        if not model.gradient_checkpointing:
            out.append({f"models.{node.model}.gradient_checkpointing": True})
        params = run.params[name]
        if hasattr(params, "minibatches"):
            out.append({f"stages.{name}.params.minibatches": 2 * int(params.minibatches)})
    assert spec.data is not None  # planned: a pipeline with loop stages
    out.append({"data.micro_batches": 2 * spec.data.micro_batches})
    return out
