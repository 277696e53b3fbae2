"""What a task runs on a device worker: the task functions the coordinator submits
(a stage, a store, a model save, a checkpoint, a weight transfer), their inputs
(``part``, ``assemble``) and what they return (``TaskResult``, with a store's partial
sums of the iteration's metrics).

Each finds the worker's resident state with ``current_host()``
(``rlhfflow.runtime.worker.host``) and is a plain function of its inputs, so Dask can
retry it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlhfflow.engine.batch import concat_batches, slice_batch
from rlhfflow.engine.forward import shared_prefix, shared_prompt_rows
from rlhfflow.engine.streaming import paused
from rlhfflow.errors import RlhfflowError
from rlhfflow.plan.tasks import Storage
from rlhfflow.runtime.worker.host import WorkerHost, current_host, worker_address
from rlhfflow.runtime.worker.rebalance import exchange_for
from rlhfflow.sdk import Batch, IterationMetric
from rlhfflow.storage import ExperienceBuffer
from rlhfflow.storage.errors import write_score_errors

# --------------------------------------------------------------------------- inputs


def part(results: list[Any], rows: tuple[int, int] | None = None) -> dict[str, Any]:
    """One input of a task: the outputs of one producer (one result per micro-batch, or
    one for the whole batch) and, for a micro-batch task, the rows to take from them.

    A plain dict on purpose: Dask replaces futures only inside builtin containers.
    """
    return {"results": list(results), "rows": rows}


def assemble(parts: list[dict[str, Any]], columns: tuple[str, ...] | None = None) -> Batch:
    """Merge the inputs of a task into one batch of columns, keeping ``columns`` (all if
    None). An input is a stage task's ``TaskResult`` (its columns) or the source's batch.
    A fused task's result may hold per-task values too (a trainer's metrics, fused behind
    the stages that wrote the rows): they are no columns, and left out."""
    batch: Batch = {}
    for p in parts:
        data = concat_batches([r.columns if isinstance(r, TaskResult) else r
                               for r in p["results"]])
        data = {k: v for k, v in data.items() if _has_rows(v)}
        if p["rows"] is not None:
            data = slice_batch(data, *p["rows"])
        for key, value in data.items():
            if columns is None or key in columns:
                batch[key] = value
    return batch


def _has_rows(value: Any) -> bool:
    """Whether ``value`` is a column (a tensor with a row dimension, or a list)."""
    return isinstance(value, list) or (isinstance(value, torch.Tensor) and value.dim() > 0)


# --------------------------------------------------------------------------- tasks


class StaleWeights(RlhfflowError, RuntimeError):
    """A task found another version of a model than the plan expects on its worker."""


class StageFailed(RlhfflowError, RuntimeError):
    """One stage of a fused task failed: names it, and keeps its exception as ``cause``."""

    def __init__(self, stage: str, cause: BaseException) -> None:
        super().__init__(f"stage {stage!r}: {type(cause).__name__}: {cause}")
        self.stage, self.cause = stage, cause

    def __reduce__(self):
        return StageFailed, (self.stage, self.cause)


def check_versions(host: WorkerHost, name: str, versions: Mapping[str, int] | None) -> None:
    """Fail fast when a model on this worker is not the version the plan expects."""
    for model, expected in (versions or {}).items():
        got = host.store.get(model).version
        if got != expected:
            raise StaleWeights(f"model {model!r} is version {got} on worker {worker_address()}, "
                               f"but stage {name!r} expects version {expected}")


#: Ragged text columns of the responses (one string per row) that a store returns for the
#: coordinator to write: the responses, and multi-turn episodes as conversations.
RESPONSE_TEXTS = ("response_text", "turns_json")
#: the source's text, which the stores return where a stage reordered the rows (the
#: coordinator wrote the source's order)
PROMPT_TEXTS = ("prompt_text", "prompt_fields")
#: a stage that reorders rows marks them with the iteration whose prompts they answer
REORDERED = "source_iteration"
#: prompt columns are left-padded: a reordered batch's may be narrower than the buffer's
LEFT_PADDED = ("prompt_ids", "prompt_mask")


@dataclass
class TaskResult:
    """What a stage or store task returns: to the tasks that read its columns
    (``assemble``) and to the coordinator.

    Attributes:
        columns: what the task's stages returned: their columns, and a trainer's or a
            reporting stage's statistics (per-task values, no rows). Empty for a store
            task, or a stage task that stored rows no other task reads.
        stored: for a task that wrote rows to the buffer, the partial sums of the
            iteration's metrics over them (``partial_metrics``); None otherwise.
        texts: with ``stored``, the rows' response texts (``RESPONSE_TEXTS``), for the
            coordinator to write.
        timings: for a task that is its iteration's only task (``StageTask.reports``),
            its worker's task timings (``WorkerHost.pop_timings``) and ``address``; the
            coordinator then asks no worker for them.
    """

    columns: Batch = field(default_factory=dict)
    stored: dict[str, Any] | None = None
    texts: dict[str, list[str]] = field(default_factory=dict)
    timings: dict[str, Any] | None = None


@dataclass(frozen=True)
class StoreRows:
    """What a stage task that writes its own rows to the buffer needs (in place of a
    store task: ``StageTask.storage``): the buffer, the first row, the columns stored,
    whether the task still returns its columns (``Storage.STAGE_TASK``: another task
    reads them) and whether it returns its worker's timings too (the iteration's only
    task, ``StageTask.reports``)."""

    path: str
    start_row: int
    columns: tuple[str, ...]
    storage: Storage = Storage.STAGE_TASK
    reports: bool = False


def holds_streams(fn):
    """A task that writes a model's weights (or plays a stream): the episode streams that
    decode between tasks (``rlhfflow.engine.streaming``) wait while it runs."""
    @functools.wraps(fn)
    def task(*args: Any, **kwargs: Any) -> Any:
        with paused():
            return fn(*args, **kwargs)
    return task


@holds_streams
def stage_task(name: str | tuple[str, ...], iteration: int, parts: list[dict[str, Any]],
               after: list[Any], versions: Mapping[str, int] | None = None,
               gang: tuple[str, ...] | None = None, store: StoreRows | None = None,
               ahead: list[tuple[int, Batch]] | None = None,
               behind: list[tuple[int, Batch]] | None = None, staleness: int = 0,
               taken: frozenset[tuple[int, int, int]] = frozenset()) -> TaskResult:
    """Run stage ``name`` on its assembled inputs; ``after`` only orders the task.

    ``name`` may be a tuple of fused stages: they run one after the other in this task,
    each on its inputs plus the columns the ones before it wrote, and the task returns
    every column they wrote (no serialisation or scheduling between them).
    ``versions`` are the model versions the plan expects here; ``gang`` the members of
    the data-parallel gang this task is one rank of (checked, so a misplaced task fails
    at once instead of hanging in a collective). With ``store`` the task then writes its
    rows to the buffer as a store task would and returns the partial sums too
    (``TaskResult.stored``): one Dask task fewer per iteration, and the write runs before
    the task's result goes out, not beside it. ``ahead``: the task's rows of the next
    iterations, for a stage that streams (``StageContext.ahead``); ``behind``,
    ``staleness`` and ``taken`` for one that reorders rows (``StageContext.behind``)."""
    del after
    host = current_host()
    names = (name,) if isinstance(name, str) else tuple(name)
    check_versions(host, "+".join(names), versions)
    ctx = host.context(iteration)
    ctx.ahead = list(ahead or ())
    ctx.behind, ctx.staleness, ctx.taken = list(behind or ()), staleness, taken
    ctx.between_tasks = True  # this task holds the streams (holds_streams)
    if gang is not None:
        from rlhfflow.engine.parallel import current_gang

        ctx.gang = current_gang()
        if ctx.gang is None or ctx.gang.members != tuple(gang) or \
                gang[ctx.gang.rank] != worker_address():
            raise RuntimeError(f"stage {name!r}: worker {worker_address()} is not a member of the "
                               f"gang {list(gang)} it was sent to")
    if any(host.stage(n).trains and not host.stage(n).once for n in names):
        host.updates.enter(iteration)  # a stop may hold it (UpdateGate)
    if gang is None:
        ctx.peers = exchange_for(host, names, iteration, continue_rows_task)
    defs = host.run.stages
    batch = assemble(parts, None if store else tuple(c for n in names for c in defs[n].reads))
    out: Batch = {}
    rows = batch_rows(batch)
    for n in names:
        stage = host.stage(n)
        inputs = {c: out[c] if c in out else batch[c] for c in defs[n].reads
                  if c in out or c in batch}
        ctx.spans = functools.partial(host.record_part, iteration, n)
        ctx.env_executor = host.env_executor() if stage.plan_hints(stage.params).env_on_pool \
            else None
        with host.timed(iteration, n, rows):
            try:
                out.update(stage.run(inputs, ctx))
            except Exception as exc:
                if len(names) == 1:
                    raise
                raise StageFailed(n, exc) from exc
    # results travel between workers: keep them off the accelerator
    out = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in out.items()}
    if store is None:
        return TaskResult(out)
    written = {**batch, **{k: v for k, v in out.items() if _has_rows(v)}}
    result = write_store(host, store.path, iteration, store.start_row, written,
                         store.columns)
    result.columns = out if store.storage is Storage.STAGE_TASK else \
        {k: v for k, v in out.items() if not _has_rows(v)}
    if store.reports:  # no out-of-band request to the worker's event loop for them
        result.timings = {**host.pop_timings(), "address": worker_address()}
    return result


def continue_rows_task(stage: str, iteration: int, model: str, version: int, cont
                       ) -> tuple[Batch, torch.Tensor] | None:
    """Finish rows another worker's task of generating stage ``stage`` handed over
    (``rlhfflow.runtime.worker.rebalance``): its outputs for those rows, or None when this
    worker's ``model`` is no longer ``version`` (the sender then finishes them)."""
    host = current_host()
    if host.store.get(model).version != version:
        return None
    with host.timed(iteration, stage, 0):
        out, steps = host.stage(stage).continue_rows(cont, host.context(iteration))
    return {k: v.cpu() for k, v in out.items()}, steps


def store_task(path: str, iteration: int, start_row: int, parts: list[dict[str, Any]],
               columns: list[str], after: list[Any] = ()) -> TaskResult:
    """Write one micro-batch's experience to the buffer (its own chunk-aligned rows) and
    return partial sums for the iteration's metrics, with the micro-batch's response
    texts for the coordinator to store; ``after`` only orders the task."""
    del after
    return write_store(current_host(), path, iteration, start_row, assemble(parts), columns)


def write_store(host: WorkerHost, path: str, iteration: int, start_row: int, batch: Batch,
                columns: Sequence[str]) -> TaskResult:
    """Write ``batch``'s ``columns`` to the buffer from ``start_row`` on (timed as
    ``store``); the partial sums for the iteration's metrics, with the response texts."""
    with host.timed(iteration, "store", batch_rows(batch)):
        tensors = {k: v for k, v in batch.items()
                   if k in columns and isinstance(v, torch.Tensor)}
        ExperienceBuffer.write_rows(path, iteration, start_row, tensors, left=LEFT_PADDED)
        if "score_error" in batch:  # reward errors skipped (on_error: skip): list them
            write_score_errors(Path(path).parent, iteration, start_row, batch["score_error"],
                               batch.get("prompt_text"), batch.get("response_text"))
        declared = [m for d in host.run.stages.values() for m in d.metrics]
        # ragged text: the coordinator stores it
        texts = {name: list(batch[name]) for name in RESPONSE_TEXTS if name in batch}
        if REORDERED in batch:
            texts.update({name: list(batch[name]) for name in PROMPT_TEXTS if name in batch})
        return TaskResult(stored=partial_metrics(batch, declared), texts=texts)


def batch_rows(batch: Batch) -> int:
    """The rows of a batch (0 for a task without inputs, e.g. a setup stage)."""
    return next((len(v) for v in batch.values()), 0)


def _shared_head(batch: Batch, shared: tuple[torch.Tensor, torch.Tensor] | None) -> int:
    """The leading real tokens the distinct prompts of ``batch`` share and every forward
    runs once (``rlhfflow.engine.forward.shared_prefix``), else 0."""
    if "prompt_ids" not in batch:
        return 0
    ids, mask = batch["prompt_ids"], batch["prompt_mask"]
    if shared is not None:
        ids, mask = ids[shared[0]], mask[shared[0]]
    return shared_prefix(ids, mask)


def partial_metrics(batch: Batch, declared: Sequence[IterationMetric] = ()
                    ) -> dict[str, Any]:
    """Sums over one micro-batch, combined across micro-batches by the coordinator
    (``rlhfflow.runtime.telemetry``): under ``METRICS``, those of the ``declared``
    figures whose columns ``batch`` holds (``declared_sums``).

    The rest are the runtime's own because every pipeline or a capability of the SDK
    defines their columns, not one stage type: the rows and response tokens
    (``response_mask``, which every pipeline's rows have), what the model FLOPs are
    counted on (``prompt_mask``, ``prompt_ids``), and a scorer's ``scores``,
    ``score_valid``, ``score_error`` and ``score_retries`` (``Stage.scores``), which the
    record's ``reward_mean``/``reward_std`` and the error budget read.
    """
    mask = batch["response_mask"].float()
    lengths = mask.sum(-1)
    out: dict[str, Any] = {"rows": float(len(lengths)), "length_sum": float(lengths.sum()),
                           "tokens": float(mask.sum())}
    if "prompt_mask" in batch:  # what the model FLOPs are counted on (rlhfflow.plan.flops)
        prompt = batch["prompt_mask"].float().sum(-1)
        # rows that repeat a prompt share its forward (every forward of rlhfflow does):
        # the prompt's tokens and their attention count once, the responses' per row
        shared = shared_prompt_rows(batch["prompt_ids"], batch["prompt_mask"]) \
            if "prompt_ids" in batch else None
        distinct = prompt[shared[0]] if shared is not None else prompt
        # distinct prompts that begin alike run that prefix once (forward._prefix_forward)
        head = float(_shared_head(batch, shared))
        out.update(prompt_tokens=float(distinct.sum()) - head * (len(distinct) - 1),
                   attention_pairs=float((distinct * (distinct + 1) / 2).sum()
                                         - head * (head + 1) / 2 * (len(distinct) - 1)
                                         + (lengths * prompt + lengths * (lengths + 1) / 2)
                                         .sum()))
    if "scores" in batch:
        valid = batch["score_valid"].bool() if "score_valid" in batch else \
            torch.ones(len(batch["scores"]), dtype=torch.bool)
        scores = batch["scores"].double()[valid]
        out.update(score_sum=float(scores.sum()), score_sq=float((scores ** 2).sum()),
                   scored=float(valid.sum()), skipped=float((~valid).sum()))
    if "score_error" in batch:
        out["score_errors"] = float(sum(1 for e in batch["score_error"] if e))
    if "score_retries" in batch:
        out["score_retries"] = float(batch["score_retries"].sum())
    out[METRICS] = declared_sums(batch, declared)
    return out


METRICS = "metrics"
"""The key of a store's partial sums under which the declared figures' sums are."""


def declared_sums(batch: Batch, declared: Sequence[IterationMetric]
                  ) -> dict[str, tuple[float, float, float]]:
    """Per declared figure whose columns ``batch`` holds, its sums over the rows:
    ``(numerator, denominator, requires)``; the coordinator adds them over the
    iteration's stores and divides (``rlhfflow.runtime.telemetry.declared_figures``).
    An unused sum is 0, an absent ``requires`` 1."""
    out = {}
    for m in declared:
        if not all(c in batch for c in m.columns):
            continue
        value = batch[m.column]
        if m.reduce == "token_mean":  # in the column's dtype, as kl_mean always was
            mask = batch[m.over].float()
            num, den = float((value * mask).sum()), float(mask.sum())
        elif m.where is not None:
            rows = batch[m.where].bool()
            num, den = float(value.double()[rows].sum()), float(rows.sum())
        else:
            num = float(value.double().sum())
            den = float(len(value)) if m.reduce == "mean" else \
                float(batch[m.over].double().sum()) if m.reduce == "ratio" else 0.0
        required = float(batch[m.requires].double().sum()) if m.requires else 1.0
        out[m.name] = (num, den, required)
    return out


def save_model_task(model: str, path: str, after: list[Any]) -> dict[str, Any]:
    """Save a resident model in transformers format (atomically; a LoRA model merged)."""
    del after
    resident = current_host().store.get(model)
    resident.export(path)
    return {"model": model, "path": path, "version": resident.version}


def checkpoint_task(model: str, directory: str, after: list[Any], rank: int = 0
                    ) -> dict[str, Any]:
    """Save a trainable model's weights and optimizer state into a checkpoint being
    assembled (``directory`` is the checkpoint's temporary directory). Rank 0 of a gang
    saves the weights; each rank of a DeepSpeed gang saves its ZeRO optimizer shard, and
    of a sharded model its optimizer part (every rank gathers the weights with rank 0)."""
    del after
    resident = current_host().store.get(model)
    root = Path(directory)
    if rank == 0 or resident.sharded:
        resident.save(root / "models" / model)
    resident.save_optimizer(root / "optimizers" / f"{model}.pt", rank)
    return {"model": model, "version": resident.version}


def export_weights_task(model: str, iteration: int, after: list[Any]) -> dict[str, Any]:
    """The weights of ``model`` at its home, to be installed on its shadow copies."""
    del after
    host = current_host()
    start = time.time()
    resident = host.store.get(model)
    weights = resident.state_for_transfer()
    sent = time.time()
    host.record(iteration, "realloc", start, sent)
    return {"model": model, "version": resident.version, "weights": weights, "sent": sent,
            "nbytes": sum(t.numel() * t.element_size() for t in weights.values())}


@holds_streams
def install_weights_task(payload: dict[str, Any] | list[dict[str, Any]], version: int,
                         iteration: int, after: list[Any] = ()) -> dict[str, Any]:
    """Install weights sent by ``export_weights_task`` on this worker's copy (a list of
    payloads: a sharded model's parts, one per rank, put together a tensor at a time),
    checking they are the version the plan expects; ``after`` (the tasks still using the
    copy there) only orders it. Returns bytes received and the seconds from export (the
    first rank's) to installed (transfer included)."""
    del after
    host = current_host()
    host.updates.enter(iteration)  # a stop may hold it (UpdateGate)
    start = time.time()
    parts = payload if isinstance(payload, list) else [payload]
    for part in parts:
        if part["version"] != version:
            raise StaleWeights(f"received {part['model']!r} version {part['version']}, "
                               f"expected version {version}")
    resident = host.store.get(parts[0]["model"])
    if len(parts) == 1:
        resident.install(parts[0]["weights"], version)
    else:
        resident.install_parts([p["weights"] for p in parts], version)
    done = time.time()
    host.record(iteration, "realloc", start, done)
    return {"nbytes": sum(p["nbytes"] for p in parts),
            "seconds": done - min(p["sent"] for p in parts)}
