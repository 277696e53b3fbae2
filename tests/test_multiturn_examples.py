"""examples/multiturn: the data script, the calculator's rewards, the guessing environment
and the three configs.

The real runs (SmolLM2-135M-Instruct, ~15 minutes each) are documented commands
(docs/how-to/multi-turn.md); here the configs are validated as written, next to a tiny
chat model standing in for the checkpoint.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from rlhfflow.cli.main import main
from rlhfflow.engine.environments import ToolEnvironment
from rlhfflow.engine.models import build_tiny_model, save_model
from tests.conftest import REPO, chat_tokenizer, example_module

EXAMPLE = REPO / "examples" / "multiturn"



# --------------------------------------------------------------------------- data


def test_the_calculator_data_is_seeded_held_out_and_right() -> None:
    make_data = example_module("multiturn", "make_data")
    train, test = make_data.make_records(300, 50, seed=3)
    assert (train, test) == make_data.make_records(300, 50, seed=3)
    assert train != make_data.make_records(300, 50, seed=4)[0]
    questions = [r["messages"][-1]["content"] for r in train + test]
    assert len(set(questions)) == 350
    shown = "What is {} * {}?".format(*make_data.EXAMPLE)
    assert shown not in questions  # the worked example is never asked
    for record in train + test:
        roles = [m["role"] for m in record["messages"]]
        assert roles == ["system", "user", "assistant", "tool", "assistant", "user"]
        a, b = record["messages"][-1]["content"].removeprefix("What is ").rstrip("?") \
            .split(" * ")
        assert 100 <= int(a) <= 999 and 10 <= int(b) <= 99
        assert record["answer"] == str(int(a) * int(b))
    # the worked call is one the tool environment runs
    demo = train[0]["messages"]
    calculate = example_module("multiturn", "tools").calculate
    env = ToolEnvironment({"calculate": calculate}, timeout_s=5)
    messages, _, done, info = env.step(demo[2]["content"])
    assert messages == [{"content": demo[3]["content"]}] and not done
    assert info == {"calls": 1, "errors": 0}


def test_the_script_writes_all_six_files(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(EXAMPLE / "make_data.py"), "--train", "20",
                           "--test", "5", "--top", "7", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for game in ("calc", "python", "guess"):
        assert len((tmp_path / f"{game}-train.jsonl").read_text().splitlines()) == 20
        assert len((tmp_path / f"{game}-test.jsonl").read_text().splitlines()) == 5
    guesses = [json.loads(line) for line in
               (tmp_path / "guess-train.jsonl").read_text().splitlines()]
    assert {1 <= g["secret"] <= 7 for g in guesses} == {True}
    assert "from 1 to 7" in guesses[0]["messages"][0]["content"]


# --------------------------------------------------------------------------- rewards

EPISODE = ('<tool_call>{"name": "calculate", "arguments": {"expression": "347 * 58"}}'
           '</tool_call>\ntool\n20126\nassistant\n')


@pytest.mark.parametrize("response, exact, called", [
    (EPISODE + "20126", 1.0, 1.0),
    (EPISODE + "The answer is 20,126.", 1.0, 1.0),
    (EPISODE + "I do not know", 0.0, 1.0),   # the tool's result is not the model's answer
    (EPISODE + "20127", 0.0, 1.0),
    ("20126", 1.0, 0.0),                     # right without the tool
    ("347 * 58 = 19746", 0.0, 0.0),
    (EPISODE.replace("347 * 58", "58*347") + "20126", 1.0, 1.0),
    (EPISODE.replace("347 * 58", "347 * 85"), 0.0, 0.0),   # a call worth something else
    (EPISODE.replace("calculate", "calc"), 0.0, 0.0),      # unknown tool
    ('<tool_call>{"name": "calculate", "arguments": {"expression": "347 *"}}</tool_call>',
     0.0, 0.0),
    ("<tool_call>not json</tool_call>\ntool\nerror\nassistant\n20126", 1.0, 0.0),
    ("", 0.0, 0.0),
])
def test_the_calculator_rewards(response, exact, called) -> None:
    reward = example_module("multiturn", "reward")
    assert reward.exact_answer([""], [response], ["20126"]) == [exact]
    assert reward.tool_call([""], [response], ["20126"]) == [called]


PROGRAM = ('<tool_call>{"name": "python", "arguments": {"code": "print(347 * 58)"}}'
           '</tool_call>\ntool\n20126\n\nassistant\n20126')


@pytest.mark.parametrize("response, called", [
    (PROGRAM, 1.0),
    (PROGRAM.replace("20126\n\nassistant", "error: exit status 1\nassistant"), 0.0),
    (PROGRAM.replace('"python"', '"calculate"'), 0.0),     # another tool
    ("<tool_call>not json</tool_call>\ntool\n20126\nassistant\n20126", 0.0),
    ("20126", 0.0),                                         # no program ran
])
def test_the_python_call_reward_wants_a_program_that_printed_the_answer(response,
                                                                        called) -> None:
    reward = example_module("multiturn", "reward")
    assert reward.python_call([""], [response], ["20126"]) == [called]


def test_the_python_data_shows_a_worked_call_the_sandbox_runs() -> None:
    from rlhfflow.engine import sandbox

    make_data = example_module("multiturn", "make_data")
    train, _ = make_data.make_records(5, 1, seed=3, tool="python")
    assert [r["answer"] for r in train] == \
        [r["answer"] for r in make_data.make_records(5, 1, seed=3)[0]]
    demo = train[0]["messages"]
    env = ToolEnvironment({"python": sandbox.python}, timeout_s=30,
                          sandbox=sandbox.SandboxSettings(warm=0))
    messages, _, done, info = env.step(demo[2]["content"])
    assert messages == [{"content": demo[3]["content"]}] and not done
    assert info == {"calls": 1, "errors": 0}


# --------------------------------------------------------------------------- environment


def test_guess_number_answers_and_reports_the_win() -> None:
    GuessNumber = example_module("multiturn", "envs").GuessNumber
    env = GuessNumber(penalty=0.2)
    assert env.reset({"secret": 6, "prompt": "guess"}) == []
    assert env.step("I say 3") == ([{"content": "higher"}], -0.2, False, {"guess": 3, "won": 0})
    assert env.step("9, then 6") == ([{"content": "lower"}], -0.2, False, {"guess": 9, "won": 0})
    assert env.step("no idea") == ([{"content": "say a number"}], -0.2, False, {"won": 0})
    assert env.step("6") == ([{"content": "correct"}], 1.0, True, {"guess": 6, "won": 1})

    worded = GuessNumber(hint="My number is {word} than {guess}.", role="user")
    worded.reset({"secret": "4"})
    messages, reward, done, info = worded.step("Is it 10?")
    assert messages == [{"role": "user", "content": "My number is lower than 10."}]
    assert (reward, done, info["won"]) == (-0.1, False, 0)
    # a turn without a number may cost more than a wrong guess
    worded = GuessNumber(silent_penalty=0.3, role="user")
    worded.reset({"secret": 4})
    assert worded.step("well, hmm")[:2] == ([{"role": "user", "content": "say a number"}], -0.3)
    assert worded.step("5")[1] == -0.1


def test_tool_environment_counts_calls_and_errors() -> None:
    env = ToolEnvironment({"calculate": example_module("multiturn", "tools").calculate}, timeout_s=5)
    call = '<tool_call>{{"name": "calculate", "arguments": {{"expression": "{}"}}}}</tool_call>'
    messages, reward, done, info = env.step(call.format("2 * 3") + call.format("1 +"))
    assert [m["content"] for m in messages][0] == "6" and not done and reward == 0.0
    assert messages[1]["content"].startswith("error: SyntaxError")
    assert info == {"calls": 2, "errors": 1, "errors_exception": 1}
    assert env.step("<tool_call>{") [3] == {"calls": 1, "errors": 1, "errors_cut": 1}
    assert env.step("42") == ([], 0.0, True, {"calls": 0, "errors": 0})


# --------------------------------------------------------------------------- configs


@pytest.fixture(scope="module")
def long_chat_lm_dir(tmp_path_factory) -> Path:
    """A tiny random chat Llama with room for the examples' prompts spelled in characters."""
    tok = chat_tokenizer()
    path = tmp_path_factory.mktemp("models") / "chat-lm-long"
    save_model(build_tiny_model(tok, "lm", seed=0, max_positions=2048), tok, path)
    return path


@pytest.mark.parametrize("config, rows", [
    ("calculator.yaml", "2 prompts x 4 samples per prompt = 8 rows per iteration"),
    ("python.yaml", "2 prompts x 4 samples per prompt = 8 rows per iteration"),
    ("guess.yaml", "2 prompts x 4 samples per prompt = 8 rows per iteration"),
    ("guess-tiny.yaml", "4 prompts x 4 samples per prompt = 16 rows per iteration"),
])
def test_the_configs_validate(tmp_path: Path, long_chat_lm_dir: Path, config: str,
                              rows: str) -> None:
    """Each config as written, with its data made by the script and a tiny chat model at
    the path where the import command puts SmolLM2. The tiny model's tokenizer spells
    characters, so only the prompt length limit is raised to fit its prompts."""
    example = tmp_path / "examples" / "multiturn"
    shutil.copytree(EXAMPLE, example, ignore=shutil.ignore_patterns("data", "runs",
                                                                    "__pycache__"))
    shutil.copytree(long_chat_lm_dir, tmp_path / "models" / "smollm2-135m")
    subprocess.run([sys.executable, str(example / "make_data.py")], check=True,
                   capture_output=True, timeout=60)
    path = example / config
    data = yaml.safe_load(path.read_text())
    if "path" in data["models"]["actor"]:
        assert data["models"]["actor"]["path"] == "../../models/smollm2-135m"
        data["data"]["max_prompt_tokens"] = 1024
        path.write_text(yaml.safe_dump(data, sort_keys=False))
    # in-process: the CLI as a program is test_cli's and test_spec's to check
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 0, result.output
    assert rows in result.stdout


@pytest.mark.parametrize("example, config", [("multiturn", "calculator.yaml"),
                                             ("multiturn", "python.yaml"),
                                             ("multiturn", "guess.yaml"),
                                             ("arithmetic", "grpo.yaml")])
def test_a_config_whose_data_is_not_made_yet_names_the_script_that_makes_it(
        tmp_path: Path, long_chat_lm_dir: Path, monkeypatch, example: str,
        config: str) -> None:
    # as the missing model names `rlhfflow models import-gguf`
    copy = tmp_path / "examples" / example
    shutil.copytree(REPO / "examples" / example, copy,
                    ignore=shutil.ignore_patterns("data", "runs", "__pycache__"))
    shutil.copytree(long_chat_lm_dir, tmp_path / "models" / "smollm2-135m")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["validate", str(copy / config)])
    assert result.exit_code == 2
    prompts = yaml.safe_load((copy / config).read_text())["data"]["prompts"]
    assert result.output.strip().splitlines() == [
        f"Error: {copy / config}: data.prompts: file not found: {copy / prompts}; make it "
        f"with `python examples/{example}/make_data.py`"]


def test_heldout_scores_a_pipeline_s_model_on_held_out_records(tmp_path: Path) -> None:
    """examples/multiturn/heldout.py: the rollout-and-reward stages run alone on held-out
    records, 2 episodes each, and the last line holds each function's mean and error."""
    from tests.conftest import DATA, small_pipeline

    path = small_pipeline(tmp_path, "grpo")
    out = subprocess.run([sys.executable, str(EXAMPLE / "heldout.py"), str(path),
                          "--prompts", str(DATA / "prompts.jsonl"), "--records", "4",
                          "--batch", "2", "--samples", "2"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    [(key, scores)] = figures.items()
    assert key == "(the pipeline's):scores" and scores["episodes"] == 8
    assert 0 <= scores["mean"] <= 1 and scores["stderr"] >= 0
    # a prompts file without -train in its name and no --prompts: one line, not a guess
    missing = subprocess.run([sys.executable, str(EXAMPLE / "heldout.py"), str(path)],
                             capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert missing.returncode != 0 and "give the held-out records with --prompts" in \
        missing.stderr.strip().splitlines()[-1]
