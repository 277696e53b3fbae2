"""The warm server (``rlhfflow.launch.warm``): ``rlhfflow run`` as a fork of a process
that imported everything once.

Each test gets a server of its own (``XDG_RUNTIME_DIR`` in ``tmp_path``), started by
real ``rlhfflow run`` commands in fresh processes, and stopped at the end. The rest of the
suite runs with ``RLHFFLOW_WARM=0`` (conftest). No test asserts a time.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from rlhfflow.launch import warm
from tests.conftest import REPO, small_pipeline

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not warm.supported(), reason="no fork server here")]


def _env(runtime: Path, idle: str = "120") -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "RLHFFLOW_WARM": idle,
            "XDG_RUNTIME_DIR": str(runtime)}


def _rlhfflow(env: dict[str, str], *args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlhfflow.cli.main", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=400, **kwargs)


def _server(runtime: Path) -> dict:
    [info] = [json.loads(p.read_text()) for p in (runtime / "rlhfflow").glob("warm-*.json")]
    return info


def _wait_gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not warm._alive(pid):
            return True
        time.sleep(0.2)
    return False


@pytest.fixture
def runtime():
    path = Path(tempfile.mkdtemp(prefix="rt-"))  # short: a socket's path has ~100 bytes
    yield path
    for info_file in (path / "rlhfflow").glob("warm-*.json"):
        pid = json.loads(info_file.read_text())["pid"]
        for sock in (path / "rlhfflow").glob("warm-*.sock"):
            sock.unlink()
        if not _wait_gone(pid, 15):
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(path, ignore_errors=True)


def _metrics(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in ("iteration", "reward_mean", "kl_mean", "policy_loss")}
            for r in rows]


def test_runs_fork_from_one_warm_server_and_compute_what_a_cold_run_computes(tmp_path,
                                                                             runtime):
    file = small_pipeline(tmp_path, "grpo", iterations=2, batch_size=4, max_new_tokens=4)
    env = _env(runtime)
    first = _rlhfflow(env, "run", str(file), "--out", str(tmp_path / "a"))
    assert first.returncode == 0, first.stderr
    assert "starting a warm server" in first.stderr
    server = _server(runtime)
    second = _rlhfflow(env, "run", str(file), "--out", str(tmp_path / "b"))
    assert second.returncode == 0, second.stderr
    assert "starting a warm server" not in second.stderr
    assert _server(runtime)["pid"] == server["pid"]  # the same server served both
    assert "rlhfflow: start-up" in second.stderr  # measured from the command's start
    cold = _rlhfflow({**env, "RLHFFLOW_WARM": "0"}, "run", str(file), "--out",
                     str(tmp_path / "c"))
    assert cold.returncode == 0, cold.stderr
    assert _metrics(tmp_path / "a") == _metrics(tmp_path / "b") == _metrics(tmp_path / "c")
    # a mistake in the file: the same one line and exit 2 as without the server
    bad = _rlhfflow(env, "run", str(file), "--set", "iterations=abc")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].startswith(f"Error: {file}: iterations:")
    shown = _rlhfflow(env, "warm")
    assert f"pid {server['pid']}" in shown.stdout and "1 running" in shown.stdout
    stopped = _rlhfflow(env, "warm", "--stop")
    assert stopped.stdout.strip() == "stopped 1 warm server(s)"
    assert _wait_gone(server["pid"])


def test_killing_the_command_kills_its_run_and_ctrl_c_stops_it(tmp_path, runtime):
    file = small_pipeline(tmp_path, "grpo", iterations=200, batch_size=4, max_new_tokens=4)
    env = _env(runtime)
    started = _rlhfflow(env, "run", str(file), "--iterations", "1", "--out",
                        str(tmp_path / "warmup"))
    assert started.returncode == 0, started.stderr
    server = psutil.Process(_server(runtime)["pid"])

    def launch(out: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "rlhfflow.cli.main", "run",
                                 str(file), "--out", str(tmp_path / out)], cwd=REPO,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        deadline = time.monotonic() + 120
        while not (tmp_path / out / "metrics.jsonl").exists():  # an iteration committed
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.2)
        return proc

    proc = launch("killed")
    run_processes = server.children(recursive=True)
    assert run_processes  # the run's coordinator and its workers: forks of the server
    proc.kill()
    proc.wait()
    gone, alive = psutil.wait_procs(run_processes, timeout=30)
    assert not alive, alive

    proc = launch("stopped")
    proc.send_signal(signal.SIGINT)  # reaches the fork: finish the iteration, checkpoint
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "stop requested" in err and "checkpoint saved" in err


def test_an_idle_server_exits_and_a_dead_one_is_replaced(tmp_path, runtime):
    file = small_pipeline(tmp_path, "grpo", iterations=1, batch_size=4, max_new_tokens=4)
    env = _env(runtime, idle="2")
    assert _rlhfflow(env, "run", str(file), "--out", str(tmp_path / "a")).returncode == 0
    info_file = next((runtime / "rlhfflow").glob("warm-*.json"))
    info = json.loads(info_file.read_text())
    assert _wait_gone(info["pid"]), "an unused server outlives its idle time"
    assert not list((runtime / "rlhfflow").glob("warm-*.sock"))
    # what a server killed outright leaves: its socket and its record, naming a process
    # that is gone. The next run starts a new server instead of knocking at the old one
    sock = info_file.with_suffix(".sock")
    with socket.socket(socket.AF_UNIX) as leftover:
        leftover.bind(str(sock))
    info["inode"] = sock.stat().st_ino
    info_file.write_text(json.dumps(info))
    again = _rlhfflow(_env(runtime), "run", str(file), "--out", str(tmp_path / "b"))
    assert again.returncode == 0, again.stderr
    assert "starting a warm server" in again.stderr
    assert _server(runtime)["pid"] != info["pid"]


def test_the_key_follows_import_time_settings_only(monkeypatch):
    warm._KEY.clear()
    base = warm.server_key()
    monkeypatch.setenv("SOME_UNRELATED_VARIABLE", "1")
    assert warm.server_key() == base  # the fork gets it with the rest of the environment
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # read by torch when imported
    assert warm.server_key() != base


def test_off_switch_and_a_directory_others_can_enter(runtime, monkeypatch):
    monkeypatch.setenv("RLHFFLOW_WARM", "0")
    assert not warm.enabled()
    monkeypatch.setenv("RLHFFLOW_WARM", "30")
    assert warm.idle_seconds() == 30
    (runtime / "rlhfflow").mkdir()
    os.chmod(runtime / "rlhfflow", 0o777)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    with pytest.raises(OSError, match="not a private directory"):
        warm.server_dir()
