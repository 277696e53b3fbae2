"""The one-line messages of ``rlhfflow run`` about where a run stands: nothing to do, how
to continue a stopped run, a resume that cannot be exact, a resume from the start, and a
cluster that did not start."""

from __future__ import annotations

import errno
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
from click.testing import CliRunner

from rlhfflow.cli import supervise
from rlhfflow.cli.main import main
from rlhfflow.config.loader import load_pipeline
from rlhfflow.launch import warm
from rlhfflow.runtime import run as runner
from rlhfflow.runtime.backend import DaskBackend
from rlhfflow.runtime.cluster import embedded_worker_processes
from rlhfflow.runtime.executor import RunResult
from rlhfflow.runtime.run import run_pipeline
from rlhfflow.storage import MetricsLog
from tests.conftest import DATA, REPO, small_pipeline


def test_a_finished_run_asked_for_no_more_iterations_has_nothing_to_do(tmp_path):
    path = small_pipeline(tmp_path, iterations=2)
    out = tmp_path / "out"
    run_pipeline(load_pipeline(path), progress=False, inline=True)
    for iterations in ("2", "1"):
        # nothing starts: no cluster (it would take seconds), no iteration, no save
        result = CliRunner().invoke(main, ["run", str(path), "--iterations", iterations])
        assert (result.exit_code, result.stderr) == (0, ""), result.output
        assert result.stdout == f"nothing to do: {out} already has 2 iterations\n"
    assert [r["iteration"] for r in MetricsLog(out / "metrics.jsonl").read()] == [0, 1]
    # a run stopped early has not saved its final models yet: that is still to do
    shutil.rmtree(out / "models" / "actor" / "final")
    again = run_pipeline(load_pipeline(path), progress=False, inline=True)
    assert again.already_done is None and again.metrics == []
    assert (out / "models" / "actor" / "final" / "config.json").is_file()


def test_the_continue_hint_repeats_every_option_the_run_was_started_with(tmp_path,
                                                                          monkeypatch):
    path = small_pipeline(tmp_path, iterations=2)
    prompts = tmp_path / "my prompts.jsonl"  # a space: quoted in the hint
    shutil.copyfile(DATA / "prompts.jsonl", prompts)

    def stopped(pipeline, **kwargs):
        return RunResult(pipeline.output_dir, stopped=True)

    monkeypatch.setattr(runner, "run_pipeline", stopped)
    result = CliRunner().invoke(main, [
        "run", str(path), "--set", "overlap.max_staleness=1", "--iterations", "7",
        "--set", f"data.prompts={prompts}", "--workers", "1", "--out",
        str(tmp_path / "o"), "--force"])
    assert result.exit_code == 130
    assert result.stderr.splitlines()[-1] == (
        f"stopped early; checkpoint saved; continue with: rlhfflow run {path} --set "
        f"overlap.max_staleness=1 --set 'data.prompts={prompts}' --iterations 7 "
        f"--workers 1 --out {tmp_path / 'o'} --force")


def test_a_resume_without_optimizer_state_says_it_is_not_exact(tmp_path, capsys):
    path = small_pipeline(tmp_path, iterations=2, overrides={"checkpoint.optimizer": False})
    run_pipeline(load_pipeline(path), progress=True, inline=True)
    assert "not an exact resume" not in capsys.readouterr().err  # a start, not a resume
    run_pipeline(load_pipeline(path, {"iterations": 3}), progress=True, inline=True)
    said = [line for line in capsys.readouterr().err.splitlines() if "exact" in line]
    assert said == ["rlhfflow: not an exact resume: the checkpoint holds no optimizer state "
                    "of 'actor', 'critic' (checkpoint.optimizer: false), whose optimizer "
                    "starts afresh"]
    # with the optimizer state kept, nothing to say
    kept = small_pipeline(tmp_path, iterations=2, file_name="kept.yaml",
                          overrides={"output": str(tmp_path / "kept")})
    run_pipeline(load_pipeline(kept), progress=True, inline=True)
    run_pipeline(load_pipeline(kept, {"iterations": 3}), progress=True, inline=True)
    assert "exact" not in capsys.readouterr().err


def test_a_supervisor_restart_before_the_first_iteration_says_from_the_start(
        tmp_path, monkeypatch):
    codes = iter([-signal.SIGKILL, 0])
    monkeypatch.setattr(supervise, "_run_child", lambda args, lock=None: next(codes))
    said: list[str] = []
    assert supervise.supervise(["f"], ["f"], tmp_path, 3, said.append) == 0
    assert said == ["rlhfflow: supervisor: the run died from SIGKILL before its first "
                    "iteration; restarting it (1/3), from the start"]


@pytest.mark.parametrize(("server", "expected"), [
    (None, "[Errno 2] No such file or directory: '/data/x.lock'"),
    ("/run/user/0/rlhfflow/warm-ab.sock",
     "[Errno 2] No such file or directory: '/data/x.lock'; the workers come from a warm "
     "server: RLHFFLOW_WARM=0 runs without it"),
])
def test_a_cluster_that_did_not_start_names_the_file(monkeypatch, server, expected):
    monkeypatch.setattr(warm, "workers_server", lambda: server)
    exc = FileNotFoundError(errno.ENOENT, "No such file or directory", "/data/x.lock")
    assert runner.cluster_failure(exc) == f"the embedded cluster did not start: {expected}"


def test_a_cluster_whose_warm_server_went_away_is_one_line_with_the_way_out(tmp_path,
                                                                           monkeypatch):
    sock = "/run/user/0/rlhfflow/warm-ab.sock"

    def gone(*args, **kwargs):  # what connecting to a removed socket raises: no file name
        raise FileNotFoundError(errno.ENOENT, "No such file or directory")

    monkeypatch.setattr(warm, "workers_server", lambda: sock)
    monkeypatch.setattr(DaskBackend, "connect", gone)
    path = small_pipeline(tmp_path, "grpo", iterations=1)
    result = CliRunner().invoke(main, ["run", str(path), "--quiet"])
    assert (result.exit_code, result.stdout) == (1, "")
    assert result.stderr == (
        f"Error: the embedded cluster did not start: [Errno 2] No such file or directory: "
        f"{sock}; the workers come from a warm server: RLHFFLOW_WARM=0 runs without it\n")


@pytest.mark.slow
def test_a_worker_lost_before_any_checkpoint_resumes_from_the_start(tmp_path):
    path = small_pipeline(tmp_path, iterations=4, overrides={
        "cluster.workers": 2, "checkpoint.every": 0})
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "rlhfflow.cli.main", "run", str(path)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 180
    while not (out / "metrics.jsonl").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    workers = embedded_worker_processes(psutil.Process(proc.pid))
    assert len(workers) == 2
    workers[0].kill()
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert "recovering from the last checkpoint" in stderr
    assert "rlhfflow: resuming from the start on 2 worker(s)" in stderr, stderr
    assert "iteration -1" not in stderr
    assert [r["iteration"] for r in MetricsLog(out / "metrics.jsonl").read()] == [0, 1, 2, 3]
