"""What the user sees of multi-turn episodes and how their turns get credit: the
``rollout`` stage's ``turns_json`` and ``turn_rewards``, per-turn advantages
(``advantages.params.per_turn``, ``ops.turns``), the stage test and the report's
conversations, and an environment whose ``step`` returns the wrong shape."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from rlhfflow import ops
from rlhfflow.config.spec import AlgorithmSpec
from rlhfflow.engine.environments import EnvironmentMisbehaved
from rlhfflow.stages import StageContext, create_stage
from tests.conftest import chat_batch, chat_store

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "multiturn"
GUESS = str(EXAMPLE / "envs.py") + ":GuessNumber"
TEXTS = ["guess my number, 1 to 9:", "which number?", "guess a number from 1 to 9:"]


def _rollout(store, batch, **params):
    stage = create_stage("rollout", params=params, model="actor")
    return stage.run(batch, StageContext(iteration=0, seed=0, models=store,
                                         settings={"base_dir": str(EXAMPLE)}))


def _advantages(batch, algorithm, **params):
    stage = create_stage("advantages", params=params, algorithm=algorithm)
    return stage.run(batch, StageContext(iteration=0, seed=0, models=None))["advantages"]


# --------------------------------------------------------------------------- ops.turns


def test_turns_are_runs_of_the_model_s_tokens_and_their_returns_are_discounted_per_turn():
    mask = torch.tensor([[1, 1, 0, 1, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0, 0]])
    index, turns = ops.turn_index(mask)
    assert index.tolist() == [[0, 0, 0, 1, 0, 2, 2, 0], [0, 0, 0, 0, 0, 0, 0, 0]]
    assert turns.tolist() == [3, 1]
    turn_rewards = torch.zeros(2, 8)
    turn_rewards[0, 1], turn_rewards[0, 3], turn_rewards[0, 6] = -0.1, -0.1, 1.0
    # row 0's score is its turns' sum; row 1's (2.0, no environment reward) all on its turn
    rewards = ops.per_turn_rewards(turn_rewards, torch.tensor([0.8, 2.0]), mask)
    torch.testing.assert_close(rewards, torch.tensor([[-0.1, -0.1, 1.0], [2.0, 0.0, 0.0]]))
    returns = ops.turn_returns(rewards, turns, gamma=0.5)
    torch.testing.assert_close(returns, torch.tensor([[0.1, 0.4, 1.0], [2.0, 0.0, 0.0]]))
    # the KL penalty of a turn's tokens comes off that turn's reward
    kl = torch.ones(2, 8)
    with_kl = ops.per_turn_rewards(turn_rewards, torch.tensor([0.8, 2.0]), mask, kl, 0.01)
    torch.testing.assert_close(with_kl, rewards - 0.01 * torch.tensor([[2., 1., 2.],
                                                                       [3., 0., 0.]]))


def test_per_turn_grpo_compares_a_turn_with_the_same_turn_of_the_prompt_s_other_episodes():
    # prompt 0: episode A wins at once (+1); episode B says two wrong numbers first
    mask = torch.tensor([[1, 1, 0, 0, 0, 0, 0], [1, 0, 1, 0, 1, 1, 0]])
    turn_rewards = torch.zeros(2, 7)
    turn_rewards[0, 1] = 1.0
    turn_rewards[1, 0], turn_rewards[1, 2], turn_rewards[1, 5] = -0.1, -0.1, 1.0
    batch = {"scores": torch.tensor([1.0, 0.8]), "response_mask": mask,
             "turn_rewards": turn_rewards, "group_ids": torch.tensor([0, 0])}
    adv = _advantages(batch, AlgorithmSpec(name="grpo", kl_coef=0.0), per_turn=True)
    first = (1.0 - 0.9) / (torch.tensor([1.0, 0.8]).std() + 1e-6)  # turn 0: returns 1, 0.8
    torch.testing.assert_close(adv[0], first * mask[0])
    # B's first turn loses to A's; its later turns have no peer at their position: 0
    torch.testing.assert_close(adv[1], torch.tensor([-first, 0, 0, 0, 0, 0, 0]))
    # RLOO: the same pairs, a leave-one-out baseline
    rloo = _advantages(batch, AlgorithmSpec(name="rloo", kl_coef=0.0), per_turn=True)
    torch.testing.assert_close(rloo[:, 0], torch.tensor([0.2, -0.2]))
    assert (rloo[1, 1:] == 0).all()


def _episode_batch(turns_per_row: list[int], width: int = 12, seed: int = 0) -> dict:
    """Hand-made episodes: each model turn 2 tokens, then 1 environment token; random
    per-turn rewards, the score their sum plus a judged part; 2 episodes per prompt."""
    gen = torch.Generator().manual_seed(seed)
    rows = len(turns_per_row)
    mask = torch.zeros(rows, width, dtype=torch.int8)
    turn_rewards = torch.zeros(rows, width)
    for row, turns in enumerate(turns_per_row):
        for k in range(turns):
            mask[row, 3 * k:3 * k + 2] = 1
            turn_rewards[row, 3 * k + 1] = torch.randn((), generator=gen)
    scores = turn_rewards.sum(-1) + torch.randn(rows, generator=gen)
    return {"scores": scores, "response_mask": mask, "turn_rewards": turn_rewards,
            "group_ids": torch.arange(rows) // 2,
            "values": torch.randn(rows, width, generator=gen)}


@pytest.mark.parametrize("name, estimator", [
    ("grpo", None), ("rloo", None), ("dr_grpo", None), ("ppo", None),
    ("grpo", "reinforce_plus_plus_baseline"), ("grpo", "reinforce_plus_plus")])
def test_with_one_turn_per_episode_per_turn_credit_is_the_episode_s(name, estimator):
    batch = _episode_batch([1] * 6)
    algorithm = AlgorithmSpec(name=name, kl_coef=0.0, advantage_estimator=estimator)
    torch.testing.assert_close(_advantages(batch, algorithm, per_turn=True),
                               _advantages(batch, algorithm))


def test_per_turn_credit_gives_a_model_turn_only_the_rewards_after_it():
    batch = _episode_batch([3, 2, 1, 3, 2, 2])
    mask = batch["response_mask"].bool()
    index, _ = ops.turn_index(batch["response_mask"])
    adv = _advantages(batch, AlgorithmSpec(name="dr_grpo", kl_coef=0.0), per_turn=True)
    assert (adv[~mask] == 0).all()
    for row in range(6):  # one advantage per turn, shared by its tokens
        for k in index[row][mask[row]].unique().tolist():
            assert len(adv[row][mask[row] & (index[row] == k)].unique()) == 1
    # the outcome-level default: one advantage for the whole episode
    episode = _advantages(batch, AlgorithmSpec(name="dr_grpo", kl_coef=0.0))
    assert all(len(episode[row][mask[row]].unique()) == 1 for row in range(6))
    assert any(len(adv[row][mask[row]].unique()) > 1 for row in range(6))
    # PPO's GAE sees each turn's reward on its last token: with gamma = lam = 1 and zero
    # values, a token's advantage is the rewards from its turn on (the score's
    # remainder at the end)
    gae = AlgorithmSpec(name="ppo", gamma=1.0, lam=1.0, whiten_advantages=False,
                        kl_coef=0.0)
    zero = {**batch, "values": torch.zeros_like(batch["values"])}
    adv = _advantages(zero, gae, per_turn=True)
    rewards = ops.per_turn_rewards(batch["turn_rewards"], batch["scores"],
                                   batch["response_mask"])
    to_go = rewards.flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(adv[mask], to_go.gather(1, index)[mask])


# --------------------------------------------------------------------------- episodes


@pytest.fixture(scope="module")
def episodes(chat_lm_dir):
    store = chat_store(chat_lm_dir)
    batch = chat_batch(store.get("actor").tokenizer, TEXTS, samples=2)
    out = _rollout(store, batch, env=GUESS, max_turns=3, max_new_tokens=6, max_tokens=120)
    return store, batch, out


def test_an_episode_s_turns_say_who_said_what_and_cover_its_tokens(episodes):
    store, _, out = episodes
    tok = store.get("actor").tokenizer
    for row, cell in enumerate(out["turns_json"]):
        turns = json.loads(cell)
        mask = out["response_mask"][row]
        length = int(mask.nonzero().max()) + 1  # the episode ends with the model's turn
        spans = [t["span"] for t in turns]
        assert spans[0][0] == 0 and spans[-1][1] == length
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
        said = [t for t in turns if t["role"] == "assistant"]
        assert len(said) == out["turns"][row] == 3
        for turn in turns:
            start, end = turn["span"]
            assert bool(mask[start:end].all()) == (turn["role"] == "assistant")
            assert bool((mask[start:end] == 0).all()) == (turn["role"] != "assistant")
            if turn["role"] == "assistant":
                assert turn["text"] == tok.decode(out["response_ids"][row, start:end],
                                                  skip_special_tokens=True)
            else:  # the environment's own words, in the role the template renders
                assert turn["role"] == "tool"
                assert turn["text"] in ("say a number", "higher", "lower")
        # each step's reward sits on the last token of the turn it answers
        ends = [t["span"][1] - 1 for t in said]
        rewards = out["turn_rewards"][row]
        torch.testing.assert_close(rewards[ends], torch.tensor([t["reward"] for t in said]))
        assert rewards.sum() == pytest.approx(float(out["env_reward"][row]))
        assert (rewards[mask == 0] == 0).all()


@pytest.mark.parametrize("name", ["grpo", "rloo", "ppo"])
def test_per_turn_advantages_on_rollout_episodes_skip_the_environment_s_tokens(episodes,
                                                                              name):
    _, batch, out = episodes
    # a judged part on top of the environment's rewards, so that returns differ
    columns = {**batch, **out, "scores": out["env_reward"] + 0.1 * torch.arange(6),
               "values": torch.zeros(out["response_mask"].shape)}
    adv = _advantages(columns, AlgorithmSpec(name=name, kl_coef=0.0), per_turn=True)
    env = out["response_mask"] == 0
    assert (adv[env] == 0).all() and torch.isfinite(adv).all()
    assert (adv[~env] != 0).any()


# --------------------------------------------------------------------------- bad input


class _Env:
    def __init__(self, result):
        self.result = result


@pytest.mark.parametrize("result, expected", [
    (("higher", 0.0, False), "a 3-tuple ('higher', 0.0, False)"),
    ("higher", "str 'higher'"),
    (("higher", "one", False, {}), "reward 'one'"),
    ((42, 0.0, False, {}), "messages of type int"),
    (([{"text": "hi"}], 0.0, False, {}), "message 0 {'text': 'hi'}"),
    (("x", 0.0, "no", {}), "done 'no'"),
    (("x", 0.0, True, [1]), "info [1]"),
])
def test_a_step_of_the_wrong_shape_is_one_line_naming_the_class(result, expected):
    from rlhfflow.engine.environments import Episode

    episode = Episode(_Env(result))
    with pytest.raises(EnvironmentMisbehaved) as info:
        episode.took(result)
    text = str(info.value)
    assert "\n" not in text and text.startswith("test_episodes.py:_Env.step returned ")
    assert expected in text and "expected a tuple (messages, reward, done, info)" in text


def test_a_good_step_passes_and_numpy_and_tensor_values_are_taken():
    import numpy as np

    from rlhfflow.engine.environments import Episode

    episode = Episode(_Env(None))
    episode.add([1, 2], [0.0, 0.0])
    assert episode.took(("x", np.float32(0.5), np.bool_(True), {"n": np.int64(3)}))[1:3] \
        == (0.5, True)
    assert episode.took(([], torch.tensor(0.25), 0, None))[1] == 0.25
    assert episode.log[0]["reward"] == 0.75 and episode.log[0]["info"] == {"n": "3"}


def test_an_environment_turn_without_messages_still_covers_its_tokens():
    from rlhfflow.engine.environments import Episode

    episode = Episode(_Env(None))
    episode.add([1, 2], [-0.5, -0.5])
    episode.add([3, 4], None, [], "tool")  # the template's markers, no message
    episode.add([5], [-0.5])
    assert [t["span"] for t in episode.log] == [[0, 2], [2, 4], [4, 5]]
    assert episode.log[1] == {"role": "tool", "text": "", "span": [2, 4]}


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlhfflow.cli.main", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300,
                          env={**_env(), "RLHFFLOW_WARM": "0"})


def _env() -> dict:
    import os

    return {**os.environ, "PYTHONPATH": str(REPO)}


def _guess_pipeline(tmp_path: Path, **params) -> Path:
    data = yaml.safe_load((EXAMPLE / "guess-tiny.yaml").read_text())
    data["data"]["prompts"] = str(EXAMPLE / "prompts.jsonl")
    data["stages"]["rollout"]["params"].update(params)
    path = tmp_path / "guess.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_stage_test_prints_episodes_turn_by_turn_and_a_bad_step_exits_2(tmp_path):
    (tmp_path / "envs.py").write_text((EXAMPLE / "envs.py").read_text())
    (tmp_path / "bad_env.py").write_text(
        "class ThreeTuple:\n    def reset(self, record):\n        return []\n\n"
        "    def step(self, text):\n        return 'lower', 0.0, False\n")
    good = _cli("stage", "test", str(_guess_pipeline(tmp_path)), "rollout", cwd=tmp_path)
    assert good.returncode == 0, good.stderr
    assert "first 3 of 16 episodes, turn by turn:" in good.stdout
    assert "  episode 0 (" in good.stdout and "    prompt: guess my number, 1 to 9:" in \
        good.stdout
    assert "    assistant: " in good.stdout and "    env: " in good.stdout
    bad = _cli("stage", "test", str(_guess_pipeline(tmp_path, env="bad_env.py:ThreeTuple",
                                                    env_kwargs={})),
               "rollout", cwd=tmp_path)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "bad_env.py:ThreeTuple.step returned a 3-tuple" in lines[0]


# --------------------------------------------------------------------------- end to end


def _algorithm_pipeline(tmp_path: Path, algorithm: str) -> Path:
    """The guessing example with ``algorithm``: per-turn credit for the estimators, a
    critic for PPO, a reference for online DPO."""
    data = yaml.safe_load((EXAMPLE / "guess-tiny.yaml").read_text())
    data.update(iterations=2, output=str(tmp_path / "out"),
                logging={"completions_every": 1})
    data["data"]["prompts"] = str(EXAMPLE / "prompts.jsonl")
    data["stages"]["rollout"]["params"]["env"] = GUESS
    stages = data["stages"]
    data["algorithm"] = {"name": algorithm, "kl_coef": 0.0}
    if algorithm == "ppo":
        data["models"]["critic"] = {"from": "actor", "head": "value", "trainable": True,
                                    "optimizer": {"lr": 1e-3}}
        stages["values"] = {"type": "values", "model": "critic", "after": ["rollout"]}
        stages["advantages"]["after"] = ["rollout", "values"]
        stages["train_critic"] = {"type": "train_critic", "model": "critic",
                                  "after": ["advantages"]}
    if algorithm == "dpo":
        del data["algorithm"]
        data["models"]["ref"] = {"from": "actor"}
        del stages["advantages"], stages["train_actor"]
        stages["ref_logprob"] = {"type": "logprob", "model": "ref", "after": ["rollout"],
                                 "params": {"output": "ref_logprobs"}}
        stages["train_dpo"] = {"type": "train_dpo_online", "model": "actor",
                               "after": ["ref_logprob"], "params": {"beta": 0.1}}
    else:
        stages["advantages"]["params"] = {"per_turn": True}
    path = tmp_path / "guess.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["grpo", "rloo", "ppo", "dpo"])
def test_algorithms_train_on_episodes_and_the_report_shows_them_as_conversations(
        tmp_path, algorithm):
    from rlhfflow.config.loader import load_pipeline
    from rlhfflow.monitor.report import build_report
    from rlhfflow.runtime.run import run_pipeline

    result = run_pipeline(load_pipeline(_algorithm_pipeline(tmp_path, algorithm)),
                          progress=False, inline=True)
    assert len(result.metrics) == 2
    last = result.metrics[-1]
    loss = last["policy_loss"] if algorithm != "dpo" else last["train"]["train_dpo"]["dpo_loss"]
    assert loss is not None and math.isfinite(loss), last
    out = tmp_path / "out"
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text()
            .splitlines()]
    assert rows and all(r["turns"][0]["role"] == "assistant" for r in rows)
    if algorithm != "dpo":  # each model turn's mean advantage, beside the episode's
        assert all("advantage" in t for r in rows for t in r["turns"]
                   if t["role"] == "assistant")
    report = build_report(out)
    assert "<div class='turn assistant'><b>assistant</b>: " in report
    assert "<b>env</b>: " in report


def test_per_turn_needs_a_stage_that_writes_turn_rewards(tmp_path):
    from rlhfflow.config.loader import load_pipeline
    from rlhfflow.config.spec import SpecError
    from tests.conftest import small_pipeline

    path = small_pipeline(tmp_path, "grpo", overrides={
        "stages.advantages.params": {"per_turn": True}})
    with pytest.raises(SpecError) as info:
        load_pipeline(path)
    assert "turn_rewards" in str(info.value) and "\n" not in str(info.value)



# --------------------------------------------------------------------------- tools at validation

ROLES = "{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}<|im_end|>" \
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant: {% endif %}"
TEMPLATES = {
    # shows each tool's name to the model, as tool-calling templates do
    "shows-tools": "{% if tools %}<|im_start|>system: {% for t in tools %}"
                   "{{ t['function']['name'] }} {% endfor %}<|im_end|>{% endif %}" + ROLES,
    # reads a key no schema has
    "breaks-on-tools": "{% if tools %}{% for t in tools %}{{ t.function.returns.kind }}"
                       "{% endfor %}{% endif %}" + ROLES,
    # knows user, assistant and system only
    "no-tool-role": "{% for m in messages %}{% if m['role'] not in ['user', 'assistant', "
                    "'system'] %}{{ raise_exception('unknown role ' + m['role']) }}"
                    "{% endif %}{% endfor %}" + ROLES,
}
DOCUMENTED = '''
def add(a: float, b: float) -> float:
    """Add two numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def bare(a, b):
    return a + b
'''


@pytest.fixture(scope="module")
def template_models(tmp_path_factory) -> dict[str, Path]:
    from rlhfflow.engine.models import build_tiny_model, save_model
    from tests.conftest import chat_tokenizer

    root = tmp_path_factory.mktemp("templates")
    paths = {}
    for name, template in TEMPLATES.items():
        tok = chat_tokenizer()
        tok.chat_template = template
        paths[name] = root / name
        save_model(build_tiny_model(tok, "lm", seed=0), tok, paths[name])
    return paths


def _tool_pipeline(tmp_path: Path, model: Path, tools: list[str]) -> Path:
    (tmp_path / "tools.py").write_text(DOCUMENTED)
    data = yaml.safe_load((EXAMPLE / "guess-tiny.yaml").read_text())
    # a template that shows tools lists them in the prompt: room for their names
    data["data"].update(prompts=str(EXAMPLE / "prompts.jsonl"), chat_template=True,
                        max_prompt_tokens=96)
    data["models"]["actor"] = {"path": str(model), "trainable": True}
    params = data["stages"]["rollout"]["params"]
    del params["env"], params["env_kwargs"]
    params["tools"] = tools
    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize("template, tools, key, message", [
    ("shows-tools", ["tools.py:add", "tools.py:bare"], "params.tools[1]",
     "the chat template shows tools to the model, but 'tools.py:bare' has no JSON schema: "
     "Cannot generate JSON schema for bare because"),
    ("breaks-on-tools", ["tools.py:add"], "params.tools",
     "the model's chat template cannot render these tools: UndefinedError"),
    ("no-tool-role", ["tools.py:add"], "params.tools",
     "the model's chat template renders no 'tool' role"),
    ("shows-tools", ["tools.py:add"], None, None),
])
def test_tools_the_chat_template_cannot_render_are_one_line_at_validation(
        tmp_path, template_models, template, tools, key, message):
    path = _tool_pipeline(tmp_path, template_models[template], tools)
    done = _cli("validate", str(path), cwd=tmp_path)
    if key is None:
        assert done.returncode == 0, done.stderr
        return
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"Error: {path}: stages.rollout.{key}: {message}"), lines[0]


def test_an_environment_that_does_not_import_is_one_line_at_validation(tmp_path):
    (tmp_path / "broken.py").write_text("import no_such_module_here\n\n\nclass Env:\n    pass\n")
    path = _guess_pipeline(tmp_path, env="broken.py:Env", env_kwargs={})
    done = _cli("validate", str(path), cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == [f"Error: {path}: stages.rollout.params.env: cannot import "
                     "'broken.py:Env': ModuleNotFoundError: No module named "
                     "'no_such_module_here'"], lines
