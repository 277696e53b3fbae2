"""Tests for rlhfflow.storage: the zarr experience buffer and the JSONL metrics log."""

from __future__ import annotations

import errno
import json
import math
import multiprocessing as mp
import os

import numpy as np
import pytest
import torch
import zarr

from rlhfflow.cli.buffer import format_summary
from rlhfflow.storage import (
    ColumnSpec,
    ExperienceBuffer,
    IterationNotFoundError,
    MetricsLog,
    split_rows,
    to_jsonable,
)
from tests.conftest import tmpfs

ROWS, CHUNK, RESP = 64, 8, 16
SPECS = {
    "response_ids": ColumnSpec("int32", (RESP,)),
    "logprobs": ColumnSpec("float32", (RESP,)),
    "mask": ColumnSpec("bool", (RESP,)),
    "score": ColumnSpec("float32"),
}


def _rows(start: int, n: int) -> dict[str, np.ndarray]:
    """Deterministic content of rows [start, start+n), so any process can rebuild it."""
    rng = np.random.default_rng(start)
    return {
        "response_ids": rng.integers(0, 50_000, (n, RESP), dtype=np.int32),
        "logprobs": rng.standard_normal((n, RESP)).astype(np.float32),
        "mask": rng.random((n, RESP)) > 0.3,
        "score": rng.standard_normal(n).astype(np.float32),
    }


def _expected(rows: int = ROWS) -> dict[str, np.ndarray]:
    parts = [_rows(s, CHUNK) for s in range(0, rows, CHUNK)]
    return {k: np.concatenate([p[k] for p in parts]) for k in SPECS}


def _worker(path: str, iteration: int, starts: list[int], barrier) -> None:
    """Child process: wait for the sibling, then write one chunk per call."""
    barrier.wait(timeout=30)
    for start in starts:
        ExperienceBuffer.write_rows(path, iteration, start, _rows(start, CHUNK))


def _fill(path, iteration: int, rows: int = ROWS) -> None:
    for start in range(0, rows, CHUNK):
        ExperienceBuffer.write_rows(path, iteration, start, _rows(start, CHUNK))


@pytest.fixture
def buf(tmp_path) -> ExperienceBuffer:
    return ExperienceBuffer(tmp_path / "buffer.zarr")


def test_two_processes_write_disjoint_chunks_concurrently(buf):
    buf.begin_iteration(0, ROWS, SPECS, CHUNK, attrs={"note": "concurrent"})
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    # Interleaved chunks (0,2,4,6 vs 1,3,5,7) so both processes hit neighbouring chunks.
    starts = [list(range(i * CHUNK, ROWS, 2 * CHUNK)) for i in range(2)]
    procs = [ctx.Process(target=_worker, args=(str(buf.path), 0, s, barrier)) for s in starts]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert buf.iterations() == []  # not visible before the commit
    buf.commit(0, attrs={"time": 1.5})
    assert buf.iterations() == [0]
    got = buf.read(0)
    for name, want in _expected().items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)
        assert got[name].dtype == np.dtype(SPECS[name].dtype)
    assert buf.attrs(0)["note"] == "concurrent" and buf.attrs(0)["time"] == 1.5


def test_crashed_iteration_is_invisible_and_cleaned(buf):
    buf.begin_iteration(0, ROWS, SPECS, CHUNK)
    _fill(buf.path, 0)
    buf.commit(0)
    buf.begin_iteration(1, ROWS, SPECS, CHUNK)
    ExperienceBuffer.write_rows(buf.path, 1, 0, _rows(0, CHUNK))  # then "crash"

    reopened = ExperienceBuffer(buf.path, create=False)
    assert reopened.iterations() == [0]
    assert reopened.uncommitted() == [1]
    with pytest.raises(IterationNotFoundError, match="not committed"):
        reopened.read(1)
    with pytest.raises(KeyError, match="not in the buffer"):
        reopened.read(7)
    # Without all chunks written, the commit refuses (a worker died silently).
    with pytest.raises(ValueError, match="unwritten"):
        reopened.commit(1)

    reopened.begin_iteration(1, 16, {"x": ColumnSpec("int64")}, 8)
    assert reopened.uncommitted() == [1]
    ExperienceBuffer.write_rows(buf.path, 1, 0, {"x": np.arange(16)})
    reopened.commit(1)
    assert reopened.columns(1) == {"x": ColumnSpec("int64", ())}
    np.testing.assert_array_equal(reopened.read(1)["x"], np.arange(16))
    assert reopened.uncommitted() == []


def test_committed_iteration_is_never_overwritten(buf):
    buf.begin_iteration(0, 16, {"x": ColumnSpec("int32")}, 8)
    ExperienceBuffer.write_rows(buf.path, 0, 0, {"x": np.arange(16)})
    buf.commit(0)
    with pytest.raises(ValueError, match="already committed"):
        buf.begin_iteration(0, 16, {"x": ColumnSpec("int32")}, 8)
    with pytest.raises(ValueError, match="committed"):
        ExperienceBuffer.write_rows(buf.path, 0, 0, {"x": np.zeros(8)})
    with pytest.raises(ValueError, match="already committed"):
        buf.commit(0)
    np.testing.assert_array_equal(buf.read(0)["x"], np.arange(16))


def test_all_zero_chunks_count_as_written(buf):
    # zarr skips writing chunks equal to the fill value unless told otherwise.
    buf.begin_iteration(0, 16, {"x": ColumnSpec("float32")}, 8)
    ExperienceBuffer.write_rows(buf.path, 0, 0, {"x": np.zeros(16)})
    buf.commit(0)
    assert buf.read(0)["x"].sum() == 0


def test_write_validation(buf):
    buf.begin_iteration(0, 20, {"ids": ColumnSpec("int32", (4,)), "m": ColumnSpec("bool")}, 8)
    ok = np.ones((8, 4), np.int32)
    with pytest.raises(ValueError, match=r"iter_000000 column 'ids'.*multiple of chunk_rows 8"):
        ExperienceBuffer.write_rows(buf.path, 0, 4, {"ids": ok})
    with pytest.raises(ValueError, match="end inside a chunk"):
        ExperienceBuffer.write_rows(buf.path, 0, 0, {"ids": ok[:5]})
    with pytest.raises(ValueError, match="outside"):
        ExperienceBuffer.write_rows(buf.path, 0, 16, {"ids": ok})
    with pytest.raises(ValueError, match="longer than column shape"):
        ExperienceBuffer.write_rows(buf.path, 0, 0, {"ids": np.ones((8, 5), np.int32)})
    with pytest.raises(ValueError, match="expected 2 dims"):
        ExperienceBuffer.write_rows(buf.path, 0, 0, {"ids": np.ones(8, np.int32)})
    with pytest.raises(ValueError, match="no such column"):
        ExperienceBuffer.write_rows(buf.path, 0, 0, {"nope": ok})
    with pytest.raises(ValueError, match="was not begun"):
        ExperienceBuffer.write_rows(buf.path, 3, 0, {"ids": ok})
    with pytest.raises(ValueError, match="cannot cast float64"):
        ExperienceBuffer.write_rows(buf.path, 0, 0, {"ids": ok * 0.5})
    with pytest.raises(ValueError, match="do not fit"):
        ExperienceBuffer.write_rows(buf.path, 0, 0, {"ids": ok.astype(np.int64) * 2**40})
    with pytest.raises(ValueError, match="0/1"):
        ExperienceBuffer.write_rows(buf.path, 0, 0, {"m": np.full(8, 2)})
    with pytest.raises(ValueError, match="other columns"):
        ExperienceBuffer.write_rows(buf.path, 0, 0, {"ids": ok, "m": np.ones(16, bool)})
    # A failed multi-column call wrote nothing, not even its valid first column.
    assert zarr.open_array(buf.path / "iter_000000" / "ids", mode="r").nchunks_initialized == 0
    # The last, partial chunk [16, 20) is a valid write; so is a multi-chunk range.
    ExperienceBuffer.write_rows(buf.path, 0, 16, {"ids": np.ones((4, 4), np.int8), "m": np.ones(4)})
    ExperienceBuffer.write_rows(buf.path, 0, 0, {"ids": ok.repeat(2, 0), "m": np.zeros(16)})
    buf.commit(0)
    got = buf.read(0)
    assert got["ids"].sum() == 80 and got["m"].tolist() == [False] * 16 + [True] * 4


def test_shorter_trailing_dim_is_right_padded(buf):
    buf.begin_iteration(0, 8, {"ids": ColumnSpec("int64", (16,))}, 8)
    short = np.arange(1, 8 * 12 + 1).reshape(8, 12)
    ExperienceBuffer.write_rows(buf.path, 0, 0, {"ids": short})
    buf.commit(0)
    got = buf.read(0)["ids"]
    assert got.shape == (8, 16)
    np.testing.assert_array_equal(got[:, :12], short)
    assert not got[:, 12:].any()


@pytest.mark.parametrize("dtype", ["int8", "int32", "int64", "float32", "float64", "bool"])
def test_dtype_round_trip(buf, dtype):
    rng = np.random.default_rng(0)
    data = (rng.standard_normal((10, 3)) * 50).astype(dtype)
    buf.begin_iteration(5, 10, {"c": ColumnSpec(dtype, (3,))}, 4)
    for start in (0, 4, 8):
        ExperienceBuffer.write_rows(buf.path, 5, start, {"c": data[start : start + 4]})
    buf.commit(5)
    got = buf.read(5, ["c"])["c"]
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got, data)


@pytest.mark.parametrize("compress", [False, True])
def test_chunk_files_are_those_zarr_writes(tmp_path, compress):
    """Uncompressed chunks are written as files by the buffer itself (zarr's codec
    pipeline cost ~1 ms per chunk): byte for byte what zarr writes for the same rows,
    the padded edge chunk included; compressed ones still go through zarr."""
    rng = np.random.default_rng(1)
    data = {"ids": rng.integers(-9, 9, (10, 3)).astype(">i4"),  # big-endian input
            "lp": rng.standard_normal(10).astype(np.float64),
            "ok": rng.random((10, 2)) > 0.5}
    specs = {c: ColumnSpec(v.dtype.newbyteorder("=").name, v.shape[1:])
             for c, v in data.items()}
    buf = ExperienceBuffer(tmp_path / "b.zarr", compress=compress)
    buf.begin_iteration(0, 10, specs, 4)
    for start in (0, 4, 8):
        ExperienceBuffer.write_rows(buf.path, 0, start,
                                    {c: v[start:start + 4] for c, v in data.items()})
    buf.commit(0)
    for col, values in data.items():
        folder = buf.path / "iter_000000" / col
        ref = zarr.create_array(zarr.storage.LocalStore(tmp_path / "ref" / col),
                                shape=values.shape, chunks=(4, *values.shape[1:]),
                                dtype=specs[col].dtype, fill_value=np.dtype(specs[col].dtype)
                                .type(0), compressors=(zarr.codecs.ZstdCodec(level=3)
                                                       if compress else None),
                                chunk_key_encoding={"name": "default", "separator": "."})
        ref[:] = values
        for key in ("c.0", "c.1", "c.2"):
            key = key + ".0" * (values.ndim - 1)
            assert (folder / key).read_bytes() == (tmp_path / "ref" / col / key).read_bytes()
        np.testing.assert_array_equal(buf.read(0, [col])[col], values)


def test_an_iteration_begun_with_slash_chunk_keys_is_still_written(buf):
    """Buffers made before chunk keys were ``c.0`` hold arrays keyed ``c/0/0``; a run
    resumed there writes its rows into those (creating the chunk folders)."""
    buf.begin_iteration(0, 8, {"x": ColumnSpec("float32", (3,))}, 4)
    zarr.create_array(zarr.storage.LocalStore(buf.path / "iter_000000" / "x"),
                      shape=(8, 3), chunks=(4, 3), dtype="float32", fill_value=0.0,
                      compressors=None, overwrite=True)  # zarr's default: c/0/0
    data = np.arange(24, dtype=np.float32).reshape(8, 3)
    for start in (0, 4):
        ExperienceBuffer.write_rows(buf.path, 0, start, {"x": data[start:start + 4]})
    buf.commit(0)
    assert (buf.path / "iter_000000" / "x" / "c" / "1" / "0").is_file()
    np.testing.assert_array_equal(buf.read(0, ["x"])["x"], data)


def test_torch_tensors_accepted(buf):
    cols = {
        "ids": ColumnSpec("int32", (6,)),
        "lp": ColumnSpec("float32", (6,)),
        "m": ColumnSpec("bool", (6,)),
    }
    buf.begin_iteration(0, 4, cols, 4)
    ids = torch.arange(24, dtype=torch.int64).reshape(4, 6)
    lp = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(4, 6, dtype=torch.long)  # attention_mask style 0/1 ints
    ExperienceBuffer.write_rows(buf.path, 0, 0, {"ids": ids, "lp": lp, "m": mask})
    buf.commit(0)
    got = buf.read(0)
    np.testing.assert_array_equal(got["ids"], ids.numpy())
    np.testing.assert_allclose(got["lp"], lp.detach().numpy(), rtol=1e-6)
    assert got["m"].dtype == np.bool_ and got["m"].all()


def test_truncate_and_discard(buf):
    for it in range(4):
        buf.begin_iteration(it, 8, {"x": ColumnSpec("int32")}, 8)
        ExperienceBuffer.write_rows(buf.path, it, 0, {"x": np.full(8, it)})
        if it < 3:
            buf.commit(it)
    assert buf.iterations() == [0, 1, 2] and buf.uncommitted() == [3]
    assert buf.truncate(keep_through=1) == [2, 3]
    assert buf.iterations() == [0, 1] and buf.uncommitted() == []
    buf.discard(1)
    buf.discard(42)  # missing: no-op
    assert buf.iterations() == [0]
    assert buf.read(0)["x"].tolist() == [0] * 8


def test_interrupted_delete_leaves_no_committed_group(buf):
    buf.begin_iteration(0, 8, {"x": ColumnSpec("int32")}, 8)
    ExperienceBuffer.write_rows(buf.path, 0, 0, {"x": np.ones(8, np.int64)})
    buf.commit(0)
    (buf.path / "iter_000000" / "zarr.json").unlink()  # half-deleted directory
    assert buf.iterations() == [] and buf.uncommitted() == [0]
    assert buf.truncate(-1) == [0]
    assert not (buf.path / "iter_000000").exists()


def test_summary_and_format(buf):
    buf.begin_iteration(2, 4, {"r": ColumnSpec("float32"), "ids": ColumnSpec("int32", (2,))}, 2)
    r = np.array([1.0, 2.0, 3.0, 4.0])
    ids = np.array([[0, 1], [2, 3], [4, 5], [6, 7]])
    ExperienceBuffer.write_rows(buf.path, 2, 0, {"r": r, "ids": ids})
    buf.commit(2, attrs={"time": "t0"})
    buf.begin_iteration(3, 4, {"r": ColumnSpec("float32")}, 2)  # left incomplete
    (item,) = buf.summary()
    assert item["iteration"] == 2 and item["rows"] == 4
    stats = item["columns"]["r"]
    assert stats["shape"] == [4] and stats["dtype"] == "float32"
    assert stats["mean"] == pytest.approx(2.5) and stats["std"] == pytest.approx(np.std(r))
    assert (stats["min"], stats["max"]) == (1.0, 4.0)
    ids_stats = item["columns"]["ids"]
    assert ids_stats["mean"] == pytest.approx(3.5) and ids_stats["std"] == pytest.approx(
        np.std(ids)
    )
    text = format_summary(buf.summary(), buf.uncommitted())
    assert "iteration 2" in text and "rows=4" in text and "time" in text
    assert "ids" in text and "4x2" in text and "int32" in text and "2.5" in text
    assert "iter_000003: incomplete (ignored)" in text
    assert "no committed iterations" in format_summary([], [])


def test_options_and_errors(tmp_path):
    missing = tmp_path / "nope.zarr"
    with pytest.raises(FileNotFoundError, match="nope.zarr"):
        ExperienceBuffer(missing, create=False)
    assert not missing.exists()
    buf = ExperienceBuffer(tmp_path / "z.zarr", compress=True)
    buf.begin_iteration(0, 8, {"x": ColumnSpec("float32", (3,))}, 8)
    assert (
        "zstd"
        in type(zarr.open_array(buf.path / "iter_000000" / "x").compressors[0]).__name__.lower()
    )
    with pytest.raises(ValueError, match="reserved"):
        buf.begin_iteration(1, 8, {"x": ColumnSpec("int32")}, 8, attrs={"complete": True})
    with pytest.raises(ValueError, match="not bool/int/float"):
        ColumnSpec("object")
    assert ColumnSpec(np.dtype("int32"), [4]) == ColumnSpec("int32", (4,))
    assert split_rows(20, 8, 2) == [(0, 16), (16, 20)]
    assert split_rows(64, 8, 3) == [(0, 24), (24, 48), (48, 64)]
    assert split_rows(8, 8, 4) == [(0, 8)]


# -- metrics log ---------------------------------------------------------------------------


def test_metrics_append_read_nan(tmp_path):
    log = MetricsLog(tmp_path / "out" / "metrics.jsonl")
    assert log.read() == []
    log.append({"iteration": 0, "loss": float("nan"), "kl": np.float32(0.5), "n": np.int64(3)})
    log.append({"iteration": 1, "loss": torch.tensor(1.25), "hist": torch.tensor([1.0, math.inf])})
    assert log.read() == [
        {"iteration": 0, "loss": None, "kl": 0.5, "n": 3},
        {"iteration": 1, "loss": 1.25, "hist": [1.0, None]},
    ]
    first = log.path.read_text().splitlines()[0]
    assert first.startswith('{"iteration": 0, "loss": null')  # key order kept, NaN -> null


def test_metrics_torn_line_repair_truncate(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for it in range(4):
        log.append({"iteration": it, "reward": it / 2})
    with open(log.path, "ab") as f:
        f.write(b'{"iteration": 4, "rew')  # crash mid-write
    assert [r["iteration"] for r in log.read()] == [0, 1, 2, 3]
    assert log.repair() == len(b'{"iteration": 4, "rew')
    assert log.repair() == 0
    with open(log.path, "ab") as f:
        f.write(b'{"iteration": 4')
    log.append({"iteration": 4})  # repairs first instead of gluing onto the torn line
    assert [r["iteration"] for r in log.read()] == [0, 1, 2, 3, 4]
    log.truncate(keep_through=1)
    assert log.read() == [{"iteration": 0, "reward": 0.0}, {"iteration": 1, "reward": 0.5}]
    assert not list(tmp_path.glob("*.tmp"))
    log.path.write_bytes(b'{"iteration": 0}\nnot json\n{"iteration": 2}\n')
    with pytest.raises(ValueError, match="line 2"):
        log.read()


def test_to_jsonable():
    value = {1: (np.bool_(True), np.arange(2)), "x": [float("-inf"), np.float64("nan")]}
    assert to_jsonable(value) == {"1": [True, [0, 1]], "x": [None, None]}
    assert json.dumps(to_jsonable(torch.tensor([[1, 2]])), allow_nan=False) == "[[1, 2]]"


def test_text_columns_round_trip_as_utf8_bytes_and_offsets(buf):
    texts = ["héllo", "", "wörld ☃", '{"answer": "4"}'] + [f"row {i}" for i in range(ROWS - 4)]
    buf.begin_iteration(0, ROWS, SPECS, chunk_rows=CHUNK)
    buf.write_text(0, {"prompt_text": texts, "empty": [""] * ROWS})
    with pytest.raises(ValueError, match="text column 'short' has 1 rows, the iteration has"):
        buf.write_text(0, {"short": ["x"]})
    _fill(buf.path, 0)
    buf.commit(0)
    assert buf.read_text(0, "prompt_text") == texts
    assert buf.read_text(0, "empty") == [""] * ROWS
    assert buf.text_columns(0) == ["empty", "prompt_text"]
    assert set(buf.columns(0)) == set(SPECS)  # text stays out of the tensor columns
    with pytest.raises(ValueError, match="already committed"):
        buf.write_text(0, {"prompt_text": texts})
    with pytest.raises(KeyError, match="no text column 'answer'"):
        buf.read_text(0, "answer")


@pytest.mark.parametrize("compress", [False, True])
def test_begun_arrays_carry_the_metadata_zarr_itself_writes(tmp_path, compress):
    """begin_iteration writes each array's and the group's zarr.json from a cached
    template: it must be what zarr's create_array / create_group write for the same node
    (so any zarr reads it), with chunk keys ``c.0.0``."""
    buffer = ExperienceBuffer(tmp_path / "b.zarr", compress=compress)
    specs = {"tokens": ColumnSpec("int64", (5,)), "score": ColumnSpec("float32")}
    buffer.begin_iteration(0, 6, specs, chunk_rows=3, attrs={"note": "x"})
    reference = zarr.open_group(zarr.storage.LocalStore(tmp_path / "ref.zarr"), mode="a")
    group = reference.create_group("g", attributes={"note": "x", "complete": False,
                                                    "rows": 6, "chunk_rows": 3})
    assert json.loads((tmp_path / "b.zarr" / "iter_000000" / "zarr.json").read_text()) == \
        json.loads((tmp_path / "ref.zarr" / "g" / "zarr.json").read_text())
    del group
    for name, spec in specs.items():
        dtype = np.dtype(spec.dtype)
        reference.create_array(name, shape=(6, *spec.shape), chunks=(3, *spec.shape),
                               dtype=dtype, fill_value=dtype.type(0),
                               compressors=(zarr.codecs.ZstdCodec(level=3) if compress
                                            else None),
                               chunk_key_encoding={"name": "default", "separator": "."})
        ours = json.loads((tmp_path / "b.zarr" / "iter_000000" / name / "zarr.json")
                          .read_text())
        theirs = json.loads((tmp_path / "ref.zarr" / name / "zarr.json").read_text())
        assert ours == theirs, name


def test_a_zarr_whose_internals_are_unknown_is_refused_in_one_line():
    """The buffer writes zarr's documents and chunks itself (storage.zarrv3): a zarr
    release it was not written against is refused, not trusted to match."""
    from rlhfflow.storage.zarrv3 import SUPPORTED, check_version

    check_version(zarr.__version__)  # the installed one is known
    major, minor = SUPPORTED[-1]
    with pytest.raises(ImportError, match=rf"knows zarr .*found zarr {major}\.{minor + 1}\.0;"):
        check_version(f"{major}.{minor + 1}.0")
    with pytest.raises(ImportError, match="found zarr 2.18.3"):
        check_version("2.18.3")


def test_a_write_that_fills_the_disk_names_its_chunk_leaves_nothing_and_commits_nothing(
        tmp_path):
    with tmpfs(tmp_path / "disk", "1m") as mount:
        buf = ExperienceBuffer(mount / "buffer.zarr")
        wide = {"logits": ColumnSpec("float32", (4096,))}  # 64 KiB per 4-row chunk
        buf.begin_iteration(0, 16, wide, chunk_rows=4)
        ballast = mount / "ballast"
        free = os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize
        ballast.write_bytes(b"\0" * (free - 100 * 1024))  # room for one chunk, not two
        rows = np.ones((8, 4096), dtype=np.float32)
        with pytest.raises(OSError) as failed:
            ExperienceBuffer.write_rows(buf.path, 0, 0, {"logits": rows})
        assert failed.value.errno == errno.ENOSPC
        assert failed.value.filename == str(buf.path / "iter_000000" / "logits" / "c.1.0")
        assert not list(mount.rglob("*.partial"))  # its space given back
        with pytest.raises(ValueError, match=r"unwritten \{'logits': '1/4 chunks'\}"):
            buf.commit(0)
        assert buf.iterations() == [] and buf.uncommitted() == [0]
        # with room again, the same write goes through and the iteration commits whole
        ballast.unlink()
        values = np.arange(16 * 4096, dtype=np.float32).reshape(16, 4096)
        ExperienceBuffer.write_rows(buf.path, 0, 0, {"logits": values})
        buf.commit(0)
        np.testing.assert_array_equal(buf.read(0)["logits"], values)
