"""``evaluate``: score the model's responses to an evaluation prompt set of its own, every
K iterations and in the run's last, inside a training pipeline; its metrics are logged as
``eval/...``.

A stage of its own rather than a second ``generate`` + ``score``: those read the
iteration's training prompts and write the training columns (``responses``, ``scores``),
while an evaluation has other prompts and must leave the training batch alone.

With ``rollout:`` (a ``rollout`` stage's params: an environment, tools or an agent) each
record is played as an episode by that rollout, in this task, on the stage's model: the
same path as training's episodes. The episodes' ``env_reward`` is the score unless reward
functions are named (they then read the episode's text); the rollout's figures are logged
too (``eval/env_reward_mean``, ``eval/turns_mean``, ``eval/info_KEY_mean``,
``eval/agent_failed_frac``).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from pydantic import Field

from rlhfflow.data.records import (
    DataError,
    pad_prompts,
    prompt_problem,
    prompt_token_ids,
    read_jsonl,
    render_prompt,
)
from rlhfflow.engine.forward import stage_seed
from rlhfflow.engine.generation import Sampling, generate
from rlhfflow.engine.rewardfns import (
    CONVENTION,
    RewardFunctionSpec,
    check_reward_function,
    record_columns,
    reward_functions,
    reward_inputs,
)
from rlhfflow.engine.usercode import load_function
from rlhfflow.sdk import (
    Batch,
    PlanHints,
    Stage,
    StageContext,
    StageParams,
    create_stage,
    get_stage_type,
    register_stage,
)


class EvaluateParams(StageParams):
    """The evaluation prompts, how often, how to decode and the reward functions (named
    as a ``score`` stage's ``function`` / ``functions``)."""

    prompts: str | None = Field(None, description="JSONL file of evaluation prompt "
                                "records ({\"prompt\": ...} or chat {\"messages\": [...]}, "
                                "and the fields the reward functions take), relative to the "
                                "pipeline file")
    chat_template: Literal["auto", True, False] = Field(
        "auto", description="as data.chat_template: auto renders messages records with "
        "the tokenizer's chat template, true every record, false none")
    every: Annotated[int, Field(gt=0, description="evaluate in iterations 0, K, 2K, "
                                                  "...")] = 1
    final: bool = Field(True, description="evaluate in the run's last iteration too (the "
                                          "model as trained), whatever every says")
    max_new_tokens: Annotated[int, Field(gt=0, description="most new tokens per "
                                                           "response")] = 32
    greedy: bool = Field(True, description="argmax decoding (the default: evaluations "
                                           "repeat); false samples at temperature")
    temperature: Annotated[float, Field(gt=0, description="sampling temperature when "
                                                          "greedy is false")] = 1.0
    batch_size: Annotated[int, Field(gt=0, description="prompts decoded at once")] = 32
    max_prompt_tokens: Annotated[int, Field(gt=0, description="longest prompt, in "
                                                              "tokens")] = 64
    function: str | None = Field(None, description="the reward function, as a score "
                                                   "stage's params.function")
    kwargs: dict[str, Any] = Field({}, description="keyword arguments for function")
    functions: list[RewardFunctionSpec] = Field(
        [], description="several reward functions ({function, weight, kwargs, name}), as "
        "a score stage's params.functions; each is logged as eval/reward_mean_NAME")
    rollout: dict[str, Any] | None = Field(
        None, description="play each record as an episode: a rollout stage's params "
        "(env, tools or agent, max_turns, max_new_tokens, temperature, ...; its own "
        "sampling settings apply, not greedy/temperature here); the episodes' env_reward "
        "is the score unless function(s) are given")

    def reward_functions(self) -> list[RewardFunctionSpec]:
        """The functions the stage calls: ``functions``, or ``function`` alone."""
        return reward_functions(self)  # same rule as the score stage


@register_stage
class EvaluateStage(Stage):
    """Evaluation of the stage's model on its own prompt set every ``every`` iterations:
    decode (greedy by default), score with reward functions, log ``eval/reward_mean``,
    ``eval/reward_mean_NAME`` per function and ``eval/response_length_mean``. It reads
    nothing of the iteration's batch and writes no column, so training is unchanged."""

    type_name = "evaluate"
    Params = EvaluateParams
    model_head = "lm"
    per_batch = True  # one task per iteration, not one per micro-batch
    reports = True
    samples = True

    @classmethod
    def plan_hints(cls, params) -> PlanHints:
        return replace(super().plan_hints(params), every=params.every)

    @classmethod
    def check_params(cls, params, has_model, base_dir):
        if params.prompts is None:
            return ("params.prompts", "required key is missing: the evaluation prompts file")
        path = Path(params.prompts)
        path = path if path.is_absolute() else base_dir / path
        try:
            read_prompts(path)
        except DataError as exc:
            return ("params.prompts", str(exc))
        functions = params.reward_functions()
        if params.function is not None and params.functions:
            return ("params.functions", "give either params.function or params.functions, "
                                        "not both")
        if params.rollout is not None:
            problem = _rollout_problem(params.rollout, has_model, base_dir)
            if problem:
                return problem
        if not functions and params.rollout is None:
            return ("params.function", "required key is missing: the reward function "
                                       "('module:function') that scores the responses")
        for i, entry in enumerate(functions):
            where = "params" if params.function is not None else f"params.functions[{i}]"
            problem = check_reward_function(entry, where, base_dir)
            if problem:
                return problem
        return None

    def run(self, batch: Batch, ctx: StageContext) -> Batch:
        last = ctx.settings.iterations is not None and \
            ctx.iteration == ctx.settings.iterations - 1
        if ctx.iteration % self.params.every and not (self.params.final and last):
            return {}
        base_dir = Path(ctx.settings.base_dir)
        path = Path(self.params.prompts)
        path = path if path.is_absolute() else base_dir / path
        records = read_prompts(path)
        tok = ctx.models.get(self.model).tokenizer
        prompts, token_ids = [], []
        for number, record in enumerate(records, start=1):
            try:
                text, templated = render_prompt(tok, record, self.params.chat_template)
            except ValueError as exc:
                raise DataError(f"{path}: record {number}: {exc}") from None
            ids = prompt_token_ids(tok, text, templated)
            if len(ids) > self.params.max_prompt_tokens:
                raise DataError(f"{path}: record {number}: the prompt has {len(ids)} "
                                f"tokens, more than max_prompt_tokens="
                                f"{self.params.max_prompt_tokens}")
            prompts.append(text)
            token_ids.append(ids)
        if self.params.rollout is not None:
            return self._episodes(ctx, records, prompts, token_ids)
        responses, lengths = self._responses(ctx, token_ids)
        return {**self._metrics(ctx, records, prompts, responses),
                "eval/response_length_mean": float(lengths.float().mean())}

    def _episodes(self, ctx: StageContext, records: list[dict[str, Any]], prompts: list[str],
                  token_ids: list[list[int]]) -> dict[str, Any]:
        """The records played as episodes by the ``rollout`` params' stage, scored."""
        rollout = create_stage("rollout", f"{self.name}.rollout", self.params.rollout,
                               ctx.algorithm, self.model)
        tok = ctx.models.get(self.model).tokenizer
        # its own random streams: evaluating never shifts the training's draws
        seed = stage_seed(ctx.seed, self.name)
        episode_ctx = StageContext(iteration=ctx.iteration, seed=seed, models=ctx.models,
                                   algorithm=ctx.algorithm, settings=ctx.settings)
        fields = [json.dumps({k: v for k, v in r.items() if k != "prompt"}) for r in records]
        outs: list[Batch] = []
        for start in range(0, len(token_ids), self.params.batch_size):
            rows = range(start, min(start + self.params.batch_size, len(token_ids)))
            ids, mask = pad_prompts([token_ids[i] for i in rows], tok.pad_token_id)
            batch = {"prompt_ids": ids, "prompt_mask": mask,
                     "prompt_index": torch.tensor(list(rows)),
                     "sample_index": torch.zeros(len(rows), dtype=torch.long),
                     "prompt_text": [prompts[i] for i in rows],
                     "prompt_fields": [fields[i] for i in rows]}
            outs.append(rollout.run(batch, episode_ctx))
        out = {key: torch.cat([o[key] for o in outs]) if isinstance(outs[0][key], torch.Tensor)
               else [v for o in outs for v in o[key]] for key in outs[0]}
        figures: dict[str, Any] = {
            "eval/env_reward_mean": float(out["env_reward"].mean()),
            "eval/turns_mean": float(out["turns"].float().mean()),
            "eval/response_length_mean": float(out["response_mask"].sum(-1).float().mean()),
            **{f"eval/{key}_mean": float(out[key].float().mean())
               for key in out if key.startswith("info_")}}
        if "agent_failed" in out:
            figures["eval/agent_failed_frac"] = float(out["agent_failed"].float().mean())
        if self.params.reward_functions():
            return {**self._metrics(ctx, records, prompts, list(out["response_text"])),
                    **figures}
        rewards = out["env_reward"]
        return {"eval/reward_mean": float(rewards.mean()),
                "eval/reward_std": float(rewards.std(unbiased=False)), **figures,
                "eval/prompts": len(prompts)}

    @torch.no_grad()
    def _responses(self, ctx: StageContext, token_ids: list[list[int]]
                   ) -> tuple[list[str], torch.Tensor]:
        """The decoded responses to the (rendered, tokenized) prompts and their lengths
        in tokens."""
        resident = ctx.models.get(self.model)
        tok = resident.tokenizer
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        params = Sampling(max_new_tokens=self.params.max_new_tokens, greedy=self.params.greedy,
                          temperature=self.params.temperature)
        # its own random stream: sampling here never shifts the training's draws
        gen = torch.Generator().manual_seed(stage_seed(ctx.seed, ctx.iteration, self.name))
        texts: list[str] = []
        lengths = []
        with resident.generating():
            for start in range(0, len(token_ids), self.params.batch_size):
                chunk = token_ids[start:start + self.params.batch_size]
                ids, mask = pad_prompts(chunk, tok.pad_token_id)
                uniforms = torch.rand(len(chunk), params.max_new_tokens, generator=gen)
                out = generate(resident.module, ids, mask, uniforms, params,
                               tok.eos_token_id, pad_id)
                real = out["response_ids"].masked_fill(out["response_mask"] == 0, pad_id)
                texts += tok.batch_decode(real.tolist(), skip_special_tokens=True)
                lengths.append(out["response_mask"].sum(-1))
        return texts, torch.cat(lengths)

    def _metrics(self, ctx: StageContext, records: list[dict[str, Any]], prompts: list[str],
                 responses: list[str]) -> dict[str, Any]:
        fields = [json.dumps({k: v for k, v in r.items() if k != "prompt"}) for r in records]
        base_dir = ctx.settings.base_dir
        total = torch.zeros(len(responses))
        out: dict[str, Any] = {}
        entries = self.params.reward_functions()
        for entry in entries:
            fn = load_function(entry.function, base_dir)
            columns = record_columns(fn, entry.kwargs, fields)
            args, keywords = reward_inputs(fn, prompts, responses, fields)
            scores = torch.as_tensor(fn(*args, **keywords, **columns, **entry.kwargs),
                                     dtype=torch.float32).flatten()
            if scores.shape[0] != len(responses):
                raise ValueError(f"stage {self.name!r}: reward returned {scores.shape[0]} "
                                 f"scores for {len(responses)} responses; rlhfflow calls "
                                 f"{CONVENTION}")
            total += entry.weight * scores
            if self.params.functions:
                out[f"eval/reward_mean_{entry.column.removeprefix('score_')}"] = \
                    float(scores.mean())
        return {"eval/reward_mean": float(total.mean()),
                "eval/reward_std": float(total.std(unbiased=False)), **out,
                "eval/prompts": len(prompts)}


def read_prompts(path: Path) -> list[dict[str, Any]]:
    """The evaluation prompt records: a ``prompt`` string or chat ``messages`` each (as
    the training prompts); a bad one is a ``DataError`` naming ``file:line``."""
    lines: list[int] = []
    records = read_jsonl(path, (), line_numbers=lines)
    for number, record in zip(lines, records, strict=True):
        problem = prompt_problem(record)
        if problem:
            raise DataError(f"{path}:{number}: {problem}")
    return records


def _rollout_problem(params: dict[str, Any], has_model: bool, base_dir: Path
                     ) -> tuple[str, str] | None:
    """Why ``params`` are not a rollout stage's params, as ``(key, message)``."""
    from pydantic import ValidationError

    cls = get_stage_type("rollout")
    try:
        parsed = cls.Params(**params)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        return (f"params.rollout.{where}", error["msg"])
    if getattr(parsed, "stream", False):
        return ("params.rollout.stream", "an evaluation plays its records to their end in "
                                         "its own task; leave stream out of it")
    problem = cls.check_params(parsed, has_model, base_dir)
    if problem:
        return (f"params.rollout.{problem[0].removeprefix('params.')}", problem[1])
    return None
