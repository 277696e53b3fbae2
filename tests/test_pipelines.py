"""The pipelines made of the same stages (configs/*.yaml) run end to end on a real Dask
cluster and do what they claim: offline DPO, online DPO, best-of-N fine-tuning,
evaluation alone and inside a training pipeline; their bad input stops before anything
starts; the planner takes them; a plugin scorer gets the score stage's checks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner

from rlhfflow.cli.main import main as cli
from rlhfflow.config.loader import load_pipeline
from rlhfflow.config.spec import SpecError
from rlhfflow.runtime.budget import skipping_stage
from rlhfflow.runtime.run import run_pipeline
from rlhfflow.stages import ModelConfig, ModelStore, StageContext, create_stage
from rlhfflow.stages.inference import ScoreStage
from rlhfflow.stages.preference import dpo_pair_loss
from rlhfflow.storage import ExperienceBuffer
from tests.conftest import CONFIGS, DATA

NEW_CONFIGS = ["dpo-tiny", "online-dpo-tiny", "best-of-n-tiny", "eval-tiny"]




def _absolute(data: dict) -> dict:
    """A shipped config's data paths made absolute, so a copy elsewhere finds them."""
    if "data" in data:
        data["data"]["prompts"] = str(CONFIGS / data["data"]["prompts"])
    for stage in data["stages"].values():
        for key in ("data", "prompts"):
            if key in stage.get("params", {}):
                stage["params"][key] = str(CONFIGS / stage["params"][key])
    return data


def _config(tmp_path, name, cluster=None, drop=(), **overrides):
    """``configs/NAME.yaml`` copied into ``tmp_path`` without the stages in ``drop`` and
    with dotted ``overrides``; output under ``tmp_path``."""
    data = _absolute(yaml.safe_load((CONFIGS / f"{name}.yaml").read_text()))
    for stage in drop:
        del data["stages"][stage]
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    settings = {"output": str(tmp_path / "out"), "cluster.torch_threads": 1,
                "cluster.dashboard_address": "127.0.0.1:0", **overrides}
    if cluster is not None:
        settings["cluster.address"] = cluster.scheduler_address
    return load_pipeline(path, settings)


# --------------------------------------------------------------------------- DPO


@pytest.mark.slow
def test_offline_dpo_learns_the_preferences_of_its_file(cluster, tmp_path):
    """configs/dpo-tiny.yaml: the trained actor prefers the chosen responses of the
    training pairs (implicit reward margin and accuracy), where it started at none."""
    result = run_pipeline(_config(tmp_path, "dpo-tiny", cluster), progress=False)
    stats = result.setup_metrics["dpo"]
    assert stats["records"] == 64
    out = result.output_dir / "models"
    store = ModelStore({"actor": ModelConfig("actor", "lm", str(out / "actor" / "final")),
                        "ref": ModelConfig("ref", "lm", str(out / "ref" / "init"))})
    stage = create_stage("train_dpo", "dpo", {"data": "preferences.jsonl", "ref": "ref"},
                         model="actor")
    ctx = StageContext(iteration=-1, seed=0, models=store)
    pairs = stage.examples(store.get("ref"), DATA, ctx)
    with torch.no_grad():
        start, before = dpo_pair_loss(store.get("ref").module, pairs, stage.params)
        _, after = dpo_pair_loss(store.get("actor").module, pairs, stage.params)
    assert start.item() == pytest.approx(math.log(2.0), abs=1e-6)
    assert before["reward_accuracy"] == 0.0
    # measured: accuracy 1.0, margin 2.0 (seed 0); an update that does nothing stays at 0
    assert after["reward_accuracy"] > 0.9 and after["reward_margin"] > 0.5, after


@pytest.mark.slow
def test_online_dpo_pairs_each_prompts_responses_and_the_reward_climbs(cluster, tmp_path):
    pipeline = _config(tmp_path, "online-dpo-tiny", cluster, iterations=12)
    result = run_pipeline(pipeline, progress=False)
    rewards = [m["reward_mean"] for m in result.metrics]
    buffer = ExperienceBuffer(result.output_dir / "buffer.zarr", create=False)
    for k, record in enumerate(result.metrics):
        rows = buffer.read(k, ["scores", "group_ids"])
        groups = [rows["scores"][rows["group_ids"] == g] for g in np.unique(rows["group_ids"])]
        stats = record["train"]["train_dpo"]
        # a pair for every prompt whose two responses scored differently, a tie otherwise
        assert stats["ties"] == sum(int(s.min() == s.max()) for s in groups)
        assert stats["pairs"] + stats["ties"] == len(groups) == 16
    first, last = np.mean(rewards[:3]), np.mean(rewards[-3:])
    # measured: 0.13 -> 0.93 (seed 0, 12 iterations); a broken update stays near 0.1
    assert last - first > 0.3, rewards


def test_a_gang_rank_left_without_pairs_still_joins_the_update(cluster, tmp_path):
    """Two workers train the actor as a gang of 2; with 3 prompts a minibatch of DPO
    pairs can hold a single pair, which leaves one rank nothing to train on: it must
    still join the gradient all-reduce (found by a 30-iteration run of the shipped config
    that failed in the forward pass of an empty shard)."""
    pipeline = _config(tmp_path, "online-dpo-tiny", cluster, iterations=2,
                       **{"data.batch_size": 3})
    assert pipeline.spec.cluster.workers == 2
    result = run_pipeline(pipeline, progress=False)
    stats = [m["train"]["train_dpo"] for m in result.metrics]
    assert all(s["pairs"] + s["ties"] == 3 for s in stats)
    # 1 to 3 pairs in 2 minibatches: some minibatch holds one pair, one rank gets none
    assert any(s["pairs"] >= 1 for s in stats)
    assert all(math.isfinite(s["dpo_loss"]) for s in stats)


# --------------------------------------------------------------------------- best-of-N


@pytest.mark.slow
def test_best_of_n_trains_on_the_best_response_of_each_prompt_and_climbs(cluster, tmp_path):
    pipeline = _config(tmp_path, "best-of-n-tiny", cluster, iterations=12)
    result = run_pipeline(pipeline, progress=False)
    buffer = ExperienceBuffer(result.output_dir / "buffer.zarr", create=False)
    for k, record in enumerate(result.metrics):
        rows = buffer.read(k, ["scores", "group_ids", "selected"])
        for g in np.unique(rows["group_ids"]):
            scores, selected = rows["scores"][rows["group_ids"] == g], \
                rows["selected"][rows["group_ids"] == g]
            assert selected.sum() == 1 and scores[selected == 1][0] == scores.max()
        assert record["train"]["train_sft"]["rows_trained"] == 8  # one per prompt
    rewards = [m["reward_mean"] for m in result.metrics]
    # measured: 0.10 -> 0.44 (seed 0, 12 iterations); training on random rows stays ~0.1
    assert np.mean(rewards[-3:]) - np.mean(rewards[:3]) > 0.2, rewards
    evals = [m.get("eval/reward_mean") for m in result.metrics]
    # every 5 iterations, and the last (the model as trained)
    assert [k for k, e in enumerate(evals) if e is not None] == [0, 5, 10, 11]
    assert evals[11] > evals[0]


# --------------------------------------------------------------------------- evaluation


def test_an_evaluation_stage_leaves_training_unchanged(cluster, tmp_path):
    """best-of-n with its evaluate stage (every 2) and without it: the same samples,
    scores and updates; eval/ metrics only in iterations 0 and 2. One plan for both: the
    evaluation's work may make ``auto`` choose another (a gang instead of one trainer),
    and a gang's all-reduced loss differs from one process's in the last bits."""
    runs = {}
    for name, drop in (("with", ()), ("without", ("evaluate",))):
        (tmp_path / name).mkdir()
        runs[name] = run_pipeline(_config(tmp_path / name, "best-of-n-tiny", cluster,
                                          drop=drop, iterations=3,
                                          **{"data.batch_size": 4,
                                             "placement.strategy": "colocated"}),
                                  progress=False)
    for a, b in zip(runs["with"].metrics, runs["without"].metrics, strict=True):
        assert a["reward_mean"] == b["reward_mean"]
        assert a["train"]["train_sft"]["sft_loss"] == b["train"]["train_sft"]["sft_loss"]
        assert not [k for k in b if k.startswith("eval/")]
    assert [m["iteration"] for m in runs["with"].metrics if "eval/reward_mean" in m] == \
        [0, 2]  # its every, and the run's last iteration
    buffers = [ExperienceBuffer(r.output_dir / "buffer.zarr", create=False) for r in
               runs.values()]
    for k in range(3):
        np.testing.assert_array_equal(buffers[0].read(k, ["response_ids"])["response_ids"],
                                      buffers[1].read(k, ["response_ids"])["response_ids"])


def test_the_eval_pipeline_scores_every_prompt_once_and_summarises(cluster, tmp_path,
                                                                   capsys):
    result = run_pipeline(_config(tmp_path, "eval-tiny", cluster), progress=True)
    buffer = ExperienceBuffer(result.output_dir / "buffer.zarr", create=False)
    seen = np.concatenate([buffer.read(k, ["prompt_index"])["prompt_index"]
                           for k in range(2)])
    assert sorted(seen.tolist()) == list(range(16))  # the whole set, each prompt once
    summary = result.summary["evaluation"]
    scores = np.concatenate([buffer.read(k, ["score_vowels"])["score_vowels"]
                             for k in range(2)])
    assert summary["samples"] == 16
    assert summary["reward_mean_vowels"] == pytest.approx(float(scores.mean()), rel=1e-5)
    assert "rlhfflow: evaluation over 16 samples: reward mean" in capsys.readouterr().err
    # the evaluate stage (greedy, same prompts and model) agrees with generate + score
    (tmp_path / "b").mkdir()
    inside = run_pipeline(_config(tmp_path / "b", "best-of-n-tiny", cluster, iterations=1,
                                  **{"data.batch_size": 4}), progress=False)
    assert inside.metrics[0]["eval/reward_mean"] == pytest.approx(summary["reward_mean"],
                                                                  rel=1e-5)


# --------------------------------------------------------------------------- bad input


def _write(tmp_path, name, data):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _shipped(name):
    return _absolute(yaml.safe_load((CONFIGS / f"{name}.yaml").read_text()))


def test_a_bad_preference_record_is_one_line_naming_file_and_line(tmp_path):
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text('{"prompt": "a:", "chosen": "ae", "rejected": "xz"}\n'
                     '{"prompt": "b:", "chosen": "io"}\n')
    data = _shipped("dpo-tiny")
    data["stages"]["dpo"]["params"]["data"] = str(prefs)
    path = _write(tmp_path, "dpo", data)
    result = CliRunner().invoke(cli, ["validate", str(path)])
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1] == (
        f"Error: {path}: stages.dpo.params.data: {prefs}:2: expected a string field 'rejected'")


@pytest.mark.parametrize("change, key, message", [
    (lambda d: d["stages"]["select"].update(type="selekt"), "stages.select.type",
     "unknown stage type 'selekt'; did you mean 'select'?"),
    (lambda d: d["stages"].update(again={"type": "select", "after": ["reward"]}),
     "stages.again", "writes column 'selected', which stage 'select' writes too"),
    (lambda d: d["stages"]["evaluate"]["params"].pop("prompts"),
     "stages.evaluate.params.prompts", "required key is missing"),
])
def test_bad_pipelines_stop_at_load_naming_file_and_key(tmp_path, change, key, message):
    data = _shipped("best-of-n-tiny")
    change(data)
    path = _write(tmp_path, "bad", data)
    with pytest.raises(SpecError) as info:
        load_pipeline(path)
    assert str(info.value).startswith(f"{path}: {key}: {message}")


@pytest.mark.parametrize("name", NEW_CONFIGS)
def test_the_planner_takes_the_new_pipelines(name):
    result = CliRunner().invoke(cli, ["plan", str(CONFIGS / f"{name}.yaml")])
    assert result.exit_code == 0, result.output


# --------------------------------------------------------------------------- roles


class PluginScorer(ScoreStage):
    """A scorer of a plugin: another type, the same role."""

    type_name = "plugin_score"


def test_a_plugin_scorer_gets_the_score_stages_checks(tmp_path):
    reward = tmp_path / "needs.py"
    reward.write_text("def reward(prompts, responses, answer):\n"
                      "    return [0.0] * len(responses)\n")
    data = _shipped("best-of-n-tiny")
    del data["stages"]["evaluate"]
    data["stages"]["reward"] = {"type": "tests.test_pipelines:PluginScorer",
                                "after": ["generate"],
                                "params": {"function": "needs.py:reward"}}
    path = _write(tmp_path, "plugin", data)
    with pytest.raises(SpecError, match=r"stages\.reward\.params\.function: the reward "
                                        r"function takes 'answer', which record .*:1 does "
                                        r"not have"):
        load_pipeline(path)
    data["stages"]["reward"]["params"] = {"function": "rlhfflow.stages.rewards:vowel_ratio",
                                          "on_error": "skip"}
    assert skipping_stage(load_pipeline(_write(tmp_path, "plugin", data))) == "reward"


def test_the_stage_reference_lists_the_new_roles():
    result = CliRunner().invoke(cli, ["stages", "--builtin-only"])
    assert result.exit_code == 0
    text = result.output
    for name in ("select", "train_sft", "train_dpo", "train_dpo_online", "evaluate"):
        assert f"\n{name}  (" in text or text.startswith(f"{name}  (")
    assert "roles:   samples, reports, per_batch" in text  # evaluate
    assert "roles:   scores" in text
