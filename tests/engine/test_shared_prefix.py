"""Distinct prompts that begin alike (a system prompt, the tools' schemas of agent work)
run their common prefix once, in prefills and in training forwards: the same log-probs,
gradients, values, caches and sampled tokens as one forward per row. Real tiny Llama and
GPT-2 models."""

from __future__ import annotations

import pytest
import torch

from rlhfflow.engine.forward import (
    MIN_SHARED_PREFIX,
    common_prefix,
    prefill,
    response_logits,
)
from rlhfflow.engine.models import build_char_tokenizer, build_tiny_model
from tests.engine.test_shared_prompts import _batch as shared_prompts_batch
from tests.engine.test_shared_prompts import (
    assert_logits_and_gradients_equal_one_forward_per_row,
    assert_prefill_equals_every_row,
    assert_sampling_equals_each_row_alone,
    assert_values_equal_one_forward_per_row,
)

# a system prompt longer than MIN_SHARED_PREFIX characters, then questions of three lengths
SYSTEM = "you have a tool. call it as the example shows, then answer with the number only. "
QUESTIONS = ["what is 12 * 34?", "what is 7 * 8?", "what is 123 * 456 then?"]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _batch(tok, rows: list[int]) -> dict:
    """Rows ``rows`` (indices into QUESTIONS, repeats allowed) of left-padded prompts
    ``SYSTEM + question``, padding in every row, and random right-padded responses."""
    return shared_prompts_batch(tok, rows, response_len=10,
                                texts=[SYSTEM + q for q in QUESTIONS], padding=2)


def _prefix_len(tok) -> int:
    """The real tokens the prompts of QUESTIONS share (BOS and SYSTEM's characters, and
    as much of the question as they have in common)."""
    encoded = [tok(SYSTEM + q)["input_ids"] for q in QUESTIONS]
    n = 0
    while all(len(e) > n and e[n] == encoded[0][n] for e in encoded):
        n += 1
    return n


def _forward_shapes(model, function, *args) -> list[tuple[int, int]]:
    """The ``[rows, tokens]`` of each forward ``function(*args)`` makes."""
    seen: list[tuple[int, int]] = []
    hook = model.get_input_embeddings().register_forward_hook(
        lambda _m, inputs, _out: seen.append(tuple(inputs[0].shape)))
    try:
        with torch.no_grad():
            function(*args)
    finally:
        hook.remove()
    return seen


def test_the_common_prefix_counts_real_tokens_and_leaves_each_prompt_one_of_its_own(tok):
    batch = _batch(tok, [0, 1, 2])
    prefix = _prefix_len(tok)
    assert prefix >= MIN_SHARED_PREFIX
    assert common_prefix(batch["prompt_ids"], batch["prompt_mask"]) == prefix
    one = _batch(tok, [2])
    assert common_prefix(one["prompt_ids"], one["prompt_mask"]) == 0
    # a prompt that is the others' prefix keeps its last token for its own forward
    ids = torch.tensor([[0, 5, 6, 7], [5, 6, 7, 8]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    assert common_prefix(ids, mask) == 2


def test_distinct_prompts_run_their_common_prefix_once(tok):
    model = build_tiny_model(tok, seed=3).eval()
    batch = _batch(tok, [0, 0, 1, 2, 2, 1])
    prefix = _prefix_len(tok)
    rest = int(batch["prompt_mask"].sum(-1).max()) - prefix
    seen = _forward_shapes(model, prefill, model, batch["prompt_ids"], batch["prompt_mask"],
                           "cpu")
    assert seen == [(1, prefix), (3, rest)]
    seen = _forward_shapes(model, response_logits, model, batch)
    assert seen[:2] == [(1, prefix), (3, rest)]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_prefix_shared_logits_and_gradients_equal_one_forward_per_row(tok, arch):
    assert_logits_and_gradients_equal_one_forward_per_row(
        build_tiny_model(tok, seed=3, arch=arch).eval(), _batch(tok, [0, 2, 1, 0, 2, 2, 1, 0]))


def test_a_value_head_on_a_shared_prefix_has_the_values_of_one_forward_per_row(tok):
    assert_values_equal_one_forward_per_row(build_tiny_model(tok, "value", seed=3).eval(),
                                            _batch(tok, [1, 0, 2, 1]))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_prefill_of_a_shared_prefix_equals_the_prefill_of_every_row(tok, arch):
    assert_prefill_equals_every_row(build_tiny_model(tok, seed=5, arch=arch).eval(),
                                    _batch(tok, [1, 0, 2, 2]))


def test_sampled_tokens_on_a_shared_prefix_equal_sampling_each_row_alone(tok):
    assert_sampling_equals_each_row_alone(build_tiny_model(tok, seed=7).eval(),
                                          _batch(tok, [0, 1, 2, 0, 2]), tok.pad_token_id)


def test_a_multi_turn_rollout_on_a_shared_prefix_plays_the_episodes_of_one_forward_per_row(
        chat_lm_dir, monkeypatch):
    """The rollout's prefill, its parked and re-joined rows and the environment's turns
    on a prefix run once: the same episodes, token for token, as with the prefix run in
    every row."""
    import rlhfflow.engine.forward as forward
    from rlhfflow.stages import StageContext, create_stage
    from tests.conftest import chat_batch, chat_store
    from tests.engine.test_episodes import EXAMPLE, GUESS

    store = chat_store(chat_lm_dir)
    tok = store.get("actor").tokenizer
    texts = [SYSTEM + "guess my number, 1 to 9:", SYSTEM + "which number?"]
    batch = chat_batch(tok, texts, samples=3)
    assert common_prefix(batch["prompt_ids"][[0, 3]],
                         batch["prompt_mask"][[0, 3]]) >= MIN_SHARED_PREFIX

    def rollout():
        stage = create_stage("rollout", model="actor", params={
            "env": GUESS, "max_turns": 3, "max_new_tokens": 6, "max_tokens": 60})
        return stage.run(batch, StageContext(iteration=0, seed=0, models=store,
                                             settings={"base_dir": str(EXAMPLE)}))

    shared = rollout()
    monkeypatch.setattr(forward, "MIN_SHARED_PREFIX", 10**9)
    every_row = rollout()
    assert int(shared["turns"].max()) > 1  # the environment answered: rows re-joined
    for key in ("response_ids", "response_mask", "turns"):
        assert torch.equal(shared[key], every_row[key]), key
    torch.testing.assert_close(shared["sample_logprobs"], every_row["sample_logprobs"],
                               atol=1e-5, rtol=1e-5)
