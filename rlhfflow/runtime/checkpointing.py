"""Checkpoints of a run, and the one way a run goes back to one.

``cut_back`` is shared by resume (a new ``rlhfflow run`` on an existing output) and by
recovery (a worker lost mid-run): everything after checkpoint k goes (buffer iterations,
metrics and task records, later checkpoints, half-assembled ones), so what is left is
exactly the state the run had when checkpoint k was published.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from rlhfflow.engine.lora import ADAPTER_CONFIG
from rlhfflow.engine.resident import ModelConfig
from rlhfflow.errors import RunError
from rlhfflow.plan.tasks import CheckpointTask
from rlhfflow.runtime.telemetry import TASKS_FILE
from rlhfflow.storage import Checkpoint, CheckpointStore, ExperienceBuffer, MetricsLog
from rlhfflow.storage.errors import truncate_score_errors


class CorruptCheckpoint(RunError):
    """A published checkpoint lacks what resuming from it needs."""


def cut_back(out: Path, keep: int, buffer: ExperienceBuffer | None = None) -> None:
    """Cut the run in ``out`` back to checkpoint ``keep`` (-1: to the start): buffer
    iterations, metrics and task records, listed reward errors and checkpoints after it,
    and checkpoints never published."""
    (buffer or ExperienceBuffer(out / "buffer.zarr")).truncate(keep)
    for name in ("metrics.jsonl", TASKS_FILE):
        log = MetricsLog(out / name)
        log.repair()
        log.truncate(keep)
    truncate_score_errors(out, keep)
    store = CheckpointStore(out / "checkpoints")
    store.truncate(keep)
    store.clean_leftovers()


def models_from_checkpoint(models: Mapping[str, ModelConfig], trained: list[str],
                           checkpoint: Checkpoint | None) -> dict[str, ModelConfig]:
    """``models`` with each loop-trained model's weights, optimizer state and version
    taken from ``checkpoint`` (unchanged without one)."""
    out = dict(models)
    if checkpoint is None:
        return out
    versions = checkpoint.state.get("versions", {})
    for name in trained:
        weights, optimizer = checkpoint.model_dir(name), checkpoint.optimizer_file(name)
        shards = list(optimizer.parent.glob(f"{optimizer.stem}.zero-rank*.pt"))
        adapters = models[name].lora is not None  # a LoRA model's checkpoint: its adapters
        marker = weights / (ADAPTER_CONFIG if adapters else "config.json")
        if not marker.is_file() or not (optimizer.is_file() or shards):
            raise CorruptCheckpoint(f"{checkpoint.path}: corrupt checkpoint (no weights or "
                                    f"optimizer state of {name!r}); delete it to resume "
                                    f"from the one before")
        where = {"adapter_path": str(weights)} if adapters else {"init_path": str(weights)}
        out[name] = replace(models[name], **where, optimizer_state=str(optimizer),
                            version=int(versions.get(name, 0)))
    return out


class Checkpointer:
    """Submits the tasks that save a checkpoint and publishes it once they are done."""

    def __init__(self, pipeline, out: Path, dataflow, wait, digest: str) -> None:
        self.pipeline = pipeline
        self.digest = digest  # the pipeline's identity, checked on resume
        self.store = CheckpointStore(out / "checkpoints")
        self.dataflow = dataflow
        self.wait = wait  # (handles by label, iteration) -> None; raises RunError
        self.pending: dict[int, tuple[Path, dict[str, list[Any]]]] = {}

    def submit(self, k: int, specs: list[CheckpointTask]) -> None:
        """Submit the checkpoint tasks of iteration ``k`` into a fresh directory."""
        if not specs:
            return
        directory = self.store.begin(k)
        handles = self.dataflow.submit(specs, directory=str(directory))
        by_model: dict[str, list[Any]] = {}
        for spec, handle in zip(specs, handles, strict=True):
            by_model.setdefault(spec.model, []).append(handle)
        self.pending[k] = (directory, by_model)

    def publish(self, k: int, expected: Mapping[str, int] | None = None) -> None:
        """Wait for checkpoint ``k``'s tasks, then make it visible (state.json last,
        rename) and prune old ones. Nothing, when iteration ``k`` had nothing to save
        (a pipeline that trains no model, such as an evaluation). With ``expected`` (the
        models' versions after iteration ``k``), a model saved at another version is a
        ``RunError`` and nothing is published."""
        if k not in self.pending:
            return
        directory, handles = self.pending.pop(k)
        self.wait({f"checkpoint[{m}]": h for m, hs in handles.items() for h in hs}, k)
        saved = {m: self.dataflow.backend.gather(hs[:1])[0] for m, hs in handles.items()}
        for m, result in saved.items():
            if expected is not None and m in expected and result["version"] != expected[m]:
                # a stop cancelled the next iteration as its update began: these weights
                # are not iteration k's
                raise RunError(f"the checkpoint of iteration {k} was not saved: model "
                               f"{m!r} was at version {result['version']}, not "
                               f"{expected[m]} (the next iteration's update began as the "
                               f"run stopped); the run resumes from its last checkpoint")
        spec = self.pipeline.spec
        state = {"versions": {m: r["version"] for m, r in saved.items()},
                 "seed": spec.seed,
                 "prompts_consumed": (k + 1) * spec.data.batch_size,
                 "kl_coef": spec.algorithm.kl_coef,
                 "pipeline_digest": self.digest,
                 "created": time.time()}
        self.store.publish(directory, k, state)
        self.store.prune(spec.checkpoint.keep)

    def clear(self) -> None:
        """Forget checkpoints under way (a recovery cleans their directories up)."""
        self.pending.clear()
