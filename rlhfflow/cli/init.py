"""``rlhfflow init DIR``: a runnable starter project (pipeline, prompts, a tiny model)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from rlhfflow.cli.common import UserError, first_line, load, table

STARTER_PIPELINE = """\
# PPO on a tiny random Llama (models/tiny-lm), on a local Dask cluster of 2 workers.
# Task: answer with vowels (reward = vowels / max(len, 8), in [0, 1]).
# Paths are relative to this file; the run writes to runs/starter in the current
# directory (set `output:` or pass --out to change it).
#   rlhfflow run pipeline.yaml      (from this directory)
name: starter
seed: 0
iterations: 20

cluster:
  workers: 2

data:
  prompts: prompts.jsonl
  batch_size: 32
  samples_per_prompt: 1
  micro_batches: 2

models:
  actor:
    path: models/tiny-lm
    trainable: true
    optimizer: {lr: 3.0e-3}
  critic:
    from: actor
    head: value
    trainable: true
    optimizer: {lr: 3.0e-3}
  ref:
    from: actor

algorithm:
  name: ppo
  kl_coef: 0.01

stages:
  generate:
    type: generate
    model: actor
    params: {max_new_tokens: 16, temperature: 1.0}
  reward:
    type: score
    after: [generate]
    params:
      function: rlhfflow.stages.rewards:vowel_ratio
  ref_logprob:
    type: logprob
    model: ref
    after: [generate]
    params: {output: ref_logprobs}
  old_logprob:
    type: logprob
    model: actor
    after: [generate]
  values:
    type: values
    model: critic
    after: [generate]
  advantages:
    type: advantages
    after: [reward, ref_logprob, old_logprob, values]
  train_actor:
    type: train_actor
    model: actor
    after: [advantages]
    params: {epochs: 2, minibatches: 2}
  train_critic:
    type: train_critic
    model: critic
    after: [advantages]
    params: {epochs: 2, minibatches: 2}
"""

_VERBS = ("describe", "sing about", "speak of", "talk about")
_THINGS = ("the sun", "a tree", "the moon", "a lake", "a bird", "the sea", "a hill", "the rain")


def starter_prompts() -> list[str]:
    """64 short prompts, the same every time: 32 about one thing, 32 about two."""
    singles = [f"{verb} {thing}:" for verb in _VERBS for thing in _THINGS]
    pairs = [f"{verb} {a} and {b}:" for verb in _VERBS
             for a, b in zip(_THINGS, _THINGS[1:] + _THINGS[:1], strict=True)]
    return singles + pairs


@click.command()
@click.argument("directory", metavar="DIR", type=click.Path(file_okay=False))
@click.option("--force", is_flag=True, help="Write into DIR even if it is not empty, "
              "replacing the starter files.")
def init(directory: str, force: bool) -> None:
    """Write a runnable starter project into DIR.

    DIR gets pipeline.yaml (PPO, 20 iterations), prompts.jsonl (64 prompts)
    and models/tiny-lm (a tiny random Llama with a character tokenizer).
    DIR must be empty or missing unless --force is given.

    \b
    Example:
      rlhfflow init demo
      rlhfflow run demo/pipeline.yaml
    """
    root = Path(directory)
    if root.exists() and any(root.iterdir()) and not force:
        raise UserError(f"{root}: directory is not empty; use --force to write into it")
    from rlhfflow.engine.models import build_char_tokenizer, build_tiny_model, save_model

    pipeline_file, prompts_file, model_dir = (root / "pipeline.yaml", root / "prompts.jsonl",
                                              root / "models" / "tiny-lm")
    prompts = starter_prompts()
    try:
        root.mkdir(parents=True, exist_ok=True)
        tokenizer = build_char_tokenizer()
        save_model(build_tiny_model(tokenizer, "lm", seed=0), tokenizer, model_dir)
        prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts),
                                encoding="utf-8")
        pipeline_file.write_text(STARTER_PIPELINE, encoding="utf-8")
    except OSError as exc:
        raise UserError(first_line(exc)) from None
    pipeline = load(str(pipeline_file))
    written = [(str(pipeline_file), f"PPO pipeline, {pipeline.spec.iterations} iterations"),
               (str(prompts_file), f"{len(prompts)} prompts"),
               (str(model_dir), "tiny random Llama and its character tokenizer")]
    click.echo("\n".join([f"wrote a starter project in {root}:", *table(written),
                          "next:", f"  rlhfflow run {pipeline_file}"]))
