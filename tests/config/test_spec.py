"""Broken pipeline files: each mistake gives one exact line naming the file, the key path
and what was expected, with exit code 2 and no traceback.

Every case starts from ``configs/ppo-tiny.yaml`` (prompts pointed at the absolute path of
``configs/data/prompts.jsonl``) and changes one thing.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from rlhfflow.cli.main import main
from rlhfflow.config.loader import load_pipeline
from rlhfflow.config.spec import SpecError

ROOT = Path(__file__).resolve().parents[2]
PPO_TINY = ROOT / "configs" / "ppo-tiny.yaml"
PROMPTS = ROOT / "configs" / "data" / "prompts.jsonl"
SFT_DATA = ROOT / "configs" / "data" / "sft.jsonl"


def base_spec() -> dict[str, Any]:
    """configs/ppo-tiny.yaml as a dict, runnable from any folder."""
    spec = yaml.safe_load(PPO_TINY.read_text())
    spec["data"]["prompts"] = str(PROMPTS)
    return spec


def _parent(spec: dict, dotted: str) -> tuple[dict, str]:
    *parents, last = dotted.split(".")
    node = spec
    for key in parents:
        node = node.setdefault(key, {})
    return node, last


def put(spec: dict, dotted: str, value: Any) -> None:
    """Set ``a.b.c`` in a raw spec."""
    node, last = _parent(spec, dotted)
    node[last] = value


def drop(spec: dict, dotted: str) -> None:
    """Remove ``a.b.c`` from a raw spec."""
    node, last = _parent(spec, dotted)
    del node[last]


def rename(spec: dict, dotted: str, new: str) -> None:
    """Rename the key ``a.b.c`` to ``a.b.new``, keeping its position."""
    node, last = _parent(spec, dotted)
    items = [((new if k == last else k), v) for k, v in node.items()]
    node.clear()
    node.update(items)


def tiny_to(spec: dict, model: str, source: str, value: str) -> None:
    """Replace a model's ``tiny:`` source with another (``path`` or ``from``)."""
    drop(spec, f"models.{model}.tiny")
    put(spec, f"models.{model}.{source}", value)


def write_spec(tmp_path: Path, spec: dict[str, Any]) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def validate(path: Path) -> Any:
    return CliRunner().invoke(main, ["validate", str(path)])


# (id, mutation of the valid spec, expected message after "FILE: "); {dir} is the folder
# of the pipeline file.
CASES: list[tuple[str, Callable[[dict], Any], str]] = [
    # unknown keys, with suggestions
    ("top-level-typo", lambda s: rename(s, "iterations", "iteration"),
     "iteration: unknown key; did you mean 'iterations'?"),
    ("top-level-unknown", lambda s: put(s, "zzz", 1),
     "zzz: unknown key (allowed: name, seed, iterations, output, models, stages, data, "
     "algorithm, cluster, placement, overlap, checkpoint, logging)"),
    ("nested-typo", lambda s: rename(s, "models.actor.optimizer", "optimzer"),
     "models.actor.optimzer: unknown key; did you mean 'optimizer'?"),
    ("tiny-typo", lambda s: rename(s, "models.actor.tiny.layers", "layer"),
     "models.actor.tiny.layer: unknown key; did you mean 'layers'?"),
    ("stage-key-typo", lambda s: rename(s, "stages.reward.after", "afterr"),
     "stages.reward.afterr: unknown key; did you mean 'after'?"),
    ("param-typo", lambda s: rename(s, "stages.generate.params.max_new_tokens", "max_new_token"),
     "stages.generate.params.max_new_token: unknown key; did you mean 'max_new_tokens'?"),
    ("train-param-typo", lambda s: rename(s, "stages.train_actor.params.epochs", "epoch"),
     "stages.train_actor.params.epoch: unknown key; did you mean 'epochs'?"),
    # wrong types and ranges
    ("batch-size-string", lambda s: put(s, "data.batch_size", "32"),
     "data.batch_size: expected an integer, got '32'"),
    ("iterations-negative", lambda s: put(s, "iterations", -1),
     "iterations: expected an integer >= 0, got -1"),
    ("iterations-float", lambda s: put(s, "iterations", 2.5),
     "iterations: expected an integer, got 2.5"),
    ("iterations-bool", lambda s: put(s, "iterations", True),
     "iterations: expected an integer, got True"),
    ("trainable-string", lambda s: put(s, "models.actor.trainable", "yes"),
     "models.actor.trainable: expected true or false, got 'yes'"),
    ("temperature-zero", lambda s: put(s, "stages.generate.params.temperature", 0),
     "stages.generate.params.temperature: expected a number > 0, got 0"),
    ("temperature-string", lambda s: put(s, "stages.generate.params.temperature", "1.0"),
     "stages.generate.params.temperature: expected a number, got '1.0'"),
    ("max-new-tokens-string", lambda s: put(s, "stages.generate.params.max_new_tokens", "16"),
     "stages.generate.params.max_new_tokens: expected an integer, got '16'"),
    ("top-p-too-big", lambda s: put(s, "stages.generate.params.top_p", 1.5),
     "stages.generate.params.top_p: expected a number <= 1, got 1.5"),
    ("lr-negative", lambda s: put(s, "models.actor.optimizer.lr", -1.0),
     "models.actor.optimizer.lr: expected a number > 0, got -1.0"),
    ("lr-string", lambda s: put(s, "models.actor.optimizer.lr", "fast"),
     "models.actor.optimizer.lr: expected a number, got 'fast'"),
    ("betas-short", lambda s: put(s, "models.actor.optimizer.betas", [0.9]),
     "models.actor.optimizer.betas: expected at least 2 items, got 1: [0.9]"),
    ("gamma-too-big", lambda s: put(s, "algorithm.gamma", 2),
     "algorithm.gamma: expected a number <= 1, got 2"),
    ("workers-zero", lambda s: put(s, "cluster.workers", 0),
     "cluster.workers: expected an integer > 0, got 0"),
    ("after-string", lambda s: put(s, "stages.reward.after", "generate"),
     "stages.reward.after: expected a list, got 'generate'"),
    ("after-item-int", lambda s: put(s, "stages.reward.after", [1]),
     "stages.reward.after[0]: expected a string, got 1"),
    ("algorithm-name", lambda s: put(s, "algorithm.name", "ppo2"),
     "algorithm.name: expected one of 'ppo', 'grpo', 'rloo' or 'dr_grpo', got 'ppo2'"),
    # algorithm: estimators and policy losses by registered name or import path
    ("estimator-typo", lambda s: put(s, "algorithm.advantage_estimator", "grop"),
     "algorithm.advantage_estimator: unknown advantage estimator 'grop'; did you mean "
     "'grpo'? (or give an import path 'package.module:function')"),
    ("estimator-unknown", lambda s: put(s, "algorithm.advantage_estimator", "zzz"),
     # {known}: the built-ins, and whatever a test's plugin module registered before
     "algorithm.advantage_estimator: unknown advantage estimator 'zzz'; known: {known} (or "
     "give an import path 'package.module:function')"),
    ("estimator-module", lambda s: put(s, "algorithm.advantage_estimator", "no_such_mod:est"),
     "algorithm.advantage_estimator: cannot import module 'no_such_mod': "
     "No module named 'no_such_mod'"),
    ("estimator-attr", lambda s: put(s, "algorithm.advantage_estimator",
                                     "tests.algorithms_plugin:nope"),
     "algorithm.advantage_estimator: 'tests.algorithms_plugin' has no callable 'nope'"),
    ("estimator-signature", lambda s: put(s, "algorithm.advantage_estimator",
                                          "tests.algorithms_plugin:needs_prompts"),
     "algorithm.advantage_estimator: advantage estimator "
     "'tests.algorithms_plugin:needs_prompts': it takes parameter 'prompts', which is not "
     "provided (provided: scores, token_rewards, mask, group_ids, values, baseline_scores, "
     "config)"),
    ("policy-loss-typo", lambda s: put(s, "algorithm.policy_loss", "ppo2"),
     "algorithm.policy_loss: unknown policy loss 'ppo2'; did you mean 'ppo'? (or give an "
     "import path 'package.module:function')"),
    ("policy-loss-module", lambda s: put(s, "algorithm.policy_loss", "my_losses.gspo:loss"),
     "algorithm.policy_loss: cannot import module 'my_losses.gspo': "
     "No module named 'my_losses'"),
    ("loss-agg", lambda s: put(s, "algorithm.loss_agg", "seq-mean"),
     "algorithm.loss_agg: expected one of 'token-mean', 'seq-mean-token-mean', 'token-sum', "
     "'seq-mean-token-sum' or 'seq-mean-token-sum-norm', got 'seq-mean'"),
    ("scale-rewards-ppo", lambda s: put(s, "algorithm.scale_rewards", "batch"),
     "algorithm: scale_rewards applies to the grpo and dr_grpo estimators, not 'gae'; "
     "remove it"),
    ("scale-factor-alone", lambda s: put(s, "algorithm.loss_scale_factor", 64.0),
     "algorithm: loss_scale_factor is the divisor of loss_agg 'seq-mean-token-sum-norm'; "
     "set loss_agg (or value_loss_agg) to it or remove the factor"),
    ("remax-without-baseline", lambda s: put(s, "algorithm.advantage_estimator", "remax"),
     "stages.advantages: reads column 'baseline_scores', which no upstream stage writes; "
     "no stage in the pipeline writes it"),
    ("head-value", lambda s: put(s, "models.critic.head", "values"),
     "models.critic.head: expected one of 'lm' or 'value', got 'values'"),
    ("logprob-output", lambda s: put(s, "stages.ref_logprob.params.output", "ref_logprob"),
     "stages.ref_logprob.params.output: expected one of 'old_logprobs' or 'ref_logprobs', "
     "got 'ref_logprob'"),
    ("models-list", lambda s: put(s, "models", ["actor"]),
     "models: expected a mapping, got ['actor']"),
    ("stage-list", lambda s: put(s, "stages.reward", ["generate"]),
     "stages.reward: expected a mapping, got ['generate']"),
    ("params-list", lambda s: put(s, "stages.generate.params", [1]),
     "stages.generate.params: expected a mapping, got [1]"),
    ("stage-name-int", lambda s: put(s, "stages", {**s["stages"], 5: {"type": "generate"}}),
     "stages: expected every key to be a string, got 5"),
    # missing keys
    ("stages-missing", lambda s: drop(s, "stages"), "stages: required key is missing"),
    ("stages-empty", lambda s: put(s, "stages", {}), "stages: expected at least one stage"),
    ("stage-type-missing", lambda s: drop(s, "stages.reward.type"),
     "stages.reward.type: required key is missing"),
    ("prompts-missing", lambda s: drop(s, "data.prompts"),
     "data: expected exactly one of 'prompts' and 'sources'; got neither"),
    ("data-missing", lambda s: drop(s, "data"),
     "data: the pipeline has stages that run every iteration, so it needs a 'data' section "
     "with a prompts file"),
    # models and their sources
    ("checkpointing-frozen", lambda s: put(s, "models.ref.gradient_checkpointing", True),
     "models.ref: gradient_checkpointing saves training memory; the model is not trainable "
     "(set trainable: true or drop it)"),
    ("attention-unknown", lambda s: put(s, "models.actor.attn_implementation", "fast"),
     "models.actor.attn_implementation: expected one of 'eager', 'sdpa', 'flex_attention', "
     "'flash_attention_2', 'flash_attention_3' or 'flash_attention_4', got 'fast'"),
    ("flash-attention-cpu", lambda s: (put(s, "cluster.device", "cpu"), put(
        s, "models.actor.attn_implementation", "flash_attention_2")),
     "models.actor.attn_implementation: flash_attention_2 runs on CUDA GPUs only and the "
     "run is on a CPU (cluster.device cpu); use sdpa"),
    ("model-no-source", lambda s: drop(s, "models.actor.tiny"),
     "models.actor: expected exactly one of 'path', 'from', 'tiny'; got none"),
    ("model-two-sources", lambda s: put(s, "models.actor.path", "models/actor"),
     "models.actor: expected exactly one of 'path', 'from', 'tiny'; got path and tiny"),
    ("model-name", lambda s: rename(s, "models.ref", "re-f"),
     "models.re-f: model names are letters, digits and underscores, starting with a letter"),
    ("from-unknown", lambda s: put(s, "models.ref.from", "acter"),
     "models.ref.from: unknown model 'acter'; did you mean 'actor'?"),
    ("from-cycle", lambda s: tiny_to(s, "actor", "from", "ref"),
     "models.actor.from: 'from' cycle: actor -> ref -> actor"),
    ("from-value-to-lm", lambda s: put(s, "models.ref.from", "critic"),
     "models.ref.from: cannot make an 'lm' model from 'critic', which has a value head"),
    ("placement-unknown-model", lambda s: put(s, "placement.models", {"actr": 0}),
     "placement.models.actr: unknown model 'actr'; did you mean 'actor'?"),
    ("placement-unknown-stage", lambda s: put(s, "placement.stages", {"generat": 0}),
     "placement.stages.generat: unknown stage 'generat'; did you mean 'generate'?"),
    ("placement-bad-strategy", lambda s: put(s, "placement.strategy", "spread"),
     "placement.strategy: expected one of 'auto', 'colocated', 'interleaved' or "
     "'disaggregated', got 'spread'"),
    ("placement-group-fraction", lambda s: put(s, "placement.groups", {"a": 1.5}),
     "placement.groups: group 'a': expected a non-empty list of worker indexes (0, 1, ...) "
     "or a fraction of the cluster between 0 and 1, got 1.5"),
    ("deepspeed-on-inference", lambda s: put(s, "stages.generate.backend", "deepspeed"),
     "stages.generate.backend: 'deepspeed' trains in the loop: only train_actor and "
     "train_critic stages take it, not 'generate'"),
    ("deepspeed-settings-alone", lambda s: put(s, "stages.train_actor.deepspeed",
                                               {"zero_stage": 2}),
     "stages.train_actor.deepspeed: DeepSpeed settings need 'backend: deepspeed' on the stage"),
    ("deepspeed-bad-zero", lambda s: put(s, "stages.train_actor.deepspeed", {"zero_stage": 4}),
     "stages.train_actor.deepspeed.zero_stage: expected one of 0, 1, 2 or 3, got 4"),
    # stages: types, models, heads
    ("stage-unknown-type", lambda s: put(s, "stages.generate.type", "genrate"),
     "stages.generate.type: unknown stage type 'genrate'; did you mean 'generate'?"),
    ("stage-unknown-model", lambda s: put(s, "stages.generate.model", "actr"),
     "stages.generate.model: unknown model 'actr'; did you mean 'actor'?"),
    ("stage-needs-model", lambda s: drop(s, "stages.generate.model"),
     "stages.generate.model: required key is missing: stage type 'generate' needs a model "
     "with head 'lm'; models with that head: actor, ref"),
    ("stage-takes-no-model", lambda s: put(s, "stages.advantages.model", "actor"),
     "stages.advantages.model: stage type 'advantages' takes no model; remove the key"),
    ("head-mismatch", lambda s: put(s, "stages.values.model", "actor"),
     "stages.values.model: stage type 'values' needs a model with head 'value'; "
     "model 'actor' has head 'lm'"),
    ("stage-name-digit-first", lambda s: rename(s, "stages.values", "2values"),
     "stages.2values: stage names are lowercase letters, digits and underscores, starting "
     "with a letter"),
    ("stage-name-upper", lambda s: rename(s, "stages.values", "Values"),
     "stages.Values: stage names are lowercase letters, digits and underscores, starting "
     "with a letter"),
    ("stage-name-reserved", lambda s: rename(s, "stages.values", "data"),
     "stages.data: the stage name 'data' is reserved for the prompt source; rename the stage"),
    # the graph
    ("after-unknown", lambda s: put(s, "stages.reward.after", ["generat"]),
     "stages.reward.after[0]: unknown stage 'generat'; did you mean 'generate'?"),
    ("after-self", lambda s: put(s, "stages.reward.after", ["generate", "reward"]),
     "stages.reward.after[1]: a stage cannot run after itself"),
    ("cycle-two-stages", lambda s: put(s, "stages.reward.after", ["generate", "advantages"]),
     "stages.reward.after: the 'after' lists form a cycle: reward -> advantages -> reward"),
    ("cycle-long", lambda s: put(s, "stages.generate.after", ["train_actor"]),
     "stages.generate.after: the 'after' lists form a cycle: generate -> reward -> "
     "advantages -> train_actor -> generate"),
    ("column-not-upstream",
     lambda s: put(s, "stages.advantages.after", ["reward", "ref_logprob", "old_logprob"]),
     "stages.advantages: reads column 'values', which no upstream stage writes; "
     "add stage 'values' to stages.advantages.after"),
    ("column-never-written", lambda s: put(s, "stages.old_logprob.params",
                                           {"output": "ref_logprobs"}),
     "stages.advantages: reads column 'old_logprobs', which no upstream stage writes; "
     "no stage in the pipeline writes it"),
    ("column-written-twice", lambda s: put(s, "stages.bonus", {
        "type": "score", "after": ["generate"],
        "params": {"function": "rlhfflow.stages.rewards:length_ratio"}}),
     "stages.bonus: writes column 'scores', which stage 'reward' writes too"),
    ("setup-after-loop", lambda s: put(s, "stages.sft", {
        "type": "sft", "model": "actor", "after": ["generate"],
        "params": {"data": str(SFT_DATA)}}),
     "stages.sft.after[0]: stage type 'sft' runs once before the loop and cannot wait for "
     "loop stage 'generate'"),
    # training
    ("trainable-not-trained", lambda s: drop(s, "stages.train_critic"),
     "models.critic.trainable: the model is trainable but no stage trains it; add a training "
     "stage or set trainable: false"),
    ("frozen-trained", lambda s: put(s, "models.critic.trainable", False),
     "stages.train_critic.model: stage trains 'critic', which is not trainable; "
     "set models.critic.trainable: true"),
    # files
    ("prompts-not-found", lambda s: put(s, "data.prompts", "nope/prompts.jsonl"),
     "data.prompts: file not found: {dir}/nope/prompts.jsonl"),
    # (not "org/name": that could be a Hub id, see test_hub_models.py)
    ("model-dir-not-found", lambda s: tiny_to(s, "actor", "path", "my/models/nope"),
     "models.actor.path: directory not found: {dir}/my/models/nope"),
    ("model-dir-no-config", lambda s: tiny_to(s, "actor", "path", "."),
     "models.actor.path: not a transformers-format model directory (no config.json): {dir}"),
    ("sft-data-not-found", lambda s: put(s, "stages.sft", {
        "type": "sft", "model": "actor", "params": {"data": "sft.jsonl"}}),
     "stages.sft.params.data: file not found: {dir}/sft.jsonl"),
    # score stages and reward functions
    ("score-model-and-function", lambda s: put(s, "stages.reward.model", "critic"),
     "stages.reward.params.function: give either a reward 'model' for the stage or "
     "params.function ('module:function'), not both or neither"),
    ("score-neither", lambda s: drop(s, "stages.reward.params.function"),
     "stages.reward.params.function: give either a reward 'model' for the stage or "
     "params.function ('module:function'), not both or neither"),
    ("function-module", lambda s: put(s, "stages.reward.params.function", "no_such_mod:f"),
     "stages.reward.params.function: cannot import module 'no_such_mod': "
     "No module named 'no_such_mod'"),
    ("function-attr", lambda s: put(s, "stages.reward.params.function",
                                    "rlhfflow.stages.rewards:nope"),
     "stages.reward.params.function: 'rlhfflow.stages.rewards' has no callable 'nope'"),
    ("function-format", lambda s: put(s, "stages.reward.params.function", "vowel_ratio"),
     "stages.reward.params.function: expected 'module:function' or 'file.py:function', "
     "got 'vowel_ratio'"),
    # kwargs against the reward function's signature, several functions, error handling
    ("kwargs-typo", lambda s: put(s, "stages.reward.params.kwargs", {"min_len": 4}),
     "stages.reward.params.kwargs.min_len: vowel_ratio() has no argument 'min_len'; "
     "did you mean 'min_length'?"),
    ("kwargs-unknown", lambda s: put(s, "stages.reward.params.kwargs", {"temperature": 1}),
     "stages.reward.params.kwargs.temperature: vowel_ratio() has no argument 'temperature'; "
     "it takes min_length"),
    ("functions-kwargs-unknown", lambda s: put(s, "stages.reward.params", {"functions": [
        {"function": "rlhfflow.stages.rewards:vowel_ratio"},
        {"function": "rlhfflow.stages.rewards:length_ratio", "kwargs": {"targte": 8}}]}),
     "stages.reward.params.functions[1].kwargs.targte: length_ratio() has no argument "
     "'targte'; did you mean 'target'?"),
    ("function-and-functions", lambda s: put(s, "stages.reward.params.functions",
                                             [{"function": "rlhfflow.stages.rewards:length_ratio"}]),
     "stages.reward.params.functions: give either params.function or params.functions, "
     "not both"),
    ("functions-same-name", lambda s: put(s, "stages.reward.params", {"functions": [
        {"function": "rlhfflow.stages.rewards:length_ratio"},
        {"function": "rlhfflow.stages.rewards:length_ratio", "kwargs": {"target": 8}}]}),
     "stages.reward.params.functions[1].function: params.functions[0] already writes "
     "'score_length_ratio'; give one of them another 'name'"),
    ("functions-reserved-name", lambda s: put(s, "stages.reward.params", {"functions": [
        {"function": "rlhfflow.stages.rewards:length_ratio", "name": "valid"}]}),
     "stages.reward.params.functions[0].name: 'valid' cannot name a score column (letters, "
     "digits and underscores; not 'valid' or 'error' or 'retries')"),
    ("functions-weight-type", lambda s: put(s, "stages.reward.params", {"functions": [
        {"function": "rlhfflow.stages.rewards:length_ratio", "weight": "0.5"}]}),
     "stages.reward.params.functions[0].weight: expected a number, got '0.5'"),
    ("on-error-value", lambda s: put(s, "stages.reward.params.on_error", "ignore"),
     "stages.reward.params.on_error: expected one of 'error' or 'skip', got 'ignore'"),
    ("retries-without-skip", lambda s: put(s, "stages.reward.params.retries", 2),
     "stages.reward.params.retries: retries each failing sample with on_error: skip; with "
     "on_error: error, the stage's own 'retries' re-runs the whole task"),
    ("max-errors-negative", lambda s: put(s, "stages.reward.params.max_errors", -1),
     "stages.reward.params.max_errors: expected an integer >= 0, got -1"),
    ("fp16-deepspeed", lambda s: (put(s, "models.actor.dtype", "float16"),
                                  put(s, "stages.train_actor.backend", "deepspeed")),
     "models.actor.dtype: float16 training has no loss scaling under backend: deepspeed "
     "(stage 'train_actor'); use bfloat16 or float32, or backend: torch"),
    ("chat-template-missing", lambda s: put(s, "data.chat_template", True),
     "data.chat_template: true, but the tokenizer of model 'actor' has no chat template; set "
     "it to auto or false, or give the model a tokenizer with one"),
    ("chat-template-value", lambda s: put(s, "data.chat_template", "yes"),
     "data.chat_template: expected one of 'auto', True or False, got 'yes'"),
    ("warmup-over-total", lambda s: put(s, "models.actor.optimizer",
                                        {"warmup_steps": 10, "total_steps": 5}),
     "models.actor.optimizer.warmup_steps: 10 warmup steps exceed total_steps=5"),
    # blocks dedented one level too far
    ("param-at-stage-level", lambda s: put(s, "stages.generate.max_new_tokens",
                                           s["stages"]["generate"].pop("params")
                                           ["max_new_tokens"]),
     "stages.generate.max_new_tokens: max_new_tokens is a param of stage type 'generate'; "
     "indent it under params:"),
    ("params-dedented", lambda s: s["stages"].update(
        params={"function": s["stages"]["reward"].pop("params")["function"]}),
     "stages.params: reads as a stage named 'params'; the params of stage 'train_critic'? "
     "indent them under it"),
    ("stage-at-top-level", lambda s: s.update(extra=s["stages"].pop("train_critic")),
     "extra: unknown key; a stage of type 'train_critic'? indent it under stages:"),
    ("schedule-value", lambda s: put(s, "models.actor.optimizer.schedule", "step"),
     "models.actor.optimizer.schedule: expected one of 'constant', 'linear' or 'cosine', "
     "got 'step'"),
]


@pytest.mark.parametrize(("mutate", "expected"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_broken_pipeline(tmp_path: Path, mutate: Callable[[dict], Any], expected: str) -> None:
    spec = base_spec()
    mutate(spec)
    path = write_spec(tmp_path, spec)
    from rlhfflow.ops.registry import ADVANTAGE_ESTIMATORS

    message = f"{path}: " + expected.format(dir=tmp_path.resolve(),
                                            known=", ".join(sorted(ADVANTAGE_ESTIMATORS)))
    result = validate(path)
    assert (result.exit_code, result.stderr, result.stdout) == (2, f"Error: {message}\n", "")
    with pytest.raises(SpecError) as err:  # the same line from the Python API
        load_pipeline(path)
    assert str(err.value) == message


def test_cases_cover_many_mistakes() -> None:
    assert len(CASES) >= 25
    assert len({c[0] for c in CASES}) == len(CASES)


# (id, file text, expected message after "FILE: ")
RAW_CASES = [
    ("syntax", "name: x\nstages:\n  a: [1, 2\n",
     "invalid YAML: line 4, column 1: expected ',' or ']', but got '<stream end>' "
     "(while parsing a flow sequence started at line 3, column 6)"),
    ("indentation", "stages:\n  g:\n    type: generate\n   model: x\n",
     "invalid YAML: line 4, column 4: expected <block end>, but found '<block mapping start>' "
     "(while parsing a block mapping started at line 2, column 3)"),
    ("tab", "name: x\n\tstages: {}\n",
     "invalid YAML: line 2, column 1: found character '\\t' that cannot start any token"),
    ("duplicate-key", "name: x\nstages: {}\nname: y\n",
     "invalid YAML: line 3, column 1: duplicate key 'name' (first at line 1)"),
    ("top-level-list", "- generate\n- reward\n",
     "expected a mapping of keys (name:, models:, stages:, ...) at the top level, got a list"),
    ("top-level-string", "just words\n",
     "expected a mapping of keys (name:, models:, stages:, ...) at the top level, "
     "got a string"),
    ("empty", "", "the file is empty; expected a mapping with at least 'stages'"),
    ("python-tag", 'name: !!python/object/apply:os.system ["echo hi"]\nstages: {}\n',
     "invalid YAML: line 1, column 7: unsupported tag '!!python/object/apply:os.system'; "
     "pipeline files hold plain data (mappings, lists, strings, numbers)"),
]


@pytest.mark.parametrize(("text", "expected"), [c[1:] for c in RAW_CASES],
                         ids=[c[0] for c in RAW_CASES])
def test_broken_yaml(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "pipeline.yaml"
    path.write_text(text)
    result = validate(path)
    assert (result.exit_code, result.stderr, result.stdout) == (2, f"Error: {path}: {expected}\n",
                                                                "")


def test_missing_pipeline_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    result = validate(path)
    assert (result.exit_code, result.stderr) == (2, f"Error: {path}: file not found\n")


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "pipeline.yaml"
    path.write_bytes(b"name: \xff\n")
    result = validate(path)
    assert (result.exit_code, result.stderr) == (
        2, f"Error: {path}: not UTF-8 text (invalid start byte at byte 6)\n")


def test_scientific_float_is_accepted(tmp_path: Path) -> None:
    text = yaml.safe_dump(base_spec(), sort_keys=False)
    assert "lr: 0.003" in text
    path = tmp_path / "pipeline.yaml"
    path.write_text(text.replace("lr: 0.003", "lr: 1e-3", 1))
    assert validate(path).exit_code == 0
    lr = load_pipeline(path).spec.models["actor"].optimizer.lr
    assert isinstance(lr, float) and lr == pytest.approx(1e-3)


@pytest.mark.parametrize(("source", "params", "expected"), [
    ("def judge(prompts, responses, *, rubric):\n    return [0.0] * len(responses)\n",
     {"function": "reward.py:judge"},
     "stages.reward.params.function: the reward function takes 'rubric', which record "
     "{prompts}:1 does not have (give it a default, or add the field)"),
    ("def judge(responses):\n    return [0.0] * len(responses)\n",
     {"function": "reward.py:judge"},
     "stages.reward.params.function: judge() cannot be called as judge(prompts, responses, "
     "**kwargs): too many positional arguments; rlhfflow calls fn(prompts: list[str], "
     "responses: list[str], **fields) -> list[float], one value per row (or TRL's "
     "fn(prompts=..., completions=..., **fields))"),
    ("def judge(prompts, responses, **options):\n    return [0.0] * len(responses)\n",
     {"function": "reward.py:judge", "kwargs": {"anything": 1}}, None),
])
def test_reward_kwargs_are_checked_against_the_function_in_a_file(
        tmp_path: Path, source: str, params: dict, expected: str | None) -> None:
    (tmp_path / "reward.py").write_text(source)
    spec = base_spec()
    put(spec, "stages.reward.params", params)
    path = write_spec(tmp_path, spec)
    result = validate(path)
    if expected is None:
        assert result.exit_code == 0, result.stderr
    else:
        # a required argument the kwargs do not give must come from every prompt record
        expected = expected.format(prompts=(path.parent / spec["data"]["prompts"]).resolve())
        assert (result.exit_code, result.stderr) == (2, f"Error: {path}: {expected}\n")


def _ppo_text() -> str:
    """configs/ppo-tiny.yaml as written (comments, block and flow style), runnable here."""
    return PPO_TINY.read_text().replace("prompts: data/prompts.jsonl", f"prompts: {PROMPTS}")


def _line_of(text: str, needle: str, start: int = 0) -> int:
    return text[:text.index(needle, start)].count("\n") + 1


# (id, edit of the real file text, key, where the second one is, where the first one is)
DUPLICATES = [
    ("top-level", lambda t: t + "seed: 7\n", "seed", "seed: 7", "seed: 0"),
    ("stage-defined-twice", lambda t: t + "  reward:\n    type: score\n    after: [generate]\n"
     "    params: {function: rlhfflow.stages.rewards:length_ratio}\n", "reward",
     "  reward:\n    type: score\n    after: [generate]\n    params: {function",
     "  reward:"),
    ("nested-block", lambda t: t.replace("    trainable: true\n", "    trainable: true\n"
                                         "    trainable: false\n", 1),
     "trainable", "trainable: false", "trainable: true"),
    ("flow-mapping", lambda t: t.replace("optimizer: {lr: 3.0e-3}", "optimizer: {lr: 3.0e-3, "
                                         "lr: 1.0e-3}", 1), "lr", "lr: 1.0e-3", "lr: 3.0e-3"),
    ("inside-params", lambda t: t.replace("params: {max_new_tokens: 16", "params: "
                                          "{max_new_tokens: 16, max_new_tokens: 8", 1),
     "max_new_tokens", "max_new_tokens: 8", "max_new_tokens: 16"),
]


@pytest.mark.parametrize(("edit", "key", "second", "first"), [d[1:] for d in DUPLICATES],
                         ids=[d[0] for d in DUPLICATES])
def test_a_duplicate_key_anywhere_is_one_line_naming_file_line_and_key(
        tmp_path: Path, edit: Callable[[str], str], key: str, second: str, first: str) -> None:
    text = edit(_ppo_text())
    path = tmp_path / "pipeline.yaml"
    path.write_text(text)
    second_line = _line_of(text, second, text.index(first) + 1)
    result = validate(path)
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr.startswith(f"Error: {path}: invalid YAML: line {second_line}, ")
    assert result.stderr.endswith(f"duplicate key {key!r} (first at line "
                                  f"{_line_of(text, first)})\n")
    assert result.stderr.count("\n") == 1


def test_keys_that_load_as_the_same_value_are_duplicates(tmp_path: Path) -> None:
    path = tmp_path / "pipeline.yaml"
    path.write_text(_ppo_text().replace(
        "function: rlhfflow.stages.rewards:vowel_ratio",
        "function: rlhfflow.stages.rewards:vowel_ratio\n      kwargs: {1: a, 0x1: b}"))
    with pytest.raises(SpecError, match=r"duplicate key '0x1' \(first at line \d+\)$"):
        load_pipeline(path)


def test_an_unedited_example_has_no_duplicates(tmp_path: Path) -> None:
    path = tmp_path / "pipeline.yaml"
    path.write_text(_ppo_text())
    assert validate(path).exit_code == 0


@pytest.mark.parametrize(("args", "message"), [
    (["--set", "seed=1", "--set", "seed=2"], "Error: --set seed: given twice; keep one\n"),
    (["--set", "cluster.workers=1", "--workers", "2"],
     "Error: --set cluster.workers and --workers both given; keep one\n"),
])
def test_an_override_given_twice_is_one_line(args: list[str], message: str) -> None:
    result = CliRunner().invoke(main, ["plan", str(PPO_TINY), *args])
    assert (result.exit_code, result.stderr, result.stdout) == (2, message, "")


def test_a_duplicate_key_in_a_set_value_is_an_error() -> None:
    result = CliRunner().invoke(main, ["plan", str(PPO_TINY), "--set",
                                       "overlap={fuse: true, fuse: false}"])
    assert result.exit_code == 2
    assert "duplicate key 'fuse'" in result.stderr


def test_yaml_merge_keys_are_not_duplicates(tmp_path: Path) -> None:
    spec = base_spec()
    text = yaml.safe_dump(spec, sort_keys=False)
    text = text.replace("  ref_logprob:\n    type: logprob\n",
                        "  ref_logprob:\n    <<: {type: logprob, retries: 1}\n    type: logprob\n")
    path = tmp_path / "pipeline.yaml"
    path.write_text(text)
    assert load_pipeline(path).spec.stages["ref_logprob"].retries == 1


def test_overrides_are_validated(tmp_path: Path) -> None:
    path = write_spec(tmp_path, base_spec())
    assert load_pipeline(path, {"cluster.workers": 1}).spec.cluster.workers == 1
    with pytest.raises(SpecError, match=r"cluster\.workers: expected an integer > 0, got 0$"):
        load_pipeline(path, {"cluster.workers": 0})


def test_estimator_and_policy_loss_by_import_path_are_accepted(tmp_path: Path) -> None:
    spec = base_spec()
    put(spec, "algorithm.advantage_estimator", "tests.algorithms_plugin:value_baseline")
    put(spec, "algorithm.policy_loss", "tests.algorithms_plugin:reinforce_loss")
    put(spec, "algorithm.importance_sampling_level", "sequence")
    algorithm = load_pipeline(write_spec(tmp_path, spec)).spec.algorithm
    assert algorithm.estimator == "tests.algorithms_plugin:value_baseline"
    assert algorithm.uses_critic  # it registered needs=("values",)


def test_presets_keep_their_estimators() -> None:
    from rlhfflow.config.spec import AlgorithmSpec

    assert {n: AlgorithmSpec(name=n).estimator for n in ("ppo", "grpo", "rloo", "dr_grpo")} \
        == {"ppo": "gae", "grpo": "grpo", "rloo": "rloo", "dr_grpo": "dr_grpo"}
    assert [AlgorithmSpec(name=n).uses_critic for n in ("ppo", "grpo", "rloo", "dr_grpo")] \
        == [True, False, False, False]


def test_unknown_estimator_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """``rlhfflow validate``: one line naming file and key, exit 2 (in-process; the real
    process is test_python_tag_in_a_real_process's)."""
    spec = base_spec()
    put(spec, "algorithm.advantage_estimator", "reinforce_plus_plus_basline")
    path = write_spec(tmp_path, spec)
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == (f"Error: {path}: algorithm.advantage_estimator: unknown advantage "
                           "estimator 'reinforce_plus_plus_basline'; did you mean "
                           "'reinforce_plus_plus_baseline'? (or give an import path "
                           "'package.module:function')\n")


def test_run_with_an_unresolvable_estimator_starts_nothing(tmp_path: Path) -> None:
    spec = base_spec()
    put(spec, "algorithm.advantage_estimator", "my_algos:best")
    put(spec, "output", str(tmp_path / "out"))
    path = write_spec(tmp_path, spec)
    result = CliRunner().invoke(main, ["run", str(path)])
    assert (result.exit_code, result.stderr) == (
        2, f"Error: {path}: algorithm.advantage_estimator: cannot import module 'my_algos': "
           "No module named 'my_algos'\n")
    assert not (tmp_path / "out").exists()


def test_python_tag_in_a_real_process(tmp_path: Path) -> None:
    """``python -m rlhfflow.cli.main validate`` on a file that tries to run a command:
    nothing runs, one line on stderr, exit 2, no traceback."""
    marker = tmp_path / "PWNED"
    path = tmp_path / "pipeline.yaml"
    path.write_text(f'name: !!python/object/apply:os.system ["touch {marker}"]\nstages: {{}}\n')
    proc = subprocess.run([sys.executable, "-m", "rlhfflow.cli.main", "validate", str(path)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert "Traceback" not in proc.stderr
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == (f"Error: {path}: invalid YAML: line 1, column 7: unsupported tag "
                           "'!!python/object/apply:os.system'; pipeline files hold plain data "
                           "(mappings, lists, strings, numbers)\n")
    assert not marker.exists()


def test_optimizer_total_steps_and_checkpoint_are_resolved(tmp_path: Path) -> None:
    spec = base_spec()
    put(spec, "models.actor.optimizer.schedule", "cosine")
    put(spec, "models.critic.optimizer.total_steps", 7)
    put(spec, "checkpoint.optimizer", False)
    put(spec, "models.critic.optimizer.checkpoint", True)
    pipeline = load_pipeline(write_spec(tmp_path, spec))
    params = pipeline.params["train_actor"]
    actor, critic = (pipeline.spec.models[m].optimizer for m in ("actor", "critic"))
    # derived: iterations x (epochs x minibatches) of the stage training it
    assert actor.total_steps == spec["iterations"] * params.epochs * params.minibatches
    assert critic.total_steps == 7
    assert (actor.checkpoint, critic.checkpoint) == (False, True)
    assert pipeline.spec.models["ref"].optimizer.checkpoint is None  # not trainable


@pytest.mark.parametrize(("algorithm", "estimator"), [
    ({"name": "grpo"}, "grpo"), ({"name": "rloo"}, "rloo"), ({"name": "dr_grpo"}, "dr_grpo"),
    ({"name": "grpo", "advantage_estimator": "reinforce_plus_plus_baseline"},
     "reinforce_plus_plus_baseline")])
def test_a_group_estimator_with_one_sample_per_prompt_is_refused(
        tmp_path: Path, algorithm: dict, estimator: str) -> None:
    spec = yaml.safe_load((ROOT / "configs" / "grpo-tiny.yaml").read_text())
    spec["data"].update(prompts=str(PROMPTS), samples_per_prompt=1)
    spec["algorithm"] = {**spec["algorithm"], **algorithm}
    path = write_spec(tmp_path, spec)
    result = validate(path)
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == (
        f"Error: {path}: data.samples_per_prompt: the {estimator!r} estimator compares the "
        f"responses to one prompt: with 1 per prompt every advantage is 0 and nothing is "
        f"learned (stage 'advantages'); set samples_per_prompt to 2 or more (e.g. 8)\n")
    spec["data"]["samples_per_prompt"] = 2
    assert validate(write_spec(tmp_path, spec)).exit_code == 0


@pytest.mark.parametrize(("device", "warned"), [
    ("cpu", "cluster.device cpu"), ("auto", "no GPU on this machine"), ("cuda", None)])
def test_float16_on_a_cpu_is_one_warning_line(tmp_path: Path, monkeypatch, device: str,
                                              warned: str | None) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    spec = base_spec()
    put(spec, "models.actor.dtype", "float16")
    put(spec, "cluster.device", device)
    path = write_spec(tmp_path, spec)
    result = validate(path)
    assert result.exit_code == 0
    assert result.stderr == (
        f"warning: {path}: models.actor.dtype: float16 on a CPU ({warned}) runs "
        f"~15x slower than float32 (no fp16 matmul kernels there); use float32\n"
        if warned else "")
