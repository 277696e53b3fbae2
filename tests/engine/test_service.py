"""The generation service (rlhfflow.engine.service): continuous batching on a real tiny
Llama, against the plain decode loop and a fresh forward over the recorded tokens."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest
import torch

from rlhfflow.engine.generation import Sampling, generate
from rlhfflow.engine.models import build_char_tokenizer, build_tiny_model
from rlhfflow.engine.service import (
    GenerationService,
    Request,
    SamplingSettings,
    ServiceClosed,
)


@pytest.fixture(scope="module")
def lm():
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=3, max_positions=256).eval()
    return model, tokenizer


def _prompts(tokenizer, n: int) -> list[list[int]]:
    words = ["hello there", "a", "the quick brown fox", "xyz", "count to ten", "b c d e f g"]
    return [tokenizer(words[i % len(words)] + " " * (i // len(words)),
                      add_special_tokens=False)["input_ids"] for i in range(n)]


def _uniforms(i: int, steps: int) -> torch.Tensor:
    return torch.rand(steps, generator=torch.Generator().manual_seed(100 + i),
                      dtype=torch.float64)


@torch.no_grad()
def _fresh_logprobs(model, prompt: list[int], tokens: list[int], temperature: float = 1.0
                    ) -> torch.Tensor:
    """Each token's log-prob from one forward over the whole sequence, no cache."""
    ids = torch.tensor([prompt + tokens])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_requests_batched_together_get_what_each_gets_alone_and_exact_logprobs(lm):
    model, tokenizer = lm
    prompts, steps = _prompts(tokenizer, 6), 12
    alone = []
    for i, prompt in enumerate(prompts):
        out = generate(model, torch.tensor([prompt]), torch.ones(1, len(prompt)),
                       _uniforms(i, steps)[None], Sampling(max_new_tokens=steps), None,
                       tokenizer.pad_token_id)
        alone.append(out["response_ids"][0].tolist())
    # two decode at a time: four requests join while others are mid-way
    with GenerationService(model, eos=None, pad_id=tokenizer.pad_token_id,
                           max_in_flight=2) as service:
        done = service.generate([Request(p, SamplingSettings(max_new_tokens=steps),
                                         uniforms=_uniforms(i, steps))
                                 for i, p in enumerate(prompts)])
        assert service.stats.joined == 6 and service.stats.finished == 6
    for i, completion in enumerate(done):
        assert completion.tokens == alone[i]
        assert completion.finish_reason == "length" and completion.versions == [0] * steps
        fresh = _fresh_logprobs(model, prompts[i], completion.tokens)
        assert torch.allclose(torch.tensor(completion.logprobs, dtype=torch.float32), fresh,
                              atol=1e-4)


def test_a_queued_request_joins_when_a_short_one_ends_not_after_the_long_one(lm):
    model, tokenizer = lm
    prompt = _prompts(tokenizer, 1)[0]
    with GenerationService(model, eos=None, pad_id=tokenizer.pad_token_id,
                           max_in_flight=2) as service:
        long = service.submit(Request(prompt, SamplingSettings(max_new_tokens=120)))
        shorts = [service.submit(Request(prompt, SamplingSettings(max_new_tokens=3)))
                  for _ in range(8)]
        long_done, short_done = long.result(), [f.result() for f in shorts]
        stats = service.stats
    # the eight short ones took their turns beside the long one, one after another
    assert all(s.finished < long_done.finished for s in short_done)
    assert all(len(s.tokens) == 3 for s in short_done) and len(long_done.tokens) == 120
    assert stats.joins >= 5  # joins happened while the long one decoded
    # the batch was full while short ones were queued: occupancy well above half
    assert stats.occupancy(2) > 0.5


def test_each_request_samples_with_its_own_settings_in_one_batch(lm):
    model, tokenizer = lm
    prompts = _prompts(tokenizer, 3)
    settings = [SamplingSettings(max_new_tokens=8, greedy=True),
                SamplingSettings(max_new_tokens=8, temperature=0.7, top_k=5),
                SamplingSettings(max_new_tokens=8, top_p=0.9)]
    requests = [Request(p, s, uniforms=_uniforms(i, 8))
                for i, (p, s) in enumerate(zip(prompts, settings, strict=True))]
    with GenerationService(model, eos=None, pad_id=tokenizer.pad_token_id) as service:
        together = service.generate(requests)
    for request, completion in zip(requests, together, strict=True):
        with GenerationService(model, eos=None, pad_id=tokenizer.pad_token_id) as service:
            assert service.generate([request])[0].tokens == completion.tokens
    greedy = together[0]
    fresh = _fresh_logprobs(model, prompts[0], greedy.tokens)
    ids = torch.tensor([prompts[0] + greedy.tokens])
    with torch.no_grad():
        argmax = model(input_ids=ids).logits[0, len(prompts[0]) - 1:-1].argmax(-1)
    assert greedy.tokens == argmax.tolist()
    assert torch.allclose(torch.tensor(greedy.logprobs, dtype=torch.float32), fresh, atol=1e-4)
    tempered = _fresh_logprobs(model, prompts[1], together[1].tokens, temperature=0.7)
    assert torch.allclose(torch.tensor(together[1].logprobs, dtype=torch.float32), tempered,
                          atol=1e-4)


def test_eos_and_stop_strings_end_a_request(lm):
    model, tokenizer = lm
    prompt = _prompts(tokenizer, 1)[0]
    with GenerationService(model, eos=None, pad_id=tokenizer.pad_token_id) as service:
        free = service.generate([Request(prompt, SamplingSettings(max_new_tokens=20),
                                         uniforms=_uniforms(0, 20))])[0]
    first = free.tokens[4]
    with GenerationService(model, eos=[first], pad_id=tokenizer.pad_token_id) as service:
        ended = service.generate([Request(prompt, SamplingSettings(max_new_tokens=20),
                                          uniforms=_uniforms(0, 20))])[0]
    cut = free.tokens.index(first) + 1
    assert ended.tokens == free.tokens[:cut] and ended.finish_reason == "stop"
    text = tokenizer.decode(free.tokens[:6], skip_special_tokens=True)
    stop = text[-2:] if text[-2:].strip() else text[-1:]
    with GenerationService(model, eos=None, pad_id=tokenizer.pad_token_id,
                           tokenizer=tokenizer) as service:
        stopped = service.generate([Request(prompt, SamplingSettings(max_new_tokens=20,
                                                                     stop=(stop,)),
                                            uniforms=_uniforms(0, 20))])[0]
    assert stopped.finish_reason == "stop" and len(stopped.tokens) <= 6
    assert stop in tokenizer.decode(stopped.tokens, skip_special_tokens=True)
    assert stopped.tokens == free.tokens[:len(stopped.tokens)]


def _wait_for_tokens(service: GenerationService, at_least: int) -> None:
    deadline = time.monotonic() + 60
    while service.stats.tokens < at_least:
        assert time.monotonic() < deadline, "the service sampled nothing"
        time.sleep(0.001)


@pytest.mark.parametrize("on_update", ["recompute", "keep"])
def test_weights_installed_mid_request_sample_its_later_tokens(lm, on_update):
    model, tokenizer = lm
    prompt = _prompts(tokenizer, 1)[0]
    old = {k: v.clone() for k, v in model.state_dict().items()}
    new_model = build_tiny_model(tokenizer, seed=4, max_positions=256).eval()
    new = {name: p.detach().clone() for name, p in new_model.named_parameters()}
    try:
        with GenerationService(model, eos=None, pad_id=tokenizer.pad_token_id,
                               on_update=on_update) as service:
            future = service.submit(Request(prompt, SamplingSettings(max_new_tokens=200),
                                            uniforms=_uniforms(0, 200)))
            _wait_for_tokens(service, 3)
            assert service.update_weights(new).result(timeout=60) == 1
            done = future.result(timeout=60)
            assert service.stats.updates == 1
    finally:
        model.load_state_dict(old)
    versions = done.versions
    switch = versions.index(1)
    assert 3 <= switch < 200 and versions == [0] * switch + [1] * (200 - switch)
    # the old policy's tokens are the old model's, exactly
    before = _fresh_logprobs(model, prompt, done.tokens)[:switch]
    assert torch.allclose(torch.tensor(done.logprobs[:switch], dtype=torch.float32), before,
                          atol=1e-4)
    after = _fresh_logprobs(new_model, prompt, done.tokens)[switch:]
    got = torch.tensor(done.logprobs[switch:], dtype=torch.float32)
    if on_update == "recompute":  # every later token is the new policy's, exactly
        assert torch.allclose(got, after, atol=1e-4)
    else:  # the kept cache holds the old policy's keys and values: close, not equal
        assert not torch.allclose(got, after, atol=1e-4)


def test_close_fails_what_is_waiting_and_a_failing_model_fails_its_requests(lm):
    model, tokenizer = lm
    prompt = _prompts(tokenizer, 1)[0]
    service = GenerationService(model, eos=None, pad_id=tokenizer.pad_token_id,
                                max_in_flight=1)
    futures = [service.submit(Request(prompt, SamplingSettings(max_new_tokens=200)))
               for _ in range(3)]
    service.close()
    assert all(f.done() for f in futures)
    assert any(isinstance(f.exception(), ServiceClosed) for f in futures)
    with pytest.raises(ServiceClosed):
        service.submit(Request(prompt))

    failing = build_tiny_model(tokenizer, seed=5).eval()

    def out_of_memory(module, args, kwargs):
        raise RuntimeError("out of memory (raised by the test's hook)")

    failing.register_forward_pre_hook(out_of_memory, with_kwargs=True)
    broken = GenerationService(failing, eos=None, pad_id=0)
    future = broken.submit(Request(prompt))
    with pytest.raises(ServiceClosed, match="out of memory"):
        future.result(timeout=60)
    with pytest.raises(ServiceClosed):
        broken.submit(Request(prompt))
    broken.close()


def test_bad_requests_are_refused_with_what_was_expected(lm):
    model, tokenizer = lm
    with GenerationService(model, eos=None, pad_id=tokenizer.pad_token_id) as service:
        with pytest.raises(ValueError, match="at least one prompt token"):
            service.submit(Request([]))
        with pytest.raises(ValueError, match="fewer than max_new_tokens"):
            service.submit(Request([1, 2], SamplingSettings(max_new_tokens=9),
                                   uniforms=torch.rand(3, dtype=torch.float64)))
        with pytest.raises(KeyError, match="does not have: nope"):
            service.update_weights({"nope": torch.zeros(1)})
    with pytest.raises(ValueError, match="temperature must be above 0"):
        SamplingSettings(temperature=0)
    with pytest.raises(ValueError, match="on_update must be one of"):
        GenerationService(model, eos=None, pad_id=0, on_update="drop")


def test_a_conversation_s_next_call_joins_on_the_kept_cache_with_the_same_values(lm):
    model, tokenizer = lm
    prompt = _prompts(tokenizer, 1)[0]
    reply = tokenizer(" and then?", add_special_tokens=False)["input_ids"]

    def conversation(key):
        with GenerationService(model, eos=None, pad_id=tokenizer.pad_token_id) as service:
            first = service.generate([Request(prompt, SamplingSettings(max_new_tokens=8),
                                              uniforms=_uniforms(0, 8), cache_key=key)])[0]
            second_prompt = prompt + first.tokens + reply
            second = service.generate([Request(second_prompt,
                                               SamplingSettings(max_new_tokens=8),
                                               uniforms=_uniforms(1, 8), cache_key=key)])[0]
            return first, second, second_prompt, service.stats.reused

    first, second, second_prompt, reused = conversation("episode-1")
    _, again, _, none_reused = conversation(None)
    # the second call fed only the last sampled token and the reply on the first's cache
    assert reused == len(prompt) + len(first.tokens) - 1 and none_reused == 0
    assert second.tokens == again.tokens
    fresh = _fresh_logprobs(model, second_prompt, second.tokens)
    assert torch.allclose(torch.tensor(second.logprobs, dtype=torch.float32), fresh,
                          atol=1e-4)


def test_a_kept_cache_is_dropped_by_forget_an_update_or_a_prompt_that_does_not_extend(lm):
    model, tokenizer = lm
    prompt = _prompts(tokenizer, 1)[0]
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    with GenerationService(model, eos=None, pad_id=tokenizer.pad_token_id) as service:
        def call(p, key="k"):
            return service.generate([Request(p, SamplingSettings(max_new_tokens=4),
                                             cache_key=key)])[0]

        first = call(prompt)
        call(prompt[:-1] + [prompt[-1] + 1] + first.tokens)  # another history: no reuse
        assert service.stats.reused == 0
        first = call(prompt)
        service.forget("k")
        call(prompt + first.tokens)
        assert service.stats.reused == 0
        first = call(prompt)
        assert service.update_weights(weights).result(timeout=60) == 1  # the same values
        call(prompt + first.tokens)
        assert service.stats.reused == 0  # a cache of the weights before the update
        first = call(prompt)
        call(prompt + first.tokens)
        assert service.stats.reused > 0


def test_requests_arriving_together_are_prefilled_together(lm):
    model, tokenizer = lm
    prompts = _prompts(tokenizer, 12)
    with GenerationService(model, eos=None, pad_id=tokenizer.pad_token_id,
                           max_in_flight=12) as service:
        service.generate([Request(p, SamplingSettings(max_new_tokens=4)) for p in prompts])
        assert service.stats.joins == 1 and service.stats.joined == 12


def test_a_driven_service_decodes_on_the_caller_s_thread_the_same_tokens(lm):
    model, tokenizer = lm
    prompts = _prompts(tokenizer, 4)
    requests = [Request(p, SamplingSettings(max_new_tokens=6), uniforms=_uniforms(i, 6))
                for i, p in enumerate(prompts)]
    with GenerationService(model, eos=None, pad_id=tokenizer.pad_token_id) as threaded:
        expected = [c.tokens for c in threaded.generate(requests)]
        with pytest.raises(RuntimeError, match="thread of its own"):
            threaded.drive(lambda: True)
    forwards = []
    hook = model.register_forward_pre_hook(
        lambda *_: forwards.append(threading.current_thread()))
    service = GenerationService(model, eos=None, pad_id=tokenizer.pad_token_id, thread=False)
    try:
        with service, concurrent.futures.ThreadPoolExecutor(1) as caller:
            # another thread asks, as the endpoint's do; this one decodes until it has all
            asked = caller.submit(lambda: [f.result() for f in map(service.submit, requests)])
            asked.add_done_callback(lambda _: service.wake())
            service.drive(asked.done)
            assert [c.tokens for c in asked.result()] == expected
    finally:
        hook.remove()
    assert forwards and set(forwards) == {threading.current_thread()}
