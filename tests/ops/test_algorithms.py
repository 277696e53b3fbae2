"""Algorithms end to end: pipelines built from the estimator and policy-loss registries run
through the executor (inline, in this process) on tiny models."""

from __future__ import annotations

import json
import math

import pytest

from rlhfflow.config.loader import load_pipeline
from rlhfflow.runtime.run import run_pipeline
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


def test_the_ratio_divides_by_the_sampling_log_probs_unless_a_stage_recomputes_them(
        tmp_path):
    """``train_actor.params.old_logprobs: auto`` (the default) divides by the generator's
    own log-probs when no stage recomputes them (the shipped GRPO configs have none): the
    same policy's, so training equals a pipeline with an ``old_logprob`` pass up to float
    rounding (a cached decode vs one forward over the sequence). With such a stage, auto
    takes its column; ``old_logprobs`` without one is refused at load."""
    import yaml

    (tmp_path / "recompute").mkdir()
    (tmp_path / "sample").mkdir()
    sample, _ = _run(tmp_path / "sample", "grpo", {"iterations": 3})
    default = load_pipeline(small_pipeline(tmp_path / "sample", "grpo", iterations=3))
    assert default.params["train_actor"].old_logprobs == "sample_logprobs"
    assert "old_logprobs" not in default.graph.columns()
    path = small_pipeline(tmp_path / "recompute", "grpo", iterations=3)
    data = yaml.safe_load(path.read_text())
    data["stages"]["old_logprob"] = {"type": "logprob", "model": "actor",
                                     "after": ["generate"]}
    data["stages"]["train_actor"]["after"] = ["advantages", "old_logprob", "ref_logprob"]
    path.write_text(yaml.safe_dump(data))
    pipeline = load_pipeline(path)
    assert pipeline.params["train_actor"].old_logprobs == "old_logprobs"
    assert "old_logprobs" in pipeline.graph.nodes["train_actor"].reads
    run_pipeline(pipeline, progress=False, inline=True)
    out = tmp_path / "recompute" / "out"
    recompute = [json.loads(line) for line in (out / "metrics.jsonl").read_text()
                 .splitlines()]
    assert len(sample) == len(recompute) == 3
    assert "old_logprob" in recompute[0]["stage_s"]
    assert "old_logprob" not in sample[0]["stage_s"]
    for a, b in zip(recompute, sample, strict=True):
        assert a["reward_mean"] == pytest.approx(b["reward_mean"], abs=1e-6)
        for key in ("policy_loss", "approx_kl", "kl_mean"):
            assert a["train"]["train_actor"][key] == pytest.approx(
                b["train"]["train_actor"][key], rel=1e-3, abs=1e-6), key
    # without an old_logprob stage the explicit setting has nothing to divide by
    del data["stages"]["old_logprob"]
    data["stages"]["train_actor"]["after"] = ["advantages", "ref_logprob"]
    data["stages"]["train_actor"]["params"]["old_logprobs"] = "old_logprobs"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(Exception, match="old_logprobs"):
        load_pipeline(path)
