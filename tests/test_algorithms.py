"""Algorithms end to end: pipelines built from the estimator and policy-loss registries run
through the executor (inline, in this process) on tiny models."""

from __future__ import annotations

import json
import math

import pytest

from rlhfflow.pipeline.executor import run_pipeline
from rlhfflow.pipeline.loader import load_pipeline
from rlhfflow.storage import ExperienceBuffer
from tests.conftest import small_pipeline


def _run(tmp_path, config, overrides=None):
    path = small_pipeline(tmp_path, config, iterations=2, overrides=overrides)
    run_pipeline(load_pipeline(path), progress=False, inline=True)
    out = tmp_path / "out"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return records, ExperienceBuffer(out / "buffer.zarr", create=False)


def test_remax_pipeline_trains_on_greedy_baselines(tmp_path):
    records, buffer = _run(tmp_path, "remax")
    assert [r["iteration"] for r in records] == [0, 1]
    for record in records:
        assert math.isfinite(record["policy_loss"])
    data = buffer.read(0, ["scores", "baseline_scores", "advantages", "response_mask"])
    mask = data["response_mask"].astype(bool)
    # ReMax with the KL in the reward: at the first token, score - baseline - KL to go
    first = data["advantages"][:, 0]
    gap = data["scores"] - data["baseline_scores"]
    assert (abs(first - gap) < 0.05).all() and mask[:, 0].all()
    assert (data["advantages"][~mask] == 0).all()


@pytest.mark.parametrize("overrides", [
    {"algorithm.advantage_estimator": "reinforce_plus_plus_baseline",
     "algorithm.importance_sampling_level": "sequence",
     "algorithm.loss_agg": "seq-mean-token-mean"},
    {"algorithm.advantage_estimator": "tests.algorithms_plugin:best_of_group",
     "algorithm.policy_loss": "tests.algorithms_plugin:reinforce_loss",
     "algorithm.loss_agg": "seq-mean-token-sum-norm"},
], ids=["reinforce-pp-baseline-gspo", "import-paths"])
def test_grpo_pipeline_with_other_estimators_and_losses(tmp_path, overrides):
    records, _ = _run(tmp_path, "grpo", overrides)
    assert len(records) == 2
    stats = records[-1]["train"]["train_actor"]
    assert math.isfinite(stats["policy_loss"]) and math.isfinite(stats["grad_norm"])
    if "algorithm.policy_loss" in overrides:
        assert "logprob_mean" in stats  # a user's loss reports its own metrics
