"""What user code in a worker writes (prints, logging, warnings, a traceback) reaches the
terminal of whoever started the run and is kept per worker in ``OUT/logs/worker-N.log``,
which ``rlhfflow report`` shows. Here with the warm server off; ``test_warm.py`` runs the
same through a warm server."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from rlhfflow.cli.main import main
from rlhfflow.monitor.workerlogs import WorkerOutput, log_tails
from tests.conftest import REPO, small_pipeline

# a reward function that says something in each way user code does
NOISY = """import logging
import threading
import warnings

from rlhfflow.stages.rewards import vowel_ratio

_calls = []


def score(prompts, responses):
    if not _calls:
        threading.Thread(target=lambda: 1 / 0, name="judge-thread").start()
    _calls.append(1)
    print("PRINTED by the reward")
    logging.getLogger("judge").warning("LOGGED by the reward")
    warnings.warn("WARNED by the reward")
    return vowel_ratio(prompts, responses)
"""

SAID = ("PRINTED by the reward", "LOGGED by the reward", "UserWarning: WARNED by the reward",
        "ZeroDivisionError: division by zero")


def noisy_pipeline(tmp_path: Path) -> Path:
    (tmp_path / "noisy.py").write_text(NOISY)
    return small_pipeline(tmp_path, "grpo", iterations=1, batch_size=4, max_new_tokens=4,
                          overrides={"stages.reward.params.function":
                                     str(tmp_path / "noisy.py") + ":score"})


def check_said_and_kept(stderr: str, out: Path) -> None:
    """Each way of saying something reached the terminal (the run's stderr), is in a
    worker's log, and in the report."""
    for text in SAID:
        assert text in stderr, (text, stderr)
    logs = sorted((out / "logs").glob("worker-*.log"))
    assert [p.name for p in logs] == ["worker-0.log", "worker-1.log"]
    kept = "".join(p.read_text() for p in logs)
    for text in SAID:
        assert text in kept, text
    report = CliRunner().invoke(main, ["report", str(out)])
    assert report.exit_code == 0, report.output
    page = (out / "report.html").read_text()
    assert "<h2>Worker logs</h2>" in page and "<h3>worker-0.log</h3>" in page
    assert "PRINTED by the reward" in page


@pytest.mark.slow
def test_user_code_in_a_worker_is_heard_and_kept_with_the_warm_server_off(tmp_path):
    file = noisy_pipeline(tmp_path)
    done = subprocess.run([sys.executable, "-m", "rlhfflow.cli.main", "run", str(file),
                           "--quiet"], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "RLHFFLOW_WARM": "0"})
    assert done.returncode == 0, done.stderr
    check_said_and_kept(done.stderr, tmp_path / "out")


def test_worker_output_is_copied_as_it_grows_in_whole_lines(tmp_path):
    log = tmp_path / "worker-0.log"
    log.write_text("from an earlier run\n")
    terminal = io.StringIO()
    output = WorkerOutput(tmp_path, terminal, interval=3600)  # copied when asked, here
    with open(log, "a") as worker:
        worker.write("one\ntw")
        worker.flush()
        output.copy()
        assert terminal.getvalue() == "one\n"  # half a line waits for its end
        worker.write("o\n")
        (tmp_path / "worker-1.log").write_text("a second worker\n")
        (tmp_path / "worker-10.log").write_text("the eleventh\n")
        worker.write("no newline at the end")
    output.close()
    assert terminal.getvalue().splitlines() == [
        "one", "two", "no newline at the end", "a second worker", "the eleventh"]
    assert log_tails(tmp_path.parent, lines=2) == {}  # not a run directory
    (tmp_path / "logs").mkdir()
    log.rename(tmp_path / "logs" / "worker-0.log")
    assert log_tails(tmp_path, lines=2) == {"worker-0.log": ["two", "no newline at the end"]}
