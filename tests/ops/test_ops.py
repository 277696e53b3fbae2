"""Tests for rlhfflow.ops: hand-computed cases plus invariants of each estimator and loss."""

import math

import pytest
import torch

from rlhfflow import ops


def close(actual, expected, atol=1e-5):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=1e-5)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# --- logprobs / kl --------------------------------------------------------------------------


def test_logprobs_from_logits_matches_log_softmax_gather():
    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    expected = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
    close(ops.logprobs_from_logits(logits, labels), expected)


def test_logprobs_from_logits_is_a_distribution_and_float32():
    logits = torch.randn(1, 3, 6).to(torch.bfloat16)
    per_label = torch.stack(
        [ops.logprobs_from_logits(logits, torch.full((1, 3), v)) for v in range(6)], dim=-1
    )
    assert per_label.dtype == torch.float32
    assert (per_label <= 0).all()
    close(per_label.exp().sum(-1), torch.ones(1, 3))


def test_logprobs_from_logits_hand_case():
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]]))
    close(ops.logprobs_from_logits(logits, torch.tensor([[1]])), [[math.log(0.25)]])


def test_kl_hand_values():
    lp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    ln2 = math.log(2.0)
    close(ops.kl(lp, ref), [[ln2]])
    close(ops.kl(lp, ref, "k1"), [[ln2]])
    close(ops.kl(lp, ref, "k2"), [[0.5 * ln2**2]])
    close(ops.kl(lp, ref, "k3"), [[0.5 - 1 + ln2]])  # 0.193147


def test_kl_zero_when_equal_and_k3_nonnegative():
    lp = torch.randn(4, 7)
    for kind in ("k1", "k2", "k3"):
        close(ops.kl(lp, lp, kind), torch.zeros(4, 7))
    ref = lp + 30 * torch.randn(4, 7)  # includes log-ratios far beyond the clamp
    k3 = ops.kl(lp, ref, "k3")
    assert torch.isfinite(k3).all() and (k3 >= 0).all()
    assert (ops.kl(lp, ref, "k2") >= 0).all()


def test_kl_unknown_kind_raises():
    with pytest.raises(ValueError, match="k3"):
        ops.kl(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


# --- masked statistics ----------------------------------------------------------------------


def test_masked_mean_and_var_hand_values():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, float("nan")]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 0]])
    close(ops.masked_mean(x, mask), 8.0 / 3)  # NaN under the mask does not leak
    close(ops.masked_mean(x, mask, dim=-1), [1.5, 5.0])
    close(ops.masked_mean(x, torch.zeros_like(mask)), 0.0)
    v, m = torch.tensor([1.0, 2.0, 3.0, 100.0]), torch.tensor([1, 1, 1, 0])
    close(ops.masked_var(v, m), 1.0)
    close(ops.masked_var(v, m, unbiased=False), 2.0 / 3)
    close(ops.masked_var(v, torch.tensor([0, 1, 0, 0])), 0.0)


def test_masked_whiten_zero_mean_unit_var_on_valid():
    x = 3.0 + 5.0 * torch.randn(4, 10)
    mask = (torch.rand(4, 10) > 0.3).long()
    w = ops.masked_whiten(x, mask)
    close(ops.masked_mean(w, mask), 0.0)
    close(ops.masked_var(w, mask), 1.0, atol=1e-4)
    assert (w[mask == 0] == 0).all()
    w2 = ops.masked_whiten(x, mask, shift_mean=False)
    close(ops.masked_mean(w2, mask), ops.masked_mean(x, mask), atol=1e-4)
    close(ops.masked_var(w2, mask), 1.0, atol=1e-4)


# --- GAE ------------------------------------------------------------------------------------


def test_gae_hand_case():
    # gamma=0.9, lam=0.8 (gamma*lam=0.72), V after last token = 0:
    # t=2: delta = 2 + 0 - 1.5 = 0.5                       A2 = 0.5
    # t=1: delta = 0 + 0.9*1.5 - 1.0 = 0.35                A1 = 0.35 + 0.72*0.5 = 0.71
    # t=0: delta = 1 + 0.9*1.0 - 0.5 = 1.4                 A0 = 1.4 + 0.72*0.71 = 1.9112
    rewards, values = torch.tensor([[1.0, 0.0, 2.0]]), torch.tensor([[0.5, 1.0, 1.5]])
    adv, ret = ops.gae(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.8)
    close(adv, [[1.9112, 0.71, 0.5]])
    close(ret, [[2.4112, 1.71, 2.0]])


def test_gae_skips_interior_masked_position():
    # Same as the hand case with a garbage token inserted at index 1 and masked out.
    rewards = torch.tensor([[1.0, 5.0, 0.0, 2.0]])
    values = torch.tensor([[0.5, float("inf"), 1.0, 1.5]])
    mask = torch.tensor([[1, 0, 1, 1]])
    adv, ret = ops.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    close(adv, [[1.9112, 0.0, 0.71, 0.5]])
    close(ret, [[2.4112, 0.0, 1.71, 2.0]])


def test_gae_lambda_one_gamma_one_zero_values_is_reward_to_go():
    rewards = torch.randn(3, 6)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 0, 1, 1, 0, 0]])
    adv, ret = ops.gae(rewards, torch.zeros(3, 6), mask, gamma=1.0, lam=1.0)
    masked_r = rewards * mask
    to_go = masked_r.flip(-1).cumsum(-1).flip(-1) * mask
    close(adv, to_go)
    close(ret, to_go)


def _gae_reference(rewards, values, mask, gamma, lam):
    """Per-sample, per-token reference: drop masked tokens, run textbook GAE, re-insert 0."""
    adv = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        idx = [t for t in range(rewards.shape[1]) if mask[b, t]]
        last, next_v = 0.0, 0.0
        for t in reversed(idx):
            delta = rewards[b, t].item() + gamma * next_v - values[b, t].item()
            last = delta + gamma * lam * last
            next_v = values[b, t].item()
            adv[b, t] = last
    return adv, (adv + values) * mask


def test_gae_matches_python_reference_on_random_padded_batches():
    B, T = 8, 12
    rewards, values = torch.randn(B, T, dtype=torch.float64), torch.randn(B, T, dtype=torch.float64)
    lengths = torch.randint(0, T + 1, (B,))
    mask = (torch.arange(T) < lengths[:, None]).long()
    mask = mask * (torch.rand(B, T) > 0.2).long()  # interior holes
    adv, ret = ops.gae(rewards, values, mask, gamma=0.97, lam=0.9)
    ref_adv, ref_ret = _gae_reference(rewards, values, mask, 0.97, 0.9)
    close(adv, ref_adv, atol=1e-10)
    close(ret, ref_ret, atol=1e-10)


def test_gae_output_is_detached():
    values = torch.randn(2, 3, requires_grad=True)
    adv, ret = ops.gae(torch.randn(2, 3), values, torch.ones(2, 3), 1.0, 0.95)
    assert not adv.requires_grad and not ret.requires_grad


# --- group advantages -----------------------------------------------------------------------


def test_grpo_hand_case_and_invariants():
    adv = ops.group_advantages(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 0, 0]))
    close(adv, [-1.0, 0.0, 1.0])  # mean 2, unbiased std 1
    scores = torch.randn(8)
    adv = ops.group_advantages(scores, torch.zeros(8, dtype=torch.long))
    close(adv.mean(), 0.0)
    close(adv.std(unbiased=True), 1.0, atol=1e-5)


def test_grpo_singleton_and_constant_groups_give_zero():
    scores = torch.tensor([5.0, 1.0, 1.0, 1.0])
    ids = torch.tensor([9, 4, 4, 4])
    for mode in ("grpo", "rloo", "dr_grpo"):
        adv = ops.group_advantages(scores, ids, mode=mode)
        close(adv, torch.zeros(4))


def test_rloo_hand_case():
    # n=4, sum=12: a_i = s_i - (12 - s_i) / 3
    adv = ops.group_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0]), torch.zeros(4).long(), "rloo")
    close(adv, [1 - 11 / 3, 2 - 10 / 3, 0.0, 4.0])


def test_dr_grpo_hand_case():
    adv = ops.group_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0]), torch.zeros(4).long(), "dr_grpo")
    close(adv, [-2.0, -1.0, 0.0, 3.0])


def test_group_ids_non_contiguous_and_unsorted():
    scores = torch.tensor([1.0, 4.0, 3.0, 10.0, 8.0])
    ids = torch.tensor([7, 100, 7, -3, 100])
    r = 1 / math.sqrt(2)  # both pairs: |centered| / unbiased std = 1/sqrt(2)
    close(ops.group_advantages(scores, ids), [-r, -r, r, 0.0, r])
    close(ops.group_advantages(scores, ids, "rloo"), [-2.0, -4.0, 2.0, 0.0, 4.0])
    close(ops.group_advantages(scores, ids, "dr_grpo"), [-1.0, -2.0, 1.0, 0.0, 2.0])


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="grpo"):
        ops.group_advantages(torch.ones(2), torch.zeros(2).long(), mode="ppo")
    with pytest.raises(ValueError):
        ops.group_advantages(torch.ones(3), torch.zeros(2).long())


# --- policy / value loss --------------------------------------------------------------------


def test_policy_loss_ratio_one_is_minus_mean_advantage():
    lp = torch.randn(3, 5)
    adv = torch.randn(3, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    loss, stats = ops.policy_loss(lp, lp.clone(), adv, mask)
    close(loss, -ops.masked_mean(adv, mask))
    assert stats["clip_frac"] == 0.0
    assert stats["ratio_mean"] == pytest.approx(1.0)
    assert stats["approx_kl"] == pytest.approx(0.0, abs=1e-7)
    assert all(isinstance(v, float) for v in stats.values())


def test_policy_loss_clipping_hand_case():
    ratio = torch.tensor([[1.5, 0.5, 0.5, 1.5]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    # per token max(-A*r, -A*clip(r, 0.8, 1.2)): [-1.2 (clip), 0.8 (clip), -0.5, 1.5]
    loss, stats = ops.policy_loss(ratio.log(), torch.zeros(1, 4), adv, torch.ones(1, 4))
    close(loss, 0.6 / 4)
    assert stats["clip_frac"] == pytest.approx(0.5)
    assert stats["ratio_mean"] == pytest.approx(1.0)
    # k3 of KL(old||new): exp(lr) - 1 - lr
    k3 = [0.5 - math.log(1.5), -0.5 + math.log(2.0)]
    assert stats["approx_kl"] == pytest.approx((k3[0] + k3[1]) / 2, abs=1e-6)


def test_policy_loss_asymmetric_clip():
    lp = torch.log(torch.tensor([[1.5]]))
    loss, _ = ops.policy_loss(
        lp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), clip_low=0.2, clip_high=0.28
    )
    close(loss, -1.28)


def test_policy_loss_dual_clip():
    lp = torch.log(torch.tensor([[5.0, 5.0]]))
    adv = torch.tensor([[-1.0, 1.0]])
    mask, old = torch.ones(1, 2), torch.zeros(1, 2)
    plain, _ = ops.policy_loss(lp, old, adv, mask)  # tokens: [5.0, -1.2]
    close(plain, (5.0 - 1.2) / 2)
    dual, _ = ops.policy_loss(lp, old, adv, mask, dual_clip=3.0)  # A<0 capped at 3
    close(dual, (3.0 - 1.2) / 2)
    with pytest.raises(ValueError):
        ops.policy_loss(lp, old, adv, mask, dual_clip=0.5)


def test_policy_loss_aggregations_differ_with_unequal_lengths():
    lp = torch.zeros(3, 3)
    adv = torch.tensor([[1.0, 1.0, 99.0], [4.0, 99.0, 99.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # last row: no valid token
    tok, _ = ops.policy_loss(lp, lp, adv, mask, agg="token-mean")
    seq, _ = ops.policy_loss(lp, lp, adv, mask, agg="seq-mean-token-mean")
    close(tok, -(1 + 1 + 4) / 3)
    close(seq, -(1 + 4) / 2)
    with pytest.raises(ValueError, match="token-mean"):
        ops.policy_loss(lp, lp, adv, mask, agg="seq-sum")


def test_policy_loss_gradient_flows_to_logprobs_only_on_valid_tokens():
    lp = torch.randn(2, 4, requires_grad=True)
    adv = torch.randn(2, 4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    loss, _ = ops.policy_loss(lp, lp.detach(), adv, mask)
    loss.backward()
    # ratio=1 is inside the clip range, so d loss / d lp = -A / n_valid
    close(lp.grad, -adv * mask / 5)


def test_value_loss_hand_case():
    values = torch.tensor([[1.0, 2.0, 1.0]])
    old = torch.tensor([[0.0, 2.0, 0.0]])
    returns = torch.tensor([[2.0, 0.0, 0.0]])
    mask = torch.ones(1, 3)
    # token0: v_clip=0.2 -> max(1, 3.24)=3.24 (clipped); token1: 4; token2: max(1, 0.04)=1
    loss, stats = ops.value_loss(values, old, returns, mask, clip=0.2)
    close(loss, 0.5 * (3.24 + 4.0 + 1.0) / 3)
    assert stats["value_clip_frac"] == pytest.approx(1 / 3)
    assert stats["values_mean"] == pytest.approx(4 / 3)
    loss, stats = ops.value_loss(values, old, returns, mask, clip=None)
    close(loss, 0.5 * (1.0 + 4.0 + 1.0) / 3)
    assert stats["value_clip_frac"] == 0.0


def test_value_loss_respects_mask_and_is_differentiable():
    values = torch.tensor([[1.0, 50.0]], requires_grad=True)
    loss, _ = ops.value_loss(
        values, torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([[1, 0]]), clip=None
    )
    close(loss, 0.5)
    loss.backward()
    close(values.grad, [[1.0, 0.0]])


# --- entropy --------------------------------------------------------------------------------


def test_entropy_uniform_is_log_v_and_hand_case():
    close(ops.entropy(torch.zeros(2, 3, 7)), math.log(7))
    close(ops.entropy_from_logits(torch.zeros(2, 3, 7)), torch.full((2, 3), math.log(7)))
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [1.0, 1e-30, 1e-30]]]))
    # H(0.5, .25, .25) = 1.5 ln 2; the near-one-hot token has ~0 entropy and is masked anyway
    close(ops.entropy_from_logits(logits), [[1.5 * math.log(2), 0.0]])
    close(ops.entropy(logits, torch.tensor([[1, 0]])), 1.5 * math.log(2))


# --- token rewards --------------------------------------------------------------------------


def test_token_rewards_hand_case():
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0])
    kl = torch.tensor(
        [[0.1, 0.2, 0.3, 0.4], [0.0, 0.0, 0.2, 0.2], [0.1, 0.1, 0.1, 0.1], [0.0, 0.2, 0.2, 0.0]]
    )
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 1, 0]])
    out = ops.token_rewards(scores, kl, mask, kl_coef=0.5)
    close(
        out,
        [
            [-0.05, -0.1, -0.15 + 1.0, 0.0],  # right padding: score at index 2
            [0.0, 0.0, -0.1, -0.1 + 2.0],  # full row: score at the last index
            [0.0, 0.0, 0.0, 0.0],  # no valid token: no score
            [0.0, -0.1, -0.1 + 4.0, 0.0],  # left and right padding
        ],
    )


# --- group scaling (TRL scale_rewards) ------------------------------------------------------


def test_grpo_scale_batch_and_none_hand_case():
    # groups {1, 3} and {2, 6}: centred [-1, 1, -2, 2]; batch std of [1, 3, 2, 6] (unbiased)
    scores, ids = torch.tensor([1.0, 3.0, 2.0, 6.0]), torch.tensor([0, 0, 1, 1])
    batch_std = math.sqrt(((1 - 3) ** 2 + 0 + (2 - 3) ** 2 + (6 - 3) ** 2) / 3)  # sqrt(14/3)
    close(ops.group_advantages(scores, ids, scale="batch"),
          [-1 / batch_std, 1 / batch_std, -2 / batch_std, 2 / batch_std])
    close(ops.group_advantages(scores, ids, scale="none"), [-1.0, 1.0, -2.0, 2.0])
    close(ops.group_advantages(scores, ids, scale="none"),
          ops.group_advantages(scores, ids, "dr_grpo"))
    r = 1 / math.sqrt(2)  # group std: sqrt(2) and 2*sqrt(2)
    close(ops.group_advantages(scores, ids, scale="group"), [-r, r, -r, r])
    with pytest.raises(ValueError, match="batch"):
        ops.group_advantages(scores, ids, scale="global")


def test_grpo_scale_batch_keeps_a_group_of_one_at_zero():
    adv = ops.group_advantages(torch.tensor([5.0, 1.0, 3.0]), torch.tensor([9, 4, 4]),
                               scale="batch")
    assert adv[0] == 0.0


# --- REINFORCE++ and ReMax ------------------------------------------------------------------


def test_reinforce_plus_plus_hand_case():
    # gamma 0.5: row 0 rewards [1, 0, 2] -> returns [1 + 0.5*(0 + 0.5*2), 0 + 0.5*2, 2]
    #            row 1 rewards [0, 4, pad] -> returns [2, 4, 0]
    rewards = torch.tensor([[1.0, 0.0, 2.0], [0.0, 4.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = ops.reinforce_plus_plus(rewards, mask, gamma=0.5)
    close(ret, [[1.5, 1.0, 2.0], [2.0, 4.0, 0.0]])
    valid = torch.tensor([1.5, 1.0, 2.0, 2.0, 4.0])
    expected = (valid - valid.mean()) / valid.std()
    close(adv, [expected[:3].tolist(), [*expected[3:].tolist(), 0.0]], atol=1e-4)


def test_reinforce_plus_plus_baseline_hand_case():
    # groups {1, 3} -> centred [-1, 1]; {5} alone -> 0; tokens: 2, 1, 2 valid
    scores, ids = torch.tensor([1.0, 3.0, 5.0]), torch.tensor([0, 0, 1])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    adv = ops.reinforce_plus_plus_baseline(scores, ids, mask)
    tokens = torch.tensor([-1.0, -1.0, 1.0, 0.0, 0.0])  # valid tokens, row by row
    w = (tokens - tokens.mean()) / tokens.std()
    close(adv, [[w[0], w[1]], [w[2], 0.0], [w[3], w[4]]], atol=1e-4)


def test_remax_hand_case():
    token_rewards = torch.tensor([[-0.1, -0.1, 2.0], [0.0, 1.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = ops.remax(token_rewards, torch.tensor([1.0, 0.5]), mask)
    close(ret, [[1.8, 1.9, 2.0], [1.0, 1.0, 0.0]])
    close(adv, [[0.8, 0.9, 1.0], [0.5, 0.5, 0.0]])


# --- loss aggregation (veRL agg_loss) -------------------------------------------------------


AGG_LOSS = torch.tensor([[1.0, 2.0, 99.0, 99.0], [3.0, 99.0, 99.0, 99.0],
                         [99.0, 99.0, 99.0, 99.0], [4.0, 5.0, 6.0, 7.0]])
AGG_MASK = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])


@pytest.mark.parametrize(("agg", "expected"), [
    ("token-mean", (1 + 2 + 3 + 4 + 5 + 6 + 7) / 7),
    ("seq-mean-token-mean", (1.5 + 3.0 + 5.5) / 3),  # the empty row is not a sequence
    ("token-sum", 28.0),
    ("seq-mean-token-sum", (3 + 3 + 22) / 3),
    ("seq-mean-token-sum-norm", 28.0 / 4),  # divided by the response length
])
def test_aggregate_loss_hand_values(agg, expected):
    close(ops.aggregate_loss(AGG_LOSS, AGG_MASK, agg), expected)


@pytest.mark.parametrize("agg", ops.LOSS_AGGS)
def test_aggregate_loss_shards_add_up_to_the_whole_batch(agg):
    loss = torch.randn(8, 6)
    mask = (torch.rand(8, 6) > 0.4).long()
    mask[3] = 0
    whole = ops.aggregate_loss(loss, mask, agg)
    count = ops.loss_count(mask, agg)
    shards = [ops.aggregate_loss(loss[i:i + 3], mask[i:i + 3], agg, count) for i in (0, 3, 6)]
    close(sum(shards), whole)


def test_seq_mean_token_sum_norm_takes_a_constant_divisor():
    close(ops.aggregate_loss(AGG_LOSS, AGG_MASK, "seq-mean-token-sum-norm", count=16.0), 1.75)
    assert ops.loss_count(AGG_MASK, "seq-mean-token-sum-norm", 16.0) == 16.0
    assert ops.loss_count(AGG_MASK, "seq-mean-token-sum-norm") == 4.0
    assert ops.loss_count(AGG_MASK, "token-sum") == 1.0
    assert ops.loss_count(AGG_MASK, "seq-mean-token-sum") == 3.0
    with pytest.raises(ValueError, match="token-sum"):
        ops.aggregate_loss(AGG_LOSS, AGG_MASK, "seq-sum")


def test_policy_value_and_entropy_losses_take_every_mode():
    lp = torch.zeros(4, 4)
    for agg in ops.LOSS_AGGS:
        loss, _ = ops.policy_loss(lp, lp, -AGG_LOSS, AGG_MASK, agg=agg)  # ratio 1: loss = -A
        close(loss, ops.aggregate_loss(AGG_LOSS, AGG_MASK, agg))
        values = torch.zeros(4, 4)
        vloss, _ = ops.value_loss(values, values, AGG_LOSS.sqrt(), AGG_MASK, clip=None, agg=agg)
        close(vloss, 0.5 * ops.aggregate_loss(AGG_LOSS, AGG_MASK, agg))
        logits = torch.zeros(4, 4, 5)  # uniform: every token's entropy is log 5
        close(ops.entropy(logits, AGG_MASK, agg=agg),
              math.log(5) * ops.aggregate_loss(torch.ones(4, 4), AGG_MASK, agg))


# --- sequence-level importance ratios (GSPO) ------------------------------------------------


def test_sequence_level_ratio_is_the_geometric_mean_of_token_ratios():
    old = torch.zeros(2, 3)
    lp = torch.tensor([[0.1, -0.3, 0.5], [0.2, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3])
    loss, stats = ops.policy_loss(lp, old, adv, mask, clip_low=1.0, clip_high=1.0,
                                  agg="seq-mean-token-mean", level="sequence")
    s0, s1 = math.exp(0.3 / 3), math.exp(0.2)  # padding (9.0) is left out of the mean
    close(loss, (-s0 + s1) / 2)
    assert stats["ratio_mean"] == pytest.approx((3 * s0 + s1) / 4)


def test_sequence_level_gradient_matches_trl_under_seq_mean_token_mean():
    # TRL: ratio (B, 1) = exp(mean log-ratio) broadcast over the tokens; veRL's GSPO-token
    # form used here must give the same gradient under seq-mean-token-mean.
    old = -torch.rand(3, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    adv = torch.tensor([0.7, -1.2, 0.4])[:, None].expand(3, 5)
    base = old + 0.05 * torch.randn(3, 5)
    lp = base.clone().requires_grad_(True)
    loss, _ = ops.policy_loss(lp, old, adv, mask, agg="seq-mean-token-mean", level="sequence")
    loss.backward()
    lp_trl = base.clone().requires_grad_(True)
    seq = ((lp_trl - old) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)
    ratio = seq.exp()
    per_token = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    trl = ((per_token * mask).sum(-1) / mask.sum(-1)).mean()
    trl.backward()
    close(loss.detach(), trl.detach())
    close(lp.grad, lp_trl.grad)


def test_sequence_level_clips_whole_sequences():
    old = torch.zeros(1, 2)
    lp = torch.log(torch.tensor([[2.0, 2.0]]))  # token ratios 2 -> sequence ratio 2
    loss, stats = ops.policy_loss(lp, old, torch.ones(1, 2), torch.ones(1, 2),
                                  level="sequence")
    close(loss, -1.2)
    assert stats["clip_frac"] == 1.0
    with pytest.raises(ValueError, match="sequence"):
        ops.policy_loss(lp, old, torch.ones(1, 2), torch.ones(1, 2), level="seq")


def test_clip_frac_lower_counts_dual_clip_activity():
    lp = torch.log(torch.tensor([[5.0, 2.0, 5.0, 0.5]]))
    adv = torch.tensor([[-1.0, -1.0, 1.0, -1.0]])
    # A<0 tokens: ratio 5 -> max(5, 1.2) = 5 > cap 3 (active); ratio 2 -> 2 < 3; ratio
    # 0.5 -> max(0.5, 0.8) = 0.8 < 3; A>0 never counts
    _, stats = ops.policy_loss(lp, torch.zeros(1, 4), adv, torch.ones(1, 4), dual_clip=3.0)
    assert stats["clip_frac_lower"] == pytest.approx(0.25)
    _, stats = ops.policy_loss(lp, torch.zeros(1, 4), adv, torch.ones(1, 4))
    assert "clip_frac_lower" not in stats


# --- value clip fraction --------------------------------------------------------------------


def test_value_clip_frac_counts_only_tokens_outside_the_clip_range():
    # v and old of different signs and sizes, so that v - old is rounded in float32 and
    # old + (v - old) is often not v: the old formula counted such in-range tokens as
    # clipped (0.182 here, and 0.025 on in-range tokens only). Reference: float64.
    old = torch.randn(64, 32) * 0.1
    values = torch.randn(64, 32) * 0.2
    returns = torch.randn(64, 32)
    _, stats = ops.value_loss(values, old, returns, torch.ones(64, 32), clip=0.2)
    v, o, r = values.double(), old.double(), returns.double()
    v_clip = torch.minimum(torch.maximum(v, o - 0.2), o + 0.2)
    expected = ((v_clip - r).square() > (v - r).square()).double().mean().item()
    assert stats["value_clip_frac"] == pytest.approx(expected, abs=1e-6)
    inside = (values - old).abs() < 0.19
    assert inside.any() and not inside.all()
    _, stats = ops.value_loss(values, old, returns, inside, clip=0.2)
    assert stats["value_clip_frac"] == 0.0


# --- registry -------------------------------------------------------------------------------


class _Config:
    """The algorithm settings the built-in estimators read (as AlgorithmSpec has them)."""

    gamma, lam, whiten_advantages, scale_rewards = 0.9, 0.8, False, None
    clip_low, clip_high, dual_clip, importance_sampling_level = 0.2, 0.2, None, "token"


def _inputs(**extra):
    g = torch.Generator().manual_seed(1)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    base = {"scores": torch.rand(4, generator=g), "token_rewards": torch.randn(4, 4, generator=g),
            "mask": mask, "group_ids": torch.tensor([0, 0, 1, 1]), "config": _Config()}
    return {**base, **extra}


def test_advantage_estimator_registry():
    assert {"gae", "grpo", "rloo", "dr_grpo", "reinforce_plus_plus",
            "reinforce_plus_plus_baseline", "remax"} <= set(ops.ADVANTAGE_ESTIMATORS)
    values = torch.randn(4, 4)
    inputs = _inputs(values=values)
    adv, ret = ops.call(ops.get_advantage_estimator("gae"), inputs)
    ref_adv, ref_ret = ops.gae(inputs["token_rewards"], values, inputs["mask"], 0.9, 0.8)
    close(adv, ref_adv)
    close(ret, ref_ret)
    scores, ids, mask = inputs["scores"], inputs["group_ids"], inputs["mask"]
    for mode in ("grpo", "rloo", "dr_grpo"):
        adv, ret = ops.call(ops.get_advantage_estimator(mode), inputs)
        close(adv, ops.group_advantages(scores, ids, mode)[:, None] * mask)
        assert ret is None
    adv, _ = ops.call(ops.get_advantage_estimator("reinforce_plus_plus"), inputs)
    close(adv, ops.reinforce_plus_plus(inputs["token_rewards"], mask, 0.9)[0])
    baseline = torch.tensor([0.5, 0.1, 0.2, 0.3])
    adv, _ = ops.call(ops.get_advantage_estimator("remax"), _inputs(baseline_scores=baseline))
    close(adv, ops.remax(inputs["token_rewards"], baseline, mask)[0])
    assert ops.estimator_needs(ops.get_advantage_estimator("gae")) == ("values",)
    assert ops.estimator_needs(ops.get_advantage_estimator("remax")) == ("baseline_scores",)
    assert ops.estimator_needs(ops.get_advantage_estimator("grpo")) == ()
    with pytest.raises(ValueError, match="grpo"):
        ops.get_advantage_estimator("nope")


def test_grpo_estimator_reads_scale_rewards_from_the_config():
    config = _Config()
    config.scale_rewards = "batch"
    inputs = _inputs(config=config)
    adv, _ = ops.call(ops.get_advantage_estimator("grpo"), inputs)
    expected = ops.group_advantages(inputs["scores"], inputs["group_ids"], scale="batch")
    close(adv, expected[:, None] * inputs["mask"])
    adv, _ = ops.call(ops.get_advantage_estimator("dr_grpo"), inputs)
    close(adv, expected[:, None] * inputs["mask"])


def test_register_new_estimator_and_reject_conflicts():
    @ops.register_advantage_estimator("_test_constant")
    def constant(scores, mask):
        return torch.ones_like(scores)[:, None] * mask, None

    try:
        assert ops.get_advantage_estimator("_test_constant") is constant
        adv, _ = ops.call(constant, _inputs())  # takes only the inputs it names
        close(adv, _inputs()["mask"].float())
        with pytest.raises(ValueError):
            ops.register_advantage_estimator("_test_constant")(lambda s, g: s)
        with pytest.raises(ValueError, match="needs"):
            ops.register_advantage_estimator("_test_other", needs=("critic",))
    finally:
        ops.ADVANTAGE_ESTIMATORS.pop("_test_constant")


def test_policy_loss_registry_and_import_paths():
    assert ops.get_policy_loss("ppo") is ops.resolve_policy_loss("ppo")
    lp, mask = torch.randn(2, 3), torch.ones(2, 3)
    adv = torch.randn(2, 3)
    loss, stats = ops.call(ops.get_policy_loss("ppo"), {
        "logprobs": lp, "old_logprobs": lp, "advantages": adv, "mask": mask,
        "agg": "token-mean", "count": None, "config": _Config()})
    close(loss, -adv.mean())
    assert ops.resolve_advantage_estimator("rlhfflow.ops.advantages:remax") is ops.remax
    with pytest.raises(ValueError, match="cannot import module 'no_such_mod'"):
        ops.resolve_policy_loss("no_such_mod:f")
    with pytest.raises(ValueError, match="has no callable 'nope'"):
        ops.resolve_advantage_estimator("rlhfflow.ops:nope")


def test_signature_problem_names_the_missing_input():
    assert ops.signature_problem(lambda scores, mask, **_: None, ops.ESTIMATOR_INPUTS) is None
    assert ops.signature_problem(lambda scores, prompts: None, ops.ESTIMATOR_INPUTS) == (
        "it takes parameter 'prompts', which is not provided (provided: scores, "
        "token_rewards, mask, group_ids, values, baseline_scores, config)")
    assert ops.takes(lambda scores, **kw: None, "group_ids")
    assert not ops.takes(lambda scores: None, "group_ids")
