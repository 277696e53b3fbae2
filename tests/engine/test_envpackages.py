"""Environments of GEM and SkyRL-gym (``rlhfflow.engine.envpackages``) played by a real tiny
model through the ``rollout`` stage, chosen per record, and the one-line refusals of a
package that is not installed or an environment id it does not know. Each package's tests
skip where its extra is not installed (``pip install 'rlhfflow[gem,skyrl-gym]'``)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rlhfflow.config.loader import load_pipeline
from rlhfflow.config.spec import SpecError
from rlhfflow.engine import envpackages
from rlhfflow.engine.envpackages import GemEnv, PackageEnv, SkyRLGymEnv, UnknownEnvironment
from rlhfflow.stages import StageContext, create_stage
from tests.conftest import chat_batch, chat_store
from tests.stages.test_rollout import _pipeline

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "multiturn"
ADAPTERS = "rlhfflow.engine.envpackages"
GUESS = "game:GuessTheNumber-v0-easy"


def _rollout(store, batch, records, **params):
    """The rollout stage over ``batch`` with each row's record ``records[prompt_index]``."""
    batch["prompt_fields"] = [json.dumps(records[i], sort_keys=True)
                              for i in batch["prompt_index"].tolist()]
    stage = create_stage("rollout", params=params, model="actor")
    return stage.run(batch, StageContext(iteration=0, seed=0, models=store,
                                         settings={"base_dir": str(EXAMPLE)}))


def _turns(out, row: int) -> list[dict]:
    return json.loads(out["turns_json"][row])


# --------------------------------------------------------------------------- GEM


def test_a_gem_game_ends_on_its_own_reward_through_the_rollout_stage(chat_lm_dir):
    pytest.importorskip("gem", reason="pip install 'rlhfflow[gem]'")
    store = chat_store(chat_lm_dir)
    tok = store.get("actor").tokenizer
    records = GemEnv.prompt_records(GUESS, seeds=[1, 2])
    batch = chat_batch(tok, [r["prompt"] for r in records], samples=2)
    out = _rollout(store, batch, records, env=f"{ADAPTERS}:GemEnv", max_turns=3,
                   max_new_tokens=8, max_tokens=64, info=["truncated"])
    # the prompt holds the game's opening: the model speaks first; a random model writes
    # no \boxed{} guess, which GEM ends with its format-error reward on that step
    assert out["turns"].tolist() == [1] * 4
    torch.testing.assert_close(out["env_reward"], torch.full((4,), -0.1))
    assert out["info_truncated"].tolist() == [0.0] * 4
    assert (out["response_mask"] == 1).sum(-1).min() > 0
    for row in range(4):  # the end reward lands on the last token of the model's turn
        last = int(out["response_mask"][row].nonzero().max())
        assert out["turn_rewards"][row, last] == pytest.approx(-0.1)
        (turn,) = _turns(out, row)
        assert turn["role"] == "assistant" and turn["reward"] == pytest.approx(-0.1)


def test_gem_s_observations_rewards_and_seeds_become_the_step_tuple():
    pytest.importorskip("gem", reason="pip install 'rlhfflow[gem]'")
    outer = random.getstate(), np.random.get_state()[1].copy()
    env = GemEnv(GUESS)
    opening = env.reset({"prompt": "let's play", "seed": 3})
    assert opening[0]["role"] == "user" and "Guess The Number" in opening[0]["content"]
    assert opening[0]["content"].endswith("Enter your next guess.")  # GEM's suffix
    secret = env.env.game_number
    # another episode of the same record plays the same game; a hash seeds a record
    # without a seed, the same for every sample of its prompt
    assert GemEnv(GUESS).reset({"prompt": "x", "seed": 3}) and secret == env.env.game_number
    unseeded = [GemEnv(GUESS) for _ in range(2)]
    for e in unseeded:
        e.reset({"prompt": "same prompt"})
    assert unseeded[0].env.game_number == unseeded[1].env.game_number
    wrong = 1 if secret != 1 else 2
    messages, reward, done, info = env.step(f"\\boxed{{{wrong}}}")
    assert ("higher" in messages[0]["content"] or "lower" in messages[0]["content"])
    assert (reward, done, info["truncated"]) == (0.0, False, 0)
    messages, reward, done, _ = env.step(f"\\boxed{{{secret}}}")
    assert (reward, done) == (1.0, True) and "Congratulations" in messages[0]["content"]
    # GEM seeded Python's and numpy's generators inside the adapter only
    assert random.getstate() == outer[0] and (np.random.get_state()[1] == outer[1]).all()
    # a prompt that already holds the opening shows nothing before the model's turn
    (record,) = GemEnv.prompt_records(GUESS, seeds=[3])
    assert GemEnv(GUESS).reset(record) == []


# --------------------------------------------------------------------------- SkyRL-gym


def test_a_skyrl_gym_environment_answers_each_turn_through_the_rollout_stage(chat_lm_dir):
    pytest.importorskip("skyrl_gym", reason="pip install 'rlhfflow[skyrl-gym]'")
    store = chat_store(chat_lm_dir)
    tok = store.get("actor").tokenizer
    # a SkyRL data set's rows as they are: env_class names the environment
    records = [{"env_class": "gsm8k_multi_turn", "reward_spec": {"ground_truth": "42"},
                "extra_info": {"max_turns": 2}},
               {"env_class": "gsm8k", "reward_spec": {"ground_truth": "7"}}]
    batch = chat_batch(tok, ["what is 6 times 7?", "what is 3 plus 4?"], samples=2)
    out = _rollout(store, batch, records, env=f"{ADAPTERS}:SkyRLGymEnv", max_turns=4,
                   max_new_tokens=6, max_tokens=160, info=["steps"])
    # gsm8k_multi_turn asks again until its max_turns; gsm8k scores one answer and ends
    assert out["turns"].tolist() == [2, 2, 1, 1]
    assert out["info_steps"].tolist() == [2.0, 2.0, 0.0, 0.0]  # get_metrics() at the end
    assert out["env_reward"].tolist() == [0.0] * 4  # no "#### 42" from a random model
    for row in (0, 1):
        roles = [t["role"] for t in _turns(out, row)]
        assert roles == ["assistant", "user", "assistant"]
        assert "final numeric answer" in out["response_text"][row]


def test_skyrl_gym_s_rewards_and_metrics_become_the_step_tuple():
    pytest.importorskip("skyrl_gym", reason="pip install 'rlhfflow[skyrl-gym]'")
    env = SkyRLGymEnv("gsm8k_multi_turn")
    record = {"prompt": "what is 6 times 7?", "reward_spec": {"ground_truth": "42"},
              "extra_info": {"max_turns": 3}}
    assert env.reset(record) == []
    messages, reward, done, info = env.step("#### 41")
    assert messages[0]["role"] == "user" and not done and reward == pytest.approx(0.2 / 3)
    messages, reward, done, info = env.step("#### 42")
    assert (messages, reward, done, info) == ([], 1.0, True, {"steps": 2})


# --------------------------------------------------------------------------- per record


def test_one_run_mixes_environments_of_both_packages_by_a_record_field(chat_lm_dir):
    pytest.importorskip("gem", reason="pip install 'rlhfflow[gem]'")
    pytest.importorskip("skyrl_gym", reason="pip install 'rlhfflow[skyrl-gym]'")
    store = chat_store(chat_lm_dir)
    tok = store.get("actor").tokenizer
    (game,) = GemEnv.prompt_records(GUESS, seeds=[5])
    records = [{**game, "env": f"gem:{GUESS}"},
               {"env": "skyrl-gym:gsm8k_multi_turn", "reward_spec": {"ground_truth": "42"},
                "extra_info": {"max_turns": 2}}]
    batch = chat_batch(tok, [game["prompt"], "what is 6 times 7?"], samples=2)
    out = _rollout(store, batch, records, env=f"{ADAPTERS}:PackageEnv", max_turns=4,
                   max_new_tokens=6, max_tokens=120)
    assert out["turns"].tolist() == [1, 1, 2, 2]
    assert out["env_reward"].tolist() == pytest.approx([-0.1, -0.1, 0.0, 0.0])
    # on threads (GEM's seeding under the adapters' lock), the same episodes
    threaded = _rollout(store, batch, records, env=f"{ADAPTERS}:PackageEnv", max_turns=4,
                        max_new_tokens=6, max_tokens=120, env_workers=2)
    assert threaded["turns"].tolist() == out["turns"].tolist()
    assert threaded["env_reward"].tolist() == out["env_reward"].tolist()


def test_a_record_naming_an_unknown_environment_is_one_line():
    pytest.importorskip("skyrl_gym", reason="pip install 'rlhfflow[skyrl-gym]'")
    with pytest.raises(UnknownEnvironment) as info:
        SkyRLGymEnv().reset({"env_class": "gsm9k", "prompt": "x"})
    assert str(info.value) == (
        "SkyRLGymEnv, the record's field 'env_class': skyrl-gym has no environment 'gsm9k' "
        "(did you mean 'gsm8k'? 7 known: aime, gsm8k, gsm8k_multi_turn, text2sql, search, "
        "lcb, searchcode)")
    with pytest.raises(UnknownEnvironment, match="no field 'env' naming its environment"):
        PackageEnv().reset({"prompt": "x"})


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("params, key, message", [
    ({"env": f"{ADAPTERS}:SkyRLGymEnv", "env_kwargs": {"env_id": "gsm9k"}},
     "params.env_kwargs.env_id", "skyrl-gym has no environment 'gsm9k' (did you mean "
                                 "'gsm8k'?"),
    ({"env": f"{ADAPTERS}:SkyRLGymEnv", "env_kwargs": {"seed": 1}},
     "params.env_kwargs", "SkyRLGymEnv: got an unexpected keyword argument 'seed'"),
    ({"env": f"{ADAPTERS}:PackageEnv", "env_kwargs": {"env_id": "gym:CartPole-v1"}},
     "params.env_kwargs.env_id", "'gym:CartPole-v1' is not 'package:id' with a package of "
                                 "gem, skyrl-gym"),
    ({"env": f"{ADAPTERS}:PackageEnv", "env_kwargs": {"skyrl-gym": {"env_id": "gsm9k"}}},
     "params.env_kwargs.skyrl-gym.env_id", "skyrl-gym has no environment 'gsm9k'"),
])
def test_an_unknown_environment_id_is_one_line_naming_the_file_and_key(tmp_path, params,
                                                                       key, message):
    pytest.importorskip("skyrl_gym", reason="pip install 'rlhfflow[skyrl-gym]'")
    path = _pipeline(tmp_path, **params)
    with pytest.raises(SpecError) as info:
        load_pipeline(path)
    text = str(info.value)
    assert "\n" not in text and str(path) in text
    assert f"stages.rollout.{key}" in text and message in text, text


def test_a_package_that_is_not_installed_is_refused_by_validate_with_exit_2(tmp_path,
                                                                          monkeypatch):
    from click.testing import CliRunner

    from rlhfflow.cli.main import main

    monkeypatch.setattr(envpackages.GemEnv, "module", "gem_not_installed_here")
    path = _pipeline(tmp_path, env=f"{ADAPTERS}:GemEnv", env_kwargs={"env_id": GUESS})
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 2, result.output
    assert result.stderr == (
        f"Error: {path}: stages.rollout.params.env: GemEnv needs the package gem-llm, "
        "which is not installed: pip install 'rlhfflow[gem]'\n")
    # through PackageEnv, the id that needs it names it
    path = _pipeline(tmp_path, env=f"{ADAPTERS}:PackageEnv",
                     env_kwargs={"env_id": f"gem:{GUESS}"})
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 2 and "\n" not in result.stderr.rstrip("\n")
    assert "stages.rollout.params.env_kwargs.env_id: 'gem:game:GuessTheNumber-v0-easy' " \
           "needs the package gem-llm, which is not installed" in result.stderr


def test_validate_refuses_an_unknown_gem_environment_as_a_real_command(tmp_path):
    pytest.importorskip("gem", reason="pip install 'rlhfflow[gem]'")
    path = _pipeline(tmp_path, env=f"{ADAPTERS}:GemEnv",
                     env_kwargs={"env_id": "game:GuessTheNumber-v1"})
    done = subprocess.run([sys.executable, "-m", "rlhfflow.cli.main", "validate", str(path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), "RLHFFLOW_WARM": "0"})
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"Error: {path}: stages.rollout.params.env_kwargs.env_id: gem-llm "
                           "has no environment 'game:GuessTheNumber-v1' (did you mean "
                           "'game:GuessTheNumber-v0-"), line
