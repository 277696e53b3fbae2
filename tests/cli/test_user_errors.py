"""Every mistake of the bad-input tests (``test_bad_input.py``, ``test_cli.py``) made
through the command line: one line on stderr starting with ``Error:`` (after click's
usage lines for a bad argument), exit 2 for a mistake in what was given and 1 for a run
that fails, and never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from rlhfflow.cli.main import main
from tests.conftest import CONFIGS, DATA, REPO, small_pipeline


def _prompts(tmp_path: Path, *bad_lines: str) -> Path:
    lines = (DATA / "prompts.jsonl").read_text().splitlines()[:20]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines[:2] + list(bad_lines) + lines[2:]) + "\n")
    return path


def _with_prompts(*bad_lines: str) -> Callable[[Path], list[str]]:
    def args(tmp_path: Path) -> list[str]:
        prompts = _prompts(tmp_path, *bad_lines)
        return ["run", str(small_pipeline(tmp_path, overrides={"data.prompts": str(prompts)}))]
    return args


def _non_empty_dir(tmp_path: Path) -> list[str]:
    (tmp_path / "notes.txt").write_text("mine")
    return ["init", str(tmp_path)]


def _a_file(tmp_path: Path) -> list[str]:
    (tmp_path / "file").write_text("")
    return ["init", str(tmp_path / "file")]


def _missing_reward_argument(tmp_path: Path) -> list[str]:
    (tmp_path / "exact.py").write_text(
        "def score(prompts, responses, answer):\n    return [0.0] * len(responses)\n")
    prompts = tmp_path / "qa.jsonl"
    prompts.write_text('{"prompt": "one plus one:", "answer": "2"}\n'
                       '{"prompt": "two plus two:"}\n')
    return ["run", str(small_pipeline(tmp_path, overrides={
        "data.prompts": str(prompts),
        "stages.reward.params.function": str(tmp_path / "exact.py") + ":score"}))]


def _small(tmp_path: Path, *args: str, **overrides) -> list[str]:
    return ["run", str(small_pipeline(tmp_path, overrides=overrides)), *args]


CHAT_TURN = json.dumps({"messages": [{"role": "user", "content": "hi"},
                                     {"role": "bot", "content": "x"}]})

MISTAKES: dict[str, Callable[[Path], list[str]]] = {
    "validate a directory": lambda tmp: ["validate", str(CONFIGS)],
    "init a non-empty directory": _non_empty_dir,
    "init into a file": _a_file,
    "inspect a missing buffer": lambda tmp: ["buffer", "inspect", str(tmp / "nope.zarr")],
    "validate a bad chat turn": lambda tmp: [
        "validate", str(small_pipeline(tmp, overrides={
            "data.prompts": str(_prompts(tmp, CHAT_TURN))}))],
    "run a malformed prompt line": _with_prompts('{"prompt": "unterminated'),
    "run an over-long prompt": _with_prompts(json.dumps({"prompt": "x" * 200})),
    "run a chat record without a template": _with_prompts(
        json.dumps({"messages": [{"role": "user", "content": "hi"}]})),
    "run past the model's context": lambda tmp: _small(tmp, **{"data.max_prompt_tokens": 121}),
    "run a reward argument no record has": _missing_reward_argument,
    "run --set a bad value": lambda tmp: _small(tmp, "--set", "iterations=abc"),
    "run --max-restarts alone": lambda tmp: _small(tmp, "--max-restarts", "5"),
    "run a missing file": lambda tmp: ["run", str(tmp / "nope.yaml")],
    "report a missing run": lambda tmp: ["report", str(tmp / "nope")],
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_a_mistake_is_one_line_and_exit_2(tmp_path, mistake):
    result = CliRunner().invoke(main, MISTAKES[mistake](tmp_path))
    # CliRunner keeps what escaped the command as result.exception (no traceback printed)
    assert isinstance(result.exception, SystemExit), result.exc_info
    assert (result.exit_code, result.stdout) == (2, "")
    assert "Traceback" not in result.output
    # one error line (click puts the usage above it for a bad argument or option)
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and result.stderr.endswith(errors[0] + "\n"), result.stderr


# reward functions that break at run time, as in test_bad_input.py
FAILURES = {
    "a reward function that raises": "raise KeyError('judge unavailable')",
    "a reward that is not finite": "return [float('nan')] * len(responses)",
    "too few rewards": "return [1.0]",
}


def _process(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlhfflow.cli.main", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("failure", FAILURES)
def test_a_run_that_fails_is_one_line_and_exit_1_in_a_real_process(tmp_path, failure):
    (tmp_path / "bad_reward.py").write_text(
        f"def score(prompts, responses):\n    {FAILURES[failure]}\n")
    path = small_pipeline(tmp_path, iterations=1, overrides={
        "cluster.workers": 1, "stages.reward.params.function":
        str(tmp_path / "bad_reward.py") + ":score",
        # the run's own checks: the trial call at validation refuses too few rewards
        "stages.reward.params.check": False})
    done = _process(["run", str(path), "--quiet"])
    assert "Traceback" not in done.stderr, done.stderr
    assert (done.returncode, done.stdout) == (1, "")
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "Error: stage 'reward' failed in iteration 0: "), done.stderr


@pytest.mark.slow
def test_a_non_finite_loss_in_a_real_process(tmp_path):
    path = small_pipeline(tmp_path, "grpo", overrides={
        "cluster.workers": 1, "models.actor.optimizer.lr": 1e30,
        "models.actor.optimizer.grad_clip": None})
    done = _process(["run", str(path), "--quiet"])
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 1 and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("Error: stage 'train_actor' failed in iteration ")
    assert "NonFiniteError: model 'actor': " in done.stderr


@pytest.mark.slow
def test_a_spent_error_budget_in_a_real_process(tmp_path):
    (tmp_path / "sometimes.py").write_text(
        "def score(prompts, responses):\n"
        "    return [1 / (sum(map(ord, r)) % 4) for r in responses]\n")
    path = small_pipeline(tmp_path, iterations=2, overrides={
        "cluster.workers": 1, "stages.reward.params.function": "sometimes.py:score",
        "stages.reward.params.on_error": "skip", "stages.reward.params.max_errors": 0})
    done = _process(["run", str(path), "--quiet"])
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 1 and len(done.stderr.splitlines()) == 1, done.stderr
    assert "more than stages.reward.params.max_errors=0" in done.stderr
