"""Trackers beyond metrics.jsonl: an offline W&B run (read back from its ``.wandb`` file and
its table files), a local Trackio run (read back from its SQLite database, across a resume)
and completions tables (``logging.completions_every``) read from the
committed iterations of the buffer. Real inline runs of a tiny GRPO pipeline."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import pytest

from rlhfflow.config.loader import load_pipeline
from rlhfflow.monitor.sinks import markdown_table
from rlhfflow.runtime.run import run_pipeline
from rlhfflow.storage import ExperienceBuffer, MetricsLog
from tests.conftest import small_pipeline


def wandb_history(path: Path) -> list[dict]:
    """The history rows of a ``.wandb`` file: a LevelDB-style log (a 7-byte ``:W&B``
    header, 32 KiB blocks of records with a 7-byte ``crc, length, type`` header) of
    ``wandb.proto`` ``Record`` messages. wandb ships no reader of its own any more."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if data[:4] != b":W&B":
        pytest.skip(f"{path.name}: not the .wandb log format this test reads")
    pos, block, pending, rows = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # the padded end of a block
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk  # FULL/FIRST start one
        if kind in (1, 4):  # FULL/LAST end one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def _by_step(rows: list[dict], step: str, metrics: list[dict]) -> dict[int, dict]:
    """A tracker's logged rows merged by their ``step`` key, checked to hold one step per
    iteration of ``metrics`` with its ``reward``."""
    by_step: dict[int, dict] = {}
    for row in rows:
        by_step.setdefault(row[step], {}).update(row)
    assert sorted(by_step) == [r["iteration"] for r in metrics]
    for record in metrics:
        assert by_step[record["iteration"]]["reward"] == pytest.approx(record["reward_mean"])
    return by_step


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory) -> Path:
    """A 3-iteration GRPO run, inline, logging to an offline W&B run in ``tmp/wb`` and a
    completions table every 2nd iteration: its output directory."""
    pytest.importorskip("wandb")
    tmp = tmp_path_factory.mktemp("tracked")
    path = small_pipeline(tmp, "grpo", iterations=3, batch_size=4, overrides={
        "logging": {"wandb": {"project": "rlhfflow-test", "dir": str(tmp / "wb")},
                    "completions_every": 2}})
    run_pipeline(load_pipeline(path), progress=False, inline=True)
    return tmp


def test_completions_every_n_iterations_come_from_the_buffer(tracked_run: Path) -> None:
    out = tracked_run / "out"
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0] * 16 + [2] * 16  # 4 prompts x 4 samples
    assert set(rows[0]) == {"iteration", "prompt", "response", "scores", "advantage"}
    buffer = ExperienceBuffer(out / "buffer.zarr", create=False)
    assert [r["response"] for r in rows[16:]] == buffer.read_text(2, "response_text")
    assert [r["prompt"] for r in rows[:16]] == buffer.read_text(0, "prompt_text")
    assert [r["scores"] for r in rows[:16]] == pytest.approx(
        buffer.read(0, ["scores"])["scores"].tolist())
    group = [r["advantage"] for r in rows[:4]]  # one prompt's samples: GRPO centres them
    assert sum(group) == pytest.approx(0.0, abs=1e-4)


def test_an_offline_wandb_run_holds_the_metrics_and_the_tables(tracked_run: Path) -> None:
    (run_dir,) = (tracked_run / "wb" / "wandb").glob("offline-run-*")
    history = wandb_history(next(run_dir.glob("run-*.wandb")))
    metrics = MetricsLog(tracked_run / "out" / "metrics.jsonl").read()
    by_step = _by_step(history, "_step", metrics)
    assert [s for s, row in sorted(by_step.items()) if "completions/path" in row] == [0, 2]
    table = json.loads((run_dir / "files" / by_step[2]["completions/path"]).read_text())
    assert table["columns"] == ["iteration", "prompt", "response", "scores", "advantage"]
    assert len(table["data"]) == 16 and {row[0] for row in table["data"]} == {2}


@pytest.fixture(scope="module")
def trackio_run(tmp_path_factory) -> tuple[Path, list[dict], list[str]]:
    """A 2-iteration GRPO run logging to a local Trackio run in ``tmp/trackio``
    (``TRACKIO_DIR``, which Trackio reads when it is first imported) with a completions
    table every 2nd iteration, then resumed to 3 iterations: its folder, the Trackio run's
    logs and the project's runs."""
    tmp = tmp_path_factory.mktemp("trackio")
    before = os.environ.get("TRACKIO_DIR")
    os.environ["TRACKIO_DIR"] = str(tmp / "trackio")
    try:
        utils = pytest.importorskip("trackio.utils")
        from trackio.sqlite_storage import SQLiteStorage

        assert utils.TRACKIO_DIR == tmp / "trackio", "trackio was imported before this test"
        path = small_pipeline(tmp, "grpo", iterations=2, batch_size=4, overrides={
            "logging": {"trackio": {"project": "rlhfflow-test", "run_name": "grpo-small"},
                        "completions_every": 2}})
        run_pipeline(load_pipeline(path), progress=False, inline=True)
        run_pipeline(load_pipeline(path, {"iterations": 3}), progress=False, inline=True)
        return tmp, SQLiteStorage.get_logs("rlhfflow-test", "grpo-small"), \
            SQLiteStorage.get_runs("rlhfflow-test")
    finally:
        if before is None:
            del os.environ["TRACKIO_DIR"]
        else:
            os.environ["TRACKIO_DIR"] = before


def test_a_trackio_run_holds_the_metrics_and_the_tables_and_goes_on_after_a_resume(
        trackio_run) -> None:
    tmp, logs, runs = trackio_run
    assert (tmp / "trackio" / "rlhfflow-test.db").is_file()
    assert runs == ["grpo-small"]  # the resume went on in the same run
    metrics = MetricsLog(tmp / "out" / "metrics.jsonl").read()
    assert [r["iteration"] for r in metrics] == [0, 1, 2]
    by_step = _by_step(logs, "step", metrics)
    for record in metrics:
        assert by_step[record["iteration"]]["timing/step"] == pytest.approx(
            record["iteration_s"])
    assert [s for s, row in sorted(by_step.items()) if "completions" in row] == [0, 2]
    table = by_step[2]["completions"]
    assert table["_type"] == "trackio.table" and len(table["_value"]) == 16
    rows = [json.loads(line) for line in (tmp / "out" / "completions.jsonl").read_text()
            .splitlines() if json.loads(line)["iteration"] == 2]
    assert [r["response"] for r in table["_value"]] == [r["response"] for r in rows]


def test_trackio_is_not_left_as_the_current_run_after_close(trackio_run) -> None:
    from trackio import context_vars

    assert context_vars.current_run.get() is None  # nothing for trackio's atexit to redo


def test_a_failed_run_leaves_an_error_alert_in_its_trackio_run(trackio_run) -> None:
    from trackio.sqlite_storage import SQLiteStorage

    from rlhfflow.monitor.sinks import TrackioSink

    # trackio_run: TRACKIO_DIR is its folder for the rest of this process
    sink = TrackioSink("rlhfflow-test", "failing", None, None, {}, resume=False)
    assert "'failing'" in sink.line and "trackio show --project rlhfflow-test" in sink.line
    sink.log({"iteration": 0, "reward_mean": 0.5})
    sink.close(failed=True)
    (alert,) = SQLiteStorage.get_alerts("rlhfflow-test", run_name="failing")
    assert alert["title"] == "rlhfflow run failed" and alert["level"] == "error"
    assert [row["reward"] for row in SQLiteStorage.get_logs("rlhfflow-test", "failing")] == [0.5]


def test_markdown_tables_keep_a_cell_on_one_line() -> None:
    text = markdown_table([{"prompt": "a|b", "response": "x\ny", "scores": 0.123456}])
    assert text.splitlines() == ["| prompt | response | scores |", "|---|---|---|",
                                 "| a\\|b | x y | 0.1235 |"]


@pytest.mark.parametrize("package", ["wandb", "trackio"])
def test_a_tracker_without_its_package_is_one_line_naming_the_extra(
        tmp_path, monkeypatch, package) -> None:
    import importlib.util

    from rlhfflow.config.spec import SpecError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == package else real(name, *a))
    path = small_pipeline(tmp_path, "grpo", overrides={f"logging.{package}": {}})
    with pytest.raises(SpecError) as caught:
        load_pipeline(path)
    assert str(caught.value) == (f"{path}: logging.{package}: needs the {package!r} package, "
                                 f"which is not installed: pip install 'rlhfflow[{package}]'")


def test_a_resumed_run_redoes_completions_rows_instead_of_doubling_them(tmp_path) -> None:
    from rlhfflow.monitor.completions import append_rows

    path = tmp_path / "completions.jsonl"
    for k in (0, 2, 4, 2, 4):  # a run that stopped after 4 resumes from 2
        append_rows(path, k, [{"iteration": k, "response": f"r{k}"}])
    assert [json.loads(line)["iteration"] for line in path.read_text().splitlines()] == [0, 2, 4]


def test_tensorboard_stays_in_its_directory_beside_wandb_and_a_resume_goes_on_in_the_same_runs(
        tmp_path) -> None:
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    path = small_pipeline(tmp_path, "grpo", iterations=2, batch_size=4, overrides={
        "logging": {"tensorboard": True, "wandb": {"project": "rlhfflow-test"}}})
    run_pipeline(load_pipeline(path), progress=False, inline=True)
    run_pipeline(load_pipeline(path, {"iterations": 3}), progress=False, inline=True)
    out = tmp_path / "out"
    assert not list(out.glob("events.out.tfevents.*"))  # W&B's directory is not TB's
    board = EventAccumulator(str(out / "tensorboard"))
    board.Reload()
    metrics = MetricsLog(out / "metrics.jsonl").read()
    assert [(e.step, e.value) for e in board.Scalars("reward")] == [
        (r["iteration"], pytest.approx(r["reward_mean"])) for r in metrics]
    # one W&B run: the resume's offline directory has the first one's id (W&B names it
    # offline-run-DATE_TIME-ID, with a "-1" after it when both started in one second)
    runs = sorted((out / "wandb").glob("offline-run-*"))
    ids = {re.match(r"offline-run-\d{8}_\d{6}-([^-]+)", r.name).group(1) for r in runs}
    assert len(runs) == 2 and len(ids) == 1
    rows = [row for r in runs for row in wandb_history(next(r.glob("run-*.wandb")))]
    _by_step(rows, "_step", metrics)
    assert sorted(row["_step"] for row in rows) == [0, 1, 2]


def test_a_resumed_tensorboard_run_drops_the_steps_it_redoes(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rlhfflow.monitor.sinks import TensorBoardSink

    first = TensorBoardSink(tmp_path)
    for k in range(4):  # stopped after iteration 3, checkpointed after 1
        first.log({"iteration": k, "reward_mean": float(k)})
    first.close()
    resumed = TensorBoardSink(tmp_path, purge_step=2)
    for k in (2, 3):
        resumed.log({"iteration": k, "reward_mean": 10.0 + k})
    resumed.close()
    board = EventAccumulator(str(tmp_path))
    board.Reload()
    assert [(e.step, e.value) for e in board.Scalars("reward")] == [
        (0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0)]
