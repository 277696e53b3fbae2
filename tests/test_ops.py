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


# --- registry -------------------------------------------------------------------------------


def test_advantage_estimator_registry():
    assert {"gae", "grpo", "rloo", "dr_grpo"} <= set(ops.ADVANTAGE_ESTIMATORS)
    rewards, values, mask = torch.randn(2, 4), torch.randn(2, 4), torch.ones(2, 4)
    adv, ret = ops.get_advantage_estimator("gae")(rewards, values, mask, gamma=0.9, lam=0.8)
    ref_adv, ref_ret = ops.gae(rewards, values, mask, 0.9, 0.8)
    close(adv, ref_adv)
    close(ret, ref_ret)
    scores, ids = torch.randn(6), torch.tensor([0, 0, 0, 1, 1, 1])
    for mode in ("grpo", "rloo", "dr_grpo"):
        close(
            ops.get_advantage_estimator(mode)(scores, ids), ops.group_advantages(scores, ids, mode)
        )
    with pytest.raises(ValueError, match="grpo"):
        ops.get_advantage_estimator("nope")


def test_register_new_estimator_and_reject_conflicts():
    @ops.register_advantage_estimator("_test_constant")
    def constant(scores, group_ids):
        return torch.ones_like(scores)

    try:
        assert ops.get_advantage_estimator("_test_constant") is constant
        with pytest.raises(ValueError):
            ops.register_advantage_estimator("_test_constant")(lambda s, g: s)
    finally:
        ops.ADVANTAGE_ESTIMATORS.pop("_test_constant")
