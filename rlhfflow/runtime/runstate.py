"""The run directory: what an earlier run left there, and where this run starts.

A run directory holds ``run.json`` (which pipeline made it), ``metrics.jsonl``,
``buffer.zarr``, ``models/`` and ``checkpoints/``. Starting a run there either starts
afresh (nothing there, or ``--overwrite``) or resumes from the last complete checkpoint:
everything after that checkpoint (buffer iterations, metrics lines, later checkpoints) is
cut away, so the continued run has every iteration exactly once.

One run at a time: a run holds ``.rlhfflow.lock`` in the directory (``output_lock``)
before it reads or writes anything else there, for its whole life.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rlhfflow.config.loader import Pipeline
from rlhfflow.errors import RunError, UserError
from rlhfflow.launch.warm import LOCK_FD_VAR
from rlhfflow.monitor.workerlogs import LOG_DIRECTORY
from rlhfflow.runtime.checkpointing import cut_back
from rlhfflow.runtime.telemetry import TASKS_FILE
from rlhfflow.storage import Checkpoint, CheckpointStore
from rlhfflow.storage.errors import DIRECTORY as ERRORS_DIRECTORY

RUN_FILE = "run.json"
ARTEFACTS = ("metrics.jsonl", "buffer.zarr", "models", "setup.jsonl", "checkpoints",
             TASKS_FILE, ERRORS_DIRECTORY, LOG_DIRECTORY, RUN_FILE)
# keys that may change between a run and its resumption without changing its results
RESUMABLE_CHANGES = ("iterations", "output", "cluster", "checkpoint", "logging")

Resume = Literal["auto", "yes", "no"]


LOCK_FILE = ".rlhfflow.lock"


class RunStateError(RunError):
    """The run directory cannot be used as asked; one line saying why and what to do."""


class OutputInUse(UserError):
    """Another live run holds the output directory (the user's to wait for or avoid:
    exit 2)."""


@contextmanager
def output_lock(out: Path) -> Iterator[int]:
    """Hold ``out`` for one run, for as long as the block runs; yields the descriptor of
    the lock. The lock is an ``flock`` on ``OUT/.rlhfflow.lock``, which holds the
    holder's pid: the kernel drops it when the holder dies, however it dies, so a killed
    run never leaves a directory locked. ``OutputInUse`` (one line naming the directory
    and the holder's pid) when another run holds it; nothing is written then.

    A process started by the holder to do its run (``rlhfflow run --supervise``'s child)
    inherits the holder's descriptor, named by ``LOCK_FD_VAR``: it shares the lock
    instead of being locked out by its own parent."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_FILE
    inherited = _inherited_lock(path)
    if inherited is not None:
        yield inherited  # the holder's: never unlocked here (that would free it for all)
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise OutputInUse(f"{out} is in use by another run (pid {holder}); wait for it to "
                          f"end, or pass --out DIR for a new run") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield fd
    finally:
        os.close(fd)  # the last descriptor of the lock: released


def _inherited_lock(path: Path) -> int | None:
    """The descriptor of ``path``'s lock that this process inherited from its holder
    (``LOCK_FD_VAR``), or None."""
    try:
        fd = int(os.environ[LOCK_FD_VAR])
        held, here = os.fstat(fd), path.stat()
    except (KeyError, ValueError, OSError):
        return None
    if (held.st_dev, held.st_ino) != (here.st_dev, here.st_ino):
        return None  # a stale variable: the descriptor is something else now
    try:  # the holder's lock is this descriptor's: taking it again succeeds at once
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return None
    return fd


@dataclass(frozen=True)
class StartPoint:
    """Where a run starts: after ``checkpoint`` (None: from the beginning); ``damaged``:
    the newer checkpoints passed over because they were not whole (name, what is wrong)."""

    checkpoint: Checkpoint | None
    resumed: bool
    damaged: tuple[tuple[str, str], ...] = ()

    def fallback_line(self) -> str | None:
        """The line saying which checkpoints a resume passed over and why, or None."""
        return damaged_line(self.damaged, self.checkpoint)

    @property
    def next_iteration(self) -> int:
        """The first iteration this run computes."""
        return self.checkpoint.iteration + 1 if self.checkpoint else 0


def damaged_line(damaged: Sequence[tuple[str, str]], checkpoint: Checkpoint | None
                 ) -> str | None:
    """One line: the checkpoints ``damaged`` (name, what is wrong) were passed over and
    discarded, and the run goes on from ``checkpoint``; None when none was."""
    if not damaged:
        return None
    names = ", ".join(f"{name} ({why})" for name, why in damaged)
    were = "is" if len(damaged) == 1 else "are"
    target = checkpoint.path.name if checkpoint else "the start"
    return (f"checkpoint{'s' if len(damaged) > 1 else ''} {names} {were} damaged and "
            f"discarded; resuming from {target}, the newest whole checkpoint")


def already_done(pipeline: Pipeline, start: StartPoint) -> int | None:
    """The iterations a resumed run holds when it has nothing left to do (``iterations``
    no more than it has, its final models saved), else None."""
    done = start.next_iteration
    if not (start.resumed and pipeline.graph.loop_stages and done >= pipeline.spec.iterations):
        return None
    out = pipeline.output_dir
    trained = [m for m, model in pipeline.spec.models.items() if model.trainable]
    if not all((out / "models" / m / "final").is_dir() for m in trained):
        return None  # stopped early: the run still saves the final models
    return done


def inexact_resume(pipeline: Pipeline) -> str | None:
    """Why resuming from a checkpoint does not continue the run exactly (checkpoints
    without optimizer state), or None."""
    models = pipeline.spec.models
    restarted = [m for m in pipeline.graph.loop_trained() if not models[m].optimizer.checkpoint]
    if not restarted:
        return None
    return (f"not an exact resume: the checkpoint holds no optimizer state of "
            f"{', '.join(map(repr, restarted))} (checkpoint.optimizer: false), whose "
            f"optimizer starts afresh")


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
    checkpoint, damaged = _latest_checkpoint(out)
    cut_back(out, checkpoint.iteration if checkpoint else -1)
    _write_run_file(pipeline, out, identity)
    return out, StartPoint(checkpoint, resumed=True, damaged=tuple(damaged))


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


def _latest_checkpoint(out: Path) -> tuple[Checkpoint | None, list[tuple[str, str]]]:
    """The newest whole checkpoint and what is wrong with the newer ones; a
    ``RunStateError`` when there are checkpoints and none is whole (nothing is cut
    then: the user decides)."""
    store = CheckpointStore(out / "checkpoints")
    checkpoint, damaged = store.latest_whole()
    if checkpoint is None and damaged:
        listed = "; ".join(f"{name}: {why}" for name, why in damaged)
        raise RunStateError(f"no whole checkpoint to resume from in {store.root} "
                            f"({listed}); pass --overwrite to start over")
    return checkpoint, damaged
