"""The OpenAI-compatible endpoint (rlhfflow.serve.endpoint) driven by the real ``openai``
client, on a real tiny Llama behind a real generation service."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
import torch

from rlhfflow.engine.models import load_model
from rlhfflow.engine.service import GenerationService
from rlhfflow.engine.toolformats import Hermes
from rlhfflow.serve.endpoint import Endpoint, EndpointSettings
from tests.conftest import REPO
from tests.stages.test_rollout import TEXTS, TOOL_CALL, tool_lm_dir  # noqa: F401 - a fixture

openai = pytest.importorskip("openai", reason="openai not installed (pip install "
                             "'rlhfflow[test]')")

ADD = {"type": "function", "function": {
    "name": "add", "description": "The sum of two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                    "b": {"type": "number"}},
                   "required": ["a", "b"]}}}


@pytest.fixture(scope="module")
def served(tool_lm_dir):  # noqa: F811 - the fixture imported above
    module, tokenizer = load_model(tool_lm_dir)
    from rlhfflow.engine.generation import eos_ids

    service = GenerationService(module, eos=eos_ids(module, tokenizer),
                                pad_id=tokenizer.pad_token_id, tokenizer=tokenizer,
                                max_in_flight=8)
    endpoint = Endpoint(service, tokenizer, EndpointSettings(model="tool-lm"), Hermes())
    with service, endpoint:
        yield endpoint, module, tokenizer


@torch.no_grad()
def _fresh(module, prompt: list[int], tokens: list[int], temperature: float = 1.0):
    ids = torch.tensor([prompt + tokens])
    logits = module(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_a_chat_completion_calls_the_tool_and_its_logprobs_are_a_fresh_forward_s(served):
    endpoint, module, tokenizer = served
    client = openai.OpenAI(base_url=endpoint.base_url, api_key="unused")
    assert [m.id for m in client.models.list()] == ["tool-lm"]
    response = client.chat.completions.create(
        model="tool-lm", messages=[{"role": "user", "content": TEXTS[0]}], tools=[ADD],
        temperature=0, max_tokens=60, logprobs=True, top_logprobs=2)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "add" and json.loads(call.function.arguments) == \
        {"a": 2, "b": 3}
    extra = choice.model_extra
    tokens, prompt = extra["token_ids"], response.model_extra["prompt_token_ids"]
    assert tokenizer.decode(tokens, skip_special_tokens=True) == TOOL_CALL
    assert extra["policy_versions"] == [0] * len(tokens)
    # the prompt is the chat template's rendering, the tokens what the model said
    assert prompt == tokenizer.apply_chat_template(
        [{"role": "user", "content": TEXTS[0]}], add_generation_prompt=True, tokenize=True,
        return_dict=False)
    got = torch.tensor([t.logprob for t in choice.logprobs.content])
    assert torch.allclose(got, _fresh(module, prompt, tokens), atol=1e-4)
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.logprob - 1e-6
               for t in choice.logprobs.content)
    assert response.usage.completion_tokens == len(tokens)
    # the assistant message sent back with its tool_calls is rendered as what the model
    # wrote: the next prompt begins with this prompt and the sampled tokens
    again = client.chat.completions.create(
        model="tool-lm", max_tokens=4, tools=[ADD], messages=[
            {"role": "user", "content": TEXTS[0]},
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "5"}])
    assert again.model_extra["prompt_token_ids"][:len(prompt) + len(tokens)] == \
        prompt + tokens


def test_the_tool_s_answer_goes_back_in_and_sampled_choices_are_exact(served):
    endpoint, module, tokenizer = served
    client = openai.OpenAI(base_url=endpoint.base_url, api_key="unused")
    messages = [{"role": "user", "content": TEXTS[0]},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_0", "type": "function",
                     "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
                {"role": "tool", "tool_call_id": "call_0", "content": "5"}]
    response = client.chat.completions.create(
        model="tool-lm", messages=messages, n=3, temperature=0.8, max_tokens=12,
        logprobs=True, seed=7)
    assert len(response.choices) == 3
    prompt = response.model_extra["prompt_token_ids"]
    # the test template shows a tool message as "tool: ..."
    assert tokenizer.decode(prompt).endswith("tool: 5<|im_end|><|im_start|>assistant: ")
    for choice in response.choices:
        tokens = choice.model_extra["token_ids"]
        got = torch.tensor([t.logprob for t in choice.logprobs.content])
        assert torch.allclose(got, _fresh(module, prompt, tokens, 0.8), atol=1e-4)
    again = client.chat.completions.create(
        model="tool-lm", messages=messages, n=3, temperature=0.8, max_tokens=12, seed=7)
    assert [c.model_extra["token_ids"] for c in again.choices] == \
        [c.model_extra["token_ids"] for c in response.choices]  # a seed fixes the draws


def test_completions_take_text_or_token_ids(served):
    endpoint, module, tokenizer = served
    client = openai.OpenAI(base_url=endpoint.base_url, api_key="unused")
    text = client.completions.create(model="tool-lm", prompt="which number?", max_tokens=5,
                                     temperature=0, logprobs=1)
    ids = text.model_extra["prompt_token_ids"]
    by_ids = client.completions.create(model="tool-lm", prompt=ids, max_tokens=5,
                                       temperature=0, logprobs=1)
    first, second = text.choices[0], by_ids.choices[0]
    assert first.text == second.text and first.model_extra["token_ids"] == \
        second.model_extra["token_ids"]
    assert first.finish_reason in ("length", "stop")
    assert torch.allclose(torch.tensor(first.logprobs.token_logprobs),
                          _fresh(module, ids, first.model_extra["token_ids"]), atol=1e-4)


def test_concurrent_agents_are_decoded_together(served):
    endpoint, _, _ = served
    client = openai.OpenAI(base_url=endpoint.base_url, api_key="unused")
    before = endpoint.service.stats.steps, endpoint.service.stats.rows_stepped

    def ask(i: int):
        return client.chat.completions.create(
            model="tool-lm", messages=[{"role": "user", "content": TEXTS[i % 3]}],
            max_tokens=40, seed=i)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(16)))
    assert all(a.choices[0].model_extra["token_ids"] for a in answers)
    steps = endpoint.service.stats.steps - before[0]
    rows = endpoint.service.stats.rows_stepped - before[1]
    assert rows / steps > 1.5  # decode steps served several agents at once


def test_bad_requests_get_openai_errors_and_the_server_goes_on(served):
    endpoint, _, _ = served
    client = openai.OpenAI(base_url=endpoint.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="serves 'tool-lm'"):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user",
                                                                   "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="'n' must be"):
        client.chat.completions.create(model="tool-lm", n=0,
                                       messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="'messages' must be"):
        client.chat.completions.create(model="tool-lm", messages=[])
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="tool-lm", temperature=-1,
                                       messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="stream"):
        client.chat.completions.create(model="tool-lm", stream=True,
                                       messages=[{"role": "user", "content": "x"}])
    request = urllib.request.Request(endpoint.base_url + "/chat/completions", b"{not json",
                                     {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(request)
    assert error.value.code == 400 and "not JSON" in error.value.read().decode()
    ok = client.chat.completions.create(model="tool-lm", max_tokens=3,
                                        messages=[{"role": "user", "content": "x"}])
    assert ok.choices[0].model_extra["token_ids"]


def test_a_key_is_required_off_loopback_and_checked_when_set(served):
    _, module, tokenizer = served
    with pytest.raises(ValueError, match="needs an API key"):
        EndpointSettings(host="0.0.0.0")
    service = GenerationService(module, eos=None, pad_id=tokenizer.pad_token_id)
    endpoint = Endpoint(service, tokenizer, EndpointSettings(model="m", api_key="s3cret"),
                        Hermes())
    with service, endpoint:
        wrong = openai.OpenAI(base_url=endpoint.base_url, api_key="guess", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        right = openai.OpenAI(base_url=endpoint.base_url, api_key="s3cret")
        assert [m.id for m in right.models.list()] == ["m"]


def test_rlhfflow_serve_serves_a_model_directory_until_interrupted(tool_lm_dir):  # noqa: F811
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen([sys.executable, "-m", "rlhfflow.cli.main", "serve",
                                str(tool_lm_dir), "--port", "0", "--name", "tiny"],
                               stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = None
        for line in process.stderr:
            if " at http://" in line:
                url = line.split(" at ", 1)[1].split()[0]
                break
        assert url is not None and url.startswith("http://127.0.0.1:")
        client = openai.OpenAI(base_url=url, api_key="unused")
        answer = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": TEXTS[0]}], temperature=0,
            max_tokens=60, tools=[ADD])
        assert answer.choices[0].message.tool_calls[0].function.name == "add"
    finally:
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    assert process.returncode == 0 and "served 1 requests" in err
    refused = subprocess.run([sys.executable, "-m", "rlhfflow.cli.main", "serve",
                              str(tool_lm_dir), "--host", "0.0.0.0"],
                             capture_output=True, text=True, env={**env,
                                                                  "RLHFFLOW_API_KEY": ""})
    assert refused.returncode == 2 and "needs an API key" in refused.stderr
    assert "Traceback" not in refused.stderr

