"""Inference stages: ``logprob`` (actor old / reference log-probs), ``values`` (critic),
``score`` (a reward model or a Python reward function)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import sys
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import torch

from rlhfflow.stages.base import Batch, Column, Stage, StageContext, StageParams, register_stage
from rlhfflow.stages.common import response_logprobs, response_values

RESPONSE_INPUTS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")


class LogprobParams(StageParams):
    """``output``: the column to write: ``old_logprobs`` (the actor before its update,
    the default) or ``ref_logprobs`` (the frozen reference)."""

    output: Literal["old_logprobs", "ref_logprobs"] = "old_logprobs"


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
        temperature = float(ctx.settings.get("temperature", 1.0))
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
    """Either a reward model (the stage's ``model``) or ``function``: a Python callable
    named ``package.module:function`` or ``file.py:function`` (relative to the pipeline
    file), called as ``function(prompts, responses, **kwargs)`` with lists of str and
    returning one float per response.

    ``on_invalid``: a score that is NaN or infinite stops the run (``error``), or
    (``skip``) its sample is left out of advantages and training and counted in the
    metrics (``samples_skipped``)."""

    function: str | None = None
    kwargs: dict[str, Any] = {}
    on_invalid: Literal["error", "skip"] = "error"


def load_function(ref: str, base_dir: str | Path | None = None) -> Callable[..., Any]:
    """Import the callable ``module:attr`` or ``path/file.py:attr``. Only the name the
    pipeline gives is imported; nothing is searched for."""
    return _load_function(ref, str(base_dir) if base_dir is not None else None)


@lru_cache(maxsize=64)
def _load_function(ref: str, base_dir: str | None) -> Callable[..., Any]:
    module_name, sep, attr = ref.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected 'module:function' or 'file.py:function', got {ref!r}")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_absolute() and base_dir is not None:
            path = Path(base_dir) / path
        if not path.is_file():
            raise ValueError(f"reward file not found: {path}")
        unique = f"rlhfflow_user_{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(unique, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[unique] = module
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"cannot import module {module_name!r}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{module_name!r} has no callable {attr!r}")
    return fn


@register_stage
class ScoreStage(Stage):
    """One scalar score per response, from a reward model or a reward function."""

    type_name = "score"
    Params = ScoreParams
    model_head = "value"
    model_optional = True

    @classmethod
    def check_params(cls, params, has_model, base_dir):
        if has_model == (params.function is not None):
            return ("params.function", "give either a reward 'model' for the stage or "
                    "params.function ('module:function'), not both or neither")
        if params.function is not None:
            try:
                load_function(params.function, base_dir)
            except Exception as exc:  # noqa: BLE001 - any import failure is the user's to fix
                return ("params.function", str(exc).splitlines()[0])
        return None

    @classmethod
    def reads(cls, params, algorithm, has_model):
        fields = ("prompt_fields",) if params.function is not None else ()
        return ("prompt_text", "response_text", *fields)

    @classmethod
    def writes(cls, params, algorithm, has_model):
        return {"scores": Column("float32"), "score_valid": Column("int8")}

    def run(self, batch: Batch, ctx: StageContext) -> Batch:
        prompts, responses = list(batch["prompt_text"]), list(batch["response_text"])
        if self.params.function is not None:
            fn = load_function(self.params.function, ctx.settings.get("base_dir"))
            columns = record_columns(fn, self.params.kwargs, batch.get("prompt_fields"))
            scores = torch.as_tensor(fn(prompts, responses, **columns, **self.params.kwargs),
                                     dtype=torch.float32).flatten()
        else:
            scores = self._model_scores(ctx.models.get(self.model), prompts, responses)
        if scores.shape[0] != len(responses):
            raise ValueError(f"stage {self.name!r}: reward returned {scores.shape[0]} scores "
                             f"for {len(responses)} responses")
        valid = torch.isfinite(scores)
        if not valid.all() and self.params.on_invalid == "error":
            bad = int((~valid).sum())
            first = int((~valid).nonzero()[0, 0])
            raise ValueError(f"stage {self.name!r}: reward is not finite for {bad} of "
                             f"{len(responses)} responses (first: row {first}); set "
                             f"params.on_invalid: skip to leave such samples out")
        # a skipped sample keeps a finite placeholder score; score_valid masks it out
        return {"scores": torch.where(valid, scores, torch.zeros_like(scores)),
                "score_valid": valid.to(torch.int8)}

    @torch.no_grad()
    def _model_scores(self, resident, prompts: list[str], responses: list[str]) -> torch.Tensor:
        """Score with the reward model's own tokenizer, so it may differ from the actor's."""
        from rlhfflow.stages.models import sequence_scores

        tok = resident.tokenizer
        texts = [p + r for p, r in zip(prompts, responses, strict=True)]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        device = next(resident.module.parameters()).device
        return sequence_scores(resident.module, enc["input_ids"].to(device),
                               enc["attention_mask"].to(device)).float().cpu()


# ---------------------------------------------------------------------------------------
# Record fields as keyword columns of reward functions (owned by the data side: prompt
# records travel as the JSON text column ``prompt_fields``; see pipeline/source.py).


def reward_fields(fn: Callable[..., Any], fixed: dict[str, Any]) -> tuple[list[str], list[str],
                                                                           bool]:
    """What a reward function asks of the prompt records, from its signature: the
    ``required`` and ``optional`` (defaulted) keyword parameters after
    ``(prompts, responses)`` that ``params.kwargs`` does not already give, and whether
    it takes ``**kwargs`` (then it gets every field, as TRL's reward functions do)."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: give it nothing
        return [], [], False
    named = [p for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    named = [p for p in named[2:] if p.name not in fixed] if len(named) >= 2 else []
    required = [p.name for p in named if p.default is p.empty]
    optional = [p.name for p in named if p.default is not p.empty]
    return required, optional, any(p.kind is p.VAR_KEYWORD for p in parameters)


def record_columns(fn: Callable[..., Any], fixed: dict[str, Any],
                   fields_json: list[str] | None) -> dict[str, list[Any]]:
    """The record fields ``fn`` takes, one list per field with a value per row (the
    loader has checked that every record has the required ones)."""
    if not fields_json:
        return {}
    rows = [json.loads(text) for text in fields_json]
    required, optional, takes_all = reward_fields(fn, fixed)
    names = {k for row in rows for k in row} - set(fixed) if takes_all else \
        set(required) | {n for n in optional if all(n in row for row in rows)}
    return {name: [row.get(name) for row in rows] for name in sorted(names)}
