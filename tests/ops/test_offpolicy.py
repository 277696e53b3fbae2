"""Off-policy correction (``algorithm.off_policy``): each correction's weights against a
reference written here with loops, the uncorrected loss when every token is on-policy,
the train stage's use of both log-prob columns, and its mistakes at validation."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

from rlhfflow import ops
from rlhfflow.cli.main import main
from rlhfflow.config.loader import load_pipeline
from rlhfflow.config.spec import AlgorithmSpec
from rlhfflow.runtime.run import run_pipeline
from tests.conftest import CONFIGS, small_pipeline

CORRECTIONS = ("tis", "mis", "decoupled")
LEVELS = ("token", "sequence", "geometric")


def _batch(seed: int = 0, rows: int = 5, tokens: int = 7):
    gen = torch.Generator().manual_seed(seed)
    behaviour = -torch.rand(rows, tokens, generator=gen) * 3
    proximal = behaviour + torch.randn(rows, tokens, generator=gen) * 0.6
    mask = torch.ones(rows, tokens)
    for row in range(rows):  # ragged responses
        mask[row, tokens - row:] = 0
    return proximal, behaviour, mask


def _reference(proximal, behaviour, mask, correction, level, cap, low, high):
    """One weight at a time, as the papers write them."""
    rows, tokens = mask.shape
    out = torch.zeros(rows, tokens)
    for r in range(rows):
        valid = [t for t in range(tokens) if mask[r, t] > 0]
        logs = [float(proximal[r, t] - behaviour[r, t]) for t in valid]
        for i, t in enumerate(valid):
            if level == "token":
                w = math.exp(logs[i])
            elif level == "sequence":
                w = math.exp(sum(logs))
            else:
                w = math.exp(sum(logs) / len(logs))
            if correction == "tis":
                w = min(w, cap)
            elif correction == "mis":
                w = w if low <= w <= high else 0.0
            else:
                w = w if w <= cap else 0.0
            out[r, t] = w
    return out


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("correction", CORRECTIONS)
def test_each_correction_weighs_tokens_as_its_reference(correction, level):
    proximal, behaviour, mask = _batch()
    weights, stats = ops.off_policy_weights(proximal, behaviour, mask, correction, level,
                                            cap=1.5, low=0.7, high=1.4)
    expected = _reference(proximal, behaviour, mask, correction, level, 1.5, 0.7, 1.4)
    assert torch.allclose(weights, expected, rtol=1e-5, atol=1e-6)
    assert (weights[mask == 0] == 0).all()
    # what the statistics say of the same weights
    raw = _reference(proximal, behaviour, mask, "tis", level, math.inf, 0, 0)
    valid = mask > 0
    assert stats["is_ratio_max"] == pytest.approx(raw[valid].max().item(), rel=1e-5)
    assert stats["is_ratio_min"] == pytest.approx(raw[valid].min().item(), rel=1e-5)
    changed = (expected != raw) & valid
    assert stats["is_bounded_frac"] == pytest.approx(changed.sum().item() / valid.sum().item())
    k3 = torch.exp(proximal - behaviour) - 1 - (proximal - behaviour)
    assert stats["mismatch_kl"] == pytest.approx(k3[valid].mean().item(), rel=1e-5)


@pytest.mark.parametrize("agg", ops.LOSS_AGGS)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("correction", CORRECTIONS)
def test_on_policy_tokens_give_the_uncorrected_loss_and_gradient(correction, level, agg):
    """pi_b == pi_prox: every weight is 1, and the loss and its gradient are today's,
    bit for bit."""
    proximal, _, mask = _batch(1)
    gen = torch.Generator().manual_seed(2)
    advantages = torch.randn(mask.shape, generator=gen) * mask
    current = (proximal + 0.1 * torch.randn(mask.shape, generator=gen)).requires_grad_()
    weights, stats = ops.off_policy_weights(proximal, proximal.clone(), mask, correction,
                                            level)
    assert (weights == mask).all() and stats["is_bounded_frac"] == 0.0
    plain, plain_stats = ops.policy_loss(current, proximal, advantages, mask, agg=agg)
    (plain_grad,) = torch.autograd.grad(plain, current)
    corrected, corrected_stats = ops.policy_loss(current, proximal, advantages, mask, agg=agg,
                                                 weights=weights)
    (corrected_grad,) = torch.autograd.grad(corrected, current)
    assert torch.equal(plain, corrected) and torch.equal(plain_grad, corrected_grad)
    assert plain_stats == corrected_stats


def test_a_weight_scales_its_token_s_gradient_and_takes_none_itself():
    proximal, behaviour, mask = _batch(3)
    advantages = torch.ones_like(mask)
    current = proximal.clone().requires_grad_()
    weights, _ = ops.off_policy_weights(proximal, behaviour, mask, "tis", cap=10.0)
    loss, _ = ops.policy_loss(current, proximal, advantages, mask, agg="token-sum",
                              weights=weights)
    (grad,) = torch.autograd.grad(loss, current)
    # at the proximal policy the ratio is 1 (unclipped): d(-A r w)/d logprob = -A w
    assert torch.allclose(grad, -weights * mask)
    assert not weights.requires_grad


def test_a_correction_needs_a_policy_loss_that_takes_weights():
    with pytest.raises(ValueError, match="takes no 'weights' input"):
        AlgorithmSpec.model_validate({"policy_loss": "tests.algorithms_plugin:reinforce_loss",
                                      "off_policy": {"correction": "tis"}})
    with pytest.raises(ValueError, match="cap 0.5 is below 1"):
        AlgorithmSpec.model_validate({"off_policy": {"correction": "tis", "cap": 0.5}})


def test_a_misspelt_correction_is_one_line_at_validation():
    result = CliRunner().invoke(main, ["validate", str(CONFIGS / "ppo-tiny.yaml"), "--set",
                                       "algorithm.off_policy={correction: truncated}"])
    assert result.exit_code == 2
    assert result.output.strip().endswith("algorithm.off_policy.correction: expected one of "
                                          "'none', 'tis', 'mis' or 'decoupled', got "
                                          "'truncated'")


@pytest.mark.slow
def test_a_run_one_step_off_policy_weighs_its_stale_samples(tmp_path):
    """GRPO (no log-prob stage on the actor) with generation one iteration ahead
    (``overlap.max_staleness: 1``) and truncated IS: the trainer recomputes the proximal
    policy, the samples of the version before it differ from it, and each iteration
    records the weights' statistics."""
    path = small_pipeline(tmp_path, "grpo", iterations=3, overrides={
        "overlap.max_staleness": 1, "algorithm.off_policy": {"correction": "tis"}})
    run_pipeline(load_pipeline(path), progress=False, inline=True)
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl")
               .read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1, 2]
    for record in records:
        stats = record["train"]["train_actor"]
        for key in ("is_ratio_mean", "is_ratio_max", "is_bounded_frac", "mismatch_kl"):
            assert math.isfinite(stats[key]), key
        assert stats["is_ratio_max"] >= stats["is_ratio_mean"] >= stats["is_ratio_min"]
    # the first iteration's samples are the actor's own: no mismatch yet; later ones come
    # from the version before the one that trains on them
    stats = [r["train"]["train_actor"] for r in records]
    assert stats[0]["mismatch_kl"] == pytest.approx(0, abs=1e-5)
    assert stats[0]["is_bounded_frac"] == 0
    assert [r["staleness_max"] for r in records] == [0, 1, 1]
    assert all(s["mismatch_kl"] > 1e-3 and s["is_bounded_frac"] > 0 for s in stats[1:])
