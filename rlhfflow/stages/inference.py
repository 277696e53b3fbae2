"""Inference stages: ``logprob`` (actor old / reference log-probs), ``values`` (critic),
``score`` (a reward model or a Python reward function)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import torch
from pydantic import Field

from rlhfflow.engine.forward import response_logprobs, response_values
from rlhfflow.engine.rewardfns import (
    CONVENTION,
    RewardError,
    RewardFunctionSpec,
    RewardLengthError,
    check_reward_function,
    describe_error,
    episode_messages,
    record_columns,
    reward_functions,
    reward_inputs,
)
from rlhfflow.engine.usercode import load_function
from rlhfflow.errors import is_out_of_memory
from rlhfflow.sdk import (
    RESPONSE_INPUTS,
    Batch,
    Column,
    IterationMetric,
    Stage,
    StageContext,
    StageParams,
    register_stage,
)

SCORE_COLUMN_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
RESERVED_SCORE_NAMES = ("valid", "error", "retries")  # the stage's own score_* columns


class LogprobParams(StageParams):
    """``output``: the column to write: ``old_logprobs`` (the actor before its update,
    the default) or ``ref_logprobs`` (the frozen reference)."""

    output: Literal["old_logprobs", "ref_logprobs"] = Field(
        "old_logprobs", description="the column to write: old_logprobs (the actor before "
        "its update) or ref_logprobs (the frozen reference)")


@register_stage
class LogprobStage(Stage):
    """Per-token log-probs of the responses under a causal LM."""

    type_name = "logprob"
    Params = LogprobParams
    model_head = "lm"

    @classmethod
    def reads(cls, params, algorithm, has_model):
        return RESPONSE_INPUTS

    @classmethod
    def writes(cls, params, algorithm, has_model):
        return {params.output: Column("float32", "response")}

    @torch.no_grad()
    def run(self, batch: Batch, ctx: StageContext) -> Batch:
        resident = ctx.models.get(self.model)
        temperature = ctx.settings.temperature
        return {self.params.output: response_logprobs(resident.module, batch, temperature)}


@register_stage
class ValuesStage(Stage):
    """Per-token values of the responses under a critic (a value-head model)."""

    type_name = "values"
    Params = StageParams
    model_head = "value"

    @classmethod
    def reads(cls, params, algorithm, has_model):
        return RESPONSE_INPUTS

    @classmethod
    def writes(cls, params, algorithm, has_model):
        return {"values": Column("float32", "response")}

    @torch.no_grad()
    def run(self, batch: Batch, ctx: StageContext) -> Batch:
        resident = ctx.models.get(self.model)
        return {"values": response_values(resident.module, batch)}


class ScoreParams(StageParams):
    """Either a reward model (the stage's ``model``) or reward functions: ``function``, a
    Python callable named ``package.module:function`` or ``file.py:function`` (relative to
    the pipeline file), called as ``function(prompts, responses, **kwargs)`` with lists of
    str and returning one float per response (or, when it has a parameter named
    ``completions``, by keyword as TRL calls it: ``function(prompts=..., completions=...,
    **kwargs)``, with chat records' messages and ``[{"role": "assistant", "content": ...}]``
    completions); or ``functions``, a list of them with
    weights, whose weighted sum is ``scores`` and each of which is kept as
    ``score_<name>``.

    ``episodes``: when the stage scores a multi-turn ``rollout`` (``auto``: a stage of the
    pipeline writes ``turns_json``), each row's episode reaches the functions as a list of
    ``{"role", "content"}`` messages: a parameter named ``episode`` gets them, and a TRL
    function's ``completions`` are them (docs/how-to/reward-function.md).

    ``on_invalid``: a score that is NaN or infinite stops the run (``error``), or
    (``skip``) its sample is left out of advantages and training and counted in the
    metrics (``samples_skipped``).

    ``on_error``: a reward function that raises stops the run (``error``, naming the file
    and line where it raised), or (``skip``) each sample is scored alone, and a sample
    whose call still raises after ``retries`` more tries is left out like an invalid score,
    its error kept in the ``score_error`` column; the coordinator stops the run when more
    than ``max_errors`` samples fail in one iteration or ``max_errors_total`` in the run."""

    function: str | None = Field(None, description="a reward function, "
                                 "'package.module:function' or 'file.py:function', called "
                                 "as function(prompts, responses, **kwargs), or TRL's "
                                 "function(prompts=, completions=, **kwargs) when it "
                                 "names completions; none: score "
                                 "with the stage's reward model")
    kwargs: dict[str, Any] = Field({}, description="keyword arguments for function")
    functions: list[RewardFunctionSpec] = Field(
        [], description="several reward functions ({function, weight, kwargs, name}): "
        "scores is their weighted sum, each is kept as score_<name>")
    on_invalid: Literal["error", "skip"] = Field(
        "error", description="a NaN or infinite score stops the run (error) or leaves its "
        "sample out of advantages and training (skip)")
    on_error: Literal["error", "skip"] = Field(
        "error", description="a reward function that raises stops the run (error) or its "
        "sample is retried alone and then left out (skip)")
    retries: Annotated[int, Field(ge=0, description="more tries of a failing sample "
                                                    "under on_error: skip")] = 0
    max_errors: Annotated[int, Field(ge=0, description="failed samples one iteration "
                                                       "may have before the run stops")] = 8
    max_errors_total: Annotated[int, Field(ge=0, description="failed samples the whole "
                                                             "run may have")] = 64
    check: bool = Field(True, description="call each reward function once at validation, "
                        "on two rows (the first prompt records and made-up responses), so "
                        "that a NameError, an import inside it, a bad call or a result that "
                        "is not one number per row fails before start-up; false for a "
                        "function too slow (or with side effects) to call then")
    episodes: Literal["auto"] | bool = Field(
        "auto", description="give reward functions each row's multi-turn episode (the "
        "rollout's turns_json) as {role, content} messages: to a parameter named episode, "
        "and as a TRL function's completions; auto: when a stage of the pipeline writes "
        "turns_json")

    def reward_functions(self) -> list[RewardFunctionSpec]:
        """The functions the stage calls: ``functions``, or ``function`` alone (weight 1)."""
        return reward_functions(self)


@register_stage
class ScoreStage(Stage):
    """One scalar score per response, from a reward model or reward functions."""

    type_name = "score"
    Params = ScoreParams
    model_head = "value"
    model_optional = True
    scores = True

    @classmethod
    def check_params(cls, params, has_model, base_dir):
        functions = params.reward_functions()
        if params.function is not None and params.functions:
            return ("params.functions", "give either params.function or params.functions, "
                                        "not both")
        if params.kwargs and params.function is None:
            return ("params.kwargs", "kwargs go with params.function; with params.functions "
                                     "give each entry its own kwargs")
        if params.retries and params.on_error != "skip":
            return ("params.retries", "retries each failing sample with on_error: skip; "
                    "with on_error: error, the stage's own 'retries' re-runs the whole task")
        if has_model == bool(functions):
            return ("params.function", "give either a reward 'model' for the stage or "
                    "params.function ('module:function'), not both or neither")
        columns: dict[str, int] = {}
        for i, entry in enumerate(functions):
            where = "params" if params.function is not None else f"params.functions[{i}]"
            problem = check_reward_function(entry, where, base_dir)
            if problem:
                return problem
            if params.function is None:
                name = entry.column.removeprefix("score_")
                if not SCORE_COLUMN_NAME.match(name) or name in RESERVED_SCORE_NAMES:
                    return (f"{where}.name", f"{name!r} cannot name a score column "
                            f"(letters, digits and underscores; not "
                            f"{' or '.join(map(repr, RESERVED_SCORE_NAMES))})")
                if entry.column in columns:
                    return (f"{where}.name" if entry.name else f"{where}.function",
                            f"params.functions[{columns[entry.column]}] already writes "
                            f"{entry.column!r}; give one of them another 'name'")
                columns[entry.column] = i
        return None

    @classmethod
    def reads(cls, params, algorithm, has_model):
        functions = params.function is not None or bool(params.functions)
        fields = ("prompt_fields",) if functions else ()
        # "auto" is settled by the loader (resolve_params); unsettled, it means none
        turns = ("turns_json",) if functions and params.episodes is True else ()
        return ("prompt_text", "response_text", *fields, *turns)

    @classmethod
    def resolve_params(cls, params, model, writers):
        # a multi-turn rollout's episodes, as messages, for the functions that take them
        if params.episodes != "auto":
            return params
        return params.model_copy(update={"episodes": "turns_json" in writers})

    @classmethod
    def writes(cls, params, algorithm, has_model):
        out = {"scores": Column("float32"), "score_valid": Column("int8")}
        out.update({entry.column: Column("float32") for entry in params.functions})
        if params.on_error == "skip":
            out["score_error"] = Column("str")  # listed by the store task, not stored
            out["score_retries"] = Column("int32")
        return out

    @classmethod
    def iteration_metrics(cls, params):
        # each reward function's own score, over the samples scored (as reward_mean)
        return tuple(IterationMetric(f"reward_mean_{entry.column.removeprefix('score_')}",
                                     entry.column, where="score_valid")
                     for entry in params.functions)

    def run(self, batch: Batch, ctx: StageContext) -> Batch:
        prompts, responses = list(batch["prompt_text"]), list(batch["response_text"])
        out: Batch = {}
        errors = [""] * len(responses)
        retried = torch.zeros(len(responses), dtype=torch.int32)
        if self.params.function is not None or self.params.functions:
            scores = torch.zeros(len(responses), dtype=torch.float32)
            turns = batch.get("turns_json") if self.params.episodes is True else None
            episodes = [episode_messages(cell) for cell in turns] if turns is not None \
                else None
            for entry in self.params.reward_functions():
                own = self._function_scores(entry, prompts, responses, episodes,
                                            batch.get("prompt_fields"), ctx, errors, retried)
                if self.params.functions:
                    out[entry.column] = torch.nan_to_num(own, nan=0.0, posinf=0.0, neginf=0.0)
                scores += entry.weight * own
            failed = torch.tensor([bool(e) for e in errors])
            scores[failed] = 0.0  # a failed sample is left out below, not an invalid score
        else:
            scores = self._model_scores(ctx.models.get(self.model), prompts, responses)
            failed = torch.zeros(len(responses), dtype=torch.bool)
        if scores.shape[0] != len(responses):
            raise ValueError(f"stage {self.name!r}: reward returned {scores.shape[0]} scores "
                             f"for {len(responses)} responses")
        finite = torch.isfinite(scores)
        if not finite.all() and self.params.on_invalid == "error":
            bad = int((~finite).sum())
            first = int((~finite).nonzero()[0, 0])
            raise ValueError(f"stage {self.name!r}: reward is not finite for {bad} of "
                             f"{len(responses)} responses (first: row {first}); set "
                             f"params.on_invalid: skip to leave such samples out")
        valid = finite & ~failed
        # a skipped sample keeps a finite placeholder score; score_valid masks it out
        out.update(scores=torch.where(valid, scores, torch.zeros_like(scores)),
                   score_valid=valid.to(torch.int8))
        if self.params.on_error == "skip":
            out.update(score_error=errors, score_retries=retried)
        return out

    def _function_scores(self, entry: RewardFunctionSpec, prompts: list[str],
                         responses: list[str], episodes: list[list[dict[str, str]]] | None,
                         fields: list[str] | None, ctx: StageContext,
                         errors: list[str], retried: torch.Tensor) -> torch.Tensor:
        """One function's scores (``episodes``: the rows' multi-turn episodes as messages,
        or None for single responses). With ``on_error: skip``, a call that raises is repeated
        one sample at a time (each up to ``retries`` more times, counted in ``retried``),
        so only the samples it keeps raising on are lost: their error lines go into
        ``errors`` and their scores are NaN."""
        fn = load_function(entry.function, ctx.settings.base_dir)
        # the prompt records' other fields (a reference answer, tests) the function takes
        columns = record_columns(fn, entry.kwargs, fields)
        args, keywords = reward_inputs(fn, prompts, responses, fields, episodes)
        try:
            return self._as_scores(fn(*args, **keywords, **columns, **entry.kwargs),
                                   len(responses))
        except RewardLengthError:
            raise
        except Exception as exc:
            if is_out_of_memory(exc):  # the worker is short, not the samples bad: the run's
                raise
            if self.params.on_error == "error":
                raise RewardError(f"{describe_error(exc, fn)}; set params.on_error: skip "
                                  f"to leave such samples out") from exc
        scores = torch.full((len(responses),), float("nan"))
        for row in range(len(responses)):
            for attempt in range(self.params.retries + 1):
                try:
                    own = {k: v[row:row + 1] for k, v in {**keywords, **columns}.items()}
                    scores[row] = self._as_scores(fn(*(a[row:row + 1] for a in args), **own,
                                                     **entry.kwargs), 1)[0]
                    break
                except RewardLengthError:
                    raise
                except Exception as exc:  # noqa: BLE001 - the user's function, any error
                    if is_out_of_memory(exc):
                        raise
                    if attempt < self.params.retries:
                        retried[row] += 1
                    elif not errors[row]:
                        errors[row] = describe_error(exc, fn)
        return scores

    def _as_scores(self, values: Any, rows: int) -> torch.Tensor:
        scores = torch.as_tensor(values, dtype=torch.float32).flatten()
        if scores.shape[0] != rows:
            raise RewardLengthError(f"stage {self.name!r}: reward returned {scores.shape[0]} "
                                    f"scores for {rows} responses; rlhfflow calls "
                                    f"{CONVENTION}")
        return scores

    @torch.no_grad()
    def _model_scores(self, resident, prompts: list[str], responses: list[str]) -> torch.Tensor:
        """Score with the reward model's own tokenizer, so it may differ from the actor's."""
        from rlhfflow.engine.models import sequence_scores

        tok = resident.tokenizer
        texts = [p + r for p, r in zip(prompts, responses, strict=True)]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        device = next(resident.module.parameters()).device
        return sequence_scores(resident.module, enc["input_ids"].to(device),
                               enc["attention_mask"].to(device)).float().cpu()


# ---------------------------------------------------------------------------------------
# Record fields as keyword columns of reward functions (owned by the data side: prompt
# records travel as the JSON text column ``prompt_fields``; see data/source.py).


