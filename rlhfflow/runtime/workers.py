"""Bringing the workers up for a plan: what each stage is on a worker, the gangs' process
groups, the ``tiny:`` models built where transformers is already imported, and the
facts a run records about its layout."""

from __future__ import annotations

import uuid
from functools import partial
from typing import Any
from urllib.parse import urlsplit

from rlhfflow.config.loader import Pipeline
from rlhfflow.engine.models import save_tiny_model
from rlhfflow.plan.layout import default_torch_threads
from rlhfflow.plan.placement import ExecutionPlan, PlanError
from rlhfflow.runtime.backend import Backend, TaskFailed
from rlhfflow.runtime.cluster import ENV_RESOURCE
from rlhfflow.runtime.failures import RunError, disk_full, is_disk_full
from rlhfflow.runtime.worker.host import StageDef, gang_port, join_gang_task


def stage_defs(pipeline: Pipeline) -> dict[str, StageDef]:
    """Every stage as the workers create it: its type by import path (so a plugin type
    needs no registration on the workers), params, model, the columns it reads and the
    figures it declares (summed by the store tasks)."""
    defs = {}
    for name, node in pipeline.graph.nodes.items():
        stage = pipeline.spec.stages[name]
        ds = stage.deepspeed.model_dump() if stage.deepspeed else None
        defs[name] = StageDef(node.impl or node.type, pipeline.params[name],
                              node.model, node.reads,
                              backend=stage.backend, deepspeed=ds, metrics=node.metrics)
    return defs


def layout(pipeline: Pipeline, plan: ExecutionPlan, workers: int) -> dict[str, Any]:
    """Torch threads per worker (None: unknown, on an external cluster) and the size of
    each training gang: what the task intervals were measured under."""
    cluster = pipeline.spec.cluster
    threads = cluster.torch_threads
    if threads is None and cluster.address is None:
        threads = default_torch_threads(workers)
    return {"workers": workers, "threads": threads,
            "gangs": {n: len(sp.workers) for n, sp in plan.stages.items() if sp.gang}}


def rows_topic(pipeline: Pipeline, plan: ExecutionPlan, backend: Backend, threads: int,
               choice=None) -> str | None:
    """The event topic of sample reallocation (``rebalance``): set when a generating
    stage with ``params.migrate`` runs as micro-batch tasks on several Dask workers
    and, under ``placement: auto`` (``choice``), its tasks are predicted to take
    ``MIN_TASK_S`` or more."""
    from rlhfflow.runtime.worker.rebalance import MIN_TASK_S

    if backend.in_process:
        return None
    spec = pipeline.spec
    rows = spec.data.batch_size * spec.data.samples_per_prompt if spec.data else 0
    for name, sp in plan.stages.items():
        if not (pipeline.graph.nodes[name].generates and len(sp.workers) > 1 and
                sp.micro_batches and sp.micro_batches > 1 and not sp.gang and
                getattr(pipeline.params[name], "migrate", False)):
            continue
        # placement: auto knows what a task costs: too short a task cannot repay
        # a handover, nor the announcements every task then makes
        if choice is not None and choice.cost.stage_seconds(
                name, max(rows // sp.micro_batches, 1), threads) < MIN_TASK_S:
            continue
        return f"rlhfflow-rows-{uuid.uuid4().hex[:12]}"
    return None


def env_pool(pipeline: Pipeline, backend: Backend) -> str | None:
    """The Dask resource of the CPU pool that environment steps go to (``ENV_RESOURCE``),
    or None when no stage puts them there or the backend runs in process (its stages
    then step their environments in their own task). A cluster at ``cluster.address``
    without such workers is a ``RunError``: the steps would wait for them forever."""
    if backend.in_process or \
            not any(node.env_on_pool for node in pipeline.graph.nodes.values()):
        return None
    if not backend.env_workers:
        raise RunError(f"{pipeline.source}: a stage has params.env_placement: pool, and the "
                       f"Dask cluster has no worker with the resource {ENV_RESOURCE!r} (start "
                       f"some with `dask worker ... --resources {ENV_RESOURCE}=1`, or set "
                       f"cluster.env_workers on the embedded cluster)")
    return ENV_RESOURCE


def check_gang_batches(pipeline: Pipeline, plan: ExecutionPlan) -> None:
    """Every rank of a gang needs rows in every minibatch."""
    spec = pipeline.spec
    if spec.data is None:
        return
    rows = spec.data.batch_size * spec.data.samples_per_prompt
    for name, sp in plan.stages.items():
        minibatches = getattr(pipeline.params[name], "minibatches", 1)
        if sp.gang and rows // minibatches < len(sp.workers):
            raise PlanError(pipeline.source, f"stages.{name}.params.minibatches",
                            f"{rows} rows in {minibatches} minibatches leave fewer rows "
                            f"per minibatch than the {len(sp.workers)} workers training "
                            f"it; use fewer minibatches or a larger batch")


def join_gangs(backend: Backend, plan: ExecutionPlan, addresses: list[str],
               timeout: float) -> None:
    """Create each gang's process group on all its members at once (out of band)."""
    for workers in plan.gangs:
        members = [addresses[i] for i in workers]
        host = urlsplit(members[0]).hostname or "127.0.0.1"
        port = backend.run_on_workers(gang_port, host, workers=members[:1])
        port = next(iter(port.values()))
        backend.run_on_workers(join_gang_task, members, host, port, timeout,
                               workers=members)


def build_tiny_models(backend, tiny: dict[str, dict[str, Any]]) -> None:
    """Build the ``tiny:`` models not built yet (``runtime.models.tiny_models``), as tasks
    on the workers: their processes imported transformers' model classes already, and
    the coordinator never needs them (~2.5 s of CPU at start-up on 2 cores)."""
    if not tiny:
        return
    workers = backend.workers
    names = {f"build-{uuid.uuid4().hex[:8]}": name for name in tiny}
    handles = [backend.submit(partial(save_tiny_model, **tiny[name]), key=key,
                              worker=workers[i % len(workers)])
               for i, (key, name) in enumerate(names.items())]
    try:
        backend.wait(handles, pinned=list(workers))
    except TaskFailed as exc:
        name = names[exc.key]
        if is_disk_full(exc.cause):
            raise RunError(disk_full(exc.cause, f"building model {name!r}")) from None
        raise RunError(f"building the tiny model {name!r}: {type(exc.cause).__name__}: "
                       f"{exc.cause}") from exc.cause
