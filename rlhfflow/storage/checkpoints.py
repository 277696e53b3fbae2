"""Checkpoints: ``OUTPUT/checkpoints/iter_NNNNNN/``, each made visible atomically.

A checkpoint is assembled in a hidden temporary directory (workers write model weights
and optimizer state into it, the coordinator writes ``state.json`` last) and renamed to
its final name in one step, so a crash never leaves a checkpoint that looks complete.
Only directories named ``iter_NNNNNN`` with a readable ``state.json`` count.

``state.json`` also lists every other file of the checkpoint with its size (``files``),
so a checkpoint damaged after it was published (a file truncated or deleted: a full
disk under a copy, a careless ``rm``) is found by a ``stat`` per file, without reading
the weights (:meth:`CheckpointStore.damage`). A resume takes the newest checkpoint that
is whole (:meth:`CheckpointStore.latest_whole`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhfflow.errors import RlhfflowError

_NAME = re.compile(r"^iter_(\d{6})$")
STATE_FILE = "state.json"
#: the key of ``state.json`` listing the checkpoint's other files: relative path -> bytes
FILES_KEY = "files"


class CheckpointError(RlhfflowError, ValueError):
    """A checkpoint that cannot be used: names the path and what is wrong."""


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint: its iteration, directory and saved state."""

    iteration: int
    path: Path
    state: dict[str, Any]

    def model_dir(self, model: str) -> Path:
        """Where the weights of ``model`` are (transformers format)."""
        return self.path / "models" / model

    def optimizer_file(self, model: str) -> Path:
        """Where the optimizer state of ``model`` is (``torch.save``)."""
        return self.path / "optimizers" / f"{model}.pt"


def link_model(source: Path, path: Path) -> None:
    """Make ``path`` a model directory holding the files of the model directory
    ``source`` as hard links (no second copy of the weights), atomically as
    ``save_model`` does: assembled in a hidden sibling and renamed into place, an
    existing ``path`` replaced.

    Hard links, not a symlink: pruning the checkpoint that ``source`` is in deletes
    its names, not the files, so ``path`` stays whole. Safe because nothing rewrites a
    saved model's files in place (a save writes new files and renames). Where linking
    fails (another filesystem, one that has no hard links) the file is copied."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        for directory, _, files in os.walk(source):
            into = tmp / Path(directory).relative_to(source)
            into.mkdir(parents=True, exist_ok=True)
            for name in files:
                try:
                    os.link(Path(directory) / name, into / name)
                except OSError:
                    shutil.copy2(Path(directory) / name, into / name)
        move_into_place(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def move_into_place(tmp: Path, path: Path) -> None:
    """Rename the finished folder ``tmp`` to ``path`` (same parent, so the rename is
    atomic), replacing an existing ``path``: a reader sees the old folder or the new one,
    never a mix."""
    if path.exists():
        old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, path)


class CheckpointStore:
    """The checkpoints of one run directory."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    def begin(self, iteration: int) -> Path:
        """A fresh temporary directory to assemble the checkpoint of ``iteration`` in."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".iter_{iteration:06d}.tmp-{uuid.uuid4().hex[:8]}"
        (tmp / "models").mkdir(parents=True)
        (tmp / "optimizers").mkdir()
        return tmp

    def publish(self, tmp: Path, iteration: int, state: dict[str, Any]) -> Checkpoint:
        """Write ``state.json`` (last, with the size of every other file) and rename
        ``tmp`` into place atomically."""
        state = {**state, "iteration": iteration, FILES_KEY: _sizes(tmp)}
        staged = tmp / (STATE_FILE + ".tmp")
        with open(staged, "w", encoding="utf-8") as f:
            json.dump(state, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(staged, tmp / STATE_FILE)
        final = self.root / f"iter_{iteration:06d}"
        if final.exists():  # a re-run of the same iteration after a resume: replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        return Checkpoint(iteration, final, state)

    def list(self) -> list[Checkpoint]:
        """Complete checkpoints, oldest first. A directory without a readable
        ``state.json`` is not a checkpoint (a crash before it was published)."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in sorted(self.root.iterdir()):
            match = _NAME.match(entry.name)
            if match and (entry / STATE_FILE).is_file():
                found.append(self._read(entry, int(match.group(1))))
        return found

    def latest(self) -> Checkpoint | None:
        """The newest complete checkpoint, or None."""
        found = self.list()
        return found[-1] if found else None

    def read(self, path: Path) -> Checkpoint:
        """The checkpoint in directory ``path`` (``iter_NNNNNN``) as published;
        ``CheckpointError`` when it is not one or its state cannot be read."""
        match = _NAME.match(Path(path).name)
        if not match:
            raise CheckpointError(f"{path}: not a checkpoint directory (expected "
                                  f"iter_NNNNNN)")
        return self._read(Path(path), int(match.group(1)))

    def latest_whole(self) -> tuple[Checkpoint | None, list[tuple[str, str]]]:
        """The newest checkpoint that is whole (readable state, every listed file there
        at its size), or None; and, newest first, each newer checkpoint's name with what
        is wrong with it (``("iter_000004", "models/actor/model.safetensors has 1024
        bytes, 4096 were written")``)."""
        damaged = []
        for path in sorted(self._directories(), reverse=True):
            iteration = int(_NAME.match(path.name).group(1))
            if not (path / STATE_FILE).is_file():
                damaged.append((path.name, f"no {STATE_FILE}"))
                continue
            try:
                checkpoint = self._read(path, iteration)
            except CheckpointError as exc:
                damaged.append((path.name, str(exc).removeprefix(f"{path / STATE_FILE}: ")))
                continue
            problem = self.damage(checkpoint)
            if problem is None:
                return checkpoint, damaged
            damaged.append((path.name, problem))
        return None, damaged

    @staticmethod
    def damage(checkpoint: Checkpoint) -> str | None:
        """What is missing or cut short in ``checkpoint`` against the sizes its
        ``state.json`` lists, or None when it is whole (or lists none: a checkpoint
        written before they were)."""
        listed = checkpoint.state.get(FILES_KEY)
        if not isinstance(listed, dict):
            return None
        for name, size in sorted(listed.items()):
            try:
                found = (checkpoint.path / name).stat().st_size
            except OSError:
                return f"{name} is missing"
            if found != size:
                return f"{name} has {found} bytes, {size} were written"
        return None

    def _directories(self) -> list[Path]:
        """Every ``iter_NNNNNN`` directory, published or not, readable or not."""
        if not self.root.is_dir():
            return []
        return [e for e in self.root.iterdir() if _NAME.match(e.name) and e.is_dir()]

    def _read(self, path: Path, iteration: int) -> Checkpoint:
        try:
            state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path / STATE_FILE}: corrupt checkpoint state ({exc})"
                                  ) from None
        if not isinstance(state, dict) or state.get("iteration") != iteration:
            raise CheckpointError(f"{path / STATE_FILE}: corrupt checkpoint state "
                                  f"(expected iteration {iteration})")
        return Checkpoint(iteration, path, state)

    def clean_leftovers(self) -> None:
        """Delete checkpoints that were never published (a crash while assembling).
        Only at start-up: during a run the next checkpoint may be under way."""
        for leftover in self.root.glob(".iter_*.tmp-*") if self.root.is_dir() else []:
            shutil.rmtree(leftover, ignore_errors=True)

    def prune(self, keep: int) -> list[int]:
        """Delete all but the newest ``keep`` checkpoints (0 keeps all); returns the
        iterations deleted."""
        # by name: an old checkpoint whose state cannot be read is pruned, not fatal
        found = sorted(p for p in self._directories() if (p / STATE_FILE).is_file())
        doomed = found[:-keep] if keep else []
        for path in doomed:
            shutil.rmtree(path, ignore_errors=True)
        return [int(_NAME.match(p.name).group(1)) for p in doomed]

    def truncate(self, keep_through: int) -> None:
        """Delete checkpoints after ``keep_through`` (they belong to a discarded future),
        damaged ones too."""
        for path in self._directories():
            if int(_NAME.match(path.name).group(1)) > keep_through:
                shutil.rmtree(path, ignore_errors=True)


def _sizes(folder: Path) -> dict[str, int]:
    """Relative path -> size of every file under ``folder``."""
    return {str(Path(d, name).relative_to(folder)): os.stat(os.path.join(d, name)).st_size
            for d, _, names in os.walk(folder) for name in names}
