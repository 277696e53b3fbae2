"""Preference ops and stages alone (no Dask): the DPO loss's math, pairing and best-of-N
selection within prompt groups, and the select / train_sft / train_dpo /
train_dpo_online stages on real tiny models."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rlhfflow import ops
from rlhfflow.stages import StageContext, create_stage
from rlhfflow.stages.preference import dpo_pair_loss
from rlhfflow.stages.train import sft_loss
from tests.conftest import DATA, make_prompt_batch

# --------------------------------------------------------------------------- ops


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_the_dpo_loss_is_log_2_when_the_policy_is_the_reference(label_smoothing):
    logps = torch.tensor([-3.0, -7.5, -0.25])
    other = torch.tensor([-1.0, -2.0, -9.0])
    losses, chosen, rejected = ops.dpo_loss(logps, other, logps, other, 0.5, label_smoothing)
    torch.testing.assert_close(losses, torch.full((3,), math.log(2.0)))
    assert chosen.abs().max() == 0 and rejected.abs().max() == 0


def test_the_dpo_loss_matches_its_formula():
    beta, eps = 0.1, 0.1
    # log-ratios: chosen +2, rejected -3 -> h = 5, beta h = 0.5
    losses, chosen, rejected = ops.dpo_loss(torch.tensor([-1.0]), torch.tensor([-6.0]),
                                            torch.tensor([-3.0]), torch.tensor([-3.0]),
                                            beta, eps)
    sig = 1 / (1 + math.exp(-0.5))
    expected = -(1 - eps) * math.log(sig) - eps * math.log(1 - sig)
    assert losses.item() == pytest.approx(expected, rel=1e-6)
    assert chosen.item() == pytest.approx(0.2) and rejected.item() == pytest.approx(-0.3)


def test_pairs_are_each_groups_best_and_worst_and_ties_are_counted():
    scores = torch.tensor([0.1, 0.5, 0.3, 0.3, 0.9, 0.2, 0.7, 0.4, 0.8, 0.8])
    groups = torch.tensor([7, 7, 3, 3, 5, 5, 9, 9, 9, 1])
    valid = torch.tensor([1, 1, 1, 1, 1, 1, 1, 1, 1, 0]).bool()
    chosen, rejected, ties = ops.preference_pairs(scores, groups, valid)
    # groups in id order: 1 (one valid row: no pair, no tie), 3 (tie), 5, 7, 9
    assert chosen.tolist() == [4, 1, 8]
    assert rejected.tolist() == [5, 0, 7]
    assert ties == 1


def test_best_in_group_keeps_top_k_per_prompt_with_ties_by_row_order():
    scores = torch.tensor([0.2, 0.9, 0.9, 0.1, 0.5, 0.4, 0.6, 0.3])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    assert ops.best_in_group(scores, groups).nonzero().flatten().tolist() == [1, 6]
    assert ops.best_in_group(scores, groups, top_k=2).nonzero().flatten().tolist() == \
        [1, 2, 4, 6]
    valid = torch.tensor([1, 0, 1, 1, 1, 1, 1, 1]).bool()
    assert ops.best_in_group(scores, groups, valid).nonzero().flatten().tolist() == [2, 6]
    kept = ops.best_in_group(scores, groups, top_k=2, min_score=0.55)
    assert kept.nonzero().flatten().tolist() == [1, 2, 6]


# --------------------------------------------------------------------------- stages


def _ctx(store, iteration=0):
    return StageContext(iteration=iteration, seed=0, models=store,
                        settings={"base_dir": str(DATA)})


def test_offline_dpo_starts_at_log_2_and_raises_the_preference_accuracy(store):
    """Step 0, with the actor equal to the reference, is exactly log 2; training passes
    raise the implicit reward margin and accuracy on the training pairs."""
    stage = create_stage("train_dpo", "dpo", {"data": "preferences.jsonl", "ref": "ref",
                                              "epochs": 1, "batch_size": 64,
                                              "shuffle": False}, model="actor")
    actor = store.get("actor")
    pairs = stage.examples(actor, DATA, _ctx(store))
    assert len(pairs["chosen_ids"]) == 64
    before, stats = dpo_pair_loss(actor.module, pairs, stage.params)
    assert before.item() == pytest.approx(math.log(2.0), abs=1e-6)
    assert stats["reward_margin"] == pytest.approx(0.0, abs=1e-5)
    accuracy = []
    for _ in range(4):
        accuracy.append(stage.run({}, _ctx(store))["reward_accuracy"])
    _, after = dpo_pair_loss(actor.module, pairs, stage.params)
    assert after["reward_margin"] > 0.1 and after["reward_accuracy"] > 0.8, after
    assert accuracy[-1] > accuracy[0], accuracy


def _scored_batch(tokenizer, store, scores, samples):
    """Prompt rows with sampled responses, given scores and reference log-probs."""
    batch = make_prompt_batch(tokenizer, [f"tell of a leaf {i}:" for i in
                                          range(len(scores) // samples)], samples=samples)
    out = create_stage("generate", "generate", {"max_new_tokens": 6}, model="actor").run(
        batch, _ctx(store))
    batch.update(out)
    batch["ref_logprobs"] = create_stage("logprob", "ref", {"output": "ref_logprobs"},
                                         model="ref").run(batch, _ctx(store))["ref_logprobs"]
    batch["scores"] = torch.tensor(scores)
    batch["score_valid"] = torch.ones(len(scores), dtype=torch.int8)
    return batch


def test_online_dpo_pairs_best_with_worst_and_skips_ties(store, tokenizer):
    batch = _scored_batch(tokenizer, store, [0.1, 0.5, 0.3, 0.3, 0.9, 0.2], samples=2)
    stage = create_stage("train_dpo_online", "dpo", {"minibatches": 1, "shuffle": False},
                         model="actor")
    stats = stage.run(batch, _ctx(store))
    assert (stats["pairs"], stats["ties"]) == (2, 1)
    # the first step's loss is taken with the actor still equal to the reference
    assert stats["dpo_loss"] == pytest.approx(math.log(2.0), abs=1e-5)
    assert stats["reward_accuracy"] == 0.0  # before the step: no margin yet


def test_select_then_train_sft_learns_from_the_best_rows_only(store, tokenizer):
    batch = _scored_batch(tokenizer, store, [0.1, 0.5, 0.3, 0.2, 0.9, 0.2, 0.2, 0.6],
                          samples=4)
    selected = create_stage("select", "select").run(batch, _ctx(store))["selected"]
    assert selected.tolist() == [0, 1, 0, 0, 1, 0, 0, 0]
    batch["selected"] = selected
    actor = store.get("actor")
    before = copy.deepcopy(actor.module)
    rows = selected.bool()
    expected, _ = sft_loss(before, {k: v[rows] for k, v in batch.items()
                                    if isinstance(v, torch.Tensor)})
    stats = create_stage("train_sft", "sft", {"minibatches": 1}, model="actor").run(
        batch, _ctx(store))
    assert stats["rows_trained"] == 2
    # one step on one minibatch: its loss is the loss of the two selected rows
    assert stats["sft_loss"] == pytest.approx(expected.item(), rel=1e-5)


def test_an_iteration_with_nothing_to_learn_from_takes_no_step(store, tokenizer):
    """All ties (online DPO) or nothing above min_score (best-of-N): no optimizer step,
    the weights stay, and the model's version still advances (the plan counts on it)."""
    batch = _scored_batch(tokenizer, store, [0.3, 0.3, 0.5, 0.5], samples=2)
    actor = store.get("actor")
    weights = [p.detach().clone() for p in actor.module.parameters()]
    version = actor.version
    stats = create_stage("train_dpo_online", "dpo", model="actor").run(batch, _ctx(store))
    assert (stats["pairs"], stats["ties"]) == (0, 2)
    batch["selected"] = create_stage("select", "select", {"min_score": 0.9}).run(
        batch, _ctx(store))["selected"]
    stats = create_stage("train_sft", "sft", model="actor").run(batch, _ctx(store))
    assert stats["rows_trained"] == 0
    assert actor.version == version + 2
    assert all(torch.equal(a, b) for a, b in zip(weights, actor.module.parameters(),
                                                 strict=True))
