"""The reward-function contract: the trial call at validation runs a function on two rows
and refuses a result that is not one number per row, naming the calling convention (a
per-sample function is told how to wrap it, not to skip the trial); a function scoring a
multi-turn rollout gets each episode as messages (a parameter named ``episode``, TRL's
``completions``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from rlhfflow.cli.main import main
from rlhfflow.stages import StageContext, create_stage
from tests.conftest import chat_batch, chat_store, small_pipeline

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "multiturn"
GUESS = str(EXAMPLE / "envs.py") + ":GuessNumber"
TRIAL = "a trial call on two rows (the first prompt records, made-up responses) failed"
CONVENTION = ("rlhfflow calls fn(prompts: list[str], responses: list[str], **fields) -> "
              "list[float], one value per row (or TRL's fn(prompts=..., completions=..., "
              "**fields))")


def _pipeline(tmp_path: Path, source: str, function: str) -> Path:
    """The tiny PPO pipeline scored by ``function`` of ``source`` (``rw.py``), on two
    prompt records that have an ``answer``."""
    (tmp_path / "rw.py").write_text(source)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "2+2=", "answer": "4"}\n{"prompt": "1+1=", "answer": "2"}\n')
    return small_pipeline(tmp_path, batch_size=2, overrides={
        "data.prompts": str(prompts), "stages.reward.params.function": f"rw.py:{function}"})


# --------------------------------------------------------------------------- trial call


def test_a_function_that_returns_one_value_for_two_rows_is_refused_naming_the_convention(
        tmp_path):
    # it reads (response, answer) but is called (prompts, responses), and one row hid it
    path = _pipeline(tmp_path, "def exact(response, answer):\n    return [1.0]\n", "exact")
    done = subprocess.run([sys.executable, "-m", "rlhfflow.cli.main", "validate", str(path)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr == (
        f"Error: {path}: stages.reward.params.function: {TRIAL}: reward function exact() "
        f"returned 1 number for 2 responses (called as exact(response=prompts, "
        f"answer=responses)); {CONVENTION}\n")


@pytest.mark.parametrize("body, what", [
    ("return float(solution_str.strip() == answer.strip())",
     "raised at {file}:2: AttributeError: 'list' object has no attribute 'strip' (given "
     "lists)"),
    ("return float(solution_str == answer)", "returned one number (0.0) for 2 responses"),
])
def test_a_per_sample_verl_style_function_is_told_to_wrap_it_not_to_skip_the_trial(
        tmp_path, body, what):
    source = f"def compute_score(solution_str, answer):\n    {body}\n"
    path = _pipeline(tmp_path, source, "compute_score")
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == (
        f"Error: {path}: stages.reward.params.function: {TRIAL}: reward function "
        f"compute_score() {what.format(file=tmp_path / 'rw.py')}; it looks per-sample (one "
        f"response in, one number out), but rlhfflow calls a reward function once per "
        f"batch: {CONVENTION.removeprefix('rlhfflow calls ')}; wrap it in a batch function "
        f"that calls it per row, e.g. def reward(prompts, responses, answer): return "
        f"[compute_score(*row) for row in zip(responses, answer)]\n")
    # the wrapper it suggests is a batch function the trial passes
    (tmp_path / "rw.py").write_text(
        source + "def reward(prompts, responses, answer):\n"
                 "    return [compute_score(*row) for row in zip(responses, answer)]\n")
    path = _pipeline(tmp_path, (tmp_path / "rw.py").read_text(), "reward")
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert (result.exit_code, result.stderr) == (0, "")


def test_the_trial_call_gives_two_rows_and_two_different_responses(tmp_path):
    source = ("import json, pathlib\n"
              "def score(prompts, responses, answer):\n"
              "    pathlib.Path(__file__).with_name('seen.json').write_text(\n"
              "        json.dumps([prompts, responses, answer]))\n"
              "    return [1.0] * len(responses)\n")
    path = _pipeline(tmp_path, source, "score")
    assert CliRunner().invoke(main, ["validate", str(path)]).exit_code == 0
    assert json.loads((tmp_path / "seen.json").read_text()) == [
        ["2+2=", "1+1="], ["The answer is 42.", "I think it is 7."], ["4", "2"]]


# --------------------------------------------------------------------------- episodes


@pytest.fixture(scope="module")
def rollout(chat_lm_dir) -> dict:
    """A chat model's guessing episodes (its template renders the ``tool`` role): the
    rollout's source columns and what it wrote."""
    store = chat_store(chat_lm_dir)
    batch = chat_batch(store.get("actor").tokenizer, ["guess my number, 1 to 9:",
                                                      "which number?"], samples=2)
    stage = create_stage("rollout", model="actor", params={
        "env": GUESS, "max_turns": 3, "max_new_tokens": 6, "max_tokens": 120})
    out = stage.run(batch, StageContext(iteration=0, seed=0, models=store,
                                        settings={"base_dir": str(EXAMPLE)}))
    return {**batch, **out}


SEEN = ("import json, pathlib\n"
        "def seen(**given):\n"
        "    pathlib.Path(__file__).with_name('seen.json').write_text(json.dumps(given))\n")


def _score(columns: dict, tmp_path: Path, source: str, function: str, **params) -> dict:
    """Run a score stage with ``function`` of ``source`` on ``columns``; what the function
    was given (``seen``) and the stage's columns."""
    (tmp_path / "rw.py").write_text(SEEN + source)
    stage = create_stage("score", params={"function": f"rw.py:{function}", **params})
    out = stage.run(columns, StageContext(iteration=0, seed=0, models=None,
                                          settings={"base_dir": str(tmp_path)}))
    return json.loads((tmp_path / "seen.json").read_text()), out


def _messages(turns_json: str) -> list[dict]:
    return [{"role": t["role"], "content": t["text"]} for t in json.loads(turns_json)]


def test_a_function_taking_episode_gets_each_rollout_episode_as_messages(rollout, tmp_path):
    source = ("def judge(prompts, responses, secret, episode):\n"
              "    seen(responses=responses, episode=episode)\n"
              "    return [sum(m['role'] == 'assistant' for m in e) for e in episode]\n")
    given, out = _score(rollout, tmp_path, source, "judge", episodes=True)
    episodes = given["episode"]
    assert episodes == [_messages(cell) for cell in rollout["turns_json"]]
    for episode, turns in zip(episodes, rollout["turns"].tolist(), strict=True):
        # the model's turns and the environment's answers in the tool role, in order
        assert [m["role"] for m in episode] == ["assistant", "tool"] * (turns - 1) + \
            ["assistant"]
        assert all(m["content"] in ("say a number", "higher", "lower")
                   for m in episode if m["role"] == "tool")
    # where the text response has the template's role names left in
    assert all("tool: " in response for response in given["responses"])
    assert out["scores"].tolist() == rollout["turns"].float().tolist()


def test_a_trl_style_function_gets_each_rollout_episode_as_its_completion(rollout, tmp_path):
    source = ("def correct(prompts, completions, secret, **kwargs):\n"
              "    seen(prompts=prompts, completions=completions)\n"
              "    return [float(str(s) in c[-1]['content'])\n"
              "            for c, s in zip(completions, secret)]\n")
    given, out = _score(rollout, tmp_path, source, "correct", episodes=True)
    assert given["completions"] == [_messages(cell) for cell in rollout["turns_json"]]
    assert given["prompts"] == rollout["prompt_text"]  # plain records: the rendered text
    assert out["score_valid"].tolist() == [1] * len(rollout["turns"])


def test_a_single_response_is_a_one_turn_episode(tmp_path):
    columns = {"prompt_text": ["2+2=", "1+1="], "response_text": ["4", "two"],
               "prompt_fields": ['{"answer": "4"}', '{"answer": "2"}']}
    source = ("def judge(prompts, responses, answer, episode):\n"
              "    seen(episode=episode)\n"
              "    return [float(e[-1]['content'] == a) for e, a in zip(episode, answer)]\n")
    given, out = _score(columns, tmp_path, source, "judge")
    assert given["episode"] == [[{"role": "assistant", "content": "4"}],
                                [{"role": "assistant", "content": "two"}]]
    assert out["scores"].tolist() == [1.0, 0.0]


def _guess_with_score(tmp_path: Path) -> Path:
    """The guessing example scored by a reward function that takes ``episode``."""
    (tmp_path / "rw.py").write_text(SEEN + (
        "def judge(prompts, responses, episode):\n"
        "    seen(episode=episode)\n"
        "    return [float(len(e)) for e in episode]\n"))
    data = yaml.safe_load((EXAMPLE / "guess-tiny.yaml").read_text())
    data["data"]["prompts"] = str(EXAMPLE / "prompts.jsonl")
    data["output"] = str(tmp_path / "out")
    data["stages"]["rollout"]["params"].update(env=GUESS, scores=False)
    data["stages"]["reward"] = {"type": "score", "after": ["rollout"],
                                "params": {"function": "rw.py:judge"}}
    data["stages"]["advantages"]["after"] = ["reward"]
    path = tmp_path / "guess.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_a_pipeline_s_score_stage_reads_the_episodes_only_where_a_rollout_writes_them(
        tmp_path):
    from rlhfflow.config.loader import load_pipeline
    from rlhfflow.runtime.stagetest import run_stage_alone

    pipeline = load_pipeline(_guess_with_score(tmp_path))
    assert pipeline.params["reward"].episodes is True
    assert "turns_json" in pipeline.graph.nodes["reward"].reads
    # the rollout, then the score stage, as `rlhfflow stage test` runs them
    scores = run_stage_alone(pipeline, "reward", 0, tmp_path).columns["scores"]
    episodes = json.loads((tmp_path / "seen.json").read_text())["episode"]
    assert scores.tolist() == [float(len(e)) for e in episodes]
    for episode in episodes:  # a plain-text episode's environment speaks as the user
        roles = [m["role"] for m in episode]  # the last is the user's if it filled the room
        assert roles == (["assistant", "user"] * len(roles))[:len(roles)]
    assert max(map(len, episodes)) > 1
    single = load_pipeline(small_pipeline(tmp_path, "grpo"))
    assert single.params["reward"].episodes is False
    assert "turns_json" not in single.graph.nodes["reward"].reads
