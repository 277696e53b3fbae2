"""The run directory: what an earlier run left there, and where this run starts.

A run directory holds ``run.json`` (which pipeline made it), ``metrics.jsonl``,
``buffer.zarr``, ``models/`` and ``checkpoints/``. Starting a run there either starts
afresh (nothing there, or ``--overwrite``) or resumes from the last complete checkpoint:
everything after that checkpoint (buffer iterations, metrics lines, later checkpoints) is
cut away, so the continued run has every iteration exactly once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rlhfflow.config.loader import Pipeline
from rlhfflow.errors import RunError
from rlhfflow.runtime.checkpointing import cut_back
from rlhfflow.runtime.telemetry import TASKS_FILE
from rlhfflow.storage import Checkpoint, CheckpointError, CheckpointStore
from rlhfflow.storage.errors import DIRECTORY as ERRORS_DIRECTORY

RUN_FILE = "run.json"
ARTEFACTS = ("metrics.jsonl", "buffer.zarr", "models", "setup.jsonl", "checkpoints",
             TASKS_FILE, ERRORS_DIRECTORY, RUN_FILE)
# keys that may change between a run and its resumption without changing its results
RESUMABLE_CHANGES = ("iterations", "output", "cluster", "checkpoint", "logging")

Resume = Literal["auto", "yes", "no"]


class RunStateError(RunError):
    """The run directory cannot be used as asked; one line saying why and what to do."""


@dataclass(frozen=True)
class StartPoint:
    """Where a run starts: after ``checkpoint`` (None: from the beginning)."""

    checkpoint: Checkpoint | None
    resumed: bool

    @property
    def next_iteration(self) -> int:
        """The first iteration this run computes."""
        return self.checkpoint.iteration + 1 if self.checkpoint else 0


def pipeline_identity(pipeline: Pipeline) -> dict[str, Any]:
    """The parts of the pipeline that decide its results (not how long or where it runs)."""
    dump = pipeline.spec.model_dump(mode="json", by_alias=True)
    # fusion and the sequential baseline change how tasks are cut, not their numbers
    for key in ("fuse", "sequential"):
        dump["overlap"].pop(key, None)
    for stage in dump["stages"].values():
        stage.pop("fuse", None)
    return {k: v for k, v in dump.items() if k not in RESUMABLE_CHANGES}


def identity_digest(identity: dict[str, Any]) -> str:
    """A stable digest of a pipeline identity."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def first_difference(old: Any, new: Any, path: str = "") -> str | None:
    """The key path of the first difference between two JSON values, or None."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            where = f"{path}.{key}" if path else str(key)
            if key not in old or key not in new:
                return where
            found = first_difference(old[key], new[key], where)
            if found:
                return found
        return None
    return None if old == new else (path or "(top level)")


def prepare_output(pipeline: Pipeline, overwrite: bool = False, resume: Resume = "auto",
                   force: bool = False) -> tuple[Path, StartPoint]:
    """Make the output directory ready and decide where the run starts."""
    out = pipeline.output_dir
    present = [out / name for name in ARTEFACTS if (out / name).exists()]
    identity = pipeline_identity(pipeline)
    if present and overwrite:
        for target in present:
            shutil.rmtree(target) if target.is_dir() else target.unlink()
        present = []
    if not present:
        if resume == "yes":
            raise RunStateError(f"--resume: {out} holds no run to resume")
        return _start_fresh(pipeline, out, identity), StartPoint(None, resumed=False)
    if resume == "no":
        raise RunStateError(f"{out} already holds a run; pass --overwrite to replace it, "
                            f"--resume to continue it, or --out DIR for a new one")
    _check_same_pipeline(out, identity, force)
    checkpoint = _latest_checkpoint(out)
    cut_back(out, checkpoint.iteration if checkpoint else -1)
    _write_run_file(pipeline, out, identity)
    return out, StartPoint(checkpoint, resumed=True)


def _start_fresh(pipeline: Pipeline, out: Path, identity: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    _write_run_file(pipeline, out, identity)
    return out


def _write_run_file(pipeline: Pipeline, out: Path, identity: dict[str, Any]) -> None:
    shutil.copyfile(pipeline.source, out / "pipeline.yaml")
    record = {"pipeline": pipeline.name, "source": str(pipeline.source),
              "identity": identity, "digest": identity_digest(identity)}
    staged = out / (RUN_FILE + ".tmp")
    staged.write_text(json.dumps(record, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(staged, out / RUN_FILE)


def _check_same_pipeline(out: Path, identity: dict[str, Any], force: bool) -> None:
    try:
        record = json.loads((out / RUN_FILE).read_text(encoding="utf-8"))
        old = record["identity"]
    except (OSError, ValueError, KeyError, TypeError):
        if force:
            return
        raise RunStateError(f"{out} holds a run without a readable {RUN_FILE}; pass --force "
                            f"to resume it anyway or --overwrite to start over") from None
    changed = first_difference(old, identity)
    if changed and not force:
        raise RunStateError(f"{out} holds a run of a different pipeline ({changed!r} "
                            f"changed); pass --force to resume it with this file, "
                            f"--overwrite to start over, or --out DIR for a new run")


def _latest_checkpoint(out: Path) -> Checkpoint | None:
    try:
        return CheckpointStore(out / "checkpoints").latest()
    except CheckpointError as exc:
        raise RunStateError(f"{exc}; delete that checkpoint directory to resume from the "
                            f"one before it") from None
