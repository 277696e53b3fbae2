"""Checkpoints, resume and faults, with real processes: a killed ``rlhfflow run``, a
killed worker, Ctrl-C, a changed pipeline, a corrupt checkpoint."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from rlhfflow.cli.main import main
from rlhfflow.config.loader import load_pipeline
from rlhfflow.runtime.cluster import embedded_worker_processes
from rlhfflow.runtime.run import RunError, run_pipeline
from rlhfflow.storage import CheckpointStore, ExperienceBuffer, MetricsLog
from tests.conftest import DATA, small_pipeline
from tests.stages.test_setup_stages import _with_setup_stage

# what must not change when a run is stopped and resumed (timings may)
RESULT_KEYS = ("iteration", "samples", "reward_mean", "reward_std", "kl_mean", "policy_loss",
               "value_loss", "clip_frac", "response_length_mean", "tokens_generated")


def _results(out: Path) -> list[dict]:
    return [{k: r[k] for k in RESULT_KEYS} for r in MetricsLog(out / "metrics.jsonl").read()]


def _pipeline(tmp_path: Path, iterations: int, workers: int = 1, every: int = 1,
              name: str = "p") -> Path:
    (tmp_path / name).mkdir(exist_ok=True)
    return small_pipeline(tmp_path / name, iterations=iterations, overrides={
        "cluster.workers": workers, "checkpoint.every": every, "checkpoint.keep": 2})


def _cli(*args: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "rlhfflow.cli.main", "run", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, **kwargs)


def _wait_for_lines(path: Path, count: int, proc: subprocess.Popen, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= count:
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended early: {proc.communicate()}")
        time.sleep(0.05)
    raise AssertionError(f"{path} did not reach {count} lines")


def _assert_each_iteration_once(out: Path, iterations: int) -> None:
    assert [r["iteration"] for r in MetricsLog(out / "metrics.jsonl").read()] == \
        list(range(iterations))
    buffer = ExperienceBuffer(out / "buffer.zarr")
    assert buffer.iterations() == list(range(iterations))
    assert buffer.uncommitted() == []


def test_resume_equals_an_uninterrupted_run(tmp_path):
    stopped = _pipeline(tmp_path, iterations=3, every=2, name="a")
    run_pipeline(load_pipeline(stopped), progress=False, inline=True)
    out = tmp_path / "a" / "out"
    assert [c.iteration for c in CheckpointStore(out / "checkpoints").list()] == [1, 2]
    resumed = run_pipeline(load_pipeline(stopped, {"iterations": 5}), progress=False,
                           inline=True)
    assert [r["iteration"] for r in resumed.metrics] == [3, 4]

    whole = _pipeline(tmp_path, iterations=5, every=2, name="b")
    run_pipeline(load_pipeline(whole), progress=False, inline=True)
    assert _results(out) == _results(tmp_path / "b" / "out")
    _assert_each_iteration_once(out, 5)
    state = CheckpointStore(out / "checkpoints").latest().state
    assert state["iteration"] == 4 and state["versions"] == {"actor": 5, "critic": 5}


def test_the_learning_rate_schedule_survives_a_resume(tmp_path):
    # total_steps fixed: a derived one follows `iterations`, which the resume changes
    schedule = {"models.actor.optimizer.schedule": "cosine",
                "models.actor.optimizer.warmup_steps": 3,
                "models.actor.optimizer.total_steps": 12}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    stopped = small_pipeline(tmp_path / "a", iterations=2, overrides={
        **schedule, "checkpoint.every": 2})
    run_pipeline(load_pipeline(stopped), progress=False, inline=True)
    run_pipeline(load_pipeline(stopped, {"iterations": 4}), progress=False, inline=True)
    whole = small_pipeline(tmp_path / "b", iterations=4, overrides=schedule)
    run_pipeline(load_pipeline(whole), progress=False, inline=True)

    def lrs(out: Path) -> list[float]:
        return [r["train"]["train_actor"]["lr"] for r in MetricsLog(out / "metrics.jsonl").read()]

    assert _results(tmp_path / "a" / "out") == _results(tmp_path / "b" / "out")
    assert lrs(tmp_path / "a" / "out") == lrs(tmp_path / "b" / "out")
    assert len(set(lrs(tmp_path / "b" / "out"))) == 4  # it did change every iteration


def test_a_checkpoint_without_optimizer_state_is_small_and_resumes(tmp_path):
    path = small_pipeline(tmp_path, iterations=2, overrides={"checkpoint.optimizer": False,
                                                             "checkpoint.every": 2})
    run_pipeline(load_pipeline(path), progress=False, inline=True)
    checkpoint = CheckpointStore(tmp_path / "out" / "checkpoints").latest()
    weights = (checkpoint.model_dir("actor") / "model.safetensors").stat().st_size
    assert checkpoint.optimizer_file("actor").stat().st_size < 4096  # the schedule's place
    assert weights > 100_000
    # the weights are stored once: nothing else in the checkpoint is near their size
    sizes = sorted(f.stat().st_size for f in checkpoint.path.rglob("*") if f.is_file())
    assert sizes[-3] < weights / 2  # the two largest: actor and critic weights
    result = run_pipeline(load_pipeline(path, {"iterations": 3}), progress=False, inline=True)
    assert [r["iteration"] for r in result.metrics] == [2]  # AdamW restarted, run goes on


def test_resume_cuts_back_to_the_last_checkpoint(tmp_path):
    path = _pipeline(tmp_path, iterations=5, every=2)
    run_pipeline(load_pipeline(path), progress=False, inline=True)
    out = tmp_path / "p" / "out"
    # as if the run had died after iteration 4 was written but before its checkpoint
    CheckpointStore(out / "checkpoints").truncate(3)
    result = run_pipeline(load_pipeline(path), progress=False, inline=True)
    assert [r["iteration"] for r in result.metrics] == [4]
    _assert_each_iteration_once(out, 5)


def test_a_changed_pipeline_is_not_resumed_without_force(tmp_path):
    path = _pipeline(tmp_path, iterations=2)
    run_pipeline(load_pipeline(path), progress=False, inline=True)
    changed = load_pipeline(path, {"algorithm.kl_coef": 0.5, "iterations": 3})
    with pytest.raises(RunError, match=r"different pipeline \('algorithm\.kl_coef' changed\)"
                                       r"; pass --force"):
        run_pipeline(changed, progress=False, inline=True)
    result = run_pipeline(changed, progress=False, inline=True, force=True)
    assert [r["iteration"] for r in result.metrics] == [2]


def _truncate(path: Path, keep: int) -> tuple[int, int]:
    """Cut ``path`` to ``keep`` bytes, as a full disk under a copy would; returns the
    sizes before and after."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(keep)
    return size, keep


def test_checkpoints_list_their_sizes_and_damaged_ones_are_found_pruned_and_truncated(
        tmp_path):
    store = CheckpointStore(tmp_path / "checkpoints")
    for k in range(4):
        staging = store.begin(k)
        (staging / "models" / "m").mkdir()
        (staging / "models" / "m" / "model.safetensors").write_bytes(bytes(1000 + k))
        store.publish(staging, k, {"versions": {"m": k}})
    latest = store.latest()
    assert latest.state["files"] == {"models/m/model.safetensors": 1003}
    assert store.latest_whole() == (latest, [])
    (store.root / "iter_000003" / "models" / "m" / "model.safetensors").write_bytes(b"x")
    (store.root / "iter_000002" / "state.json").write_text("{")
    whole, damaged = store.latest_whole()
    assert whole.iteration == 1
    assert damaged == [("iter_000003", "models/m/model.safetensors has 1 bytes, 1003 were "
                                       "written"),
                       ("iter_000002", "corrupt checkpoint state (Expecting property name "
                                       "enclosed in double quotes: line 1 column 2 (char 1))")]
    # an old checkpoint whose state cannot be read is pruned, and truncate takes damaged
    # ones too
    (store.root / "iter_000000" / "state.json").write_text("{")
    assert store.prune(3) == [0]
    store.truncate(1)
    assert sorted(p.name for p in store.root.iterdir()) == ["iter_000001"]


def test_a_truncated_checkpoint_is_passed_over_with_one_line_and_the_run_resumes(
        tmp_path, capsys):
    path = _pipeline(tmp_path, iterations=2)
    run_pipeline(load_pipeline(path), progress=False, inline=True)
    out = tmp_path / "p" / "out"
    weights = out / "checkpoints" / "iter_000001" / "models" / "actor" / "model.safetensors"
    written, cut = _truncate(weights, 4096)
    result = run_pipeline(load_pipeline(path, {"iterations": 3}), progress=True, inline=True)
    assert (f"rlhfflow: checkpoint iter_000001 (models/actor/model.safetensors has {cut} "
            f"bytes, {written} were written) is damaged and discarded; resuming from "
            f"iter_000000, the newest whole checkpoint") in capsys.readouterr().err
    assert [r["iteration"] for r in result.metrics] == [1, 2]
    _assert_each_iteration_once(out, 3)
    assert [c.iteration for c in CheckpointStore(out / "checkpoints").list()] == [1, 2]


def test_a_checkpoint_with_a_missing_file_or_unreadable_state_is_passed_over(tmp_path,
                                                                              capsys):
    path = _pipeline(tmp_path, iterations=3)
    run_pipeline(load_pipeline(path), progress=False, inline=True)
    checkpoints = tmp_path / "p" / "out" / "checkpoints"
    (checkpoints / "iter_000002" / "state.json").write_text("{not json")
    (checkpoints / "iter_000001" / "optimizers" / "critic.pt").unlink()
    store = CheckpointStore(checkpoints)
    assert store.latest_whole()[1] == [
        ("iter_000002", "corrupt checkpoint state (Expecting property name enclosed in "
                        "double quotes: line 1 column 2 (char 1))"),
        ("iter_000001", "optimizers/critic.pt is missing")]
    # keep: 2, so no checkpoint is whole: one line, and nothing is cut away
    with pytest.raises(RunError, match=r"^no whole checkpoint to resume from in .*checkpoints "
                                       r"\(iter_000002: corrupt checkpoint state .*; "
                                       r"iter_000001: optimizers/critic.pt is missing\); "
                                       r"pass --overwrite to start over$"):
        run_pipeline(load_pipeline(path, {"iterations": 4}), progress=False, inline=True)
    assert ExperienceBuffer(checkpoints.parent / "buffer.zarr").iterations() == [0, 1, 2]


def test_a_checkpoint_written_before_sizes_were_listed_is_still_checked_for_its_files(
        tmp_path):
    path = _pipeline(tmp_path, iterations=2)
    run_pipeline(load_pipeline(path), progress=False, inline=True)
    state = tmp_path / "p" / "out" / "checkpoints" / "iter_000001" / "state.json"
    state.write_text(json.dumps({"iteration": 1, "versions": {"actor": 2, "critic": 2}}))
    (state.parent / "optimizers" / "critic.pt").unlink()
    with pytest.raises(RunError, match="corrupt checkpoint .*'critic'"):
        run_pipeline(load_pipeline(path, {"iterations": 3}), progress=False, inline=True)


@pytest.mark.slow
def test_sigkill_of_the_run_then_resume_loses_and_repeats_nothing(tmp_path):
    iterations = 4
    path = _pipeline(tmp_path, iterations=iterations)
    out = tmp_path / "p" / "out"
    proc = _cli(str(path))
    _wait_for_lines(out / "metrics.jsonl", 2, proc)
    workers = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGKILL)  # the coordinator only, mid-iteration
    proc.communicate()
    psutil.wait_procs(workers, timeout=60)  # orphaned workers exit by themselves

    again = _cli(str(path))
    stdout, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr
    assert "resuming after iteration" in stderr
    _assert_each_iteration_once(out, iterations)

    whole = _pipeline(tmp_path, iterations=iterations, name="whole")
    run_pipeline(load_pipeline(whole), progress=False, inline=True)
    assert _results(out) == _results(tmp_path / "whole" / "out")


@pytest.mark.slow
def test_a_killed_worker_is_replaced_and_the_run_completes(tmp_path):
    iterations = 6
    path = _pipeline(tmp_path, iterations=iterations, workers=2)
    out = tmp_path / "p" / "out"
    proc = _cli(str(path))
    _wait_for_lines(out / "metrics.jsonl", 2, proc)
    workers = embedded_worker_processes(psutil.Process(proc.pid))
    assert len(workers) == 2, [c.cmdline() for c in workers]
    workers[0].kill()
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert "recovering from the last checkpoint" in stderr
    _assert_each_iteration_once(out, iterations)
    # why it was lost: in the run's line, in the worker's log, marked in the report
    assert "left the cluster while it held resident models (killed by SIGKILL; " in stderr
    logs = "".join(p.read_text() for p in (out / "logs").glob("worker-*.log"))
    assert f"(pid {workers[0].pid}) ended: killed by SIGKILL; its memory was " in logs
    [recovery] = MetricsLog(out / "recoveries.jsonl").read()
    assert "killed by SIGKILL" in recovery["cause"] and recovery["logged"] >= 1
    from rlhfflow.monitor.report import build_report

    assert "<li>recovery 1, " in build_report(out, samples=0)


@pytest.mark.slow
def test_a_worker_silent_past_dasks_worker_ttl_but_alive_is_not_declared_lost(tmp_path):
    # a worker frozen (SIGSTOP: no heartbeats, as an event loop starved of the cores) for
    # longer than a Dask worker-ttl would allow: the embedded scheduler's limit is
    # cluster.heartbeat_timeout_s (15 min), so the run waits for it instead of restarting
    # it and redoing iterations, and ends with the results of an untouched run
    iterations = 5
    untouched = _cli(str(_pipeline(tmp_path, iterations=iterations, workers=2, name="a")))
    assert untouched.communicate(timeout=300) and untouched.returncode == 0
    path = _pipeline(tmp_path, iterations=iterations, workers=2, name="b")
    out = tmp_path / "b" / "out"
    proc = _cli(str(path), env={"DASK_DISTRIBUTED__SCHEDULER__WORKER_TTL": "2s"})
    _wait_for_lines(out / "metrics.jsonl", 2, proc)
    worker = embedded_worker_processes(psutil.Process(proc.pid))[0]
    worker.suspend()
    time.sleep(8)  # 2-4 checks of a 2 s worker-ttl; 16 missed 0.5 s heartbeats
    worker.resume()
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert "recovering" not in stderr and "left the cluster" not in stderr, stderr
    assert _results(out) == _results(tmp_path / "a" / "out")
    _assert_each_iteration_once(out, iterations)


@pytest.mark.slow
def test_ctrl_c_finishes_the_iteration_checkpoints_and_resumes(tmp_path):
    iterations = 8
    path = _pipeline(tmp_path, iterations=iterations, workers=2, every=0)
    out = tmp_path / "p" / "out"
    proc = _cli(str(path), start_new_session=True)
    _wait_for_lines(out / "metrics.jsonl", 2, proc)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: the whole process group
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "finishing the iteration in flight" in stderr
    assert "checkpoint saved" in stderr
    done = [r["iteration"] for r in MetricsLog(out / "metrics.jsonl").read()]
    assert done == list(range(len(done))) and len(done) < iterations
    assert CheckpointStore(out / "checkpoints").latest().iteration == done[-1]
    assert not (out / "models" / "actor" / "final").exists()

    again = _cli(str(path))
    stdout, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr
    _assert_each_iteration_once(out, iterations)


@pytest.mark.slow
def test_ctrl_c_cancels_what_was_submitted_ahead_of_the_iteration_in_flight(tmp_path):
    # iterations run ahead (the next one is submitted while one is waited for, and the
    # generation of the one after with max_staleness 1): Ctrl-C used to finish the next
    # iteration too. Training is the longer part here (20 epochs), as on a real model.
    iterations = 6
    (tmp_path / "p").mkdir()
    path = small_pipeline(tmp_path / "p", iterations=iterations, overrides={
        "cluster.workers": 2, "checkpoint.every": 0, "placement.strategy": "disaggregated",
        "overlap.max_staleness": 1, "stages.train_actor.params.epochs": 20})
    out = tmp_path / "p" / "out"
    proc = _cli(str(path), start_new_session=True)
    _wait_for_lines(out / "metrics.jsonl", 2, proc)
    time.sleep(0.3)  # into the wait for iteration 2 (~1 s of training), 3 submitted
    os.killpg(proc.pid, signal.SIGINT)
    signalled = len((out / "metrics.jsonl").read_text().splitlines())  # in flight then
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    [said] = [line for line in stderr.splitlines() if line.startswith("rlhfflow: stopping")]
    done = [r["iteration"] for r in MetricsLog(out / "metrics.jsonl").read()]
    assert done == list(range(len(done)))
    # the iteration in flight when the stop was taken (within ~0.2 s of the signal: one
    # may have been committed meanwhile); the next only where its update had begun
    # (the signal came as the update of the one in flight ended), which is said
    in_flight = int(re.search(r"(?:finishing|after) iterations? (\d+)", said).group(1))
    assert signalled <= in_flight <= signalled + 1, (signalled, said)
    begun = "its model update had already begun, which cannot be undone" in said
    assert done[-1] <= in_flight + begun, (in_flight, said)
    # what was submitted ahead is cancelled and said, unless the iteration in flight
    # needs it (its trainer waits for the next generation, which reads its weights)
    assert begun or "cancelled" not in said or \
        re.search(rf"; cancelled iterations? {done[-1] + 1}\b", said), said
    assert said.endswith("then saving a checkpoint"), said
    assert CheckpointStore(out / "checkpoints").latest().iteration == done[-1]
    assert ExperienceBuffer(out / "buffer.zarr").iterations() == done

    again = _cli(str(path))  # nothing was left half-done: the resume runs the rest once
    stdout, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr
    _assert_each_iteration_once(out, iterations)


@pytest.mark.slow
def test_supervise_restarts_a_killed_coordinator_and_the_run_completes(tmp_path):
    iterations = 4
    path = _pipeline(tmp_path, iterations=iterations)
    out = tmp_path / "p" / "out"
    proc = _cli(str(path), "--supervise")
    _wait_for_lines(out / "metrics.jsonl", 2, proc)
    coordinators = psutil.Process(proc.pid).children()
    assert len(coordinators) == 1 and "run" in coordinators[0].cmdline()
    workers = coordinators[0].children(recursive=True)
    coordinators[0].kill()  # mid-run, as the OOM killer would
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    restarts = [line for line in stderr.splitlines() if "supervisor:" in line]
    assert len(restarts) == 1, stderr
    assert restarts[0].startswith("rlhfflow: supervisor: the run died from SIGKILL after "
                                  "iteration ")
    assert restarts[0].endswith("; restarting it (1/3), resuming from its last checkpoint")
    assert "resuming after iteration" in stderr
    psutil.wait_procs(workers, timeout=60)  # the dead coordinator's workers exit too
    _assert_each_iteration_once(out, iterations)

    whole = _pipeline(tmp_path, iterations=iterations, name="whole")
    run_pipeline(load_pipeline(whole), progress=False, inline=True)
    assert _results(out) == _results(tmp_path / "whole" / "out")


@pytest.mark.slow
def test_supervise_does_not_restart_a_run_that_fails_where_it_started(tmp_path):
    (tmp_path / "judge.py").write_text("def score(prompts, responses):\n"
                                       "    raise RuntimeError('no judge configured')\n")
    path = small_pipeline(tmp_path, iterations=2, overrides={
        "cluster.workers": 1, "stages.reward.params.function": str(tmp_path / "judge.py")
        + ":score", "stages.reward.params.check": False})  # it fails in the run, not before
    proc = _cli(str(path), "--supervise", "--quiet")
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr
    assert stderr.splitlines() == [
        f"Error: stage 'reward' failed in iteration 0: RewardError: reward function score() "
        f"raised at {tmp_path / 'judge.py'}:2: RuntimeError: no judge configured; set "
        f"params.on_error: skip to leave such samples out",
        "rlhfflow: supervisor: the run exited with 1 without committing an iteration; "
        "not restarting it"]


def test_supervise_checks_the_file_before_starting_anything(tmp_path):
    path = _pipeline(tmp_path, iterations=1)
    result = CliRunner().invoke(main, ["run", str(path), "--supervise", "--set",
                                       "iterations=-1"])
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == f"Error: {path}: iterations: expected an integer >= 0, got -1\n"
    assert not (tmp_path / "p" / "out").exists()


@pytest.mark.slow
def test_ctrl_c_reaches_a_supervised_run_once_and_is_not_restarted(tmp_path):
    iterations = 8
    path = _pipeline(tmp_path, iterations=iterations, workers=2, every=0)
    out = tmp_path / "p" / "out"
    proc = _cli(str(path), "--supervise", start_new_session=True)
    _wait_for_lines(out / "metrics.jsonl", 2, proc)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: the supervisor's group
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    # one SIGINT reached the run: it finished the iteration instead of stopping at once
    assert "finishing the iteration in flight" in stderr and "checkpoint saved" in stderr
    assert "interrupted at once" not in stderr and "supervisor:" not in stderr
    done = [r["iteration"] for r in MetricsLog(out / "metrics.jsonl").read()]
    assert CheckpointStore(out / "checkpoints").latest().iteration == done[-1]


def test_max_restarts_without_supervise_is_a_mistake(tmp_path):
    path = _pipeline(tmp_path, iterations=1)
    result = CliRunner().invoke(main, ["run", str(path), "--max-restarts", "5"])
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == ("Error: --max-restarts bounds the restarts of --supervise; add "
                             "--supervise\n")


def _device_workers(coordinator: psutil.Process) -> list[psutil.Process]:
    """The embedded cluster's worker processes (spawned by the coordinator's nannies)."""
    return embedded_worker_processes(coordinator)


@pytest.mark.slow
def test_a_worker_killed_during_the_setup_stages_is_replaced_and_setup_redone(tmp_path):
    def with_sft(name: str) -> Path:
        # 20 epochs: the SFT stage computes for ~5 s, long enough to be killed during
        return _with_setup_stage(_pipeline(tmp_path, iterations=2, name=name), {
            "type": "sft", "model": "actor",
            "params": {"data": str(DATA / "sft.jsonl"), "epochs": 20, "batch_size": 8}})

    path = with_sft("p")
    out = tmp_path / "p" / "out"
    proc = _cli(str(path))
    lines: list[str] = []
    started = threading.Event()

    def follow() -> None:
        for line in proc.stderr:
            lines.append(line)
            if "iterations on 1 worker(s)" in line:  # printed right before the setup
                started.set()

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    assert started.wait(120), "".join(lines)
    time.sleep(1.5)  # loading the models and training: inside the setup task either way
    [worker] = _device_workers(psutil.Process(proc.pid))
    worker.kill()
    assert proc.wait(timeout=300) == 0, "".join(lines)
    reader.join(timeout=10)
    stderr = "".join(lines)
    # with why, as its nanny saw it (issue 42, 13)
    assert re.search(r"left the cluster while it held resident models \(killed by SIGKILL; "
                     r"[^\n]*\); redoing the setup stages from their start", stderr), stderr
    assert stderr.count("rlhfflow: setup sft:") == 1, stderr
    _assert_each_iteration_once(out, 2)

    whole = with_sft("whole")
    run_pipeline(load_pipeline(whole), progress=False, inline=True)
    assert MetricsLog(out / "setup.jsonl").read() == \
        MetricsLog(tmp_path / "whole" / "out" / "setup.jsonl").read()
    for weights in ("setup", "final"):  # after the redone SFT, and after the loop
        redone = load_file(out / "models" / "actor" / weights / "model.safetensors")
        uninterrupted = load_file(tmp_path / "whole" / "out" / "models" / "actor" / weights
                                  / "model.safetensors")
        assert redone.keys() == uninterrupted.keys()
        for name, tensor in redone.items():
            torch.testing.assert_close(tensor, uninterrupted[name], rtol=1e-6, atol=1e-7)
    assert _results(out) == _results(tmp_path / "whole" / "out")


def test_the_final_weights_are_the_last_checkpoints_files_not_a_second_copy(tmp_path):
    from transformers import AutoModelForCausalLM

    pipeline = small_pipeline(tmp_path, iterations=2, overrides={
        "checkpoint.every": 1, "checkpoint.keep": 1})
    run_pipeline(load_pipeline(pipeline), progress=False, inline=True)
    out = tmp_path / "out"

    def shared(iteration: int) -> None:
        for model in ("actor", "critic"):
            final = out / "models" / model / "final"
            saved = out / "checkpoints" / f"iter_{iteration:06d}" / "models" / model
            assert sorted(p.name for p in final.iterdir()) == \
                sorted(p.name for p in saved.iterdir())
            for weights in final.glob("*.safetensors"):
                assert weights.stat().st_ino == (saved / weights.name).stat().st_ino
                assert weights.stat().st_nlink == 2  # one file, two names

    shared(1)
    # --iterations extends the run: checkpoint 1, which final's files were in, is pruned
    # (keep: 1) before the new final is linked; the resume read it first
    resumed = run_pipeline(load_pipeline(pipeline, {"iterations": 3}), progress=False,
                           inline=True)
    assert [r["iteration"] for r in resumed.metrics] == [2]
    assert [c.iteration for c in CheckpointStore(out / "checkpoints").list()] == [2]
    shared(2)
    # pruned away, the checkpoint's names go; final's stay whole, loadable by transformers
    CheckpointStore(out / "checkpoints").truncate(-1)
    assert not (out / "checkpoints" / "iter_000002").exists()
    final = out / "models" / "actor" / "final"
    assert (final / "model.safetensors").stat().st_nlink == 1
    module = AutoModelForCausalLM.from_pretrained(final)
    weights = load_file(final / "model.safetensors")
    for name, tensor in module.state_dict().items():
        if name in weights:
            assert torch.equal(tensor, weights[name])


def test_final_weights_are_copied_where_hard_links_fail(tmp_path, monkeypatch):
    from rlhfflow.storage import link_model

    source = tmp_path / "iter_000001" / "models" / "actor"
    source.mkdir(parents=True)
    (source / "config.json").write_text("{}")
    (source / "model.safetensors").write_bytes(b"weights")
    final = tmp_path / "models" / "actor" / "final"
    final.mkdir(parents=True)
    (final / "stale.bin").write_bytes(b"an older final, replaced whole")

    def cross_device(src, dst):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", cross_device)
    link_model(source, final)
    assert sorted(p.name for p in final.iterdir()) == ["config.json", "model.safetensors"]
    assert (final / "model.safetensors").read_bytes() == b"weights"
    assert (final / "model.safetensors").stat().st_ino != \
        (source / "model.safetensors").stat().st_ino
    assert [p.name for p in final.parent.iterdir()] == ["final"]  # no temporary left


# --------------------------------------------------------------------------- out of memory

# A reward function with a large working memory: 1 GiB of address space, never touched
# (so it costs no real memory where the worker may have it)
HUNGRY = ("import torch\n"
          "from rlhfflow.stages.rewards import vowel_ratio\n"
          "def score(prompts, responses):\n"
          "    scratch = torch.empty(2**28)\n"
          "    return [v + 0 * float(scratch[0]) for v in vowel_ratio(prompts, responses)]\n")


@pytest.mark.slow
def test_a_worker_out_of_memory_mid_run_stops_with_one_line_and_the_run_resumes_after(
        tmp_path):
    (tmp_path / "hungry.py").write_text(HUNGRY)
    path = small_pipeline(tmp_path, iterations=6, overrides={
        "cluster.workers": 1, "checkpoint.every": 1, "checkpoint.keep": 2,
        "stages.reward.params.function": str(tmp_path / "hungry.py") + ":score"})
    out = tmp_path / "out"
    proc = _cli(str(path), "--quiet", env={"RLHFFLOW_WARM": "0"})
    _wait_for_lines(out / "metrics.jsonl", 1, proc)
    [worker] = embedded_worker_processes(psutil.Process(proc.pid))
    # the worker's address space may grow by 64 MiB from now on: its next big
    # allocation fails, as on a machine whose memory ran out
    limit = worker.memory_info().vms + 64 * 2**20
    worker.rlimit(psutil.RLIMIT_AS, (limit, limit))
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert lines[0].startswith("Error: out of memory: stage 'reward' on worker tcp://")
    assert "in iteration " in lines[0] and "can't allocate memory" in lines[0]
    assert "cluster.memory_limit" in lines[0]
    assert lines[0].endswith("then run the same command again to resume from the last "
                             "checkpoint")
    stopped_after = len(MetricsLog(out / "metrics.jsonl").read())
    assert 1 <= stopped_after < 6
    # the same command on a fresh worker (no limit) resumes and completes
    again = _cli(str(path), "--quiet", env={"RLHFFLOW_WARM": "0"})
    _, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr
    _assert_each_iteration_once(out, 6)
