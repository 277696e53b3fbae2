"""One run per output directory: a run holds ``OUT/.rlhfflow.lock`` for its life; a
second run (or a ``--resume``, or an ``--overwrite``) on the directory of a live one is
refused in one line naming the directory and the holder's pid, and writes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from rlhfflow.cli.main import main
from rlhfflow.config.loader import load_pipeline
from rlhfflow.launch.warm import LOCK_FD_VAR
from rlhfflow.runtime.run import run_pipeline
from rlhfflow.runtime.runstate import LOCK_FILE, OutputInUse, output_lock
from rlhfflow.storage import MetricsLog
from tests.conftest import REPO, small_pipeline

RESULT_KEYS = ("iteration", "samples", "reward_mean", "reward_std", "kl_mean", "policy_loss",
               "response_length_mean", "tokens_generated")

# holds the lock on the directory given as argv[1] until its stdin closes
HOLDER = ("import sys; from pathlib import Path; from rlhfflow.runtime.runstate import "
          "output_lock\nwith output_lock(Path(sys.argv[1])):\n    print('held', flush=True)\n"
          "    sys.stdin.read()\n")


def _hold(out: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], cwd=REPO, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout.readline() == "held\n"
    return proc


def _snapshot(out: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(out)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(out.rglob("*"))}


def test_a_directory_is_held_by_one_run_and_freed_when_it_ends(tmp_path):
    out = tmp_path / "out"
    with output_lock(out):
        assert (out / LOCK_FILE).read_text() == f"{os.getpid()}\n"
        holder = _hold(tmp_path / "other")  # another directory: no conflict
        holder.communicate("")
    with output_lock(out):  # released at the end of the block: the next run takes it
        pass


def test_a_run_on_a_held_directory_is_refused_and_writes_nothing(tmp_path):
    path = small_pipeline(tmp_path, "grpo", iterations=1, batch_size=4, max_new_tokens=4)
    out = tmp_path / "out"
    holder = _hold(out)
    try:
        before = _snapshot(out)
        message = f"{out} is in use by another run (pid {holder.pid}); wait for it to end, " \
                  f"or pass --out DIR for a new run"
        with pytest.raises(OutputInUse) as err:
            run_pipeline(load_pipeline(path), progress=False, inline=True)
        assert str(err.value) == message
        for extra in ([], ["--resume"], ["--overwrite"], ["--supervise"]):
            result = CliRunner().invoke(main, ["run", str(path), "--quiet", *extra])
            assert (result.exit_code, result.stdout) == (2, ""), result.output
            assert result.stderr == f"Error: {message}\n"
        assert _snapshot(out) == before  # not a file created, changed or deleted
    finally:
        holder.communicate("")
    result = run_pipeline(load_pipeline(path), progress=False, inline=True)
    assert [r["iteration"] for r in result.metrics] == [0]


def test_a_child_that_inherits_the_lock_shares_it(tmp_path):
    """``rlhfflow run --supervise`` holds the directory and hands the lock to its child
    (``LOCK_FD_VAR``): the child runs; anyone else is refused."""
    out = tmp_path / "out"
    code = ("import sys; from pathlib import Path; from rlhfflow.runtime.runstate import "
            "output_lock\nwith output_lock(Path(sys.argv[1])):\n    print('shared')\n")
    with output_lock(out) as fd:
        child = subprocess.run([sys.executable, "-c", code, str(out)], cwd=REPO, text=True,
                               capture_output=True, pass_fds=(fd,),
                               env={**os.environ, LOCK_FD_VAR: str(fd)})
        assert (child.returncode, child.stdout) == (0, "shared\n"), child.stderr
        # after the child's end: still held (the child never unlocked the holder's lock)
        stranger = subprocess.run([sys.executable, "-c", code, str(out)], cwd=REPO,
                                  text=True, capture_output=True)
        assert stranger.returncode == 1 and "OutputInUse" in stranger.stderr
    # a stale variable (a descriptor of something else) is ignored
    with open(tmp_path / "unrelated", "w") as unrelated:
        child = subprocess.run([sys.executable, "-c", code, str(out)], cwd=REPO, text=True,
                               capture_output=True, pass_fds=(unrelated.fileno(),),
                               env={**os.environ, LOCK_FD_VAR: str(unrelated.fileno())})
    assert (child.returncode, child.stdout) == (0, "shared\n"), child.stderr


# a reward that waits, once an iteration was committed, for the test to open a gate: the
# first run is then surely alive while the second starts; the scores are vowel_ratio's
GATED = """import time
from pathlib import Path

from rlhfflow.stages.rewards import vowel_ratio


def score(prompts, responses):
    if Path({metrics!r}).exists():
        while not Path({gate!r}).exists():
            time.sleep(0.05)
    return vowel_ratio(prompts, responses)
"""


def _run(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rlhfflow.cli.main", "run", *args],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.mark.slow
def test_two_real_runs_on_one_directory_the_second_is_refused_the_first_unaffected(
        tmp_path):
    out, gate = tmp_path / "out", tmp_path / "gate"
    (tmp_path / "gated.py").write_text(GATED.format(metrics=str(out / "metrics.jsonl"),
                                                    gate=str(gate)))
    path = small_pipeline(tmp_path, "grpo", iterations=3, batch_size=4, max_new_tokens=4,
                          overrides={"cluster.workers": 1, "stages.reward.params.function":
                                     str(tmp_path / "gated.py") + ":score",
                                     # no trial call at validation: it would wait at the gate
                                     "stages.reward.params.check": False})
    first = _run(str(path), "--quiet")
    deadline = time.monotonic() + 180
    while not (out / "metrics.jsonl").exists():
        assert first.poll() is None, first.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(1.0)  # the first run now waits at the gate
    before = _snapshot(out)
    second = _run(str(path), "--quiet", "--resume")
    stdout, stderr = second.communicate(timeout=180)
    assert (second.returncode, stdout) == (2, "")
    assert stderr.splitlines() == [
        f"Error: {out} is in use by another run (pid {first.pid}); wait for it to end, or "
        f"pass --out DIR for a new run"]
    assert _snapshot(out) == before
    # reading a live run is allowed
    report = CliRunner().invoke(main, ["report", str(out), "--out", str(tmp_path / "r.html")])
    assert report.exit_code == 0, report.output
    gate.touch()
    stdout, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr
    # in this process: the same embedded cluster, without paying for the imports again
    lone = CliRunner().invoke(main, ["run", str(path), "--quiet", "--out",
                                     str(tmp_path / "lone")])
    assert lone.exit_code == 0, lone.output
    assert [{k: r[k] for k in RESULT_KEYS} for r in MetricsLog(out / "metrics.jsonl").read()
            ] == [{k: r[k] for k in RESULT_KEYS}
                  for r in MetricsLog(tmp_path / "lone" / "metrics.jsonl").read()]
