"""Metrics log: ``OUTPUT/metrics.jsonl``, one JSON object per iteration.

Every line is written with one ``write`` and then flushed and fsynced, so a crash loses at
most the line being written. Such a torn last line is ignored by :meth:`MetricsLog.read`
and cut off by :meth:`MetricsLog.repair` (which :meth:`MetricsLog.append` runs first when
needed, so a new record never gets glued onto a torn one).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np


def to_jsonable(x: Any) -> Any:
    """``x`` as plain JSON data: numpy/torch scalars and arrays become Python numbers/lists.

    NaN and +/-inf become ``None`` (JSON ``null``): strict JSON has no NaN, and a
    diverged loss must not make the whole log unreadable by other tools. Mapping keys
    become strings, tuples/sets become lists. Anything else is returned unchanged (and
    ``json.dumps`` will name it if it is not serialisable).
    """
    if x is None or isinstance(x, (bool, str, int)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, Mapping):
        return {str(k): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor, duck-typed (no import)
        tensor = x.detach().cpu()
        return to_jsonable(tensor.item() if tensor.ndim == 0 else tensor.tolist())
    if isinstance(x, np.ndarray):
        return to_jsonable(x.tolist())
    if isinstance(x, np.generic):  # numpy scalars: np.float32, np.int64, np.bool_
        return to_jsonable(x.item())
    return x


def _parse(line: bytes) -> dict | None:
    """The JSON object on ``line``, or None if it is not one (torn or garbage)."""
    try:
        value = json.loads(line)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError both subclass it
        return None
    return value if isinstance(value, dict) else None


class MetricsLog:
    """``OUTPUT/metrics.jsonl``: one JSON object per iteration, appended durably.

    Each line is flushed and fsynced, so a crash loses at most the line being written; a
    torn last line (crash mid-write) is ignored by :meth:`read` and removed by
    :meth:`repair`. A bad line anywhere else is real corruption and raises ValueError.

    Args:
        path: the ``.jsonl`` file; it and its directory are created on first append.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"MetricsLog({str(self.path)!r})"

    def append(self, record: Mapping) -> None:
        """Append ``record`` as one line; NaN/inf values are written as ``null``."""
        line = json.dumps(to_jsonable(record), allow_nan=False, sort_keys=False) + "\n"
        if self._has_torn_tail():
            self.repair()
            if self._has_torn_tail():  # a good last line that just lacks its newline
                line = "\n" + line
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "ab") as f:
            f.write(line.encode())
            f.flush()
            os.fsync(f.fileno())

    def read(self) -> list[dict]:
        """All complete records in order; [] when the file does not exist yet."""
        records, _ = self._scan()
        return records

    def truncate(self, keep_through: int) -> None:
        """Keep only records with ``iteration <= keep_through`` (for resume).

        Records without an ``"iteration"`` key are kept. The file is rewritten atomically
        (temp file, fsync, ``os.replace``), so a crash leaves either the old or new log.
        """
        if not self.path.exists():
            return
        records = [
            r for r in self.read() if r.get("iteration") is None or r["iteration"] <= keep_through
        ]
        text = "".join(json.dumps(r, allow_nan=False) + "\n" for r in records)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(text.encode())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _fsync_dir(self.path.parent)  # make the rename itself durable

    def repair(self) -> int:
        """Cut off a torn (unparseable) last line; return the number of bytes dropped."""
        if not self.path.exists():
            return 0
        _, good_end = self._scan()
        size = self.path.stat().st_size
        if good_end == size:
            return 0
        with open(self.path, "r+b") as f:
            f.truncate(good_end)
            f.flush()
            os.fsync(f.fileno())
        return size - good_end

    def _scan(self) -> tuple[list[dict], int]:
        """Parse the file: (records, byte offset just after the last good line)."""
        if not self.path.exists():
            return [], 0
        data = self.path.read_bytes()
        lines = data.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()  # the file ends with a newline: no partial tail
        records, offset, good_end = [], 0, 0
        for number, line in enumerate(lines, start=1):
            offset += len(line) + 1
            if not line.strip():
                good_end = min(offset, len(data))
                continue
            record = _parse(line)
            if record is None:
                if number == len(lines):
                    break  # a torn last line: the crash the format is designed for
                raise ValueError(f"{self.path}: line {number} is not a JSON object")
            records.append(record)
            good_end = min(offset, len(data))
        return records, good_end

    def _has_torn_tail(self) -> bool:
        """Cheap check before appending: does the file end without a newline?"""
        try:
            with open(self.path, "rb") as f:
                f.seek(0, os.SEEK_END)
                if f.tell() == 0:
                    return False
                f.seek(-1, os.SEEK_END)
                return f.read(1) != b"\n"
        except FileNotFoundError:
            return False


def _fsync_dir(directory: Path) -> None:
    """fsync a directory so a rename in it survives a power loss (no-op where unsupported)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
