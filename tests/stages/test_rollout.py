"""The ``rollout`` stage: multi-turn episodes with an environment or tools, run alone from
Python with real tiny models (fixed seeds), and its checks through the loader."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from rlhfflow.config.loader import load_pipeline
from rlhfflow.config.spec import AlgorithmSpec, SpecError
from rlhfflow.data.records import prompt_token_ids
from rlhfflow.engine.environments import ToolEnvironment
from rlhfflow.engine.forward import response_logprobs
from rlhfflow.engine.models import (
    DEFAULT_ALPHABET,
    build_char_tokenizer,
    build_tiny_model,
    save_model,
)
from rlhfflow.engine.usercode import load_function
from rlhfflow.stages import StageContext, create_stage
from tests.conftest import CHAT_TEMPLATE, chat_batch, chat_store, make_prompt_batch

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "multiturn"
GUESS = str(EXAMPLE / "envs.py") + ":GuessNumber"
TEXTS = ["guess my number, 1 to 9:", "which number?", "guess a number from 1 to 9:"]


def _ctx(store, iteration=0, seed=0) -> StageContext:
    return StageContext(iteration=iteration, seed=seed, models=store,
                        settings={"base_dir": str(EXAMPLE)})


def _rollout(store, batch, **params):
    stage = create_stage("rollout", params=params, model="actor")
    return stage.run(batch, _ctx(store))


def _check_logprobs_match_a_fresh_forward(store, batch, out) -> None:
    """The sampler's log-probs of the model's tokens are those of one forward over the
    whole episode (the environment's tokens attended, not scored)."""
    episode = {**batch, **out}
    fresh = response_logprobs(store.get("actor").module, episode)
    assert (fresh[out["response_mask"] == 0] == 0).all()
    torch.testing.assert_close(fresh, out["sample_logprobs"], atol=1e-4, rtol=0)


# --------------------------------------------------------------------------- one turn


@pytest.mark.parametrize("compact", [True, False])
def test_one_turn_without_an_environment_gives_generate_s_samples(store, tokenizer, compact):
    batch = make_prompt_batch(tokenizer, TEXTS, samples=3)
    expected = create_stage("generate", params={"max_new_tokens": 10, "compact": compact},
                            model="actor").run(batch, _ctx(store))
    got = _rollout(store, batch, max_turns=1, max_new_tokens=10, max_tokens=10)
    assert torch.equal(got["response_ids"], expected["response_ids"])
    assert torch.equal(got["response_mask"], expected["response_mask"])
    torch.testing.assert_close(got["sample_logprobs"], expected["sample_logprobs"],
                               atol=1e-5, rtol=0)
    assert got["response_text"] == expected["response_text"]
    assert got["turns"].tolist() == [1] * 9
    assert got["env_reward"].tolist() == [0.0] * 9


# --------------------------------------------------------------------------- environments


def test_guessing_episodes_mask_the_environment_and_keep_the_sampler_s_logprobs(chat_lm_dir):
    store = chat_store(chat_lm_dir)
    tok = store.get("actor").tokenizer
    batch = chat_batch(tok, TEXTS, samples=2)
    out = _rollout(store, batch, env=GUESS, max_turns=3, max_new_tokens=6, max_tokens=120)

    mask = out["response_mask"]
    length = (out["response_ids"] != tok.pad_token_id).long().sum(-1)
    assert out["turns"].tolist() == [3] * 6  # a random model never says "3"
    # the environment's turns are in the response, rendered by the template as tool turns
    # (holes in the mask between the model's turns), and never masked in
    for row, text in enumerate(out["response_text"]):
        assert text.count("tool: ") == 2, text
        assert any(word in text for word in ("say a number", "higher", "lower"))
        env_ids = out["response_ids"][row, :length[row]][mask[row, :length[row]] == 0]
        assert "tool" in tok.decode(env_ids.tolist())
    assert ((mask[:, 1:] - mask[:, :-1]) == 1).any()  # a model turn after an env turn
    torch.testing.assert_close(out["env_reward"], torch.full((6,), -0.3))
    assert (out["sample_logprobs"][mask == 0] == 0).all()
    _check_logprobs_match_a_fresh_forward(store, batch, out)
    # the next turn starts with the template's assistant header after the tool's answer
    assert "<|im_start|>assistant: " in tok.decode(out["response_ids"][0].tolist())


def test_a_lora_actor_s_episodes_decode_from_its_merged_weights(chat_lm_dir):
    pytest.importorskip("peft", reason="pip install 'rlhfflow[lora]'")
    from rlhfflow.stages import ModelConfig, ModelStore

    lora = {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear"}
    store = ModelStore({"actor": ModelConfig("actor", "lm", str(chat_lm_dir), trainable=True,
                                             lora=lora)})
    module = store.get("actor").module
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    batch = chat_batch(store.get("actor").tokenizer, TEXTS, samples=2)
    grads = []  # every forward of the episodes decodes without gradients
    hook = module.get_base_model().register_forward_pre_hook(
        lambda *_: grads.append(torch.is_grad_enabled()))
    out = _rollout(store, batch, env=GUESS, max_turns=2, max_new_tokens=6, max_tokens=80)
    hook.remove()
    assert len(grads) > 6 and not any(grads)
    _check_logprobs_match_a_fresh_forward(store, batch, out)  # the adapters' own path
    merged = module.__dict__["_lean_merged"]
    assert merged  # made on entry; what follows shows the episodes' steps read it
    for entry in merged.values():
        entry.weight.mul_(0.5)
    halved = _rollout(store, batch, env=GUESS, max_turns=2, max_new_tokens=6, max_tokens=80)
    assert not torch.allclose(halved["sample_logprobs"], out["sample_logprobs"])


def _secrets_guessed_on_the_first_turn(store) -> tuple[dict, dict, list]:
    """A batch of 4 samples of one prompt for the guessing game, each row's secret the
    first number its model says in a first turn (none: 0, never guessed); that turn's
    output, and those matches (a row's ``re.Match`` or None)."""
    batch = chat_batch(store.get("actor").tokenizer, TEXTS[:1], samples=4)
    first = _rollout(store, batch, env=GUESS, max_turns=1, max_new_tokens=6, max_tokens=64)
    said = [re.search(r"\d+", t) for t in first["response_text"]]
    assert any(said), first["response_text"]
    batch["prompt_fields"] = [json.dumps({"secret": int(s.group()) if s else 0})
                              for s in said]
    return batch, first, said


def test_an_episode_ends_when_the_environment_says_done(chat_lm_dir):
    store = chat_store(chat_lm_dir)
    batch, first, said = _secrets_guessed_on_the_first_turn(store)
    rows = [r for r in range(4) if said[r]]
    out = _rollout(store, batch, env=GUESS, max_turns=3, max_new_tokens=6, max_tokens=64)
    for row in rows:
        assert out["turns"][row] == 1 and out["env_reward"][row] == 1.0
        assert torch.equal(out["response_ids"][row], first["response_ids"][row])


def test_episodes_stop_at_max_tokens(chat_lm_dir):
    store = chat_store(chat_lm_dir)
    tok = store.get("actor").tokenizer
    batch = chat_batch(tok, TEXTS, samples=1)
    out = _rollout(store, batch, env=GUESS, max_turns=8, max_new_tokens=6, max_tokens=20)
    assert out["response_ids"].shape == (3, 20)
    assert ((out["response_ids"] != tok.pad_token_id).sum(-1) <= 20).all()
    assert (out["turns"] < 8).all()
    _check_logprobs_match_a_fresh_forward(store, batch, out)


# --------------------------------------------------------------------------- the loop


class SlowGuess:
    """``GuessNumber`` whose step sleeps ``record["delay"]`` seconds: a slow environment."""

    def __init__(self) -> None:
        self.game = load_function("envs.py:GuessNumber", EXAMPLE)()
        self.delay = 0.0

    def reset(self, record: dict) -> list:
        self.delay = float(record.get("delay", 0.0))
        return self.game.reset(record)

    def step(self, text: str):
        time.sleep(self.delay)
        return self.game.step(text)


class AsyncGuess(SlowGuess):
    """The same game with an ``async`` step."""

    async def step(self, text: str):
        import asyncio

        await asyncio.sleep(self.delay)
        return self.game.step(text)


def test_the_kv_cache_kept_across_turns_gives_the_tokens_of_a_fresh_prefill_each_turn(
        chat_lm_dir):
    store = chat_store(chat_lm_dir)
    tok = store.get("actor").tokenizer
    batch = chat_batch(tok, TEXTS, samples=2)
    params = dict(env=GUESS, max_turns=4, max_new_tokens=5, max_tokens=120, env_workers=0)
    kept = _rollout(store, batch, **params)
    again = _rollout(store, batch, kv_cache=False, **params)
    assert kept["turns"].tolist() == [4] * 6
    for column in ("response_ids", "response_mask", "turns", "env_reward"):
        assert torch.equal(kept[column], again[column]), column
    torch.testing.assert_close(kept["sample_logprobs"], again["sample_logprobs"],
                               atol=1e-5, rtol=0)
    _check_logprobs_match_a_fresh_forward(store, batch, kept)


def test_a_slow_environment_step_overlaps_the_decoding_of_other_rows(chat_lm_dir):
    store = chat_store(chat_lm_dir)
    tok = store.get("actor").tokenizer
    batch = chat_batch(tok, TEXTS, samples=2)
    # the first row's environment takes a second per step; the others answer at once
    batch["prompt_fields"] = [json.dumps({"secret": 3, "delay": 1.0 if row == 0 else 0.0})
                              for row in range(6)]
    stage = create_stage("rollout", model="actor", params=dict(
        env="tests.stages.test_rollout:SlowGuess", max_turns=3, max_new_tokens=5, max_tokens=80,
        env_workers=8))
    ctx, spans = _ctx(store), []
    ctx.spans = lambda part, start, stop: spans.append((part, start, stop))
    out = stage.run(batch, ctx)
    timeline = stage.last_timeline
    assert out["turns"].tolist() == [3] * 6
    # while row 0's environment stepped, the other rows decoded, and rejoined without it
    during = [rows for rows, waiting in timeline.steps if 0 in waiting]
    assert len(during) >= 5 and all(rows <= 5 for rows in during)
    assert any(0 not in joined and len(joined) >= 1 for joined in timeline.joins[:2])
    slow = [(start, stop) for row, _, start, stop in timeline.env if row == 0]
    assert len(slow) == 3 and out["env_seconds"][0] >= 3.0 > out["env_seconds"][1:].max()
    # the task timeline gets the time some environment step ran: row 0's steps inside it
    assert spans and {part for part, _, _ in spans} == {"env"}
    assert all(any(a <= start and stop <= b for _, a, b in spans) for start, stop in slow)
    _check_logprobs_match_a_fresh_forward(store, batch, out)


def test_an_async_environment_step_is_awaited(chat_lm_dir):
    store = chat_store(chat_lm_dir)
    tok = store.get("actor").tokenizer
    batch = chat_batch(tok, TEXTS[:1], samples=2)
    params = dict(max_turns=2, max_new_tokens=5, max_tokens=60, env_workers=0)
    sync = _rollout(store, batch, env="tests.stages.test_rollout:SlowGuess", **params)
    out = _rollout(store, batch, env="tests.stages.test_rollout:AsyncGuess", **params)
    assert torch.equal(out["response_ids"], sync["response_ids"])
    assert out["turns"].tolist() == [2, 2]


def test_the_planner_charges_a_rollout_for_each_model_turn():
    from rlhfflow.plan.auto.costmodel import CostModel

    three = load_pipeline(EXAMPLE / "guess-tiny.yaml")
    one = load_pipeline(EXAMPLE / "guess-tiny.yaml", {"stages.rollout.params.max_turns": 1})
    assert three.graph.nodes["rollout"].turns == 3 and one.graph.nodes["rollout"].turns == 1
    assert CostModel(three).analytic("rollout", 16, 1) > CostModel(one).analytic(
        "rollout", 16, 1)


def test_the_task_timeline_draws_environment_time_under_its_task():
    from rlhfflow.monitor.report import gantt_plot

    tasks = [{"iteration": 0, "tasks": [[0, "rollout", 0, 10.0, 12.0, 16],
                                        [0, "rollout/env", 0, 10.5, 11.0, 0],
                                        [0, "train_actor", 0, 12.0, 13.0, 16]]}]
    assert gantt_plot(tasks, 0)


def test_info_keys_become_per_episode_columns_and_iteration_means(chat_lm_dir):
    from rlhfflow.runtime.telemetry import declared_figures
    from rlhfflow.runtime.worker.tasks import METRICS, partial_metrics
    from rlhfflow.stages.rollout import RolloutParams, RolloutStage

    store = chat_store(chat_lm_dir)
    # rows whose first number is the secret win on their first turn, the others never
    batch, _, said = _secrets_guessed_on_the_first_turn(store)
    out = _rollout(store, batch, env=GUESS, max_turns=3, max_new_tokens=6, max_tokens=64,
                   info=["won", "guess", "absent"])
    won = torch.tensor([1.0 if s else 0.0 for s in said])
    assert out["info_won"].dtype == torch.float32
    torch.testing.assert_close(out["info_won"], won)
    torch.testing.assert_close(out["info_absent"], torch.zeros(4))  # never in info: 0
    assert "info_calls" not in out
    # the rollout declares their means over the iteration's rows (Stage.iteration_metrics)
    declared = RolloutStage.iteration_metrics(RolloutParams(
        env=GUESS, max_turns=3, max_new_tokens=6, max_tokens=64,
        info=["won", "guess", "absent"]))
    sums = partial_metrics({**batch, **out}, declared)[METRICS]
    assert sums["info_won_mean"] == (float(won.sum()), 4.0, 1.0)
    assert sums["turns_mean"] == (float(out["turns"].sum()), 4.0, 1.0)
    assert sums["env_reward_mean"][0] == pytest.approx(float(out["env_reward"].sum()))
    assert declared_figures(declared, sums) == {
        "env_reward_mean": pytest.approx(float(out["env_reward"].mean())),
        "info_absent_mean": 0.0,
        "info_guess_mean": pytest.approx(float(out["info_guess"].mean())),
        "info_won_mean": float(won.mean()),
        "turns_mean": float(out["turns"].float().mean())}


def test_info_keys_must_name_columns(tmp_path):
    path = _pipeline(tmp_path, env="envs.py:GuessNumber", info=["won", "no-dash"])
    with pytest.raises(SpecError) as info:
        load_pipeline(path)
    assert "stages.rollout.params.info[1]" in str(info.value)
    assert "'no-dash'" in str(info.value) and "\n" not in str(info.value)


# --------------------------------------------------------------------------- tools


def _slow(seconds: float) -> str:
    time.sleep(seconds)
    return "late"


def _fails() -> str:
    raise KeyError("nope")


def test_tool_calls_and_their_mistakes_are_answered_in_the_tool_message():
    add = load_function("tools.py:add", EXAMPLE)
    calculate = load_function("tools.py:calculate", EXAMPLE)
    env = ToolEnvironment({"add": add, "calculate": calculate, "slow": _slow,
                           "fails": _fails}, timeout_s=0.2)
    assert env.reset({"prompt": "x"}) == []
    turn = ('first <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call> '
            'then <tool_call>{"name": "calculate", "arguments": {"expression": "(1+2)*4"}}'
            '</tool_call>')
    messages, reward, done, info = env.step(turn)
    assert [m["content"] for m in messages] == ["5", "12"]
    assert (reward, done, info["calls"]) == (0.0, False, 2)

    def answer(body: str) -> str:
        return env.step(f"<tool_call>{body}</tool_call>")[0][0]["content"]

    assert answer("{oops").startswith("error: the tool call is not JSON")
    assert answer('{"name": "mul", "arguments": {}}') == \
        "error: unknown tool 'mul' (known: add, calculate, fails, slow)"
    assert answer('{"name": "fails"}') == "error: KeyError: 'nope'"
    assert answer('{"name": "add", "arguments": [1, 2]}') == \
        "error: 'arguments' must be a JSON object"
    assert answer('{"name": "calculate", "arguments": {"expression": "__import__(1)"}}') \
        .startswith("error: ValueError: not arithmetic")
    started = time.perf_counter()
    assert answer('{"name": "slow", "arguments": {"seconds": 5}}') == \
        "error: tool 'slow' took more than 0.2 s"
    assert time.perf_counter() - started < 2
    assert env.step("<tool_call>{\"name\": \"add\"")[0][0]["content"] == \
        "error: a <tool_call> without </tool_call>"
    assert env.step("no call: the answer is 5") == ([], 0.0, True, {"calls": 0, "errors": 0})


TOOL_CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def teach(model, ids: torch.Tensor, start: int, margin: float = 3.0,
          max_steps: int = 600) -> None:
    """Train ``model`` on the one sequence ``ids`` (``[1, L]``) until greedy decoding
    from its first ``start`` tokens gives the rest: at every position the next token
    leads the others by ``margin`` logits, far more than two CPUs' float rounding moves
    them (a fixed number of steps reproduced the sequence on one vendor's CPU and not on
    another's). Asserts that it got there."""
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    target = ids[0, start:]
    for _ in range(max_steps):
        out = model(input_ids=ids, labels=ids)
        logits = out.logits[0, start - 1:-1].detach()
        right = logits.gather(-1, target[:, None])[:, 0]
        others = logits.scatter(-1, target[:, None], float("-inf")).amax(-1)
        lead = float((right - others).min())
        if lead >= margin:
            return
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    raise AssertionError(f"the model did not learn the sequence in {max_steps} steps "
                         f"(the next token leads by {lead:.2f} logits at worst)")


@pytest.fixture(scope="module")
def tool_lm_dir(tmp_path_factory) -> Path:
    """A tiny Llama taught to answer a chat prompt with ``TOOL_CALL`` (greedily, on any
    CPU: ``teach``): a real model that calls a tool, so an episode has tool turns."""
    tok = build_char_tokenizer(DEFAULT_ALPHABET + '{}"[]<>/_')
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHAT_TEMPLATE
    model = build_tiny_model(tok, "lm", seed=0, max_positions=256)  # an episode fits
    model.generation_config.eos_token_id = [tok.eos_token_id,
                                            tok.convert_tokens_to_ids("<|im_end|>")]
    prompt = tok.apply_chat_template([{"role": "user", "content": TEXTS[0]}],
                                     add_generation_prompt=True, tokenize=False)
    start = len(prompt_token_ids(tok, prompt, templated=True))
    teach(model, torch.tensor([prompt_token_ids(tok, prompt + TOOL_CALL, templated=True)]),
          start)
    path = tmp_path_factory.mktemp("models") / "tool-lm"
    save_model(model, tok, path)
    return path


def test_a_model_that_calls_a_tool_gets_its_answer_and_the_sampler_s_logprobs_hold(
        tool_lm_dir):
    store = chat_store(tool_lm_dir)
    tok = store.get("actor").tokenizer
    batch = chat_batch(tok, TEXTS[:1], samples=2)
    tools = [str(EXAMPLE / "tools.py") + ":add"]
    out = _rollout(store, batch, tools=tools, greedy=True, max_turns=2,
                   max_new_tokens=60, max_tokens=160)
    for row in range(2):
        text = tok.decode(out["response_ids"][row].tolist(), skip_special_tokens=True)
        assert text.startswith(TOOL_CALL + "tool: 5assistant: "), text
    assert out["turns"].tolist() == [2, 2]
    # the tool's answer is not the model's: out of the mask, log-prob 0
    first_turn = len(tok(TOOL_CALL, add_special_tokens=False)["input_ids"])
    assert out["response_mask"][:, :first_turn].all()
    assert (out["response_mask"][:, first_turn] == 0).all()
    _check_logprobs_match_a_fresh_forward(store, batch, out)


HANGING_TOOL = """import time


def add(a: float, b: float) -> float:
    \"\"\"The sum of two numbers, some day.

    Args:
        a: the first number
        b: the second number
    \"\"\"
    time.sleep(600)
    return a + b
"""


def test_stage_test_exits_after_printing_when_a_tool_hangs(tool_lm_dir, tmp_path):
    # the call past tool_timeout_s is abandoned; the command printed its episodes, then
    # waited for the abandoned call (600 s here) before it exited
    (tmp_path / "hang.py").write_text(HANGING_TOOL)
    (tmp_path / "prompts.jsonl").write_text(
        json.dumps({"messages": [{"role": "user", "content": TEXTS[0]}]}) + "\n")
    pipeline = {
        "name": "hanging-tool", "iterations": 1,
        "data": {"prompts": "prompts.jsonl", "batch_size": 1, "samples_per_prompt": 2,
                 "max_prompt_tokens": 48},
        "models": {"actor": {"path": str(tool_lm_dir), "trainable": True}},
        "algorithm": {"name": "grpo", "kl_coef": 0.0},
        "stages": {"rollout": {"type": "rollout", "model": "actor", "params": {
            "tools": ["hang.py:add"], "tool_timeout_s": 1, "greedy": True, "max_turns": 2,
            "max_new_tokens": 60, "max_tokens": 160, "scores": True}},
            "advantages": {"type": "advantages", "after": ["rollout"]},
            "train_actor": {"type": "train_actor", "model": "actor",
                            "after": ["advantages"]}}}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(pipeline, sort_keys=False))
    done = subprocess.run([sys.executable, "-m", "rlhfflow.cli.main", "stage", "test",
                           str(path), "rollout"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), "RLHFFLOW_WARM": "0"})
    assert done.returncode == 0, done.stderr
    assert "tool: error: tool 'add' took more than 1 s" in done.stdout, done.stdout


# --------------------------------------------------------------------------- training


def test_the_policy_loss_takes_nothing_from_the_environment_s_tokens(chat_lm_dir):
    store = chat_store(chat_lm_dir)
    resident = store.get("actor")
    tok = resident.tokenizer
    batch = chat_batch(tok, TEXTS, samples=2)
    batch.update(_rollout(store, batch, env=GUESS, max_turns=3, max_new_tokens=6,
                          max_tokens=48))
    gen = torch.Generator().manual_seed(0)
    env = batch["response_mask"] == 0
    batch["advantages"] = torch.randn(batch["response_mask"].shape, generator=gen)
    stage = create_stage("train_actor", algorithm=AlgorithmSpec(name="grpo", kl_coef=0.0),
                         model="actor")

    def loss_and_grads(columns):
        resident.module.zero_grad()
        loss, _ = stage.loss(resident, columns, _ctx(store))
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in resident.module.parameters()]

    loss, grads = loss_and_grads(batch)
    # whatever the per-token columns hold on the environment's tokens, and whatever
    # follows the model's last token, the loss and its gradient are the same
    altered = dict(batch)
    altered["advantages"] = batch["advantages"].masked_fill(env, 1e3)
    altered["sample_logprobs"] = batch["sample_logprobs"].masked_fill(env, -50.0)
    ids = batch["response_ids"].clone()
    last = (batch["response_mask"].long() * torch.arange(1, ids.shape[1] + 1)).argmax(-1)
    after = torch.arange(ids.shape[1])[None, :] > last[:, None]
    altered["response_ids"] = ids.masked_fill(after, 5)
    assert after.any()
    loss2, grads2 = loss_and_grads(altered)
    torch.testing.assert_close(loss2, loss)
    for g, g2 in zip(grads, grads2, strict=True):
        torch.testing.assert_close(g2, g)
    # and the gradient reaches no environment token's log-prob
    from rlhfflow import ops

    logprobs = response_logprobs(resident.module, batch).detach().requires_grad_()
    policy_loss, _ = ops.call(ops.resolve_policy_loss("ppo"), {
        "logprobs": logprobs, "old_logprobs": batch["sample_logprobs"],
        "advantages": batch["advantages"], "mask": batch["response_mask"].float(),
        "agg": "token-mean", "count": None, "config": AlgorithmSpec(name="grpo")})
    policy_loss.backward()
    assert (logprobs.grad[env] == 0).all() and (logprobs.grad[~env] != 0).any()


# --------------------------------------------------------------------------- validation


def _pipeline(tmp_path, **params) -> Path:
    data = yaml.safe_load((EXAMPLE / "guess-tiny.yaml").read_text())
    data["data"]["prompts"] = str(EXAMPLE / "prompts.jsonl")
    data["stages"]["rollout"]["params"] = {"max_tokens": 32, **params}
    path = tmp_path / "dag.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    (tmp_path / "envs.py").write_text((EXAMPLE / "envs.py").read_text() + "\nVALUE = 3\n\n\ndef helper():\n    pass\n")
    (tmp_path / "bad.py").write_text("def broken(:\n")
    return path


def test_the_example_pipeline_loads_and_its_stage_runs_alone(tmp_path):
    from rlhfflow.runtime.stagetest import run_stage_alone

    pipeline = load_pipeline(EXAMPLE / "guess-tiny.yaml")
    result = run_stage_alone(pipeline, "rollout", 0, tmp_path)
    out = result.columns
    assert out["response_ids"].shape == (16, 32)
    torch.testing.assert_close(out["scores"], out["env_reward"])


@pytest.mark.parametrize("params, key, message", [
    ({"env": "missing.py:Env"}, "params.env", "file not found"),
    ({"env": "bad.py:X"}, "params.env", "cannot import 'bad.py:X': SyntaxError"),
    ({"env": "envs.py:helper"}, "params.env", "not a class with reset(record) and step"),
    ({"env": "envs.py:Nothing"}, "params.env", "has no callable 'Nothing'"),
    ({"tools": ["envs.py:GuessNumber", "envs.py:VALUE"]}, r"params.tools\[1\]",
     "has no callable 'VALUE'"),
    ({"env": "envs.py:GuessNumber", "tools": ["envs.py:GuessNumber"]}, "params.tools",
     "either params.env or params.tools"),
])
def test_a_bad_environment_or_tool_is_one_line_naming_the_file_and_key(tmp_path, params, key,
                                                                     message):
    path = _pipeline(tmp_path, **params)
    with pytest.raises(SpecError) as info:
        load_pipeline(path)
    text = str(info.value)
    assert "\n" not in text and str(path) in text
    assert f"stages.rollout.{key.replace(chr(92), '')}" in text and message in text, text


@pytest.mark.slow
def test_the_example_pipeline_trains_on_episodes(tmp_path):
    from rlhfflow.runtime.run import run_pipeline

    data = yaml.safe_load((EXAMPLE / "guess-tiny.yaml").read_text())
    data.update(iterations=2, output=str(tmp_path / "out"))
    data["data"]["prompts"] = str(EXAMPLE / "prompts.jsonl")
    data["stages"]["rollout"]["params"]["env"] = GUESS
    path = tmp_path / "guess.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    result = run_pipeline(load_pipeline(path), progress=False, inline=True)
    assert len(result.metrics) == 2
    last = result.metrics[-1]
    assert last["samples"] == 16 and last["samples_skipped"] == 0
    assert math.isfinite(last["policy_loss"]) and -0.3 <= last["reward_mean"] <= 1
    # the environment's steps are in the task timeline, beside the rollout task
    tasks = [t for line in (tmp_path / "out" / "tasks.jsonl").read_text().splitlines()
             for t in json.loads(line)["tasks"]]
    env = [t for t in tasks if t[1] == "rollout/env"]
    rollouts = [t for t in tasks if t[1] == "rollout"]
    assert env and all(any(r[3] <= e[3] and e[4] <= r[4] for r in rollouts) for e in env)
    assert all("rollout/env" not in r["stage_s"] for r in result.metrics)
