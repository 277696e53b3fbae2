"""Experience buffer: one zarr v3 group per RLHF iteration, written by many processes.

Layout (``OUTPUT/buffer.zarr``, a zarr v3 ``LocalStore``)::

    buffer.zarr/                root group, attrs {"rlhfflow_buffer": 1}
        iter_000000/            one group per iteration, attrs {"complete": bool, "rows", ...}
            prompt_ids          array (rows, *spec.shape), chunks (chunk_rows, *spec.shape)
            logprobs            ...
            text/prompt_text/   a text column: utf-8 ``bytes`` (uint8, flat) and ``offsets``
                                (int64, rows + 1); row i is bytes[offsets[i]:offsets[i+1]]

Protocol (see docs/design/buffer.md):

* ONE coordinator owns every piece of metadata: it creates an iteration's group and arrays
  with their final shape (:meth:`ExperienceBuffer.begin_iteration`), then marks it complete
  (:meth:`ExperienceBuffer.commit`). Resizing/appending from several processes races and
  silently loses rows, so nothing here ever resizes an array.
* SEVERAL workers fill disjoint, chunk-aligned row ranges with the static
  :meth:`ExperienceBuffer.write_rows`, which needs no coordinator state, only the path.
* Readers see committed iterations only, so a crash mid-write never yields a half
  iteration that looks valid. The commit marker is the group attribute ``"complete"``,
  written in the group's ``zarr.json``, which ``LocalStore`` replaces atomically (temp file
  plus rename). Process crashes are covered; data is not fsynced, so a power loss right
  after a commit may still lose chunks.

The module imports neither dask nor torch (torch tensors are accepted by duck typing), so
the CLI can inspect a buffer without paying for those imports.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.codecs import ZstdCodec
from zarr.storage import LocalStore

from rlhfflow.errors import RlhfflowError
from rlhfflow.storage.bufferwrites import (
    COMMIT_KEY,
    committed,
    read_group,
    write_columns,
    write_text_columns,
)
from rlhfflow.storage.zarrv3 import (
    array_document,
    atomic_write,
    chunk_keys,
    group_document,
    metadata_of,
    write_file,
)

# Keys the buffer itself keeps in an iteration's attributes; user attrs may not shadow them.
RESERVED_ATTRS = frozenset({COMMIT_KEY, "rows", "chunk_rows"})
_FORMAT_ATTR = "rlhfflow_buffer"
_FORMAT_VERSION = 1
_GROUP_RE = re.compile(r"iter_(\d{6,})")
_ALLOWED_KINDS = "biuf"  # bool, signed/unsigned int, float: no object/vlen (docs/design/buffer.md)
# Rows per block when streaming statistics, so a summary never loads a whole large column.
_STATS_BLOCK_BYTES = 64 * 2**20


@dataclass(frozen=True)
class ColumnSpec:
    """A column: per-row trailing shape and dtype.

    Attributes:
        dtype: numpy dtype name, e.g. ``"int32"``, ``"int64"``, ``"float32"``, ``"bool"``,
            ``"int8"``. Only bool, integer and float dtypes are allowed.
        shape: trailing shape per row, e.g. ``(response_len,)`` or ``()`` for one value
            per row.
    """

    dtype: str
    shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # Specs often come from YAML (lists, numpy ints): normalise so equality works.
        try:
            dtype = np.dtype(self.dtype)
        except TypeError as exc:
            raise ValueError(f"ColumnSpec: unknown dtype {self.dtype!r}") from exc
        if dtype.kind not in _ALLOWED_KINDS:
            raise ValueError(
                f"ColumnSpec: dtype {self.dtype!r} is not bool/int/float "
                "(pad ragged data instead of using object or string dtypes)"
            )
        shape = tuple(int(d) for d in self.shape)
        if any(d < 1 for d in shape):  # zarr chunks cannot have an empty dimension
            raise ValueError(f"ColumnSpec: dimensions must be >= 1, got shape {shape}")
        object.__setattr__(self, "dtype", dtype.name)
        object.__setattr__(self, "shape", shape)


class IterationNotFoundError(RlhfflowError, KeyError):
    """The iteration does not exist in the buffer or is not committed."""

    def __str__(self) -> str:
        # KeyError quotes its message; show it plainly.
        return str(self.args[0]) if self.args else ""


def group_name(iteration: int) -> str:
    """Name of the zarr group holding ``iteration``: ``iter_000042``."""
    if int(iteration) < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    return f"iter_{int(iteration):06d}"


def split_rows(rows: int, chunk_rows: int, parts: int) -> list[tuple[int, int]]:
    """Split ``rows`` into at most ``parts`` contiguous, chunk-aligned ``(start, stop)`` ranges.

    Every range but the last holds a whole number of chunks, so each can go to a different
    worker's :meth:`ExperienceBuffer.write_rows` call safely. Empty ranges are left out.
    """
    if chunk_rows < 1 or parts < 1:
        raise ValueError(f"chunk_rows and parts must be >= 1, got {chunk_rows}, {parts}")
    n_chunks = math.ceil(rows / chunk_rows)
    per_part, extra = divmod(n_chunks, parts)
    ranges, chunk = [], 0
    for part in range(parts):
        take = per_part + (1 if part < extra else 0)
        if take == 0:
            continue
        start, chunk = chunk * chunk_rows, chunk + take
        ranges.append((start, min(chunk * chunk_rows, rows)))
    return ranges


def _merge_stats(acc: dict[str, float], block: np.ndarray) -> None:
    """Fold ``block`` into running count/mean/M2/min/max (Chan et al. parallel variance)."""
    x = block.astype(np.float64, copy=False).ravel()
    if x.size == 0:
        return
    n_b, mean_b = x.size, float(x.mean())
    m2_b = float(np.square(x - mean_b).sum())
    n_a, mean_a = acc["n"], acc["mean"]
    n = n_a + n_b
    delta = mean_b - mean_a
    acc["mean"] = mean_a + delta * n_b / n
    acc["m2"] += m2_b + delta * delta * n_a * n_b / n
    acc["n"] = n
    acc["min"] = min(acc["min"], float(x.min()))
    acc["max"] = max(acc["max"], float(x.max()))


def _column_stats(array: zarr.Array) -> dict[str, Any]:
    """Shape, dtype and mean/std/min/max over all elements of ``array``, read in blocks."""
    row_bytes = max(1, math.prod(array.shape[1:]) * array.dtype.itemsize)
    chunk_rows = array.chunks[0]
    block = max(chunk_rows, (_STATS_BLOCK_BYTES // row_bytes) // chunk_rows * chunk_rows)
    acc = {"n": 0, "mean": 0.0, "m2": 0.0, "min": math.inf, "max": -math.inf}
    for start in range(0, array.shape[0], block):
        _merge_stats(acc, array[start : start + block])
    empty = acc["n"] == 0
    return {
        "shape": list(array.shape),
        "dtype": str(array.dtype),
        "mean": None if empty else acc["mean"],
        "std": None if empty else math.sqrt(acc["m2"] / acc["n"]),
        "min": None if empty else acc["min"],
        "max": None if empty else acc["max"],
    }


def _check_attrs(attrs: Mapping | None) -> dict[str, Any]:
    """User attrs as a dict, refusing the keys the buffer reserves for itself."""
    attrs = dict(attrs or {})
    clash = RESERVED_ATTRS.intersection(attrs)
    if clash:
        raise ValueError(f"attrs may not set reserved keys {sorted(clash)}")
    return attrs


class ExperienceBuffer:
    """Experience of every RLHF iteration in one zarr v3 store, one group per iteration.

    The coordinator calls :meth:`begin_iteration`, workers call the static
    :meth:`write_rows` on disjoint chunk-aligned row ranges, the coordinator calls
    :meth:`commit`. Readers (:meth:`iterations`, :meth:`read`, :meth:`columns`,
    :meth:`attrs`, :meth:`summary`) only ever see committed iterations.

    Args:
        path: directory of the ``LocalStore`` (``OUTPUT/buffer.zarr``).
        create: create the root group if ``path`` does not hold one. With ``False`` a
            missing buffer raises :class:`FileNotFoundError` naming the path (use it for
            read-only tools such as ``rlhfflow buffer inspect``).
        compress: compress new arrays with zstd. Off by default: uncompressed chunks were
            measured 2x faster to write (zstd gives ~2.4x smaller files).
        compression_level: zstd level when ``compress`` is True.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        create: bool = True,
        compress: bool = False,
        compression_level: int = 3,
    ) -> None:
        self.path = Path(path)
        self.compress = compress
        self.compression_level = compression_level
        if not create and not (self.path / "zarr.json").is_file():
            raise FileNotFoundError(f"no experience buffer (zarr group) at {self.path}")
        self._store = LocalStore(self.path)
        self._root = zarr.open_group(self._store, mode="a" if create else "r+")
        if create and _FORMAT_ATTR not in self._root.attrs:
            # Written once, so later opens by other processes never rewrite root metadata.
            self._root.attrs[_FORMAT_ATTR] = _FORMAT_VERSION

    def __repr__(self) -> str:
        return f"ExperienceBuffer({str(self.path)!r})"

    # -- coordinator ---------------------------------------------------------------------

    def begin_iteration(
        self,
        iteration: int,
        rows: int,
        columns: Mapping[str, ColumnSpec],
        chunk_rows: int,
        attrs: Mapping | None = None,
        texts: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        """Create group ``iter_NNNNNN`` with one zero-filled array per column (coordinator),
        and the text columns ``texts`` already known (as :meth:`write_text` would).

        Arrays have shape ``(rows, *spec.shape)`` and chunks ``(chunk_rows, *spec.shape)``,
        so a chunk is always whole rows and chunk-aligned row ranges never overlap. A
        leftover uncommitted group of the same iteration (a crash mid-write) is deleted
        first; a committed one raises :class:`ValueError` rather than being overwritten.
        """
        name = group_name(iteration)
        if rows < 0 or chunk_rows < 1:
            raise ValueError(
                f"{name}: need rows >= 0 and chunk_rows >= 1, got {rows}, {chunk_rows}"
            )
        if not columns:
            raise ValueError(f"{name}: no columns given")
        for col, spec in columns.items():
            if not col or "/" in col or col.startswith("__"):
                raise ValueError(f"{name}: invalid column name {col!r}")
            if not isinstance(spec, ColumnSpec):
                raise ValueError(f"{name}: column {col!r} needs a ColumnSpec, got {spec!r}")
        user_attrs = _check_attrs(attrs)
        if self._exists(name):
            if self._iscommitted(name):
                raise ValueError(f"iteration {iteration} is already committed in {self.path}")
            self._delete(name)
        meta = {**user_attrs, COMMIT_KEY: False, "rows": int(rows), "chunk_rows": int(chunk_rows)}
        compressors = ZstdCodec(level=self.compression_level) if self.compress else None
        # Every metadata document is zarr's own, made once per column shape and written
        # as a file: zarr's create_group / create_array cost ~3 ms of CPU each (existence
        # checks of every parent, validation), ~80 ms for an iteration's ~25 columns on
        # the coordinator's critical path; these writes cost well under 1 ms each.
        folder = self.path / name
        folder.mkdir()
        write_file(folder / "zarr.json", group_document(meta))
        for col, spec in columns.items():
            document = array_document(spec.dtype, spec.shape, int(rows), int(chunk_rows),
                                      compressors)
            (folder / col).mkdir()
            write_file(folder / col / "zarr.json", document)
        if texts:
            write_text_columns(folder, texts, int(rows), name)

    def commit(
        self, iteration: int, attrs: Mapping | None = None, *, check_complete: bool = True
    ) -> None:
        """Make ``iteration`` visible to readers by writing the commit marker last.

        ``attrs`` (e.g. a timestamp) and ``"complete": True`` go into the group's metadata
        in one atomic write. With ``check_complete`` every chunk of every column must have
        been written (by :meth:`write_rows`), so a worker that died silently cannot yield
        an iteration whose missing rows read as zeros.
        """
        name = group_name(iteration)
        if not self._exists(name):
            raise ValueError(f"cannot commit iteration {iteration}: it was never begun")
        folder = self.path / name
        document = read_group(folder)
        if committed(document):
            raise ValueError(f"iteration {iteration} is already committed in {self.path}")
        user_attrs = _check_attrs(attrs)
        if check_complete:
            missing = {}
            for entry in os.scandir(folder):
                if not entry.is_dir() or entry.name == "text":
                    continue
                metadata = metadata_of(Path(entry.path, "zarr.json").read_bytes())
                keys = chunk_keys(metadata)
                done = sum(os.path.exists(os.path.join(entry.path, k)) for k in keys)
                if done != len(keys):
                    missing[entry.name] = f"{done}/{len(keys)} chunks"
            if missing:
                raise ValueError(f"cannot commit iteration {iteration}: unwritten {missing}")
        document["attributes"] = {**document.get("attributes", {}), **user_attrs,
                                  COMMIT_KEY: True}
        atomic_write(folder / "zarr.json", json.dumps(document, indent=2).encode())

    def discard(self, iteration: int) -> None:
        """Delete the group of ``iteration``, committed or not; a missing one is a no-op."""
        name = group_name(iteration)
        if self._exists(name):
            self._delete(name)

    def truncate(self, keep_through: int) -> list[int]:
        """Delete every iteration after ``keep_through`` (committed or not), for resume.

        Returns the deleted iteration numbers, sorted.
        """
        doomed = [it for it in sorted(self._group_names()) if it > keep_through]
        for it in doomed:
            self._delete(group_name(it))
        return doomed

    def write_text(self, iteration: int, columns: Mapping[str, Sequence[str]]) -> None:
        """Store text columns of a begun iteration, one string per row (coordinator).

        Text is ragged, so it is kept as a flat array of utf-8 bytes plus offsets (no
        object or vlen dtypes: docs/design/buffer.md) in the ``text/`` subgroup, written
        whole by the one process that owns the iteration's metadata; call it before
        :meth:`commit`.
        """
        name = group_name(iteration)
        if not self._exists(name):
            raise ValueError(f"cannot store text of iteration {iteration}: it was never begun")
        document = read_group(self.path / name)
        if committed(document):
            raise ValueError(f"iteration {iteration} is already committed in {self.path}")
        write_text_columns(self.path / name, columns, document["attributes"]["rows"], name)

    def read_text(self, iteration: int, column: str) -> list[str]:
        """The strings of text column ``column`` of a committed iteration."""
        group = self.committed_group(iteration)
        names = self.text_columns(iteration)
        if column not in names:
            raise KeyError(f"iteration {iteration} has no text column {column!r}; it has "
                           f"{names}")
        stored = group["text"][column]
        flat, offsets = stored["bytes"][:].tobytes(), stored["offsets"][:]
        return [flat[a:b].decode("utf-8") for a, b in zip(offsets[:-1], offsets[1:],
                                                          strict=True)]

    def text_columns(self, iteration: int) -> list[str]:
        """Names of the text columns of a committed iteration."""
        group = self.committed_group(iteration)
        return sorted(group["text"].group_keys()) if "text" in group else []

    # -- workers -------------------------------------------------------------------------

    @staticmethod
    def write_rows(
        path: str | os.PathLike,
        iteration: int,
        start: int,
        columns: Mapping[str, Any],
        left: Collection[str] = (),
    ) -> None:
        """Write rows ``[start, start + n)`` of each given column of a begun iteration.

        Safe from any number of processes at once as long as their row ranges are
        disjoint: ``start`` must be a multiple of the chunk row size and the range must
        end on a chunk boundary or at the last row. Values (numpy arrays or torch tensors
        on any device) are cast to the column dtype when no value changes; a trailing
        length shorter than the column's is right-padded with zeros (left-padded for the
        columns named in ``left``: left-padded prompts). Everything is
        validated before anything is written; errors are :class:`ValueError`. Never
        resizes or touches metadata.
        """
        name = group_name(iteration)
        where = f"{path}:{name}"
        if not columns:
            raise ValueError(f"{where}: no columns given")
        write_columns(path, name, where, iteration, start, columns, left)

    # -- readers -------------------------------------------------------------------------

    def iterations(self) -> list[int]:
        """Committed iterations, sorted."""
        return sorted(it for it, name in self._group_names().items() if self._iscommitted(name))

    def uncommitted(self) -> list[int]:
        """Iterations begun but never committed (crashed or in progress), sorted."""
        return sorted(
            it for it, name in self._group_names().items() if not self._iscommitted(name)
        )

    def read(
        self,
        iteration: int,
        columns: Sequence[str] | None = None,
        *,
        start: int = 0,
        stop: int | None = None,
    ) -> dict[str, np.ndarray]:
        """Rows ``[start, stop)`` (all by default) of ``columns`` (all by default)."""
        group = self.committed_group(iteration)
        available = sorted(group.array_keys())
        wanted = available if columns is None else list(columns)
        unknown = [c for c in wanted if c not in available]
        if unknown:
            raise KeyError(f"iteration {iteration} has no columns {unknown}; it has {available}")
        return {col: group[col][start:stop] for col in wanted}

    def columns(self, iteration: int) -> dict[str, ColumnSpec]:
        """Name -> :class:`ColumnSpec` of each column of a committed iteration."""
        group = self.committed_group(iteration)
        return {
            col: ColumnSpec(dtype=str(arr.dtype), shape=tuple(arr.shape[1:]))
            for col, arr in sorted(group.arrays())
        }

    def attrs(self, iteration: int) -> dict[str, Any]:
        """All attributes of a committed iteration, including ``complete``/``rows``/``chunk_rows``."""
        return dict(self.committed_group(iteration).attrs)

    def summary(self) -> list[dict[str, Any]]:
        """Per committed iteration: rows, attrs and per-column shape/dtype/mean/std/min/max.

        Statistics are over ALL elements of a column, padding included (masks are not
        applied), as float64; ``std`` is the population std. They are ``None`` for an
        empty column. Columns are read in blocks, so memory stays bounded.
        """
        out = []
        for it in self.iterations():
            group = self.committed_group(it)
            cols = {col: _column_stats(arr) for col, arr in sorted(group.arrays())}
            attrs = dict(group.attrs)
            out.append(
                {"iteration": it, "rows": attrs.get("rows"), "columns": cols, "attrs": attrs}
            )
        return out

    # -- internals -----------------------------------------------------------------------

    def _group_names(self) -> dict[int, str]:
        """Iteration -> group name for every iteration directory, readable or not.

        Lists the directory itself rather than zarr's members so that a group whose
        metadata is missing (a crash inside a delete) is still found and cleaned up.
        """
        found = {}
        with os.scandir(self.path) as entries:
            for entry in entries:
                match = _GROUP_RE.fullmatch(entry.name)
                if match and entry.is_dir() and group_name(int(match[1])) == entry.name:
                    found[int(match[1])] = entry.name
        return found

    def _exists(self, name: str) -> bool:
        return (self.path / name).is_dir()

    def _iscommitted(self, name: str) -> bool:
        """Whether group ``name`` carries the commit marker; unreadable groups are not."""
        try:
            return committed(read_group(self.path / name))
        except (OSError, ValueError, AttributeError):
            return False

    def committed_group(self, iteration: int) -> zarr.Group:
        """The zarr group of a committed iteration (``IterationNotFoundError`` otherwise)."""
        name = group_name(iteration)
        if not self._iscommitted(name):
            state = "not committed (incomplete)" if self._exists(name) else "not in the buffer"
            raise IterationNotFoundError(f"iteration {iteration} is {state}: {self.path}")
        return self._root[name]

    def _delete(self, name: str) -> None:
        """Delete a group, un-committing it first.

        The store deletes a directory file by file in no set order; clearing the marker
        first (an atomic metadata write) means an interrupted delete leaves an
        uncommitted group, never a committed one with chunks missing.
        """
        if self._iscommitted(name):
            self._root[name].attrs[COMMIT_KEY] = False
        del self._root[name]  # rmtree of the directory; needs no readable metadata
