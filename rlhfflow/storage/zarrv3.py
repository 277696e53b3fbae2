"""zarr v3 as the experience buffer writes it: the one module that touches zarr's internals.

The buffer writes array and group documents (``zarr.json``) and uncompressed chunks as
files itself, byte for byte as zarr writes them, because zarr's write path (codec
pipeline, event loop, a thread per file) cost ~1 ms of CPU per chunk, most of a tiny
demo's store task. What it needs of zarr beyond the public API (the metadata classes,
the async array, the buffer prototype, ``sync``) is imported here, and only for the
zarr versions this code is tested with; a zarr outside them is refused at import with
one line, instead of a buffer written wrong. Compressed arrays go through zarr's own
codecs.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zarr

#: the zarr releases whose internals this module was written against (major.minor);
#: chunks and documents it writes are checked against zarr's own reader by the tests
SUPPORTED = ((3, 0), (3, 1))


def check_version(version: str) -> None:
    """Refuse a zarr this module does not know (``ImportError``, one line)."""
    try:
        major_minor = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        major_minor = ()
    if major_minor not in SUPPORTED:
        known = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED)
        raise ImportError(f"rlhfflow's experience buffer knows zarr {known}, found zarr "
                          f"{version}; install a supported zarr (pip install 'zarr>=3.0,<3.2')")


check_version(zarr.__version__)

from zarr.codecs import BytesCodec  # noqa: E402  (after the version check)
from zarr.core.array import AsyncArray  # noqa: E402
from zarr.core.buffer import default_buffer_prototype  # noqa: E402
from zarr.core.metadata.v3 import ArrayV3Metadata  # noqa: E402
from zarr.core.sync import sync  # noqa: E402
from zarr.storage import LocalStore, MemoryStore, StorePath  # noqa: E402


def array_document(dtype_name: str, shape: tuple[int, ...], rows: int, chunk_rows: int,
                   compressors) -> bytes:
    """The ``zarr.json`` of an array of ``rows`` rows of column ``spec``: zarr's own
    document for the column's dtype, trailing shape and codecs (made once, cached), with
    the shape and chunk shape filled in. Chunk keys use ``.`` as separator (``c.0.0``):
    chunks are files of the array's folder, with no ``c/0/`` folders to create."""
    key = (dtype_name, shape, None if compressors is None else
           repr(compressors.to_dict()))
    if key not in _TEMPLATES:
        dtype = np.dtype(dtype_name)
        array = zarr.create_array(MemoryStore(), shape=(1, *shape),
                                  chunks=(1, *shape), dtype=dtype,
                                  fill_value=dtype.type(0), compressors=compressors,
                                  chunk_key_encoding={"name": "default", "separator": "."})
        documents = array.metadata.to_buffer_dict(default_buffer_prototype())
        _TEMPLATES[key] = json.loads(documents["zarr.json"].to_bytes())
    document = dict(_TEMPLATES[key])
    document["shape"] = [int(rows), *shape]
    document["chunk_grid"] = {"name": "regular",
                              "configuration": {"chunk_shape": [int(chunk_rows), *shape]}}
    return json.dumps(document, indent=2).encode()


_TEMPLATES: dict[tuple, dict] = {}


def group_document(attributes: Mapping[str, Any]) -> bytes:
    """The ``zarr.json`` of a group with ``attributes``, as zarr writes it."""
    if "group" not in _TEMPLATES:
        group = zarr.create_group(MemoryStore())
        documents = group.metadata.to_buffer_dict(default_buffer_prototype())
        _TEMPLATES["group"] = json.loads(documents["zarr.json"].to_bytes())
    return json.dumps({**_TEMPLATES["group"], "attributes": dict(attributes)},
                      indent=2).encode()


def metadata_of(document: bytes) -> ArrayV3Metadata:
    """zarr's metadata object of an array document (cached: documents repeat)."""
    found = _METADATA.get(document)
    if found is None:
        if len(_METADATA) > 4096:
            _METADATA.clear()
        found = _METADATA[document] = ArrayV3Metadata.from_dict(json.loads(document))
    return found


_METADATA: dict[bytes, ArrayV3Metadata] = {}


def chunk_keys(metadata: ArrayV3Metadata) -> list[str]:
    """The key of every chunk of an array (relative to its folder)."""
    grid = [range(math.ceil(n / c)) for n, c in
            zip(metadata.shape, metadata.chunk_grid.chunk_shape, strict=True)]
    return [metadata.encode_chunk_key(coords) for coords in itertools.product(*grid)]


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` at once (temp file plus rename), as ``LocalStore``
    does, so a reader never sees half a document or chunk; a write that fails (a full
    disk) leaves ``path`` as it was and no temp file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        write_file(tmp, data, named=path)
        os.replace(tmp, path)
    except BaseException:  # a full disk: give its space back, leave no partial file
        tmp.unlink(missing_ok=True)
        raise


def write_file(path: Path, data: bytes, named: Path | None = None) -> None:
    """Write ``data`` to ``path``; an ``OSError`` names ``named`` (default ``path``): a
    failed ``write``, as on a full disk, names no file by itself, and the file a user
    knows of is the final one, not its temporary."""
    try:
        path.write_bytes(data)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(named or path)) from None


def open_array(folder: Path, store: LocalStore, path: str) -> AsyncArray:
    """The array at ``folder`` (``path`` in ``store``) from its document, read as a file
    (zarr's open reads it through the store and validates every parent: ~1 ms each)."""
    try:
        document = (folder / "zarr.json").read_bytes()
    except FileNotFoundError:
        raise KeyError(path) from None
    return array_of(document, store, path)


def array_of(document: bytes, store: LocalStore, path: str) -> AsyncArray:
    """The array ``path`` of ``store`` whose ``zarr.json`` is ``document``."""
    return AsyncArray(metadata=metadata_of(document), store_path=StorePath(store, path))


def write_all(writes: Sequence[tuple[Path, AsyncArray, int, np.ndarray]]) -> None:
    """Write rows ``[start, start + len(data))`` of each array (its folder, the array,
    start, data): uncompressed chunks as files here, others through zarr's codecs."""
    through_zarr = []
    for folder, array, start, data in writes:
        if _plain(array.metadata):
            _write_plain(folder, array.metadata, start, data)
        else:
            through_zarr.append((array, slice(start, start + len(data)), data))
    if through_zarr:
        sync(_set_all(through_zarr))


def _plain(metadata: ArrayV3Metadata) -> bool:
    """Whether an array's chunks are its values' bytes (no compressor) and span its
    trailing dimensions whole: the buffer's arrays unless ``compress`` is on."""
    codecs = metadata.codecs
    return (len(codecs) == 1 and isinstance(codecs[0], BytesCodec)
            and tuple(metadata.chunk_grid.chunk_shape[1:]) == tuple(metadata.shape[1:]))


def _write_plain(folder: Path, metadata: ArrayV3Metadata, start: int, data: np.ndarray
                 ) -> None:
    """The chunks holding rows ``[start, start + len(data))`` of a plain array (see
    :func:`_plain`; ``start`` chunk-aligned), each written as zarr writes it: the
    chunk's values in C order, little-endian, an edge chunk padded with the fill value
    to the full chunk shape. Through zarr (codec pipeline, event loop, a thread per
    file) one chunk cost ~1 ms of CPU, ~20 ms for a micro-batch's columns on the tiny
    demos; written here, a file's creation is most of what is left."""
    rows = metadata.chunk_grid.chunk_shape[0]
    dtype = data.dtype.newbyteorder("<") if data.dtype.itemsize > 1 else data.dtype
    fill = metadata.fill_value
    for a in range(0, len(data), rows):
        block = np.ascontiguousarray(data[a:a + rows], dtype=dtype)
        if len(block) < rows:
            padded = np.full((rows, *block.shape[1:]), fill, dtype=dtype)
            padded[:len(block)] = block
            block = padded
        key = metadata.encode_chunk_key(((start + a) // rows,) + (0,) * (data.ndim - 1))
        if "/" in key:  # an array made before chunk keys were c.0.0 (a resumed run)
            (folder / key).parent.mkdir(parents=True, exist_ok=True)
        atomic_write(folder / key, block.tobytes())


async def _set_all(writes: Sequence[tuple[AsyncArray, slice, np.ndarray]]) -> None:
    # zarr skips chunks equal to the fill value by default; write them anyway so
    # commit(check_complete=True) can tell "written zeros" from "never written"
    await asyncio.gather(*(array.with_config({"write_empty_chunks": True}).setitem(rows, data)
                           for array, rows, data in writes))
