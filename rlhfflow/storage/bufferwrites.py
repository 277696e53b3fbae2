"""Writes into a begun iteration of the experience buffer, from any process: a worker's
chunk-aligned rows (each column checked against its shape and dtype first, then every
chunk written at once) and the coordinator's text columns, written as files
(``rlhfflow.storage.zarrv3``) rather than through zarr's write path; and the group
documents they read (is the iteration begun, is it committed).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from zarr.storage import LocalStore

from rlhfflow.storage.zarrv3 import (
    array_document,
    array_of,
    group_document,
    open_array,
    write_all,
    write_file,
)

#: The group attribute that marks an iteration committed (readers see only those).
COMMIT_KEY = "complete"


def read_group(folder: Path) -> dict[str, Any]:
    """The ``zarr.json`` document of the group at ``folder`` (``OSError`` or
    ``ValueError`` when it cannot be read)."""
    return json.loads((folder / "zarr.json").read_bytes())


def committed(document: Mapping[str, Any]) -> bool:
    """Whether a group document carries the commit marker."""
    return document.get("attributes", {}).get(COMMIT_KEY) is True


def write_text_columns(folder: Path, columns: Mapping[str, Sequence[str]], rows: int,
                       name: str) -> None:
    """Text columns of the iteration group at ``folder``: per column, utf-8 ``bytes`` and
    ``offsets`` arrays under ``text/COLUMN`` (replacing an earlier one), documents written
    as files and data through zarr, all at once."""
    for col, values in columns.items():
        if not col or "/" in col:
            raise ValueError(f"{name}: invalid text column name {col!r}")
        if len(values) != rows:
            raise ValueError(f"{name}: text column {col!r} has {len(values)} rows, the "
                             f"iteration has {rows}")
    texts = folder / "text"
    if not texts.is_dir():
        texts.mkdir()
        write_file(texts / "zarr.json", group_document({}))
    store = LocalStore(folder.parent)
    writes = []
    for col, values in columns.items():
        encoded = [str(v).encode("utf-8") for v in values]
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in encoded], out=offsets[1:])
        flat = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        column = texts / col
        if column.exists():
            shutil.rmtree(column)
        column.mkdir()
        write_file(column / "zarr.json", group_document({}))
        for key, data in (("bytes", flat), ("offsets", offsets)):
            document = array_document(data.dtype.name, (), len(data),
                                       max(1, len(data)), None)
            (column / key).mkdir()
            write_file(column / key / "zarr.json", document)
            writes.append((column / key, array_of(document, store, f"{name}/text/{col}/{key}"),
                           0, data))
    write_all(writes)


def write_columns(path, name: str, where: str, iteration: int, start: int,
                  columns: Mapping[str, Any], left: Collection[str] = ()) -> None:
    """:meth:`ExperienceBuffer.write_rows`: open every column from its document,
    validate all, then write all chunks."""
    folder = Path(path) / name
    try:
        group = read_group(folder)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{where}: iteration {iteration} was not begun") from exc
    if committed(group):
        raise ValueError(f"{where}: iteration {iteration} is committed; refusing to modify it")
    store = LocalStore(path)
    prepared = []
    n_rows = None
    for col, value in columns.items():
        col_where = f"{where} column {col!r}"
        try:
            array = open_array(folder / col, store, f"{name}/{col}")
        except KeyError:
            raise ValueError(f"{col_where}: no such column in iteration {iteration}") from None
        data = _to_numpy(value)
        data = _fit_trailing(data, tuple(array.shape[1:]), col_where, col in left)
        data = _cast(data, array.dtype, col_where)
        if n_rows is not None and len(data) != n_rows:
            raise ValueError(f"{col_where}: {len(data)} rows, other columns have {n_rows}")
        n_rows = len(data)
        _check_alignment(col_where, start, n_rows, array.shape[0], array.chunks[0])
        prepared.append((folder / col, array, start, data))
    write_all(prepared)


def _to_numpy(value: Any) -> np.ndarray:
    """numpy view of ``value``; torch tensors (any device, with grad) are detached and copied."""
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # torch.Tensor, duck-typed
        tensor = value.detach().cpu()
        if str(tensor.dtype) == "torch.bfloat16":  # numpy has no bfloat16
            tensor = tensor.float()
        return tensor.numpy()
    return np.asarray(value)


def _cast(data: np.ndarray, dtype: np.dtype, where: str) -> np.ndarray:
    """Cast ``data`` to the column ``dtype``, refusing casts that would change values."""
    if data.dtype == dtype:
        return data
    if dtype.kind == "b":
        # Masks often arrive as int/float 0/1 (attention_mask, mask.float()): accept those.
        if data.dtype.kind in "biuf" and np.isin(data, (0, 1)).all():
            return data.astype(dtype)
        raise ValueError(f"{where}: expected bool (or 0/1 values), got {data.dtype}")
    if not np.can_cast(data.dtype, dtype, casting="same_kind"):
        raise ValueError(f"{where}: cannot cast {data.dtype} to column dtype {dtype}")
    if dtype.kind in "iu" and data.dtype.kind in "iu" and data.size:
        # same_kind allows int64 -> int32, which would wrap token ids silently.
        info = np.iinfo(dtype)
        low, high = data.min(), data.max()
        if low < info.min or high > info.max:
            raise ValueError(f"{where}: values [{low}, {high}] do not fit column dtype {dtype}")
    return data.astype(dtype)


def _fit_trailing(data: np.ndarray, shape: tuple[int, ...], where: str,
                  left: bool = False) -> np.ndarray:
    """Right-pad ``data``'s trailing axes with zeros up to ``shape`` (``left``: pad on the
    left); longer is an error."""
    if data.ndim != 1 + len(shape):
        raise ValueError(
            f"{where}: expected {1 + len(shape)} dims (rows, *{shape}), got shape {data.shape}"
        )
    trailing = data.shape[1:]
    if any(got > want for got, want in zip(trailing, shape, strict=True)):
        raise ValueError(f"{where}: trailing shape {trailing} is longer than column shape {shape}")
    if trailing == shape:
        return data
    pad = [(0, 0)] + [(want - got, 0) if left else (0, want - got)
                      for got, want in zip(trailing, shape, strict=True)]
    return np.pad(data, pad)  # constant 0 (False for bool)


def _check_alignment(where: str, start: int, n: int, rows: int, chunk_rows: int) -> None:
    """Refuse writes that could share a chunk with another writer (the protocol:
    ``rlhfflow.storage.buffer``)."""
    stop = start + n
    if n < 1:
        raise ValueError(f"{where}: nothing to write (0 rows)")
    if start < 0 or stop > rows:
        raise ValueError(f"{where}: rows [{start}, {stop}) outside the array's {rows} rows")
    if start % chunk_rows:
        raise ValueError(
            f"{where}: start {start} is not a multiple of chunk_rows {chunk_rows}; only "
            "chunk-aligned writes are safe from several processes"
        )
    if stop % chunk_rows and stop != rows:
        raise ValueError(
            f"{where}: {n} rows from {start} end inside a chunk; expected a multiple of "
            f"chunk_rows {chunk_rows} or a write reaching the last row ({rows})"
        )
