"""Rows that repeat a prompt share its forward (GRPO's samples of one prompt, a DPO pair):
the same log-probs, gradients and sampled tokens as one forward per row, with fewer tokens
through the model. Real tiny Llama and GPT-2 models."""

from __future__ import annotations

import itertools

import pytest
import torch

from rlhfflow import ops
from rlhfflow.engine.forward import (
    length_groups,
    position_ids,
    prefill,
    response_logits,
    response_logprobs,
    response_values,
    sequence_inputs,
    shared_prompt_rows,
)
from rlhfflow.engine.generation import generate
from rlhfflow.engine.models import build_char_tokenizer, build_tiny_model
from rlhfflow.stages.generate import GenerateParams

PROMPTS = ["speak of the star:", "a", "talk about a fire and a rain:"]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _batch(tok, rows: list[int], response_len: int = 12, seed: int = 0,
           lengths: list[int] | None = None, texts: list[str] = PROMPTS,
           padding: int = 0) -> dict:
    """Rows ``rows`` (indices into ``texts``, repeats allowed), left-padded prompts (with
    ``padding`` more columns than the longest) and random right-padded responses of
    random lengths, or of ``lengths``."""
    encoded = [tok(texts[i])["input_ids"] for i in rows]
    width = max(map(len, encoded)) + padding
    prompt_ids = torch.full((len(rows), width), tok.pad_token_id)
    prompt_mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, ids in enumerate(encoded):
        prompt_ids[r, width - len(ids):] = torch.tensor(ids)
        prompt_mask[r, width - len(ids):] = 1
    gen = torch.Generator().manual_seed(seed)
    response_ids = torch.randint(3, len(tok), (len(rows), response_len), generator=gen)
    response_mask = torch.ones(len(rows), response_len, dtype=torch.int8)
    for r in range(len(rows)):
        end = int(torch.randint(1, response_len + 1, (1,), generator=gen)) \
            if lengths is None else lengths[r]
        response_mask[r, end:] = 0
        response_ids[r, end:] = tok.pad_token_id
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
            "response_ids": response_ids, "response_mask": response_mask}


def _full_logits(module, batch) -> torch.Tensor:
    """One forward per row over prompt + response: what response_logits did before."""
    input_ids, mask, positions, prompt_len = sequence_inputs(batch)
    out = module(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                 use_cache=False)
    response_len = batch["response_ids"].shape[1]
    return out.logits[:, prompt_len - 1: prompt_len - 1 + response_len].float()


def test_rows_sharing_a_prompt_are_found_in_order_of_first_appearance(tok):
    batch = _batch(tok, [2, 0, 2, 1, 0, 2])
    first, inverse = shared_prompt_rows(batch["prompt_ids"], batch["prompt_mask"])
    assert first.tolist() == [0, 1, 3]
    assert inverse.tolist() == [0, 1, 0, 2, 1, 0]
    distinct = _batch(tok, [0, 1, 2])
    assert shared_prompt_rows(distinct["prompt_ids"], distinct["prompt_mask"]) is None
    one = _batch(tok, [1])
    assert shared_prompt_rows(one["prompt_ids"], one["prompt_mask"]) is None


def assert_logits_and_gradients_equal_one_forward_per_row(model, batch: dict) -> None:
    """``response_logits`` of ``batch`` and the gradients of its log-probs equal one
    forward per row over prompt + response."""
    mask = batch["response_mask"].bool()

    def loss_and_grads(logits_fn):
        model.zero_grad()
        logits = logits_fn(model, batch)
        logprobs = torch.log_softmax(logits, -1).gather(
            -1, batch["response_ids"][..., None]).squeeze(-1)
        (logprobs * mask).sum().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    shared, shared_grads = loss_and_grads(response_logits)
    full, full_grads = loss_and_grads(_full_logits)
    torch.testing.assert_close(shared[mask], full[mask], atol=1e-5, rtol=1e-5)
    for a, b in zip(shared_grads, full_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def assert_values_equal_one_forward_per_row(model, batch: dict) -> None:
    """A value head's ``response_values`` of ``batch`` and their gradients equal one
    forward per row."""
    model.zero_grad()
    shared = response_values(model, batch)
    shared.sum().backward()
    shared_grads = [p.grad.clone() for p in model.parameters()]
    input_ids, mask, positions, prompt_len = sequence_inputs(batch)
    model.zero_grad()
    width = batch["response_ids"].shape[1]
    full = model(input_ids=input_ids, attention_mask=mask, position_ids=positions
                 ).logits[:, prompt_len - 1: prompt_len - 1 + width, 0]
    full = full * batch["response_mask"]
    full.sum().backward()
    torch.testing.assert_close(shared, full, atol=1e-5, rtol=1e-5)
    for a, b in zip(shared_grads, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_shared_prompt_logits_and_gradients_equal_one_forward_per_row(tok, arch):
    assert_logits_and_gradients_equal_one_forward_per_row(
        build_tiny_model(tok, seed=3, arch=arch).eval(), _batch(tok, [0, 0, 1, 2, 0, 2, 1, 1]))


def _forward_shapes(model, batch, function=response_logits
                    ) -> tuple[list[tuple[int, int]], torch.Tensor]:
    """The ``[rows, tokens]`` of each forward ``function`` makes, and what it returns."""
    seen: list[tuple[int, int]] = []
    hook = model.get_input_embeddings().register_forward_hook(
        lambda _m, args, _out: seen.append(tuple(args[0].shape)))
    try:
        with torch.no_grad():
            logits = function(model, batch)
    finally:
        hook.remove()
    return seen, logits


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_value_head_runs_each_prompt_once_with_the_values_of_one_forward_per_row(tok,
                                                                                  arch):
    model = build_tiny_model(tok, "value", seed=3, arch=arch).eval()
    batch = _batch(tok, [0, 0, 1, 2, 0, 2, 1, 1], response_len=12)
    seen, _ = _forward_shapes(model, batch, response_values)
    assert seen[0] == (3, batch["prompt_ids"].shape[1])  # the distinct prompts first
    assert_values_equal_one_forward_per_row(model, batch)


def test_each_distinct_prompt_goes_through_the_model_once(tok):
    model = build_tiny_model(tok, seed=3).eval()
    rows = [0, 0, 0, 0, 2, 2, 2, 2]
    batch = _batch(tok, rows, response_len=10, lengths=[10] * 8)
    seen, _ = _forward_shapes(model, batch)
    prompt_len = batch["prompt_ids"].shape[1]
    # the two distinct prompts, then every row's response but its last token
    assert seen == [(2, prompt_len), (len(rows), 9)]


def test_responses_run_in_length_groups_cut_to_their_longest_row(tok):
    model = build_tiny_model(tok, seed=3).eval()
    lengths = [3, 30, 2, 29, 3, 30, 1, 28]
    batch = _batch(tok, [0, 1, 2, 0, 1, 2, 0, 1], response_len=30, lengths=lengths)
    seen, logits = _forward_shapes(model, batch)
    # distinct prompts, then the short half cut to 3 tokens, the long half to 30
    assert seen == [(3, batch["prompt_ids"].shape[1]), (4, 2), (4, 29)]
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(logits[mask], _full_logits(model, batch)[mask],
                               atol=1e-5, rtol=1e-5)
    assert not logits[6, 3:].any()  # past its group's cut: zeros, never read
    # one plain forward where nothing repeats and lengths are alike
    alike = _batch(tok, [0, 1, 2], response_len=8, lengths=[8, 8, 7])
    seen, _ = _forward_shapes(model, alike)
    assert seen == [(3, alike["prompt_ids"].shape[1] + 8)]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_taken_group_by_group_equal_the_logprobs_of_the_batch_s_logits(
        tok, temperature):
    """``response_logprobs`` takes each length group's log-softmax on its own instead of
    assembling the batch's logits: the same values, bitwise, and the same gradients up to
    float rounding (a prompt's first-token log-softmax is taken once, not per row)."""
    model = build_tiny_model(tok, seed=3).eval()
    lengths = [3, 30, 2, 29, 3, 30, 1, 28]
    batch = _batch(tok, [0, 1, 2, 0, 1, 2, 0, 1], response_len=30, lengths=lengths)
    seen, _ = _forward_shapes(model, batch, response_logprobs)
    assert seen == [(3, batch["prompt_ids"].shape[1]), (4, 2), (4, 29)]  # in groups

    def with_grads(logprobs_fn):
        model.zero_grad()
        logprobs = logprobs_fn()
        (logprobs * torch.linspace(-1, 1, logprobs.numel()).view_as(logprobs)).sum().backward()
        return logprobs.detach(), [p.grad.clone() for p in model.parameters()]

    grouped, grouped_grads = with_grads(lambda: response_logprobs(model, batch, temperature))
    whole, whole_grads = with_grads(lambda: ops.logprobs_from_logits(
        response_logits(model, batch, temperature), batch["response_ids"])
        * batch["response_mask"])
    assert torch.equal(grouped, whole)
    for a, b in zip(grouped_grads, whole_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def assert_prefill_equals_every_row(model, batch: dict) -> None:
    """``prefill`` of ``batch``'s prompts gives the last logits and the KV cache (at real
    positions) of one forward over every row."""
    ids, mask = batch["prompt_ids"], batch["prompt_mask"]
    with torch.no_grad():
        cache, logits = prefill(model, ids, mask, "cpu")
        out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask),
                    use_cache=True)
    torch.testing.assert_close(logits, out.logits[:, -1].float(), atol=1e-5, rtol=1e-5)
    real = mask.bool()[:, None, :, None]  # keys at padding positions are never attended
    for shared_layer, full_layer in zip(cache.layers, out["cache"].layers, strict=True):
        assert shared_layer.keys.shape == full_layer.keys.shape
        torch.testing.assert_close(shared_layer.keys * real, full_layer.keys * real,
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(shared_layer.values * real, full_layer.values * real,
                                   atol=1e-5, rtol=1e-5)


def assert_sampling_equals_each_row_alone(model, batch: dict, pad_id: int) -> None:
    """Sampling ``batch``'s rows together gives each row's tokens and log-probs sampled
    alone (a peaked model: a wrong cache would change tokens)."""
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    rows = len(batch["prompt_ids"])
    params = GenerateParams(max_new_tokens=10)
    uniforms = torch.rand(rows, 10, generator=torch.Generator().manual_seed(1),
                          dtype=torch.float64)
    together = generate(model, batch["prompt_ids"], batch["prompt_mask"], uniforms, params,
                        eos_id=None, pad_id=pad_id)
    for r in range(rows):
        width = int(batch["prompt_mask"][r].sum())
        alone = generate(model, batch["prompt_ids"][r:r + 1, -width:],
                         batch["prompt_mask"][r:r + 1, -width:], uniforms[r:r + 1], params,
                         eos_id=None, pad_id=pad_id)
        assert torch.equal(together["response_ids"][r], alone["response_ids"][0])
        torch.testing.assert_close(together["sample_logprobs"][r],
                                   alone["sample_logprobs"][0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_prefill_of_repeated_prompts_equals_the_prefill_of_every_row(tok, arch):
    assert_prefill_equals_every_row(build_tiny_model(tok, seed=5, arch=arch).eval(),
                                    _batch(tok, [1, 0, 1, 1, 2, 0]))


def test_sampled_tokens_of_repeated_prompts_equal_sampling_each_row_alone(tok):
    assert_sampling_equals_each_row_alone(build_tiny_model(tok, seed=7).eval(),
                                          _batch(tok, [0, 0, 2, 0, 2, 2]), tok.pad_token_id)


def _padded_cost(lengths: torch.Tensor, ends: list[int], call_cost: float) -> float:
    """Padded tokens of groups ending at ``ends``, plus ``call_cost`` per extra group."""
    starts = [0, *ends[:-1]]
    tokens = sum((hi - lo) * int(lengths[hi - 1]) for lo, hi in zip(starts, ends, strict=True))
    return tokens + call_cost * (len(ends) - 1)


def test_length_groups_are_the_cheapest_cuts_of_at_most_four_groups():
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        rows = int(torch.randint(1, 12, (1,), generator=gen))
        lengths = torch.sort(torch.randint(1, 20, (rows,), generator=gen))[0]
        call_cost = float(trial % 5) * 4.0
        every = [[*cuts, rows] for k in range(4)
                 for cuts in itertools.combinations(range(1, rows), k)]
        ends = length_groups(lengths, call_cost)
        assert ends[-1] == rows and ends == sorted(set(ends)) and len(ends) <= 4
        assert _padded_cost(lengths, ends, call_cost) == \
            min(_padded_cost(lengths, e, call_cost) for e in every)


def test_gang_ranks_get_whole_prompt_groups_with_balanced_tokens(tok):
    from rlhfflow.engine.parallel import Gang
    from rlhfflow.stages.trainers import _rank_rows

    # prompt 0's four samples are long, the others short: equal row counts would give
    # one rank most of the tokens
    rows = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    lengths = [20, 20, 20, 20, 2, 2, 2, 2, 3, 3, 3, 3]
    batch = _batch(tok, rows, response_len=20, lengths=lengths)
    index = torch.tensor([11, 0, 5, 3, 8, 1, 6, 9, 2, 4, 7, 10])  # a shuffled minibatch
    shares = [_rank_rows(batch, index, Gang(rank, 2, ("a", "b"), "gloo"))
              for rank in range(2)]
    assert sorted(torch.cat(shares).tolist()) == sorted(index.tolist())  # a partition
    prompt_of = {r: p for r, p in enumerate(rows)}
    owners = {prompt_of[int(r)]: rank for rank, share in enumerate(shares) for r in share}
    for rank, share in enumerate(shares):  # no prompt's samples on two ranks
        assert all(owners[prompt_of[int(r)]] == rank for r in share)
    tokens = [int(batch["response_mask"][share].sum()) for share in shares]
    assert sorted(tokens) == [20, 80]  # the long group alone, the two short ones together
    # fewer groups than ranks: near-equal row counts, as before
    two = _batch(tok, [0, 0, 0, 0], lengths=[5, 5, 5, 5])
    halves = [_rank_rows(two, torch.arange(4), Gang(rank, 2, ("a", "b"), "gloo")).tolist()
              for rank in range(2)]
    assert halves == [[0, 1], [2, 3]]
