"""Agents (rlhfflow.serve.agents): a rollout whose episodes are played by a user's function
through the real ``openai`` client against the run's endpoint, on real tiny Llamas."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from rlhfflow.config.spec import SpecError
from rlhfflow.errors import RunError
from rlhfflow.stages import create_stage
from tests.conftest import REPO, chat_batch, chat_store
from tests.stages.test_rollout import (  # noqa: F401 - tool_lm_dir is a fixture
    TEXTS,
    TOOL_CALL,
    _check_logprobs_match_a_fresh_forward,
    _ctx,
    tool_lm_dir,
)

pytest.importorskip("openai", reason="openai not installed (pip install 'rlhfflow[test]')")

AGENTS = '''
import asyncio
import json

ADD = {"type": "function", "function": {
    "name": "add", "description": "The sum of two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                    "b": {"type": "number"}}}}}


async def once(client, record):
    """One call with the record's messages: what a one-turn rollout samples."""
    answer = await client.chat.completions.create(model="policy",
                                                  messages=record["messages"])
    return float(len(answer.choices[0].message.content or ""))


async def twice(client, record):
    """Two calls, the second's history the first's plus a user's reply."""
    messages = list(record["messages"])
    first = await client.chat.completions.create(model="policy", messages=messages,
                                                 max_tokens=6)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "again"}]
    await client.chat.completions.create(model="policy", messages=messages, temperature=0.1)
    return {"reward": 1.0, "info": {"asked": 2, "ignored": "text"}}


async def where(client, record):
    """Once, and which process it ran in."""
    import os

    await client.chat.completions.create(model="policy", messages=record["messages"])
    return {"reward": 1.0, "info": {"pid": os.getpid()}}


def plain(client, record):
    """A plain function with the blocking client."""
    client.chat.completions.create(model="policy", messages=record["messages"])
    return 0.5


async def tools(client, record):
    """A tool-calling agent: the model's call runs here, its answer goes back."""
    messages = list(record["messages"])
    answer = await client.chat.completions.create(model="policy", messages=messages,
                                                  tools=[ADD])
    message = answer.choices[0].message
    if not message.tool_calls:
        return 0.0
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        args = json.loads(call.function.arguments)
        messages.append({"role": "tool", "tool_call_id": call.id,
                         "content": str(args["a"] + args["b"])})
    await client.chat.completions.create(model="policy", messages=messages, tools=[ADD])
    return 1.0


async def rewrites(client, record):
    """Two calls, the second's history edited: not what the model said."""
    messages = list(record["messages"])
    await client.chat.completions.create(model="policy", messages=messages)
    messages += [{"role": "assistant", "content": "(edited)"},
                 {"role": "user", "content": "again"}]
    await client.chat.completions.create(model="policy", messages=messages)
    return 1.0


async def rewrites_or_not(client, record):
    """The record's ``calls`` decides: 1, one call; 2, a second call whose history is
    rewritten (a sample of its own with agent_samples). The reward varies with the first
    answer's length, so the samples of a prompt differ."""
    messages = list(record["messages"])
    first = await client.chat.completions.create(model="policy", messages=messages,
                                                 max_tokens=4)
    if record["calls"] == 2:
        messages += [{"role": "assistant", "content": "edited"},
                     {"role": "user", "content": "again"}]
        await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    return float(len(first.choices[0].message.content or "") % 3)


async def raises(client, record):
    await client.chat.completions.create(model="policy", messages=record["messages"])
    raise KeyError("answer")


async def sleeps(client, record):
    await asyncio.sleep(60)


async def silent(client, record):
    return 1.0


async def not_a_number(client, record):
    await client.chat.completions.create(model="policy", messages=record["messages"])
    return "good"


async def own_system_prompt(client, record):
    messages = [{"role": "system", "content": "be brief"}, *record["messages"]]
    await client.chat.completions.create(model="policy", messages=messages)
    return 1.0


def wrong(client):
    return 0.0


LEFT = {}


async def reach(client, record):
    """Tries to reach further than its own episode: an earlier episode's session, and its
    own without the task's key."""
    import openai

    await client.chat.completions.create(model="policy", messages=record["messages"],
                                         max_tokens=2)
    refused = {}
    for name, url, key in [("stale", LEFT.get("url"), client.api_key),
                           ("keyless", str(client.base_url), "guess")]:
        if url is None:
            continue
        other = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
        try:
            await other.chat.completions.create(model="policy", max_tokens=2,
                                                messages=record["messages"])
            refused[name] = 0.0
        except (openai.NotFoundError, openai.AuthenticationError):
            refused[name] = 1.0
        finally:
            await other.close()
    LEFT["url"] = str(client.base_url)
    return {"reward": 1.0, "info": refused}


async def guess(client, record):
    """The rollout's rules with examples/multiturn/envs.py's game, as an agent."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("envs", record["envs"])
    envs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(envs)
    env = envs.GuessNumber()
    env.reset(record)
    messages = list(record["messages"])
    for turn in range(3):
        answer = await client.chat.completions.create(model="policy", messages=messages)
        text = answer.choices[0].message.content
        messages.append({"role": "assistant", "content": text})
        said, _, done, _ = env.step(text)
        if done or turn == 2:
            break
        messages += [{"role": "tool", "content": m["content"]} for m in said]
    return 0.0
'''


@pytest.fixture(scope="module")
def agents_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("agents") / "agents.py"
    path.write_text(textwrap.dedent(AGENTS))
    return path


def _batch(tok, texts, samples=2):
    batch = chat_batch(tok, texts, samples)
    batch["prompt_fields"] = [json.dumps({"messages": [{"role": "user", "content": t}]})
                              for t in texts for _ in range(samples)]
    return batch


def _agent_rollout(store, batch, agent, **params):
    stage = create_stage("rollout", params={"agent": agent, **params}, model="actor")
    return stage.run(batch, _ctx(store))


def test_a_one_call_agent_samples_what_a_one_turn_rollout_samples(chat_lm_dir, agents_file):
    store = chat_store(chat_lm_dir)
    tok = store.get("actor").tokenizer
    batch = _batch(tok, TEXTS)
    params = {"max_turns": 1, "max_new_tokens": 10, "max_tokens": 10}
    expected = create_stage("rollout", params=params, model="actor").run(batch, _ctx(store))
    got = _agent_rollout(store, batch, f"{agents_file}:once", **params)
    # the same draws (each episode's stream is its row's), the same prompt: the same tokens
    assert torch.equal(got["response_ids"], expected["response_ids"])
    assert torch.equal(got["response_mask"], expected["response_mask"])
    torch.testing.assert_close(got["sample_logprobs"], expected["sample_logprobs"],
                               atol=1e-4, rtol=0)
    assert got["agent_calls"].tolist() == [1] * 6 and got["agent_failed"].sum() == 0
    lengths = [len(tok.decode(got["response_ids"][r][got["response_mask"][r].bool()],
                              skip_special_tokens=True)) for r in range(6)]
    assert got["env_reward"].tolist() == [float(n) for n in lengths]


def test_a_two_call_agent_is_one_sample_with_the_user_turn_masked(chat_lm_dir, agents_file):
    store = chat_store(chat_lm_dir)
    tok = store.get("actor").tokenizer
    batch = _batch(tok, TEXTS[:2])
    out = _agent_rollout(store, batch, f"{agents_file}:twice", max_new_tokens=8,
                         max_tokens=60, info=["asked"])
    assert out["agent_calls"].tolist() == [2] * 4
    assert out["env_reward"].tolist() == [1.0] * 4 and out["info_asked"].tolist() == [2.0] * 4
    # a random model's first answer may end with <eos> or hold <unk>, which the template
    # re-renders as <|im_end|> or drops: then the second call does not extend the first
    # at token level, and it is left out and counted
    extended = out["turns"] == 2
    assert (out["turns"] + out["agent_untrained_calls"]).tolist() == [2] * 4
    assert extended.sum() >= 2
    for row in extended.nonzero().squeeze(-1).tolist():
        turns = json.loads(out["turns_json"][row])
        assert [t["role"] for t in turns] == ["assistant", "env", "assistant"]
        assert "user: again" in turns[1]["text"]
        # the first turn was capped at the agent's max_tokens, the second at the stage's
        first, second = (t["span"][1] - t["span"][0] for t in turns[::2])
        assert first <= 6 and second <= 8
    _check_logprobs_match_a_fresh_forward(store, batch, out)


@pytest.mark.parametrize("agent", ["where", "plain"])
def test_agents_on_the_pool_run_in_another_process_and_play_the_same_episodes(
        chat_lm_dir, agents_file, agent):
    """``env_placement: pool``: each episode's agent runs in a pool process (a process pool
    started with spawn stands in for the run's Dask pool: the stage sees an Executor),
    calling the endpoint of the task's worker on loopback."""
    import concurrent.futures
    import multiprocessing
    import os

    store = chat_store(chat_lm_dir)
    tok = store.get("actor").tokenizer
    batch = _batch(tok, TEXTS)
    params = {"max_turns": 1, "max_new_tokens": 8, "max_tokens": 8, "info": ["pid"]}
    here = _agent_rollout(store, batch, f"{agents_file}:{agent}", **params)
    stage = create_stage("rollout", params={"agent": f"{agents_file}:{agent}",
                                            "env_placement": "pool", **params},
                         model="actor")
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=spawn) as pool:
        ctx = _ctx(store)
        ctx.env_executor = pool
        shipped = stage.run(batch, ctx)
    assert shipped["agent_failed"].sum() == 0 and shipped["agent_calls"].tolist() == [1] * 6
    assert torch.equal(shipped["response_ids"], here["response_ids"])
    assert torch.equal(shipped["response_mask"], here["response_mask"])
    if agent == "where":
        assert os.getpid() not in shipped["info_pid"].tolist()
        assert set(here["info_pid"].tolist()) == {os.getpid()}


def test_a_plain_function_agent_runs_on_a_thread(chat_lm_dir, agents_file):
    store = chat_store(chat_lm_dir)
    tok = store.get("actor").tokenizer
    out = _agent_rollout(store, _batch(tok, TEXTS[:1]), f"{agents_file}:plain",
                         max_new_tokens=4, max_tokens=8)
    assert out["env_reward"].tolist() == [0.5, 0.5] and out["agent_failed"].sum() == 0


def test_a_tool_calling_agent_is_one_sample_its_call_as_the_model_wrote_it(
        tool_lm_dir, agents_file):  # noqa: F811 - the fixture imported above
    store = chat_store(tool_lm_dir)
    tok = store.get("actor").tokenizer
    batch = _batch(tok, TEXTS[:1])
    out = _agent_rollout(store, batch, f"{agents_file}:tools", greedy=True,
                         max_new_tokens=60, max_tokens=100)
    assert out["env_reward"].tolist() == [1.0, 1.0]
    # the assistant message came back with the call in tool_calls (OpenAI's form); the
    # endpoint rendered it as the text the model wrote, so the second call extends the
    # first at token level and the episode is one sample with both turns trained
    assert out["agent_calls"].tolist() == [2, 2] and out["turns"].tolist() == [2, 2]
    assert out["agent_untrained_calls"].tolist() == [0, 0]
    for row in range(2):
        turns = json.loads(out["turns_json"][row])
        assert [t["role"] for t in turns] == ["assistant", "env", "assistant"]
        assert turns[0]["text"] == TOOL_CALL and "tool: 5" in turns[1]["text"]
    _check_logprobs_match_a_fresh_forward(store, batch, out)


def test_a_call_whose_history_was_rewritten_is_left_out_and_counted(chat_lm_dir,
                                                                     agents_file):
    store = chat_store(chat_lm_dir)
    tok = store.get("actor").tokenizer
    batch = _batch(tok, TEXTS[:1])
    out = _agent_rollout(store, batch, f"{agents_file}:rewrites", max_new_tokens=6,
                         max_tokens=40)
    assert out["agent_calls"].tolist() == [2, 2] and out["turns"].tolist() == [1, 1]
    assert out["agent_untrained_calls"].tolist() == [1, 1]
    assert out["env_reward"].tolist() == [1.0, 1.0]  # the first call trains, rewarded
    _check_logprobs_match_a_fresh_forward(store, batch, out)


def test_with_agent_samples_a_call_that_rewrites_history_is_a_sample_of_its_own(
        chat_lm_dir, agents_file):
    store = chat_store(chat_lm_dir)
    tok = store.get("actor").tokenizer
    batch = _batch(tok, TEXTS[:2], samples=4)  # two episodes of two samples per prompt
    params = {"max_new_tokens": 6, "max_tokens": 40, "scores": True}
    out = _agent_rollout(store, batch, f"{agents_file}:rewrites", agent_samples=2, **params)
    # each episode: its first call in its first row, the second (history edited) in the
    # next, with the episode's reward; nothing left out
    assert out["turns"].tolist() == [1] * 8 and out["agent_calls"].tolist() == [2] * 8
    assert out["agent_untrained_calls"].tolist() == [0] * 8
    assert out["env_reward"].tolist() == [1.0] * 8 and out["score_valid"].tolist() == [1] * 8
    second = json.loads(out["turns_json"][1])
    assert [t["role"] for t in second] == ["env", "assistant"]
    assert "edited" in second[0]["text"] and "again" in second[0]["text"]  # context, masked
    _check_logprobs_match_a_fresh_forward(store, batch, out)
    # the episode's first sample is what one sample per episode trains in that row
    one = _agent_rollout(store, batch, f"{agents_file}:rewrites", **params)
    assert one["agent_untrained_calls"].tolist() == [1] * 8
    for row in (0, 2, 4, 6):
        assert torch.equal(out["response_ids"][row], one["response_ids"][row])
    # an episode of one call leaves its second sample empty: skipped, no token trained
    once = _agent_rollout(store, batch, f"{agents_file}:once", agent_samples=2, **params)
    assert once["score_valid"].tolist() == [1, 0] * 4
    assert once["response_mask"][1::2].sum() == 0 and once["turns"][1::2].sum() == 0
    # an episode's rows split over two tasks is refused in one line
    half = {k: v[:3] if hasattr(v, "shape") or isinstance(v, list) else v
            for k, v in batch.items()}
    with pytest.raises(RunError, match="params.agent_samples: 2: the rows of an agent's "
                                       "episode .* are not all in this task"):
        _agent_rollout(store, half, f"{agents_file}:once", agent_samples=2, **params)


@pytest.mark.parametrize("agent, kind", [("raises", "KeyError"), ("sleeps", "ran past"),
                                         ("silent", "no call"), ("not_a_number", "'good'"),
                                         ("own_system_prompt", "does not begin")])
def test_an_agent_that_fails_trains_nothing_and_is_counted(chat_lm_dir, agents_file,
                                                           caplog, agent, kind):
    store = chat_store(chat_lm_dir)
    tok = store.get("actor").tokenizer
    out = _agent_rollout(store, _batch(tok, TEXTS[:1]), f"{agents_file}:{agent}",
                         max_new_tokens=4, max_tokens=8, agent_timeout_s=1.0)
    assert out["agent_failed"].tolist() == [1, 1]
    assert out["response_mask"].sum() == 0 and out["env_reward"].tolist() == [0.0, 0.0]
    assert "2 of 2 agents failed" in caplog.text and kind in caplog.text


def test_validation_names_a_bad_agent(agents_file):
    from rlhfflow.stages.rollout import RolloutStage

    def problem(**params):
        return RolloutStage.check_params(RolloutStage.Params(**params), True,
                                         str(agents_file.parent))

    assert problem(agent="agents.py:once") is None
    key, message = problem(agent="agents.py:wrong")
    assert key == "params.agent" and "must take (client, record)" in message
    key, message = problem(agent="agents.py:nope")
    assert key == "params.agent" and "nope" in message
    key, message = problem(agent="agents.py:once", tools=["agents.py:plain"])
    assert key == "params.agent" and "alone" in message
    key, message = problem(agent="agents.py:once", agent_samples=2)
    assert key == "params.agent_samples" and "scores: true" in message
    assert problem(agent="agents.py:once", agent_samples=2, scores=True) is None
    assert SpecError  # the loader turns the pair into one line naming the file


def test_agent_samples_must_divide_the_samples_per_prompt(agents_file, tmp_path):
    import yaml

    from rlhfflow.config.loader import load_pipeline

    spec = yaml.safe_load((REPO / "examples/multiturn/guess-tiny.yaml").read_text())
    spec["data"]["prompts"] = str(REPO / "examples/multiturn/prompts.jsonl")
    spec["stages"]["rollout"]["params"] = {
        "agent": f"{agents_file}:once", "agent_samples": 2, "scores": True,
        "max_new_tokens": 4, "max_tokens": 32}
    path = tmp_path / "agents.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert load_pipeline(path).params["rollout"].agent_samples == 2  # 4 per prompt
    with pytest.raises(SpecError, match=r"stages.rollout.params.agent_samples: each agent "
                                        r"episode makes up to 2 samples of its prompt, and "
                                        r"data.samples_per_prompt \(3\) is not a multiple"):
        load_pipeline(path, {"data.samples_per_prompt": 3})


@pytest.mark.slow
def test_a_pipeline_trains_each_call_of_a_history_rewriting_agent(chat_lm_dir, agents_file,
                                                                  tmp_path):
    """examples/multiturn/guess-tiny.yaml's GRPO with an agent whose second call rewrites
    its history (for half the records), on the chat model, inline: every call a sample
    that trains, an episode's unused sample skipped, nothing failed or left out."""
    import yaml

    from rlhfflow.config.loader import load_pipeline
    from rlhfflow.runtime.run import run_pipeline
    from rlhfflow.storage import ExperienceBuffer

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": text}],
                                        "calls": 1 + i % 2}) + "\n"
                            for i, text in enumerate(TEXTS + ["say a number:"])))
    spec = yaml.safe_load((REPO / "examples/multiturn/guess-tiny.yaml").read_text())
    spec.update(iterations=2, output=str(tmp_path / "out"))
    spec["data"]["prompts"] = str(data)
    spec["models"]["actor"] = {"path": str(chat_lm_dir), "trainable": True,
                               "optimizer": {"lr": 3.0e-3}}
    spec["stages"]["rollout"]["params"] = {
        "agent": f"{agents_file}:rewrites_or_not", "agent_samples": 2, "scores": True,
        "max_new_tokens": 4, "max_tokens": 48}
    path = tmp_path / "agents.yaml"
    path.write_text(yaml.safe_dump(spec))
    result = run_pipeline(load_pipeline(path), progress=False, inline=True)
    buffer = ExperienceBuffer(tmp_path / "out" / "buffer.zarr", create=False)
    for record in result.metrics:
        assert record["agent_failed_frac"] == 0 and record["agent_untrained_calls"] == 0
        # 4 prompts x 2 episodes of 2 samples; the episodes of one call leave one empty
        assert record["samples"] == 16 and record["samples_skipped"] == 4
        rows = buffer.read(record["iteration"], ["turns", "agent_calls", "score_valid",
                                                 "response_mask", "advantages"])
        first, second = rows["turns"][0::2], rows["turns"][1::2]
        assert (first == 1).all()
        assert (second == (rows["agent_calls"][1::2] == 2)).all()
        assert (rows["score_valid"] == (rows["turns"] > 0)).all()
        assert (rows["response_mask"][rows["turns"] == 0] == 0).all()
        assert (rows["advantages"][rows["turns"] == 0] == 0).all()
    assert any((buffer.read(k, ["advantages"])["advantages"] != 0).any() for k in (0, 1))


def test_an_agent_that_plays_the_rollout_s_rules_gets_the_rollout_s_episodes(chat_lm_dir,
                                                                           agents_file):
    """Each episode draws its n-th token from the n-th uniform of its stream across its
    calls, as a rollout's row does across its turns: where the agent's calls extend each
    other at token level, its episodes are the rollout's, token for token."""
    store = chat_store(chat_lm_dir)
    tok = store.get("actor").tokenizer
    envs = str(REPO / "examples" / "multiturn" / "envs.py")
    # a random model's first turn ends on <eos> or holds <unk> in about half the rows (its
    # history then does not extend): 24 rows leave enough second turns to compare
    batch = _batch(tok, TEXTS, samples=8)
    batch["prompt_fields"] = [json.dumps({**json.loads(f), "secret": 3, "envs": envs})
                              for f in batch["prompt_fields"]]
    params = {"max_turns": 3, "max_new_tokens": 8, "max_tokens": 80}  # within 128 positions
    rollout = create_stage("rollout", params={"env": f"{envs}:GuessNumber", **params},
                           model="actor").run(batch, _ctx(store))
    agent = _agent_rollout(store, batch, f"{agents_file}:guess", **params)
    # where a call did not extend the one before (a random model's <eos> or <unk>, which
    # the template re-renders or drops), the agent's sample ends after the call before:
    # up to there it is the rollout's
    for row in range(agent["response_ids"].shape[0]):
        said = agent["response_mask"][row].nonzero().squeeze(-1)
        end = int(said[-1]) + 1
        assert torch.equal(agent["response_ids"][row, :end], rollout["response_ids"][row, :end])
        assert torch.equal(agent["response_mask"][row, :end],
                           rollout["response_mask"][row, :end])
        torch.testing.assert_close(agent["sample_logprobs"][row, :end],
                                   rollout["sample_logprobs"][row, :end], atol=1e-4, rtol=0)
    # later turns were compared: the n-th token of an episode drew the n-th uniform
    assert (agent["turns"] >= 2).sum() >= 2


def test_an_agent_cannot_use_an_earlier_episode_s_session_or_call_without_the_key(
        chat_lm_dir, agents_file):
    store = chat_store(chat_lm_dir)
    tok = store.get("actor").tokenizer
    out = _agent_rollout(store, _batch(tok, TEXTS[:2]), f"{agents_file}:reach",
                         max_new_tokens=4, max_tokens=8, agent_concurrency=1,
                         info=["stale", "keyless"])
    # one agent at a time: from the second on, each finds the session before its own
    assert out["info_stale"].tolist() == [0.0, 1.0, 1.0, 1.0]
    assert out["info_keyless"].tolist() == [1.0] * 4
    # the refused calls were not served: each episode made (and trained) its own call only
    assert out["agent_calls"].tolist() == [1] * 4 and out["agent_failed"].sum() == 0
