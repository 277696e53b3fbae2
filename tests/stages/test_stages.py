"""Stages run alone from Python, as a user would (no Dask): real tiny models, fixed seeds."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rlhfflow import ops
from rlhfflow.config.spec import AlgorithmSpec
from rlhfflow.data.records import pad_prompts, prompt_problem, prompt_token_ids, render_prompt
from rlhfflow.engine.generation import eos_ids
from rlhfflow.engine.models import load_model, sequence_scores
from rlhfflow.engine.rewardfns import (
    RewardError,
    check_signature,
    record_columns,
    reward_fields,
    reward_inputs,
)
from rlhfflow.engine.sampling import filter_logits
from rlhfflow.stages import ModelConfig, ModelStore, StageContext, concat_batches, create_stage
from rlhfflow.stages.rewards import length_ratio, vowel_ratio
from tests.conftest import CONFIGS, REPO, chat_tokenizer, make_prompt_batch

TEXTS = ["describe the sun:", "a", "talk about a fire and a rain:", "hello there",
         "speak of the star:", "x y z"]
EOS = 2  # build_char_tokenizer: <pad> 0, <bos> 1, <eos> 2


def _ctx(store, iteration=0, seed=0, **settings) -> StageContext:
    return StageContext(iteration=iteration, seed=seed, models=store, settings=settings)


def _generate(store, batch, iteration=0, seed=0, **params):
    stage = create_stage("generate", params={"max_new_tokens": 12, **params}, model="actor")
    return stage.run(batch, _ctx(store, iteration, seed))


@pytest.fixture
def rollout(store, tokenizer):
    """Prompts (4 samples each) with sampled responses: some end at EOS, some are cut."""
    batch = make_prompt_batch(tokenizer, TEXTS, samples=4)
    batch.update(_generate(store, batch))
    return batch


# --------------------------------------------------------------------------- generate


def test_generate_is_reproducible_per_sample_whatever_the_batch(store, tokenizer):
    batch = make_prompt_batch(tokenizer, TEXTS, samples=2)
    whole = _generate(store, batch)
    rows = {(p, s): i for i, (p, s) in enumerate(zip(
        batch["prompt_index"].tolist(), batch["sample_index"].tolist(), strict=True))}

    # the same prompts in another order, split over two calls (other padding widths)
    order = [4, 1, 5, 0, 3, 2]
    first = make_prompt_batch(tokenizer, [TEXTS[i] for i in order[:2]], 2, order[:2])
    second = make_prompt_batch(tokenizer, [TEXTS[i] for i in order[2:]], 2, order[2:])
    parts = concat_batches([_generate(store, first), _generate(store, second)])
    index = concat_batches([first, second])
    # and the longest prompt alone, in a micro-batch of its own
    alone_batch = make_prompt_batch(tokenizer, [TEXTS[2]], 2, [2])
    alone = _generate(store, alone_batch)

    for got, where in ((parts, index), (alone, alone_batch)):
        for row, (p, s) in enumerate(zip(where["prompt_index"].tolist(),
                                         where["sample_index"].tolist(), strict=True)):
            expected = rows[(p, s)]
            assert torch.equal(got["response_ids"][row], whole["response_ids"][expected])
            assert torch.equal(got["response_mask"][row], whole["response_mask"][expected])
            assert got["response_text"][row] == whole["response_text"][expected]
            torch.testing.assert_close(got["sample_logprobs"][row],
                                       whole["sample_logprobs"][expected],
                                       atol=1e-4, rtol=0)


def test_generate_differs_across_iterations_and_samples(store, tokenizer):
    batch = make_prompt_batch(tokenizer, TEXTS, samples=2)
    base = _generate(store, batch)["response_ids"]
    assert not torch.equal(_generate(store, batch, iteration=1)["response_ids"], base)
    assert not torch.equal(_generate(store, batch, seed=1)["response_ids"], base)
    # two samples of one prompt are different draws
    assert any(not torch.equal(base[2 * i], base[2 * i + 1]) for i in range(len(TEXTS)))
    # ...and the same sample again is the same draw
    assert torch.equal(_generate(store, batch)["response_ids"], base)


def test_response_mask_covers_up_to_and_including_eos(rollout):
    ids, mask = rollout["response_ids"], rollout["response_mask"]
    assert ids.shape == mask.shape == (len(TEXTS) * 4, 12)
    assert mask.dtype == torch.int8
    ended = 0
    for row_ids, row_mask in zip(ids.tolist(), mask.tolist(), strict=True):
        if EOS in row_ids:
            end = row_ids.index(EOS) + 1
            ended += 1
        else:
            end = len(row_ids)
        assert row_mask == [1] * end + [0] * (len(row_ids) - end)
        assert row_ids[end:] == [0] * (len(row_ids) - end)  # pad after EOS
    assert 0 < ended < len(ids)  # the batch has both kinds of rows
    assert (rollout["sample_logprobs"][mask == 0] == 0).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sample_logprobs_match_full_forward(store, tokenizer, temperature):
    batch = make_prompt_batch(tokenizer, TEXTS, samples=2)
    batch.update(_generate(store, batch, temperature=temperature))
    stage = create_stage("logprob", params={"output": "old_logprobs"}, model="actor")
    out = stage.run(batch, _ctx(store, temperature=temperature))
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(out["old_logprobs"][mask], batch["sample_logprobs"][mask],
                               atol=1e-4, rtol=0)


def test_greedy_equals_argmax_decoding(store, tokenizer):
    batch = make_prompt_batch(tokenizer, TEXTS)
    greedy = _generate(store, batch, greedy=True)
    module = store.get("actor").module
    for row, text in enumerate(TEXTS):
        # one prompt alone, no padding, no KV cache: the plain definition of greedy
        ids = make_prompt_batch(tokenizer, [text])["prompt_ids"]
        tokens = []
        with torch.no_grad():
            for _ in range(12):
                token = int(module(input_ids=ids).logits[0, -1].argmax())
                tokens.append(token)
                if token == EOS:
                    break
                ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        length = int(greedy["response_mask"][row].sum())
        assert greedy["response_ids"][row, :length].tolist() == tokens


def test_top_k_one_equals_greedy(store, tokenizer):
    batch = make_prompt_batch(tokenizer, TEXTS, samples=2)
    greedy = _generate(store, batch, greedy=True)
    top1 = _generate(store, batch, top_k=1, temperature=0.9)
    assert torch.equal(top1["response_ids"], greedy["response_ids"])
    assert torch.equal(top1["response_mask"], greedy["response_mask"])


@pytest.mark.parametrize(("top_p", "kept"), [(0.4, 1), (0.7, 2), (0.85, 3), (0.99, 4), (1.0, 4)])
def test_top_p_keeps_the_smallest_set_covering_p(top_p, kept):
    # probabilities 0.5, 0.3, 0.15, 0.05, in a shuffled vocabulary order
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]])
    filtered = filter_logits(probs.log(), top_p=top_p)
    expected = torch.argsort(probs[0], descending=True)[:kept]
    assert set(torch.isfinite(filtered[0]).nonzero().flatten().tolist()) == \
        set(expected.tolist())
    # kept logits are unchanged
    assert torch.equal(filtered[0, expected], probs.log()[0, expected])


def test_top_k_and_top_p_compose():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    assert torch.isfinite(filter_logits(logits, top_k=3)).sum() == 3
    assert torch.isfinite(filter_logits(logits, top_k=3, top_p=0.5)).sum() == 1


# --------------------------------------------------------------------------- inference


def test_logprob_and_values_shapes_and_padding(store, rollout):
    mask = rollout["response_mask"]
    ref = create_stage("logprob", params={"output": "ref_logprobs"}, model="ref")
    logprobs = ref.run(rollout, _ctx(store))["ref_logprobs"]
    assert logprobs.shape == mask.shape and logprobs.dtype == torch.float32
    assert (logprobs[mask == 0] == 0).all()
    assert (logprobs[mask == 1] < 0).all()
    # the reference has the actor's initial weights: the same log-probs
    torch.testing.assert_close(logprobs[mask == 1], rollout["sample_logprobs"][mask == 1],
                               atol=1e-4, rtol=0)

    values = create_stage("values", model="rm").run(rollout, _ctx(store))["values"]
    assert values.shape == mask.shape
    assert (values[mask == 0] == 0).all()
    assert (values[mask == 1] != 0).all()
    # a critic made from an LM starts with a zero value head: every value is exactly 0
    critic = create_stage("values", model="critic").run(rollout, _ctx(store))["values"]
    assert (critic == 0).all()


def _score_batch(responses: list[str]) -> dict:
    return {"prompt_text": [f"prompt {i}:" for i in range(len(responses))],
            "response_text": responses}


def test_score_with_a_packaged_reward_function():
    responses = ["aeiou", "xyz", "hello world", ""]
    stage = create_stage("score", params={"function": "rlhfflow.stages.rewards:vowel_ratio"})
    scores = stage.run(_score_batch(responses), _ctx(None))["scores"]
    assert scores.dtype == torch.float32 and scores.shape == (4,)
    expected = torch.tensor(vowel_ratio([], responses), dtype=torch.float32)
    assert torch.equal(scores, expected)
    assert scores[0] == pytest.approx(5 / 8)


def test_score_with_a_reward_file_relative_to_base_dir(tmp_path):
    (tmp_path / "my_reward.py").write_text(
        "def length(prompts, responses, scale=1.0):\n"
        "    return [scale * len(r) for r in responses]\n")
    stage = create_stage("score", params={"function": "my_reward.py:length",
                                          "kwargs": {"scale": 2.0}})
    out = stage.run(_score_batch(["ab", "abcd", ""]), _ctx(None, base_dir=str(tmp_path)))
    assert out["scores"].tolist() == [4.0, 8.0, 0.0]


def test_score_rejects_non_finite_rewards(tmp_path):
    (tmp_path / "bad_reward.py").write_text(
        "def reward(prompts, responses):\n"
        "    return [float('nan') if r == 'b' else 1.0 for r in responses]\n")
    stage = create_stage("score", name="reward", params={"function": "bad_reward.py:reward"})
    with pytest.raises(ValueError, match=r"stage 'reward': reward is not finite for 1 of 3 "
                                         r"responses \(first: row 1\)"):
        stage.run(_score_batch(["a", "b", "c"]), _ctx(None, base_dir=str(tmp_path)))


def test_score_rejects_a_wrong_number_of_rewards(tmp_path):
    (tmp_path / "short_reward.py").write_text(
        "def reward(prompts, responses):\n"
        "    return [1.0]\n")
    stage = create_stage("score", name="reward", params={"function": "short_reward.py:reward"})
    with pytest.raises(ValueError, match="returned 1 scores for 3 responses"):
        stage.run(_score_batch(["a", "b", "c"]), _ctx(None, base_dir=str(tmp_path)))


MOODY_REWARD = """\
tried = set()


def lookup(prompts, responses):
    table = {"a": 1.0, "bb": 2.0}
    return [table[r] for r in responses]


def flaky(prompts, responses):
    # a remote judge that takes no batches and times out on the first try of a response
    if len(responses) > 1:
        raise ValueError("one response at a time")
    if responses[0] not in tried:
        tried.add(responses[0])
        raise TimeoutError("judge timed out")
    return [0.5]
"""


def test_a_raising_reward_function_is_named_by_its_file_and_line(tmp_path):
    (tmp_path / "moody.py").write_text(MOODY_REWARD)
    stage = create_stage("score", name="reward", params={"function": "moody.py:lookup"})
    with pytest.raises(RewardError) as err:
        stage.run(_score_batch(["a", "missing_key"]), _ctx(None, base_dir=str(tmp_path)))
    assert str(err.value) == (f"reward function lookup() raised at {tmp_path / 'moody.py'}:6: "
                              f"KeyError: 'missing_key'; set params.on_error: skip to leave "
                              f"such samples out")


def test_on_error_skip_leaves_out_only_the_samples_the_function_raises_on(tmp_path):
    (tmp_path / "moody.py").write_text(MOODY_REWARD)
    stage = create_stage("score", name="reward", params={"function": "moody.py:lookup",
                                                         "on_error": "skip"})
    out = stage.run(_score_batch(["a", "zz", "bb", "q"]), _ctx(None, base_dir=str(tmp_path)))
    assert out["score_valid"].tolist() == [1, 0, 1, 0]
    assert out["scores"].tolist() == [1.0, 0.0, 2.0, 0.0]
    where = f"reward function lookup() raised at {tmp_path / 'moody.py'}:6: KeyError"
    assert out["score_error"] == ["", f"{where}: 'zz'", "", f"{where}: 'q'"]
    assert out["score_retries"].tolist() == [0, 0, 0, 0]


def test_on_error_skip_retries_each_failing_sample_and_counts_the_retries(tmp_path):
    (tmp_path / "moody.py").write_text(MOODY_REWARD)
    stage = create_stage("score", name="reward", params={"function": "moody.py:flaky",
                                                         "on_error": "skip", "retries": 1})
    out = stage.run(_score_batch(["a", "b", "c"]), _ctx(None, base_dir=str(tmp_path)))
    # the batch call fails; each sample alone fails once, then succeeds on its retry
    assert out["score_valid"].tolist() == [1, 1, 1]
    assert out["scores"].tolist() == [0.5, 0.5, 0.5]
    assert out["score_retries"].tolist() == [1, 1, 1]
    assert out["score_error"] == ["", "", ""]


def test_several_weighted_reward_functions_each_keep_their_column():
    responses = ["aeiou", "xyz", "hello world", ""]
    stage = create_stage("score", params={"functions": [
        {"function": "rlhfflow.stages.rewards:vowel_ratio", "weight": 0.75},
        {"function": "rlhfflow.stages.rewards:length_ratio", "weight": 0.25,
         "kwargs": {"target": 8}, "name": "length"}]})
    assert set(stage.writes(stage.params, None, False)) == {
        "scores", "score_valid", "score_vowel_ratio", "score_length"}
    out = stage.run(_score_batch(responses), _ctx(None))
    vowels = torch.tensor(vowel_ratio([], responses))
    length = torch.tensor(length_ratio([], responses, target=8))
    assert torch.equal(out["score_vowel_ratio"], vowels)
    assert torch.equal(out["score_length"], length)
    assert torch.allclose(out["scores"], 0.75 * vowels + 0.25 * length)
    assert out["score_valid"].tolist() == [1, 1, 1, 1]


def test_one_function_writes_only_scores_and_score_valid():
    stage = create_stage("score", params={"function": "rlhfflow.stages.rewards:vowel_ratio"})
    assert set(stage.writes(stage.params, None, False)) == {"scores", "score_valid"}
    assert set(stage.run(_score_batch(["ab"]), _ctx(None))) == {"scores", "score_valid"}


def test_score_with_a_reward_model(store):
    responses = ["aeiou", "x", "hello world and more", "ok"]
    batch = _score_batch(responses)
    scores = create_stage("score", model="rm").run(batch, _ctx(store))["scores"]
    assert scores.shape == (4,) and torch.isfinite(scores).all()
    assert len(set(scores.tolist())) == 4
    # each row scores as if it were alone (padding does not leak into the score)
    rm = store.get("rm")
    for row, (prompt, response) in enumerate(zip(batch["prompt_text"], responses,
                                                 strict=True)):
        enc = rm.tokenizer([prompt + response], return_tensors="pt",
                           add_special_tokens=False)
        with torch.no_grad():
            alone = sequence_scores(rm.module, enc["input_ids"], enc["attention_mask"])
        assert scores[row].item() == pytest.approx(alone.item(), abs=1e-5)


# --------------------------------------------------------------------------- advantages


def _experience(rows=6, length=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 3, 1, 4, 5, 2])[:rows]
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(torch.int8)
    old = -torch.rand(rows, length, generator=gen) * 3 * mask
    ref = -torch.rand(rows, length, generator=gen) * 3 * mask
    values = torch.randn(rows, length, generator=gen) * mask
    scores = torch.rand(rows, generator=gen)
    return {"scores": scores, "response_mask": mask, "old_logprobs": old,
            "ref_logprobs": ref, "values": values,
            "group_ids": torch.tensor([7, 7, 7, 3, 3, 3])[:rows]}


def test_ppo_advantages_equal_the_ops():
    algo = AlgorithmSpec(name="ppo", kl_coef=0.05, gamma=0.99, lam=0.9)
    batch = _experience()
    out = create_stage("advantages", algorithm=algo).run(batch, _ctx(None))
    mask = batch["response_mask"].float()
    kl = ops.kl(batch["old_logprobs"], batch["ref_logprobs"], "k1") * mask
    rewards = ops.token_rewards(batch["scores"], kl, mask, 0.05)
    advantages, returns = ops.gae(rewards, batch["values"], mask, 0.99, 0.9)
    torch.testing.assert_close(out["kl"], kl)
    torch.testing.assert_close(out["returns"], returns)
    torch.testing.assert_close(out["advantages"], ops.masked_whiten(advantages, mask) * mask)
    assert (out["advantages"][mask == 0] == 0).all()
    # whitened over the valid tokens
    assert ops.masked_mean(out["advantages"], mask).abs() < 1e-5


def test_grpo_advantages_are_zero_mean_per_group_and_broadcast():
    algo = AlgorithmSpec(name="grpo", kl_coef=0.0)
    batch = _experience()
    stage = create_stage("advantages", algorithm=algo)
    assert set(stage.reads(stage.params, algo, False)) == {"scores", "score_valid",
                                                           "response_mask", "group_ids"}
    out = stage.run({k: batch[k] for k in ("scores", "response_mask", "group_ids")},
                    _ctx(None))
    assert set(out) == {"advantages"}
    mask = batch["response_mask"]
    seq = out["advantages"][:, 0]  # every row has at least one token
    assert torch.equal(out["advantages"], seq[:, None] * mask)
    for group in (7, 3):
        in_group = batch["group_ids"] == group
        assert seq[in_group].sum().abs() < 1e-5
        assert seq[in_group].std() == pytest.approx(1.0, abs=1e-4)
    torch.testing.assert_close(seq, ops.group_advantages(batch["scores"], batch["group_ids"],
                                                         "grpo"))


def test_advantages_stage_calls_the_registered_estimator():
    algo = AlgorithmSpec(name="grpo", advantage_estimator="reinforce_plus_plus_baseline",
                         kl_coef=0.0)
    batch = _experience()
    stage = create_stage("advantages", algorithm=algo)
    assert not algo.uses_critic
    assert set(stage.reads(stage.params, algo, False)) == {"scores", "score_valid",
                                                           "response_mask", "group_ids"}
    out = stage.run(batch, _ctx(None))
    mask = batch["response_mask"].float()
    expected = ops.reinforce_plus_plus_baseline(batch["scores"], batch["group_ids"], mask)
    torch.testing.assert_close(out["advantages"], expected * mask)
    assert ops.masked_mean(out["advantages"], mask).abs() < 1e-5  # whitened over tokens


def test_reinforce_plus_plus_takes_the_kl_penalty_per_token():
    algo = AlgorithmSpec(name="ppo", advantage_estimator="reinforce_plus_plus", kl_coef=0.1,
                         kl_estimator="k3", gamma=0.9)
    batch = _experience()
    stage = create_stage("advantages", algorithm=algo)
    assert "values" not in stage.reads(stage.params, algo, False)
    assert set(stage.writes(stage.params, algo, False)) == {"advantages", "kl"}
    out = stage.run(batch, _ctx(None))
    mask = batch["response_mask"].float()
    kl = ops.kl(batch["old_logprobs"], batch["ref_logprobs"], "k3") * mask
    rewards = ops.token_rewards(batch["scores"], kl, mask, 0.1)
    torch.testing.assert_close(out["advantages"], ops.reinforce_plus_plus(rewards, mask, 0.9)[0])


def test_remax_reads_the_baseline_scores_column():
    algo = AlgorithmSpec(name="grpo", advantage_estimator="remax", kl_coef=0.0)
    batch = _experience()
    batch["baseline_scores"] = torch.full((6,), 0.5)
    stage = create_stage("advantages", algorithm=algo)
    assert "baseline_scores" in stage.reads(stage.params, algo, False)
    out = stage.run(batch, _ctx(None))
    mask = batch["response_mask"].float()
    torch.testing.assert_close(out["advantages"], (batch["scores"] - 0.5)[:, None] * mask)


def test_an_estimator_by_import_path_sees_only_scored_samples():
    algo = AlgorithmSpec(name="grpo", advantage_estimator="tests.algorithms_plugin:best_of_group",
                         kl_coef=0.0)
    batch = _experience()
    batch["scores"] = torch.tensor([0.1, 0.9, 0.5, 0.3, 0.2, 0.8])
    batch["score_valid"] = torch.tensor([1, 0, 1, 1, 1, 1], dtype=torch.int8)
    out = create_stage("advantages", algorithm=algo).run(batch, _ctx(None))
    # row 1 has the group's best score but no valid one: row 2 is the best of group 7
    best = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    torch.testing.assert_close(out["advantages"], best[:, None] * batch["response_mask"])


def test_grpo_stage_leaves_skipped_samples_out_of_the_group_statistics():
    algo = AlgorithmSpec(name="grpo", kl_coef=0.0, scale_rewards="batch")
    batch = _experience()
    batch["score_valid"] = torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.int8)
    out = create_stage("advantages", algorithm=algo).run(batch, _ctx(None))
    keep = batch["score_valid"].bool()
    expected = torch.zeros(6)
    expected[keep] = ops.group_advantages(batch["scores"][keep], batch["group_ids"][keep],
                                          scale="batch")
    torch.testing.assert_close(out["advantages"], expected[:, None] * batch["response_mask"])
    assert (out["advantages"][2] == 0).all()


def test_an_estimator_returning_the_wrong_shape_is_named():
    algo = AlgorithmSpec(name="grpo", advantage_estimator="tests.algorithms_plugin:per_sample")
    with pytest.raises(ValueError, match=r"advantage estimator 'tests.algorithms_plugin:"
                                         r"per_sample' returned \(advantages, returns\) of "
                                         r"shapes \(\(6,\), None\); expected \(6, 5\)"):
        create_stage("advantages", algorithm=algo).run(_experience(), _ctx(None))


def test_a_registered_estimator_with_values_needs_a_critic():
    algo = AlgorithmSpec(name="grpo",
                         advantage_estimator="tests.algorithms_plugin:value_baseline",
                         kl_coef=0.0)
    assert algo.uses_critic and algo.estimator_needs == ("values",)
    batch = _experience()
    stage = create_stage("advantages", algorithm=algo)
    assert "returns" in stage.writes(stage.params, algo, False)
    out = create_stage("advantages", algorithm=algo).run(
        {**batch, "score_valid": torch.tensor([1, 1, 1, 1, 0, 1])}, _ctx(None))
    mask = batch["response_mask"].float()
    assert (out["returns"][4] == 0).all() and (out["advantages"][4] == 0).all()
    torch.testing.assert_close(out["returns"][:4], batch["scores"][:4, None] * mask[:4])


def test_remax_baseline_scores_each_prompt_greedy_response(store, tokenizer):
    batch = make_prompt_batch(tokenizer, TEXTS[:3], samples=2)
    stage = create_stage("remax_baseline", model="actor", params={
        "max_new_tokens": 12, "function": "rlhfflow.stages.rewards:vowel_ratio"})
    out = stage.run(batch, _ctx(store))
    assert set(out) == {"baseline_scores"} and out["baseline_scores"].shape == (6,)
    greedy = _generate(store, batch, greedy=True)
    expected = torch.tensor(vowel_ratio(batch["prompt_text"], greedy["response_text"]),
                            dtype=torch.float32)
    torch.testing.assert_close(out["baseline_scores"], expected)
    assert torch.equal(out["baseline_scores"][0::2], out["baseline_scores"][1::2])


def test_remax_baseline_needs_a_reward_function():
    from rlhfflow.stages.advantages import RemaxBaselineStage

    params = RemaxBaselineStage.Params()
    assert RemaxBaselineStage.check_params(params, True, CONFIGS)[0] == "params.function"


# --------------------------------------------------------------------------- training


def _response_logprob(store, model, batch) -> torch.Tensor:
    stage = create_stage("logprob", params={"output": "old_logprobs"}, model=model)
    return stage.run(batch, _ctx(store))["old_logprobs"].sum(-1)


def test_train_actor_raises_the_logprob_of_a_rewarded_response(store, tokenizer):
    algo = AlgorithmSpec(name="ppo")
    batch = make_prompt_batch(tokenizer, TEXTS[:4])
    batch.update(_generate(store, batch, max_new_tokens=8))
    batch["old_logprobs"] = create_stage("logprob", model="actor").run(
        batch, _ctx(store))["old_logprobs"]
    before = batch["old_logprobs"].sum(-1)
    advantages = torch.zeros_like(batch["old_logprobs"])
    advantages[0] = batch["response_mask"][0].float()  # reward response 0 only
    batch["advantages"] = advantages

    stage = create_stage("train_actor", params={"epochs": 3, "minibatches": 1},
                         algorithm=algo, model="actor")
    first = stage.run(batch, _ctx(store))
    second = stage.run(batch, _ctx(store, iteration=1))
    assert first["version"] == 1 and second["version"] == 2
    assert store.get("actor").version == 2
    for key in ("policy_loss", "clip_frac", "approx_kl", "grad_norm"):
        assert math.isfinite(first[key])
    assert first["policy_loss"] < 0  # positive advantage, ratio >= 1

    after = _response_logprob(store, "actor", batch)
    assert after[0] > before[0] + 0.1
    # the reference (same initial weights, not trained) has not moved
    torch.testing.assert_close(_response_logprob(store, "ref", batch), before,
                               atol=1e-4, rtol=0)


def test_train_critic_reduces_the_value_loss(store, rollout):
    algo = AlgorithmSpec(name="ppo")
    mask = rollout["response_mask"].float()
    rollout["values"] = torch.zeros_like(mask)
    # targets within the value clip (0.2) of the old values, different per row
    rollout["returns"] = torch.linspace(-0.15, 0.15, len(mask))[:, None] * mask
    stage = create_stage("train_critic", params={"epochs": 2, "minibatches": 2},
                         algorithm=algo, model="critic")
    losses = [stage.run(rollout, _ctx(store, iteration=i)) for i in range(5)]
    assert [m["version"] for m in losses] == [1, 2, 3, 4, 5]
    assert losses[-1]["value_loss"] < 0.5 * losses[0]["value_loss"]


def _rollout_for_training(store, tokenizer):
    batch = make_prompt_batch(tokenizer, TEXTS[:4])
    batch.update(_generate(store, batch, max_new_tokens=8))
    batch["old_logprobs"] = create_stage("logprob", model="actor").run(
        batch, _ctx(store))["old_logprobs"]
    advantages = torch.zeros_like(batch["old_logprobs"])
    advantages[0] = batch["response_mask"][0].float()  # reward response 0 only
    batch["advantages"] = advantages
    return batch


def test_train_actor_with_a_policy_loss_by_import_path(store, tokenizer):
    algo = AlgorithmSpec(name="grpo", policy_loss="tests.algorithms_plugin:reinforce_loss",
                         kl_coef=0.0, loss_agg="token-sum")
    batch = _rollout_for_training(store, tokenizer)
    before = batch["old_logprobs"].sum(-1)
    stage = create_stage("train_actor", params={"epochs": 3}, algorithm=algo, model="actor")
    metrics = stage.run(batch, _ctx(store))
    assert set(metrics) >= {"policy_loss", "logprob_mean", "grad_norm"}
    assert "clip_frac" not in metrics  # the loss reports its own metrics
    assert _response_logprob(store, "actor", batch)[0] > before[0] + 0.1


def test_gspo_with_kl_and_entropy_aggregated_like_the_policy_term(store, tokenizer):
    agg = "seq-mean-token-sum-norm"
    algo = AlgorithmSpec(name="grpo", importance_sampling_level="sequence", loss_agg=agg,
                         loss_scale_factor=4.0, kl_coef=0.1, kl_in="loss",
                         kl_estimator="k3", entropy_coef=0.01, dual_clip=3.0)
    batch = _rollout_for_training(store, tokenizer)
    mask = batch["response_mask"].float()
    batch["ref_logprobs"] = batch["old_logprobs"] - 0.3 * mask
    stage = create_stage("train_actor", params={"epochs": 1, "minibatches": 1},
                         algorithm=algo, model="actor")
    metrics = stage.run(batch, _ctx(store))
    # one step, taken after the loss was measured at the rollout weights
    kl = ops.kl(batch["old_logprobs"], batch["ref_logprobs"], "k3")
    assert metrics["kl_loss"] == pytest.approx(
        ops.aggregate_loss(kl, mask, agg, 4.0).item(), abs=1e-4)
    assert metrics["kl_mean"] == pytest.approx(ops.masked_mean(kl, mask).item(), abs=1e-4)
    assert metrics["kl_loss"] != pytest.approx(metrics["kl_mean"], abs=1e-3)
    assert metrics["policy_loss"] == pytest.approx(-mask[0].sum().item() / 4.0, abs=1e-4)
    assert metrics["clip_frac"] == 0.0 and metrics["clip_frac_lower"] == 0.0
    assert math.isfinite(metrics["entropy"]) and math.isfinite(metrics["grad_norm"])


@pytest.mark.parametrize("correction", ["tis", "decoupled"])
def test_one_step_takes_the_proximal_logprobs_from_its_own_forward(
        store, tiny_lm_dir, tokenizer, monkeypatch, correction):
    """With one optimizer step an iteration the trainer's forward runs on the weights
    before the step, so its detached log-probs serve as the proximal policy's: the same
    loss, weights statistics and update as with them computed by a forward beforehand
    (forced here), without that forward."""
    algo = AlgorithmSpec(name="grpo", kl_coef=0.0,
                         off_policy={"correction": correction, "cap": 1.5})
    batch = _rollout_for_training(store, tokenizer)
    mask = batch["response_mask"].float()
    # a behaviour policy off the trainer's: the weights differ from 1 and some are capped
    shift = torch.linspace(-0.6, 0.6, mask.shape[1])[None, :] * torch.tensor(
        [1.0, -1.0, 0.5, 0.0])[:, None]
    batch["old_logprobs"] = batch["old_logprobs"] + shift * mask
    params = {"epochs": 1, "minibatches": 1, "shuffle": False}
    forward = type(create_stage("train_actor", model="actor")).before_steps

    def trained(one_step: bool, models):
        stage = create_stage("train_actor", params=params, algorithm=algo, model="actor")
        computed = []
        monkeypatch.setattr(type(stage), "_one_step", lambda self, resident: one_step)

        def before(self, resident, columns, ctx):
            out = forward(self, resident, columns, ctx)
            computed.append("proximal_logprobs" in out)
            return out
        monkeypatch.setattr(type(stage), "before_steps", before)
        metrics = stage.run({k: v.clone() if isinstance(v, torch.Tensor) else v
                             for k, v in batch.items()}, _ctx(models))
        weights = torch.cat([p.detach().flatten()
                             for p in models.get("actor").module.parameters()])
        return metrics, weights, computed

    reused, after_reused, computed_reused = trained(True, store)
    fresh_store = ModelStore({"actor": ModelConfig("actor", "lm", str(tiny_lm_dir),
                                                   trainable=True, optimizer={"lr": 1e-3})})
    forced, after_forced, computed_forced = trained(False, fresh_store)
    assert computed_reused == [False] and computed_forced == [True]
    for key in ("policy_loss", "is_ratio_mean", "is_ratio_max", "is_ratio_min",
                "is_bounded_frac", "mismatch_kl"):
        assert reused[key] == pytest.approx(forced[key], rel=1e-4, abs=1e-6), key
    assert reused["is_bounded_frac"] > 0 and reused["mismatch_kl"] > 1e-3
    torch.testing.assert_close(after_reused, after_forced, rtol=1e-4, atol=1e-6)


def test_the_proximal_forward_runs_when_the_iteration_takes_several_steps(store):
    """Two epochs or two minibatches: the second step's forward is on updated weights,
    so the proximal log-probs are computed before the first."""
    algo = AlgorithmSpec(name="grpo", kl_coef=0.0, off_policy={"correction": "tis"})
    resident = store.get("actor")
    for params, one in (({"epochs": 1, "minibatches": 1}, True),
                        ({"epochs": 2, "minibatches": 1}, False),
                        ({"epochs": 1, "minibatches": 2}, False)):
        stage = create_stage("train_actor", params=params, algorithm=algo, model="actor")
        assert stage._one_step(resident) is one, params


def test_train_critic_aggregates_with_value_loss_agg(store, rollout):
    algo = AlgorithmSpec(name="ppo", value_loss_agg="seq-mean-token-mean")
    mask = rollout["response_mask"].float()
    rollout["values"] = torch.zeros_like(mask)
    returns = torch.linspace(-0.15, 0.15, len(mask))[:, None] * mask
    returns[:, 0] *= 3  # token 0 weighs more in a short sequence than in a long one
    rollout["returns"] = returns
    stage = create_stage("train_critic", params={"epochs": 1, "minibatches": 1},
                         algorithm=algo, model="critic")
    metrics = stage.run(rollout, _ctx(store))
    # the critic starts at 0 everywhere, so the first (only) loss is 0.5 * agg(R^2)
    expected = 0.5 * ops.aggregate_loss(returns.square(), mask, "seq-mean-token-mean")
    assert metrics["value_loss"] == pytest.approx(expected.item(), rel=1e-5)
    assert metrics["value_loss"] != pytest.approx(
        0.5 * ops.masked_mean(returns.square(), mask).item(), rel=1e-3)


def test_sft_lowers_the_loss_over_epochs(store):
    stage = create_stage("sft", params={"data": "data/sft.jsonl", "batch_size": 16},
                         model="actor")
    ctx = StageContext(iteration=-1, seed=0, models=store,
                       settings={"base_dir": str(CONFIGS)})
    epochs = [stage.run({}, ctx) for _ in range(3)]
    assert epochs[0]["records"] == 64
    assert [e["version"] for e in epochs] == [1, 2, 3]
    assert epochs[-1]["sft_loss"] < epochs[0]["sft_loss"] - 0.3


def test_reward_model_learns_the_preferences(tiny_lm_dir):
    store = ModelStore({"rm": ModelConfig("rm", "value", str(tiny_lm_dir), trainable=True,
                                          optimizer={"lr": 3e-3})})
    stage = create_stage("reward_model", params={"data": "data/preferences.jsonl",
                                                 "batch_size": 16}, model="rm")
    ctx = StageContext(iteration=-1, seed=0, models=store,
                       settings={"base_dir": str(CONFIGS)})
    first = stage.run({}, ctx)
    last = stage.run({}, ctx)
    assert first["records"] == 64
    assert last["rm_accuracy"] > 0.8
    assert last["rm_loss"] < first["rm_loss"]
    # the trained model prefers vowels when it scores through the score stage
    scores = create_stage("score", model="rm").run(
        {"prompt_text": ["describe the sea:"] * 2, "response_text": ["aeiaoue", "xkcdrtp"]},
        StageContext(iteration=0, seed=0, models=store))["scores"]
    assert scores[0] > scores[1]


# --------------------------------------------------------------------------- resident


def test_model_store_loads_each_model_once(store):
    first = store.get("actor")
    for _ in range(5):
        assert store.get("actor") is first
    store.get("ref")
    assert store.loads == {"actor": 1, "ref": 1}
    assert store.loaded() == {"actor": 0, "ref": 0}
    with pytest.raises(KeyError, match="unknown model 'nope'"):
        store.get("nope")


# --------------------------------------------------------------------------- prompts


def test_a_chat_record_is_rendered_with_one_bos_and_the_generation_prompt():
    tok = chat_tokenizer()
    record = {"messages": [{"role": "system", "content": "be brief"},
                           {"role": "user", "content": "hi"}]}
    text, templated = render_prompt(tok, record, "auto")
    assert templated
    assert text == ("<bos><|im_start|>system: be brief<|im_end|><|im_start|>user: hi"
                    "<|im_end|><|im_start|>assistant: ")
    ids = prompt_token_ids(tok, text, templated)
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    assert ids[-len("assistant: ") - 1:] == [start] + tok("assistant: ",
                                                          add_special_tokens=False)["input_ids"]
    assert ids.count(end) == 2


def test_plain_prompts_follow_the_chat_template_setting():
    tok = chat_tokenizer()
    plain = {"prompt": "hi", "answer": "4"}
    assert render_prompt(tok, plain, "auto") == ("hi", False)
    assert render_prompt(tok, plain, False) == ("hi", False)
    text, templated = render_prompt(tok, plain, True)  # a plain question as a user turn
    assert templated and text.endswith("<|im_start|>user: hi<|im_end|><|im_start|>assistant: ")
    with pytest.raises(ValueError, match="needs a chat template; data.chat_template is false"):
        render_prompt(tok, {"messages": [{"role": "user", "content": "hi"}]}, False)


def test_a_typed_bos_is_not_doubled(tokenizer):
    bos = tokenizer.bos_token_id
    assert prompt_token_ids(tokenizer, "hi") == [bos] + tokenizer("hi")["input_ids"]
    assert prompt_token_ids(tokenizer, "<bos>hi") == prompt_token_ids(tokenizer, "hi")


@pytest.mark.parametrize(("record", "problem"), [
    ({"messages": [{"role": "bot", "content": "hi"}]},
     "messages[0].role: unknown role 'bot' (expected one of system, user, assistant, tool, "
     "developer)"),
    ({"messages": [{"role": "user"}]}, "messages[0]: expected"),
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"question": "hi"}, "expected a string field 'prompt' or a 'messages' list"),
    (["hi"], "expected a JSON object"),
])
def test_bad_prompt_records_are_described(record, problem):
    assert prompt_problem(record).startswith(problem)


def test_reward_functions_get_the_record_fields_they_name():
    def exact(prompts, responses, answer, scale=1.0):
        return [scale * (r == a) for r, a in zip(responses, answer, strict=True)]

    def everything(prompts, responses, **kwargs):
        return kwargs

    assert reward_fields(exact, {}) == (["answer"], ["scale"], False)
    assert reward_fields(exact, {"answer": "x"}) == ([], ["scale"], False)
    assert reward_fields(vowel_ratio, {}) == ([], ["min_length"], False)
    fields = ['{"answer": "4", "id": 1}', '{"answer": "5", "id": 2}']
    assert record_columns(exact, {}, fields) == {"answer": ["4", "5"]}
    assert record_columns(everything, {"id": 0}, fields) == {"answer": ["4", "5"]}
    assert record_columns(vowel_ratio, {}, ["{}", "{}"]) == {}


def test_score_passes_record_fields_as_keyword_columns(tmp_path, tokenizer):
    (tmp_path / "exact.py").write_text(
        "def score(prompts, responses, answer):\n"
        "    return [float(a in r) for r, a in zip(responses, answer)]\n")
    batch = make_prompt_batch(tokenizer, ["one plus one:", "two plus two:"])
    batch.update(response_text=["it is 2", "5"],
                 prompt_fields=['{"answer": "2"}', '{"answer": "4"}'])
    stage = create_stage("score", params={"function": "exact.py:score"})
    out = stage.run(batch, _ctx(None, base_dir=str(tmp_path)))
    assert out["scores"].tolist() == [1.0, 0.0]


def test_prompts_come_from_parquet_with_rows_named_in_errors(tmp_path):
    pa = pytest.importorskip("pyarrow")  # an optional dependency: skipped where absent
    import pyarrow.parquet as pq

    from rlhfflow.config.loader import load_pipeline
    from rlhfflow.data.records import DataError
    from rlhfflow.data.source import PromptSource
    from tests.conftest import small_pipeline

    table = pa.Table.from_pylist([{"prompt": "speak of the sun:", "answer": "5"},
                                  {"prompt": "a", "answer": "6"}])
    pq.write_table(table, tmp_path / "qa.parquet")
    path = small_pipeline(tmp_path, overrides={"data.prompts": str(tmp_path / "qa.parquet")})
    source = PromptSource.from_pipeline(load_pipeline(path), "actor")
    assert source.texts == ["speak of the sun:", "a"]
    assert source.fields == [{"answer": "5"}, {"answer": "6"}]
    pq.write_table(pa.Table.from_pylist([{"prompt": "a"}, {"prompt": "x" * 200}]),
                   tmp_path / "long.parquet")
    path = small_pipeline(tmp_path, overrides={"data.prompts": str(tmp_path / "long.parquet")})
    with pytest.raises(DataError, match=r"long.parquet:2: the prompt has 201 tokens"):
        load_pipeline(path)


# --------------------------------------------------------------------------- where responses end


def test_generation_stops_at_every_eos_id_of_the_model(chat_lm_dir):
    module, tok = load_model(str(chat_lm_dir), "lm")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert eos_ids(module, tok) == [tok.eos_token_id, end]
    store = ModelStore({"actor": ModelConfig("actor", "lm", str(chat_lm_dir))})
    batch = make_prompt_batch(tok, TEXTS)
    free = _generate(store, batch, greedy=True)
    # whatever token the model says third in row 0 now ends the turn, as <|im_end|> would
    store.get("actor").module.generation_config.eos_token_id = [
        tok.eos_token_id, int(free["response_ids"][0, 2])]
    stopped = _generate(store, batch, greedy=True)
    length = int(stopped["response_mask"][0].sum())
    assert length <= 3
    assert stopped["response_ids"][0, :length].tolist() == \
        free["response_ids"][0, :length].tolist()


def test_a_stop_string_ends_the_response_after_it(store, tokenizer):
    batch = make_prompt_batch(tokenizer, TEXTS)
    free = _generate(store, batch, greedy=True)
    text = free["response_text"][0]
    assert len(text) >= 6
    stop = text[3:5]
    cut = _generate(store, batch, greedy=True, stop=[stop])
    assert cut["response_text"][0] == text[:text.index(stop) + len(stop)]
    length = int(cut["response_mask"][0].sum())
    assert (cut["response_ids"][0, length:] == tokenizer.pad_token_id).all()
    assert (cut["sample_logprobs"][0, length:] == 0).all()
    torch.testing.assert_close(cut["sample_logprobs"][0, :length],
                               free["sample_logprobs"][0, :length])


# --------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_chat_pipeline_renders_its_prompts_and_scores_against_record_fields(
        tmp_path, chat_lm_dir, dtype):
    import json

    from rlhfflow.config.loader import load_pipeline
    from rlhfflow.runtime.run import run_pipeline
    from rlhfflow.storage import ExperienceBuffer
    from tests.conftest import small_pipeline

    prompts = tmp_path / "qa.jsonl"
    records = [{"messages": [{"role": "user", "content": f"what is {a} plus {b}?"}],
                "answer": str(a + b)} for a, b in [(1, 1), (2, 2), (3, 4), (5, 0)]]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "exact.py").write_text(
        "def score(prompts, responses, answer):\n"
        "    assert all(p.endswith('<|im_start|>assistant: ') for p in prompts)\n"
        "    return [float(a in r) for r, a in zip(responses, answer)]\n")
    path = small_pipeline(tmp_path, "grpo", iterations=1, batch_size=4, overrides={
        "data.prompts": str(prompts), "models.actor": {
            "path": str(chat_lm_dir), "trainable": True, "dtype": dtype,
            "optimizer": {"lr": 1e-3, "schedule": "cosine", "warmup_steps": 1}},
        "stages.reward.params.function": str(tmp_path / "exact.py") + ":score"})
    result = run_pipeline(load_pipeline(path), progress=False, inline=True)
    assert result.metrics[0]["samples"] == 16
    # 4 steps (2 epochs x 2 minibatches): warmup 1, then cosine from 1e-3 down to 0 at step 4
    assert result.metrics[0]["train"]["train_actor"]["lr"] == pytest.approx(0.25e-3)
    final, _ = load_model(str(result.output_dir / "models" / "actor" / "final"), "lm")
    assert all(torch.isfinite(p).all() and p.dtype == torch.float32 for p in final.parameters())
    buffer = ExperienceBuffer(result.output_dir / "buffer.zarr")
    rows = buffer.read(0, ["prompt_ids", "prompt_mask", "prompt_index"])
    tok = chat_tokenizer()
    for ids, mask, index in zip(rows["prompt_ids"], rows["prompt_mask"], rows["prompt_index"],
                                strict=True):
        content = records[index]["messages"][0]["content"]
        assert tok.decode(ids[mask == 1].tolist()) == (
            f"<bos><|im_start|>user: {content}<|im_end|><|im_start|>assistant: ")


def _trl_reward_file(tmp_path):
    """A reward function written for TRL's GRPOTrainer: keyword arguments, conversational
    completions, dataset columns through **kwargs."""
    (tmp_path / "trl_reward.py").write_text(
        "import json, pathlib\n"
        "def correct(prompts, completions, answer, **kwargs):\n"
        "    pathlib.Path(__file__).with_suffix('.json').write_text(\n"
        "        json.dumps({'prompts': prompts, 'completions': completions,\n"
        "                    'kwargs': sorted(kwargs)}))\n"
        "    return [float(a in c[0]['content']) if isinstance(c, list) else float(a in c)\n"
        "            for c, a in zip(completions, answer)]\n")


def test_a_trl_style_reward_gets_messages_and_assistant_completions_on_chat_records(
        tmp_path, tokenizer):
    _trl_reward_file(tmp_path)
    chat = [{"role": "user", "content": "one plus one?"}]
    batch = make_prompt_batch(tokenizer, ["one plus one:", "two plus two:"])
    batch.update(response_text=["it is 2", "5"], prompt_fields=[
        json.dumps({"messages": chat, "answer": "2", "id": 1}),
        json.dumps({"messages": chat, "answer": "4", "id": 2})])
    stage = create_stage("score", params={"function": "trl_reward.py:correct"})
    assert stage.check_params(stage.params, False, tmp_path) is None
    out = stage.run(batch, _ctx(None, base_dir=str(tmp_path)))
    assert out["scores"].tolist() == [1.0, 0.0]
    seen = json.loads((tmp_path / "trl_reward.json").read_text())
    assert seen == {"prompts": [chat, chat], "kwargs": ["id"], "completions": [
        [{"role": "assistant", "content": "it is 2"}], [{"role": "assistant", "content": "5"}]]}


def test_a_trl_style_reward_gets_strings_on_plain_records_and_the_old_convention_stays(
        tmp_path, tokenizer):
    _trl_reward_file(tmp_path)
    batch = make_prompt_batch(tokenizer, ["one plus one:", "two plus two:"])
    batch.update(response_text=["it is 2", "5"],
                 prompt_fields=['{"answer": "2"}', '{"answer": "4"}'])
    stage = create_stage("score", params={"function": "trl_reward.py:correct"})
    assert stage.run(batch, _ctx(None, base_dir=str(tmp_path)))["scores"].tolist() == [1, 0]
    seen = json.loads((tmp_path / "trl_reward.json").read_text())
    assert seen["prompts"] == ["one plus one:", "two plus two:"]
    assert seen["completions"] == ["it is 2", "5"]

    def only_completions(completions, scale=1.0):
        return [scale * len(c) for c in completions]

    def positional(prompts, responses, **kwargs):
        return kwargs

    def needs_ids(prompts, completions, completion_ids):
        return [0.0] * len(completions)

    assert reward_fields(only_completions, {}) == ([], ["scale"], False)
    assert check_signature(only_completions, {"scale": 2.0}) is None
    assert check_signature(needs_ids, {}) == (
        "function", "needs_ids() takes completion_ids, which rlhfflow does not give reward "
                    "functions; give it a default (None)")
    assert reward_inputs(only_completions, ["p"], ["r"], ["{}"]) == ([], {"completions": ["r"]})
    # the old convention: positional strings, and a chat record's messages are no field
    chat = ['{"messages": [{"role": "user", "content": "hi"}], "answer": "4"}']
    assert reward_inputs(positional, ["p"], ["r"], chat) == ([["p"], ["r"]], {})
    assert record_columns(positional, {}, chat) == {"answer": ["4"]}


def test_evaluate_renders_chat_records_with_the_chat_template(tmp_path, chat_lm_dir):
    chat = [{"role": "user", "content": "2+2?"}]
    (tmp_path / "eval.jsonl").write_text(
        json.dumps({"messages": chat, "answer": "4"}) + "\n"
        + json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    (tmp_path / "seen.py").write_text(
        "import json, pathlib\n"
        "def score(prompts, responses, answer):\n"
        "    pathlib.Path(__file__).with_suffix('.json').write_text(json.dumps(prompts))\n"
        "    return [1.0] * len(responses)\n")
    store = ModelStore({"actor": ModelConfig("actor", "lm", str(chat_lm_dir))})
    stage = create_stage("evaluate", params={"prompts": "eval.jsonl",
                                             "function": "seen.py:score"}, model="actor")
    assert stage.check_params(stage.params, True, tmp_path) is None
    out = stage.run({}, _ctx(store, base_dir=str(tmp_path)))
    assert out["eval/prompts"] == 2 and out["eval/reward_mean"] == 1.0
    # the chat record as generate renders it; the plain one as it is (chat_template: auto)
    assert json.loads((tmp_path / "seen.json").read_text()) == [
        "<bos><|im_start|>user: 2+2?<|im_end|><|im_start|>assistant: ", "1+1="]


def test_evaluate_refuses_a_bad_chat_record_naming_its_line(tmp_path):
    (tmp_path / "eval.jsonl").write_text('{"prompt": "a"}\n{"messages": [{"role": "bot", '
                                         '"content": "hi"}]}\n')
    stage = create_stage("evaluate", params={"prompts": "eval.jsonl", "function":
                                             "rlhfflow.stages.rewards:vowel_ratio"})
    key, message = stage.check_params(stage.params, True, tmp_path)
    assert key == "params.prompts"
    assert message.startswith(f"{tmp_path / 'eval.jsonl'}:2: messages[0].role: unknown role")


def test_evaluate_plays_records_as_episodes_through_a_rollout(tmp_path, chat_lm_dir):
    from rlhfflow.engine.forward import stage_seed

    guess = str(REPO / "examples" / "multiturn" / "envs.py") + ":GuessNumber"
    records = [{"messages": [{"role": "user", "content": f"guess {i}"}], "secret": i}
               for i in range(1, 6)]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rollout = {"env": guess, "max_turns": 3, "max_new_tokens": 6, "max_tokens": 40,
               "info": ["won"]}
    store = ModelStore({"actor": ModelConfig("actor", "lm", str(chat_lm_dir))})
    stage = create_stage("evaluate", "eval", params={"prompts": "eval.jsonl",
                                                     "rollout": rollout, "batch_size": 2},
                         model="actor")
    assert stage.check_params(stage.params, True, tmp_path) is None
    out = stage.run({}, _ctx(store, base_dir=str(tmp_path)))
    # the same episodes as the rollout stage plays on those records, on its own streams
    tok = store.get("actor").tokenizer
    texts = [tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False)
             for r in records]
    ids, mask = pad_prompts([prompt_token_ids(tok, t, templated=True) for t in texts],
                            tok.pad_token_id)
    batch = {"prompt_ids": ids, "prompt_mask": mask, "prompt_index": torch.arange(5),
             "sample_index": torch.zeros(5, dtype=torch.long), "prompt_text": texts,
             "prompt_fields": [json.dumps({k: v for k, v in r.items()}) for r in records]}
    ctx = _ctx(store, base_dir=str(tmp_path))
    direct = create_stage("rollout", params=rollout, model="actor").run(
        batch, StageContext(iteration=0, seed=stage_seed(ctx.seed, "eval"), models=store,
                            settings=ctx.settings))
    assert out["eval/env_reward_mean"] == pytest.approx(float(direct["env_reward"].mean()))
    assert out["eval/reward_mean"] == out["eval/env_reward_mean"]
    assert out["eval/turns_mean"] == pytest.approx(float(direct["turns"].float().mean()))
    assert out["eval/info_won_mean"] == pytest.approx(float(direct["info_won"].mean()))
    assert out["eval/prompts"] == 5
    # a rollout key that is wrong is named under params.rollout
    bad = create_stage("evaluate", params={"prompts": "eval.jsonl",
                                           "rollout": {**rollout, "max_turns": 0}})
    key, message = bad.check_params(bad.params, True, tmp_path)
    assert key == "params.rollout.max_turns" and "greater than 0" in message
    both = create_stage("evaluate", params={"prompts": "eval.jsonl",
                                            "rollout": {"env": guess, "tools": [guess]}})
    assert both.check_params(both.params, True, tmp_path)[0] == "params.rollout.tools"
    streams = create_stage("evaluate", params={"prompts": "eval.jsonl",
                                               "rollout": {**rollout, "stream": True}})
    assert streams.check_params(streams.params, True, tmp_path)[0] == "params.rollout.stream"


def test_evaluate_runs_every_k_iterations_and_in_the_run_s_last(tmp_path, chat_lm_dir):
    (tmp_path / "eval.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    store = ModelStore({"actor": ModelConfig("actor", "lm", str(chat_lm_dir))})

    def evaluated(iteration, iterations=None, **params):
        stage = create_stage("evaluate", params={"prompts": "eval.jsonl", "every": 3,
                                                 "function": "rlhfflow.stages.rewards:"
                                                             "vowel_ratio", **params},
                             model="actor")
        ctx = StageContext(iteration=iteration, seed=0, models=store,
                           settings={"base_dir": str(tmp_path), "iterations": iterations})
        return bool(stage.run({}, ctx))

    assert [evaluated(i, 5) for i in range(5)] == [True, False, False, True, True]
    assert [evaluated(i, 5, final=False) for i in range(5)] == \
        [True, False, False, True, False]
    assert evaluated(4) is False  # outside a run (stage test): every K only
