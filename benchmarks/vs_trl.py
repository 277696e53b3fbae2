"""rlhfflow's default against TRL's ``GRPOTrainer`` on the same GRPO work.

For each config, rlhfflow runs the pipeline as the file has it (the product's default
placement), then TRL's ``GRPOTrainer`` does the same work: the actor's initial weights from
that run's ``OUTPUT/models/actor/init``, the same prompts in the same order, the same
reward function, samples per prompt, response length, sampling temperature, optimizer
steps per generated batch, AdamW settings, gradient clipping, clip range, and k3 KL to the
reference in the loss with the same coefficient (``trl_settings`` maps each one). Each
system runs in its own fresh process (``sys.executable``), so neither's imports or torch
thread settings reach the other and both start alike; the parent only collects their JSON.

The figure is seconds per iteration (one generated batch and its ``epochs x minibatches``
optimizer steps), the median over the steady iterations (all but the first, which loads
the models) on both sides, and the samples per second that gives. The learning check is
the mean reward of the first and of the last iterations on each side (sampling noise
differs: the two draw different random numbers). Also the wall time from launching the
process to the end of the first iteration (imports and model loading included).

TRL is an optional extra, never a dependency of rlhfflow::

    pip install -c constraints.txt -e ".[bench]"
    python benchmarks/vs_trl.py [--configs tiny,small,arithmetic,calculator,FILE.yaml]
                                [--iterations N]
                                [--rounds R] [--threads T[,T]] [--workdir DIR]
                                [--recompute-logprobs] [--device cpu|cuda]
                                [--lora 0,16] [--lora-lr LR]

``--configs`` takes the names above or paths of other GRPO files (``gpu/grpo-large.yaml``);
``arithmetic`` is ``examples/arithmetic/grpo.yaml``: the real SmolLM2-135M-Instruct
(``rlhfflow models import-gguf --smollm2 models/smollm2-135m`` and
``python examples/arithmetic/make_data.py`` first), chat records, which TRL gets in its
conversational form and renders with the same template, and an exact-match reward reading
the records' ``answer`` field, which TRL passes as a dataset column. ``calculator`` is agent work:
``examples/multiturn/calculator.yaml`` (``python examples/multiturn/make_data.py`` first),
whose ``rollout`` plays up to 2 model turns with the tool ``tools.py:calculate`` between
them, against TRL's tool loop (``GRPOTrainer(tools=...)``): the same tool function, the
rollout's ``max_new_tokens`` per turn (TRL's ``generation_kwargs``), ``max_tokens`` per
episode, tool results included (TRL's ``max_completion_length``), ``max_turns - 1`` tool
rounds (``max_tool_calling_iterations``), and the score stage's reward functions with their
weights (``reward_weights``), each reading the episode's text after the prompt, special
tokens removed, on both sides. TRL refuses SmolLM2's own chat template for tools, so both
systems load the model from a copy whose template is Hermes' (``HERMES_TEMPLATE``: the
tools' schemas in the system prompt, ``<tool_call>`` JSON, results as ``tool`` turns), which
rlhfflow's rollout parses by default and TRL with its Qwen response template; the prompts
then carry the tools' schemas (``data.max_prompt_tokens`` raised to fit). ``--lora`` runs each
config once per rank (0: every weight trained): both systems then train the same LoRA
adapters (rlhfflow's ``models.ACTOR.lora``, TRL's ``peft_config``: every linear layer, alpha
twice the rank, no dropout), at ``--lora-lr`` when given.
``--device cuda`` runs both on the GPU: rlhfflow with ``cluster.device: cuda``, TRL without
``use_cpu``; an actor of ``dtype: bfloat16`` (or ``float16``), which rlhfflow trains with
fp32 master weights under autocast, is TRL's ``bf16`` (``fp16``) mixed precision, the
same arithmetic. There each run's peak GPU memory is recorded too (``nvidia-smi``,
sampled from outside, the same for both). ``--iterations`` defaults to 30 for tiny (both
systems speed up over the first ~10) and 8 for small and files; ``--rounds`` (runs of each
system, alternating; the median counts) to 1; ``--threads`` (TRL's torch threads) to the
machine's cores, and ``--threads 1,2`` runs TRL at each, its fastest counting (on a busy
machine 2 OpenMP threads on 2 cores are many times slower than 1). Both systems get the
same cores: a one-worker config whose worker has fewer torch threads than TRL's most
(the calculator example's 1, set for a shared machine) runs with that many
(``cluster.torch_threads``, in the figures' overrides); ``--workdir`` keeps the
runs' outputs and logs; ``--recompute-logprobs`` also runs rlhfflow with an
``old_logprob`` stage recomputing the behaviour log-probs, the pass TRL makes and the
shipped configs leave out (a row of its own). Prints a table per config, then one JSON object
with the figures as its last line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from shared import emit_result

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"tiny": ROOT / "configs" / "grpo-tiny.yaml",
           "small": ROOT / "configs" / "grpo-small.yaml",
           # the real model (SmolLM2-135M-Instruct), chat records, an exact-match reward
           "arithmetic": ROOT / "examples" / "arithmetic" / "grpo.yaml",
           # agent work: up to 2 model turns with a calculator tool between them
           "calculator": ROOT / "examples" / "multiturn" / "calculator.yaml"}
DEFAULT_ITERATIONS = {"tiny": 30, "small": 8, "arithmetic": 6, "calculator": 6}
FILE_ITERATIONS = 8
BENCH_PACKAGES = ("trl", "datasets", "accelerate")
INSTALL_HINT = 'pip install -c constraints.txt -e ".[bench]"'


# ------------------------------------------------------------------ the work, from the config
def _stage(graph, *type_names: str) -> str:
    """The first stage of one of the built-in types ``type_names`` in ``graph``."""
    return next(name for name in graph.order if graph.nodes[name].type in type_names)


def _generator(graph) -> str:
    """The stage that samples the responses: ``generate``, or a multi-turn ``rollout``."""
    return _stage(graph, "generate", "rollout")


# Qwen2.5's Hermes template (TRL's chat_templates/qwen2_5.jinja) with two changes that keep
# the calculator prompts' own worked example in the form SmolLM2 was tuned on: a tool
# result is a `tool` turn (Qwen2.5: a `user` turn of <tool_response>), and a call is
# <tool_call>{json}</tool_call> without newlines, as the example writes it. With Qwen2.5's
# rendering SmolLM2 called the tool in 1 of 16 samples and no run scored above 0.
HERMES_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful AI assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful AI assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- if message.content %}
            {{- message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '<tool_call>{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>tool\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def hermes_model(source: Path, out: Path) -> Path:
    """A directory of ``source``'s model (its weights and tokenizer, linked) whose chat
    template is ``HERMES_TEMPLATE``: it renders ``tools=`` into the system prompt
    (Hermes' <tools> block), assistant ``tool_calls`` as ``<tool_call>`` JSON and tool
    results as ``tool`` turns. TRL refuses SmolLM2's own template for tools ("does not
    support tool calling"), so both systems get this one; SmolLM2's ``<|im_start|>`` /
    ``<|im_end|>`` are its special tokens already."""
    out.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        target = out / f.name
        if f.name in ("chat_template.jinja", "tokenizer_config.json") or target.exists():
            continue
        target.symlink_to(f.resolve())
    config_file = source / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    config.pop("chat_template", None)  # the .jinja file beside it is the template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (out / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    return out


def tool_overrides(config: Path, work: Path) -> dict[str, Any]:
    """For a config whose ``rollout`` calls tools: its actor on the shared Hermes
    template (``hermes_model``, written under ``work``), for both systems; else none."""
    from rlhfflow.config import load_pipeline

    pipeline = load_pipeline(config)
    graph = pipeline.graph
    generator = _generator(graph)
    if graph.nodes[generator].type != "rollout" or not pipeline.params[generator].tools:
        return {}
    model = graph.nodes[generator].model
    source = Path(pipeline.model_source(pipeline.spec.models[model].path))
    path = hermes_model(source, work / "model-hermes")
    # the template lists the tools' schemas in the system prompt (as rlhfflow's
    # tools_in_prompt: auto and TRL's tools= both do with it): the prompts grow by that
    return {f"models.{model}.path": str(path),
            "data.max_prompt_tokens": max(pipeline.spec.data.max_prompt_tokens,
                                          longest_prompt(pipeline, generator, path))}


def same_cores(config: Path, threads: int) -> dict[str, Any]:
    """For a one-worker config whose worker has fewer torch threads than TRL gets:
    as many (both systems then compute on the same cores); else none."""
    from rlhfflow.config import load_pipeline

    cluster = load_pipeline(config).spec.cluster
    if cluster.workers == 1 and cluster.torch_threads is not None and \
            cluster.torch_threads < threads:
        return {"cluster.torch_threads": threads}
    return {}


def longest_prompt(pipeline, generator: str, model: Path) -> int:
    """Tokens of the longest of ``pipeline``'s chat prompts rendered by ``model``'s
    template with the rollout's tools."""
    from transformers import AutoTokenizer

    from rlhfflow.engine.usercode import load_function

    tokenizer = AutoTokenizer.from_pretrained(model)
    tools = [load_function(ref, pipeline.base_dir) for ref in pipeline.params[generator].tools]
    prompts = pipeline.resolve(pipeline.spec.data.prompts)
    records = [json.loads(line) for line in prompts.read_text().splitlines() if line.strip()]
    return max(len(tokenizer.apply_chat_template(r["messages"], tools=tools,
                                                 add_generation_prompt=True,
                                                 return_dict=False))
               for r in records)


def config_path(name: str) -> Path:
    """A config named on the command line: one of ``CONFIGS``, or a file."""
    return CONFIGS[name] if name in CONFIGS else Path(name).resolve()


def lora_settings(rank: int) -> dict[str, Any]:
    """The adapters both systems train with ``--lora RANK``: rlhfflow's
    ``models.ACTOR.lora`` block, which TRL's ``peft_config`` copies (the same peft code
    builds both): every linear layer of the blocks, alpha twice the rank, no dropout."""
    return {"r": rank, "alpha": 2 * rank, "dropout": 0.0, "target_modules": "all-linear"}


def lora_overrides(config: Path, rank: int, lr: float | None) -> dict[str, Any]:
    """The overrides that give ``config``'s trained actor LoRA adapters of ``rank`` (and
    learning rate ``lr``, when given)."""
    from rlhfflow.config import load_pipeline

    graph = load_pipeline(config).graph
    actor = graph.nodes[_stage(graph, "train_actor")].model
    overrides: dict[str, Any] = {f"models.{actor}.lora": lora_settings(rank)}
    if lr is not None:
        overrides[f"models.{actor}.optimizer.lr"] = lr
    return overrides


def describe_work(config: Path, iterations: int, init_path: Path, device: str = "cpu",
                  overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """What one run of ``config`` does, in plain data both children read: the prompts of
    every iteration in rlhfflow's order (a chat record's messages, which TRL renders with
    the same template), their record fields, and the settings TRL needs
    (``trl_settings``). ``overrides`` (dotted keys) change the file for both systems."""
    from rlhfflow.config import load_pipeline
    from rlhfflow.data.source import PromptSource

    overrides = dict(overrides or {})
    pipeline = load_pipeline(config, {"iterations": iterations, **overrides})
    spec, graph = pipeline.spec, pipeline.graph
    algo = spec.algorithm
    # without KL (kl_coef 0, as the arithmetic example) its form does not matter
    if algo.name != "grpo" or (algo.kl_coef and (algo.kl_in != "loss"
                                                 or algo.kl_estimator != "k3")):
        raise SystemExit(f"{config}: vs_trl compares GRPO with k3 KL in the loss (TRL's "
                         f"only form); the file has {algo.name}, {algo.kl_estimator} in "
                         f"{algo.kl_in}")
    generate = graph.nodes[_generator(graph)]
    sampling = pipeline.params[generate.name]
    score = pipeline.params[_stage(graph, "score")]
    train = pipeline.params[_stage(graph, "train_actor")]
    actor = spec.models[generate.model]
    rewards = score.reward_functions()
    if not rewards:
        raise SystemExit(f"{config}: vs_trl needs reward functions")
    tools = list(getattr(sampling, "tools", []))
    if generate.type == "rollout" and not tools:
        raise SystemExit(f"{config}: vs_trl compares a rollout with tools (TRL's tool "
                         f"loop); the file's rollout has none")
    if actor.dtype != "float32" and device == "cpu":
        raise SystemExit(f"{config}: on CPU vs_trl compares float32 actors (TRL's bf16 "
                         f"and fp16 are for GPUs); the file has {actor.dtype}")
    if actor.tiny is None:  # the run starts from the file's weights, not a built model
        init_path = Path(pipeline.model_source(actor.path)) if actor.path else init_path
    source = PromptSource.from_pipeline(pipeline, generate.model)
    order = [i for k in range(iterations) for i in source.prompt_indices(k)]
    chat = all(isinstance(source.fields[i].get("messages"), list) for i in order)
    rows = spec.data.batch_size * spec.data.samples_per_prompt
    if rows % train.minibatches:
        raise SystemExit(f"{config}: {rows} rows do not split into {train.minibatches} "
                         f"equal minibatches, which TRL needs")
    return {
        "config": str(config), "iterations": iterations, "seed": spec.seed,
        "overrides": overrides,
        "lora_settings": overrides.get(f"models.{generate.model}.lora"),
        "init_path": str(init_path), "base_dir": str(pipeline.base_dir),
        # iteration k's prompts, as rlhfflow's data stage draws them: a chat record's
        # messages (TRL's conversational form), else the text
        "chat": chat,
        "prompts": [source.fields[i]["messages"] if chat else source.texts[i] for i in order],
        "fields": [{k: v for k, v in source.fields[i].items() if k != "messages"}
                   for i in order],
        # the score stage's functions and weights (TRL's reward_funcs, reward_weights)
        "rewards": [{"function": r.function, "weight": r.weight, "kwargs": dict(r.kwargs)}
                    for r in rewards],
        "tools": tools,
        "rows": rows, "batch_size": spec.data.batch_size,
        "samples_per_prompt": spec.data.samples_per_prompt,
        "max_new_tokens": sampling.max_new_tokens,
        "steps_per_iteration": train.epochs * train.minibatches,
        "device": device,
        "trl": trl_settings(pipeline, train, rows, device),
    }


def trl_settings(pipeline, train, rows: int, device: str = "cpu") -> dict[str, Any]:
    """``GRPOConfig`` arguments that make TRL do what ``pipeline`` does; each line says
    which part of the pipeline it copies."""
    spec = pipeline.spec
    algo, data = spec.algorithm, spec.data
    generate = pipeline.params[_generator(pipeline.graph)]
    actor = spec.models[pipeline.graph.nodes[_stage(pipeline.graph, "train_actor")].model]
    opt = actor.optimizer
    episodes: dict[str, Any] = {}
    if getattr(generate, "tools", None):
        # a rollout's episode: max_new_tokens per model turn (TRL's generate() cap),
        # max_tokens for the whole episode, tool results included (TRL's completion
        # budget, which its tool loop enforces the same way), max_turns model turns
        # (the first plus max_turns - 1 after tool results)
        episodes = {"max_completion_length": generate.max_tokens,
                    "generation_kwargs": {"max_new_tokens": generate.max_new_tokens},
                    "max_tool_calling_iterations": generate.max_turns - 1}
    return {
        # one generation = batch_size prompts x samples_per_prompt rows, trained on for
        # `epochs` passes of `minibatches` optimizer steps (no gradient accumulation)
        "num_generations": data.samples_per_prompt,
        "per_device_train_batch_size": rows // train.minibatches,
        "steps_per_generation": train.minibatches,
        "gradient_accumulation_steps": 1,
        "num_iterations": train.epochs,
        "max_completion_length": generate.max_new_tokens,
        "temperature": generate.temperature,
        "top_k": generate.top_k,
        "top_p": generate.top_p,
        # rlhfflow's AdamW, constant lr, gradient clipping
        "learning_rate": opt.lr,
        "adam_beta1": opt.betas[0],
        "adam_beta2": opt.betas[1],
        "adam_epsilon": opt.eps,
        "weight_decay": opt.weight_decay,
        "max_grad_norm": opt.grad_clip or 0.0,
        "optim": "adamw_torch",
        # rlhfflow's step i of warmup uses lr * (i + 1) / warmup, transformers' lr * i /
        # warmup: the same ramp one step later
        "lr_scheduler_type": "constant_with_warmup" if opt.warmup_steps else "constant",
        "warmup_steps": opt.warmup_steps,
        # the loss: PPO clip range, k3 KL to the reference in the loss, group-std scaling;
        # "bnpo" divides by the minibatch's own token count like rlhfflow's token-mean
        # ("dapo", TRL's default, divides by the generation's mean tokens per step)
        "beta": algo.kl_coef,
        "epsilon": algo.clip_low,
        "epsilon_high": algo.clip_high,
        "scale_rewards": "group",
        "loss_type": "bnpo" if algo.loss_agg == "token-mean" else "grpo",
        # the prompts arrive in rlhfflow's order: no reshuffling
        "shuffle_dataset": False,
        "seed": spec.seed,
        # rlhfflow trains without activation checkpointing, in fp32 or, for a bfloat16 or
        # float16 actor, mixed precision with fp32 master weights: TRL's bf16 / fp16
        # (TRL defaults to bf16 and gradient checkpointing); its tiny models have no dropout
        "bf16": actor.dtype == "bfloat16",
        "fp16": actor.dtype == "float16",
        "gradient_checkpointing": False,
        "disable_dropout": True,
        "use_cpu": device == "cpu",
        "use_vllm": False,
        **episodes,
    }


def recompute_logprob_stages(config: Path) -> dict[str, Any]:
    """The config's stages with a ``logprob`` pass over the generator's model that writes
    ``old_logprobs`` before ``train_actor``, whose ratio then divides by them
    (``--recompute-logprobs``): the pass TRL makes, which the shipped GRPO configs leave
    out (``train_actor``'s ``old_logprobs: auto`` takes ``generate``'s own log-probs).
    Passed as an override of ``stages``, so paths in the file stay relative to it."""
    import yaml

    stages = yaml.safe_load(config.read_text())["stages"]
    generator = next(name for name, st in stages.items()
                     if st.get("type") in ("generate", "rollout"))
    out = {}
    for name, st in stages.items():
        st = dict(st)
        if st.get("type") == "train_actor":
            out["old_logprob"] = {"type": "logprob", "model": stages[generator]["model"],
                                  "after": [generator]}
            st["after"] = [*st.get("after", []), "old_logprob"]
            st["params"] = {**(st.get("params") or {}), "old_logprobs": "old_logprobs"}
        out[name] = st
    return out


# ------------------------------------------------------------------ the children
def run_rlhfflow(job: dict[str, Any]) -> dict[str, Any]:
    """One rlhfflow run with the pipeline's own settings; the per-iteration times and
    rewards from its metrics."""
    from rlhfflow.config import load_pipeline
    from rlhfflow.runtime.run import run_pipeline

    out = Path(job["output"])
    first_done: list[float] = []
    stop = threading.Event()

    def watch_first_iteration() -> None:
        # iteration 0's record is the first line of metrics.jsonl; nothing in the result
        # says when it finished, so poll for it (cheap beside the run)
        metrics = out / "metrics.jsonl"
        while not stop.is_set():
            if metrics.is_file() and metrics.stat().st_size > 0:
                first_done.append(time.time())
                return
            time.sleep(0.01)

    watcher = threading.Thread(target=watch_first_iteration, daemon=True)
    watcher.start()
    overrides = {**job.get("overrides", {}), "iterations": job["iterations"],
                 "output": str(out), "cluster.device": job.get("device", "cpu")}
    if job.get("recompute_logprobs"):
        overrides["stages"] = recompute_logprob_stages(Path(job["config"]))
    pipeline = load_pipeline(job["config"], overrides)
    result = run_pipeline(pipeline, progress=False, overwrite=True)
    stop.set()
    return {"iteration_s": [m["iteration_s"] for m in result.metrics],
            "reward": [m["reward_mean"] for m in result.metrics],
            # the model's tokens per sample (response_mask: tool results left out)
            "length": [m.get("response_length_mean") for m in result.metrics],
            "summary_s": result.summary.get("iteration_s"),
            # TRL is on-policy: the comparison holds only while rlhfflow's default is too
            "staleness_max": max((m["staleness_max"] or 0 for m in result.metrics), default=0),
            "first_iteration_s": first_done[0] - job["launched"] if first_done else None}


def run_trl(job: dict[str, Any]) -> dict[str, Any]:
    """TRL's ``GRPOTrainer`` on the work ``job`` describes; times each optimizer step."""
    import torch

    torch.set_num_threads(job["threads"])
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhfflow.engine.rewardfns import record_columns, reward_inputs
    from rlhfflow.engine.usercode import load_function

    tokenizer = AutoTokenizer.from_pretrained(job["init_path"])
    if job.get("tools"):
        # how TRL parses a turn of HERMES_TEMPLATE into tool calls: its own response
        # template for Qwen's <tool_call> JSON (it sets it itself only for templates it
        # knows by their exact text)
        from trl.chat_template_utils import qwen3_template

        tokenizer.response_template = qwen3_template
    # rlhfflow puts BOS before every plain prompt; TRL tokenizes the text as it is, and
    # the tokenizer turns the literal "<bos>" into that token. A chat prompt is rendered
    # by the template on both sides, which places its own start tokens.
    bos = "" if job["chat"] else tokenizer.bos_token or ""
    field_names = sorted({k for f in job["fields"] for k in f})
    dataset = Dataset.from_dict({
        "prompt": job["prompts"] if job["chat"] else [bos + p for p in job["prompts"]],
        **{k: [f.get(k) for f in job["fields"]] for k in field_names}})
    tools = [load_function(ref, job["base_dir"]) for ref in job.get("tools", [])]

    def reward_fn(spec: dict[str, Any]):
        """One of the pipeline's reward functions, called as rlhfflow calls it: the
        rendered prompts and response texts (or TRL's forms, for a function in TRL's
        convention) and the record fields it names."""
        reward = load_function(spec["function"], job["base_dir"])
        kwargs = spec["kwargs"]

        def call(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]],
                 **columns: Any) -> list[float]:
            records = [{k: columns[k][i] for k in field_names} for i in range(len(prompts))]
            if job["chat"]:
                # (with tools TRL hands over the prompts extended by their episodes; the
                # calculator's rewards read the responses only)
                texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True,
                                                       tokenize=False) for p in prompts]
                records = [{**r, "messages": p} for r, p in zip(records, prompts, strict=True)]
                if tools:
                    # the whole episode after the prompt, the model's turns and the tool
                    # results, special tokens removed: rlhfflow's response_text of a rollout
                    responses = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
                else:
                    responses = [c[-1]["content"] for c in completions]
            else:
                texts, responses = [p.removeprefix(bos) for p in prompts], list(completions)
            fields_json = [json.dumps(r) for r in records]
            args, keywords = reward_inputs(reward, texts, responses, fields_json)
            return reward(*args, **keywords, **record_columns(reward, kwargs, fields_json),
                          **kwargs)

        call.__name__ = spec["function"].rsplit(":", 1)[-1]
        return call

    class StepClock(TrainerCallback):
        """Wall time at the start of training and at the end of every optimizer step."""

        def __init__(self) -> None:
            self.begin = 0.0
            self.ends: list[float] = []

        def on_train_begin(self, args, state, control, **kw):
            self.begin = time.time()

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.time())

    clock = StepClock()
    steps = job["steps_per_iteration"]
    config = GRPOConfig(output_dir=job["output"], max_steps=job["iterations"] * steps,
                        logging_steps=1, save_strategy="no", report_to="none",
                        disable_tqdm=True, dataloader_num_workers=0,
                        reward_weights=[spec["weight"] for spec in job["rewards"]],
                        **job["trl"])
    peft_config = None
    if job.get("lora_settings"):
        from peft import LoraConfig

        lora = job["lora_settings"]
        peft_config = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"],
                                 lora_dropout=lora["dropout"],
                                 target_modules=lora["target_modules"], task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=job["init_path"],
                          reward_funcs=[reward_fn(spec) for spec in job["rewards"]],
                          args=config, train_dataset=dataset, processing_class=tokenizer,
                          callbacks=[clock], peft_config=peft_config, tools=tools or None)
    trainer.train()
    # iteration k = the generation at step k*steps and its `steps` optimizer steps
    ends = [clock.begin] + clock.ends
    iteration_s = [ends[(k + 1) * steps] - ends[k * steps] for k in range(job["iterations"])]
    # TRL logs the batch's mean reward at the step that generated it
    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    # the model's tokens per sample (its tool_mask leaves the tool results out)
    lengths = [log["completions/mean_length"] for log in trainer.state.log_history
               if "completions/mean_length" in log]
    return {"iteration_s": iteration_s, "reward": rewards, "length": lengths,
            "version": trl.__version__,
            "threads": torch.get_num_threads(),
            "first_iteration_s": ends[steps] - job["launched"]}


def child(system: str, job_file: Path, result_file: Path) -> None:
    """Entry point of a child process: run ``system`` on the job, write its result."""
    job = json.loads(job_file.read_text())
    result = run_rlhfflow(job) if system == "rlhfflow" else run_trl(job)
    result_file.write_text(json.dumps(result))


# ------------------------------------------------------------------ the parent
def spawn(system: str, job: dict[str, Any], work: Path) -> dict[str, Any]:
    """Run ``system`` in a fresh Python process; its result, or exit with its log's tail.
    On a GPU the result has the peak GPU memory in use while it ran (``gpu_peak_mib``)."""
    from gpumem import GpuMemory

    import rlhfflow

    work.mkdir(parents=True, exist_ok=True)
    job_file, result_file = work / f"{system}-job.json", work / f"{system}-result.json"
    log = work / f"{system}.log"
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    # the child imports the same rlhfflow as this process, wherever it was found
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [
        str(Path(rlhfflow.__file__).resolve().parents[1]), env.get("PYTHONPATH")]))
    job_file.write_text(json.dumps({**job, "launched": time.time()}))
    with log.open("w") as out, GpuMemory() as memory:
        done = subprocess.run([sys.executable, __file__, "--child", system, str(job_file),
                               str(result_file)], stdout=out, stderr=subprocess.STDOUT,
                              env=env, cwd=ROOT)
    if done.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise SystemExit(f"{tail}\nvs_trl: the {system} run failed (exit {done.returncode})")
    result = json.loads(result_file.read_text())
    if job.get("device") == "cuda":
        result["gpu_peak_mib"] = memory.peak_mib
    return result


def steady(times: list[float]) -> float:
    """The median over the steady iterations: all but the first, which loads models."""
    return statistics.median(times[1:] if len(times) > 1 else times)


def compare(name: str, iterations: int, threads: list[int], rounds: int, work: Path,
            recompute_logprobs: bool = False, device: str = "cpu",
            overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """rlhfflow and TRL at each of ``threads`` on config ``name`` (changed by
    ``overrides``), ``rounds`` times, alternating which runs first so that drift of the
    machine hits all alike; the figures of the comparison, TRL's being those of its
    fastest thread count."""
    # other processes on the machine skew TRL's OpenMP threads far more than rlhfflow's
    # single-threaded workers: keep the load beside the figures to judge them by
    load = os.getloadavg()[0]
    ours: list[dict[str, Any]] = []
    recomputed: list[dict[str, Any]] = []
    theirs: dict[int, list[dict[str, Any]]] = {t: [] for t in threads}
    # TRL starts from the actor's initial weights that rlhfflow's first round writes (the
    # same, seeded, in every round)
    # a rollout with tools: both systems on the same tool-capable template
    overrides = {**tool_overrides(config_path(name), work),
                 **same_cores(config_path(name), max(threads, default=1)),
                 **(overrides or {})}
    base = describe_work(config_path(name), iterations,
                         work / "rlhfflow-0" / "models" / "actor" / "init", device, overrides)

    def run_ours(r: int) -> None:
        ours.append(spawn("rlhfflow", {**base, "output": str(work / f"rlhfflow-{r}")},
                          work / f"round-{r}"))
        if recompute_logprobs:
            recomputed.append(spawn("rlhfflow", {**base, "recompute_logprobs": True,
                                                 "output": str(work / f"rlhfflow-old-{r}")},
                                    work / f"round-{r}" / "recompute"))

    def run_theirs(r: int) -> None:
        for t in threads:
            theirs[t].append(spawn("trl", {**base, "output": str(work / f"trl-{t}-{r}"),
                                           "threads": t}, work / f"round-{r}" / f"trl-{t}"))

    for r in range(rounds):
        # rlhfflow first in even rounds, TRL first in odd ones: neither system always
        # gets the machine as the other left it
        for run in (run_ours, run_theirs) if r % 2 == 0 else (run_theirs, run_ours):
            run(r)
    rows = base["rows"]
    by_threads = {t: summarize(runs, rows) for t, runs in theirs.items()}
    best = min(by_threads, key=lambda t: by_threads[t]["s"])
    fig = {"config": config_path(name).name, "iterations": iterations, "rounds": rounds,
           "rows": rows, "device": device, "overrides": base["overrides"],
           "work": f"{base['batch_size']} prompts x {base['samples_per_prompt']} samples x "
                   f"{base['max_new_tokens']} tokens, {base['steps_per_iteration']} steps"}
    fig.update({f"rlhfflow_{k}": v for k, v in summarize(ours, rows).items()})
    fig.update({f"trl_{k}": v for k, v in by_threads[best].items()})
    fig["speedup"] = round(fig["trl_s"] / fig["rlhfflow_s"], 3)
    # each round's own ratio (the two ran minutes apart at most): how much of the
    # figure is the machine drifting between rounds
    fig["speedup_by_round"] = [round(steady(t["iteration_s"]) / steady(o["iteration_s"]), 3)
                               for o, t in zip(ours, theirs[best], strict=True)]
    if recomputed:
        fig["recompute_logprobs"] = summarize(recomputed, rows)
        fig["speedup_recompute_logprobs"] = round(
            fig["trl_s"] / fig["recompute_logprobs"]["s"], 3)
    fig.update({
        "rlhfflow_summary_s": [run["summary_s"] for run in ours],
        "rlhfflow_staleness_max": max(run["staleness_max"] for run in ours),
        "trl_threads": best, "trl_version": theirs[best][0]["version"],
        "trl_by_threads": {str(t): f for t, f in by_threads.items()},
        "load_1min": round(load, 2), "cpus": os.cpu_count()})
    if device == "cuda":
        for system, runs in (("rlhfflow", ours), ("trl", theirs[best])):
            peaks = [run["gpu_peak_mib"] for run in runs if run.get("gpu_peak_mib")]
            fig[f"{system}_gpu_peak_mib"] = max(peaks, default=None)
    return fig


def summarize(runs: list[dict[str, Any]], rows: int) -> dict[str, Any]:
    """The figures of one system's rounds: s/iteration (median of the steady medians),
    samples/s, time to the first iteration, and the rewards of the first round."""
    seconds = statistics.median(steady(run["iteration_s"]) for run in runs)
    first = runs[0]
    return {
        "s": round(seconds, 4), "samples_per_s": round(rows / seconds, 2),
        "first_iteration_s": _round(statistics.median(
            run["first_iteration_s"] for run in runs)),
        "reward": [_round(first["reward"][0]), _round(first["reward"][-1])],
        "rewards": [_round(r) for r in first["reward"]],
        # the same work on both sides: the model's tokens per sample, mean of the first round
        "response_tokens": _round(statistics.mean(first["length"]), 2)
        if all(x is not None for x in first.get("length") or [None]) else None,
        # seeded: every round must learn the same numbers
        "same_rewards_every_round": all(run["reward"] == first["reward"] for run in runs),
        "iteration_s": [[_round(t) for t in run["iteration_s"]] for run in runs],
    }


def _round(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def print_table(name: str, fig: dict[str, Any]) -> None:
    """One config's comparison as a small table: rlhfflow, then TRL per thread count."""
    print(f"\n{name}: {fig['config']}, {fig['work']} per iteration, "
          f"{fig['iterations']} iterations x {fig['rounds']} round(s) (s/iter: median of "
          f"iterations 1.., median over rounds)")
    print(f"{'system':<18}{'s/iter':>9}{'samples/s':>11}{'vs rlhfflow':>13}"
          f"{'first iter s':>14}{'reward first':>14}{'reward last':>13}")
    rows = {"rlhfflow": {k.removeprefix("rlhfflow_"): v for k, v in fig.items()
                         if k.startswith("rlhfflow_")}}
    if "recompute_logprobs" in fig:
        rows["rlhfflow +old_lp"] = fig["recompute_logprobs"]
    for t, f in fig["trl_by_threads"].items():
        rows[f"TRL {fig['trl_version']} {t}thr"] = f
    for label, row in rows.items():
        first, last = row["reward"]
        first_it = row["first_iteration_s"]
        print(f"{label:<18}{row['s']:>9.4f}{row['samples_per_s']:>11.1f}"
              f"{row['s'] / fig['rlhfflow_s']:>13.3f}"
              f"{first_it if first_it is not None else float('nan'):>14.2f}"
              f"{first:>14.4f}{last:>13.4f}")
        if not row["same_rewards_every_round"]:
            print(f"warning: {label}'s rewards differed between rounds (not seeded?)")
    tokens = {label: row.get("response_tokens") for label, row in rows.items()}
    if all(t is not None for t in tokens.values()):
        print("the model's tokens per sample (mean of the first round's iterations): "
              + ", ".join(f"{label} {t:.1f}" for label, t in tokens.items()))
    if "recompute_logprobs" in fig:
        print(f"speedup rlhfflow with an old_logprob pass (as TRL) vs TRL: "
              f"{fig['speedup_recompute_logprobs']:.3f}x")
    print(f"speedup rlhfflow vs TRL: {fig['speedup']:.3f}x (samples/s ratio, against TRL's "
          f"fastest: {fig['trl_threads']} torch thread(s); load {fig['load_1min']:.2f} on "
          f"{fig['cpus']} cores before the runs)")
    if len(fig["speedup_by_round"]) > 1:
        print("speedup in each round (rlhfflow and TRL back to back): "
              + ", ".join(f"{x:.3f}x" for x in fig["speedup_by_round"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="tiny,small",
                        help=f"comma-separated, of {', '.join(CONFIGS)} or GRPO files")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where both systems run (cuda: the first GPU)")
    parser.add_argument("--iterations", type=int, default=None,
                        help="iterations per run (default: 30 for tiny, 8 for small)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of each system, alternating; the median counts")
    parser.add_argument("--threads", default=str(os.cpu_count() or 1),
                        help="TRL's torch threads, comma-separated to try several; the "
                             "fastest counts (default: the machine's cores)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the runs' outputs and logs here (default: a temporary "
                             "folder, removed)")
    parser.add_argument("--recompute-logprobs", action="store_true",
                        help="also run rlhfflow with an old_logprob stage recomputing the "
                             "behaviour log-probs, as TRL does")
    parser.add_argument("--lora", default="0",
                        help="comma-separated LoRA ranks, 0 for the full fine-tune: each "
                             "config runs once per rank, both systems training the same "
                             "adapters (rlhfflow's models.ACTOR.lora, TRL's peft_config)")
    parser.add_argument("--lora-lr", type=float, default=None,
                        help="the learning rate of the LoRA rows, for both systems "
                             "(default: the file's)")
    parser.add_argument("--child", nargs=3, metavar=("SYSTEM", "JOB", "RESULT"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        system, job_file, result_file = args.child
        child(system, Path(job_file), Path(result_file))
        return
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS and not Path(n).is_file()]
    if unknown or not names:
        parser.error(f"--configs: expected names from {', '.join(CONFIGS)} or GRPO files, "
                     f"got {args.configs!r}")
    try:
        threads = sorted({int(t) for t in args.threads.split(",") if t.strip()})
    except ValueError:
        threads = []
    if not threads or min(threads) < 1:
        parser.error(f"--threads: expected positive integers, got {args.threads!r}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    try:
        ranks = [int(r) for r in args.lora.split(",") if r.strip()]
    except ValueError:
        ranks = []
    if not ranks or min(ranks) < 0:
        parser.error(f"--lora: expected ranks >= 0 (0: full fine-tune), got {args.lora!r}")
    if args.iterations is not None and args.iterations < 2:
        parser.error("--iterations must be at least 2 (iteration 0 is left out)")
    missing = [p for p in BENCH_PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        raise SystemExit(f"vs_trl.py needs {', '.join(missing)}: {INSTALL_HINT}")

    figures = {}
    for name, rank in [(n, r) for n in names for r in ranks]:
        iterations = args.iterations or DEFAULT_ITERATIONS.get(name, FILE_ITERATIONS)
        label = (name if name in CONFIGS else Path(name).stem) + (f"-lora{rank}" if rank else "")
        overrides = lora_overrides(config_path(name), rank, args.lora_lr) if rank else {}
        if args.workdir is not None:
            work = args.workdir / label
            work.mkdir(parents=True, exist_ok=True)
            figures[label] = compare(name, iterations, threads, args.rounds, work,
                                     args.recompute_logprobs, args.device, overrides)
        else:
            with tempfile.TemporaryDirectory(prefix=f"vs-trl-{label}-") as tmp:
                figures[label] = compare(name, iterations, threads, args.rounds,
                                         Path(tmp), args.recompute_logprobs, args.device,
                                         overrides)
        print_table(label, figures[label])
    emit_result(figures, __file__)


if __name__ == "__main__":
    main()
