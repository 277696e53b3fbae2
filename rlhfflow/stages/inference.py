"""Inference stages: ``logprob`` (actor old / reference log-probs), ``values`` (critic),
``score`` (a reward model or a Python reward function)."""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import json
import re
import sys
import traceback
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from rlhfflow.engine.forward import response_logprobs, response_values
from rlhfflow.errors import RlhfflowError, is_out_of_memory
from rlhfflow.ops.registry import load_callable
from rlhfflow.stages.base import Batch, Column, Stage, StageContext, StageParams, register_stage

RESPONSE_INPUTS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")


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


class RewardFunctionSpec(BaseModel):
    """One reward function of a ``score`` stage with several: ``function`` as in
    ``params.function``, its ``weight`` in the stage's ``scores``, its ``kwargs``, and the
    ``name`` of its own column ``score_<name>`` (default: the function's name)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    function: str
    weight: float = 1.0
    kwargs: dict[str, Any] = {}
    name: str | None = None

    @property
    def column(self) -> str:
        """The column this function's own score is written to."""
        return f"score_{self.name or self.function.rpartition(':')[2]}"


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
                        "on the first prompt record and a made-up response, so that a "
                        "NameError, an import inside it or a bad call fails before start-up; "
                        "false for a function too slow (or with side effects) to call then")

    def reward_functions(self) -> list[RewardFunctionSpec]:
        """The functions the stage calls: ``functions``, or ``function`` alone (weight 1)."""
        if self.function is not None:
            return [RewardFunctionSpec(function=self.function, kwargs=self.kwargs)]
        return list(self.functions)


#: The module name a pipeline's own ``file.py`` is imported under (with a hash of its path,
#: which differs between processes: pickles send its objects by value).
USER_MODULE_PREFIX = "rlhfflow_user_"


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
        unique = f"{USER_MODULE_PREFIX}{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(unique, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[unique] = module
        spec.loader.exec_module(module)
    else:  # an importable module: the same resolution as estimators and policy losses
        return load_callable(ref)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{module_name!r} has no callable {attr!r}")
    return fn


class RewardError(RlhfflowError, RuntimeError):
    """A reward function raised: names where (the user's file and line) and what."""


class RewardLengthError(RlhfflowError, ValueError):
    """A reward function returned another number of scores than responses: a bug in the
    function, never skipped."""


SCORE_COLUMN_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
RESERVED_SCORE_NAMES = ("valid", "error", "retries")  # the stage's own score_* columns


def raised_where(exc: BaseException, fn: Callable[..., Any]) -> str:
    """``file:line`` where ``exc`` was raised in the user's code: the last traceback frame
    in the reward function's own file, else the last frame outside rlhfflow."""
    frames = traceback.extract_tb(exc.__traceback__)
    try:
        own = str(Path(inspect.getsourcefile(fn) or "").resolve())
    except TypeError:  # a builtin or C function
        own = ""
    ours = str(Path(__file__).resolve().parent.parent)
    mine = [f for f in frames if own and str(Path(f.filename).resolve()) == own] or \
        [f for f in frames if not str(Path(f.filename).resolve()).startswith(ours)]
    frame = mine[-1] if mine else (frames[-1] if frames else None)
    return f"{frame.filename}:{frame.lineno}" if frame else "?"


def describe_error(exc: BaseException, fn: Callable[..., Any]) -> str:
    """One line: the reward function, where it raised, and the exception."""
    text = str(exc).strip().splitlines()
    message = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    name = getattr(fn, "__qualname__", None) or repr(fn)
    return f"reward function {name}() raised at {raised_where(exc, fn)}: {message}"


def check_reward_function(entry, where: str, base_dir: str | Path | None
                          ) -> tuple[str, str] | None:
    """Import one reward function entry (``function``, ``kwargs``) and check that it takes
    its keyword arguments: ``(key under where, problem)``, or None when it is usable."""
    try:
        fn = load_function(entry.function, base_dir)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to fix
        return (f"{where}.function", str(exc).splitlines()[0])
    problem = check_signature(fn, entry.kwargs)
    return (f"{where}.{problem[0]}", problem[1]) if problem else None


def check_signature(fn: Callable[..., Any], kwargs: dict[str, Any]) -> tuple[str, str] | None:
    """Whether ``fn`` binds as the stage calls it (``fn(prompts, responses, **kwargs)``,
    or TRL's ``fn(prompts=..., completions=..., **kwargs)``): ``(key, message)``
    relative to the function's entry (``"kwargs.scale"``, ``"function"``), or None."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to check (some builtins)
        return None
    parameters = list(signature.parameters.values())
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters)
    required, optional, _ = reward_fields(fn, {})
    named = required + optional
    for key in kwargs:
        if not takes_any and key not in named:
            hint = _did_you_mean(key, named) or (
                f"; it takes {', '.join(named)}" if named else "; it takes no keyword arguments")
            return (f"kwargs.{key}", f"{fn.__name__}() has no argument {key!r}{hint}")
    # a required argument the kwargs do not give comes from the prompt records (the
    # loader checks that every record has it)
    fields = {name: None for name in required if name not in kwargs}
    ids = next((p for p in parameters if p.name == "completion_ids"), None)
    if takes_completions(fn) and ids is not None and ids.default is ids.empty:
        return ("function", f"{fn.__name__}() takes completion_ids, which rlhfflow does "
                            f"not give reward functions; give it a default (None)")
    args, keywords = reward_inputs(fn, ["prompt"], ["response"], None)
    try:
        signature.bind(*args, **keywords, **kwargs, **fields)
    except TypeError as exc:
        shown = "completions=..." if takes_completions(fn) else "prompts, responses"
        return ("function", f"{fn.__name__}() cannot be called as "
                            f"{fn.__name__}({shown}, **kwargs): {exc}")
    return None


#: exceptions of a trial call that no real row would avoid: refused at validation
_CODE_ERRORS = (ImportError, NameError)
#: what the trial call gives for the response (a real one is the model's)
TRIAL_RESPONSE = "The answer is 42."


def trial_call(entry: RewardFunctionSpec, base_dir: str | Path | None, prompt: str,
               fields: dict[str, Any]) -> tuple[bool, str] | None:
    """Call one reward function on one made-up row (``prompt``, the record ``fields`` it
    takes, ``TRIAL_RESPONSE``): None when it returns one number, else ``(fatal, line)``.

    Fatal: a mistake in the code that every row meets (an ImportError or NameError, an
    AttributeError of a module, a TypeError of the call itself, not one number back).
    Not fatal, only worth a warning: any other exception, which the made-up response may
    cause (a regex that finds no answer in it) and a real response would not."""
    fn = load_function(entry.function, base_dir)
    fields_json = [json.dumps(fields)]
    columns = record_columns(fn, entry.kwargs, fields_json)
    args, keywords = reward_inputs(fn, [prompt], [TRIAL_RESPONSE], fields_json)
    try:
        value = fn(*args, **keywords, **columns, **entry.kwargs)
    except Exception as exc:  # noqa: BLE001 - the user's function, any error
        in_call = isinstance(exc, TypeError) and exc.__traceback__ is not None \
            and exc.__traceback__.tb_next is None  # raised binding the arguments
        of_module = isinstance(exc, AttributeError) and inspect.ismodule(
            getattr(exc, "obj", None))
        fatal = isinstance(exc, _CODE_ERRORS) or in_call or of_module
        return fatal, describe_error(exc, fn)
    try:
        count = torch.as_tensor(value, dtype=torch.float32).numel()
    except (TypeError, ValueError, RuntimeError):
        count = None
    if count != 1:
        got = f"{count} numbers" if count is not None else type(value).__name__
        return True, (f"reward function {fn.__name__}() returned {got} for 1 response; "
                      f"expected one float per response")
    return None


def _did_you_mean(word: str, choices: list[str]) -> str:
    """``"; did you mean 'x'?"`` for a close argument name, else ``""`` (the spec's own
    helper is in ``pipeline``, which stages must not import)."""
    match = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else ""


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
        fields = ("prompt_fields",) if params.function is not None or params.functions else ()
        return ("prompt_text", "response_text", *fields)

    @classmethod
    def writes(cls, params, algorithm, has_model):
        out = {"scores": Column("float32"), "score_valid": Column("int8")}
        out.update({entry.column: Column("float32") for entry in params.functions})
        if params.on_error == "skip":
            out["score_error"] = Column("str")  # listed by the store task, not stored
            out["score_retries"] = Column("int32")
        return out

    def run(self, batch: Batch, ctx: StageContext) -> Batch:
        prompts, responses = list(batch["prompt_text"]), list(batch["response_text"])
        out: Batch = {}
        errors = [""] * len(responses)
        retried = torch.zeros(len(responses), dtype=torch.int32)
        if self.params.function is not None or self.params.functions:
            scores = torch.zeros(len(responses), dtype=torch.float32)
            for entry in self.params.reward_functions():
                own = self._function_scores(entry, prompts, responses,
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
                         responses: list[str], fields: list[str] | None, ctx: StageContext,
                         errors: list[str], retried: torch.Tensor) -> torch.Tensor:
        """One function's scores. With ``on_error: skip``, a call that raises is repeated
        one sample at a time (each up to ``retries`` more times, counted in ``retried``),
        so only the samples it keeps raising on are lost: their error lines go into
        ``errors`` and their scores are NaN."""
        fn = load_function(entry.function, ctx.settings.base_dir)
        # the prompt records' other fields (a reference answer, tests) the function takes
        columns = record_columns(fn, entry.kwargs, fields)
        args, keywords = reward_inputs(fn, prompts, responses, fields)
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
                                    f"scores for {rows} responses")
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


#: TRL's reward-function arguments (``GRPOTrainer``): given by the stage, not by records
TRL_ARGUMENTS = ("prompts", "completions", "completion_ids")
#: record keys that are the prompt itself, never given as a field to ``**kwargs``
PROMPT_KEYS = ("messages",)


def _signature_parameters(fn: Callable[..., Any]) -> list[inspect.Parameter] | None:
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature
        return None


def takes_completions(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` follows TRL's convention: a parameter named ``completions``, called
    by keyword (``prompts=``, ``completions=``, record fields), instead of rlhfflow's
    positional ``(prompts, responses, **fields)``."""
    parameters = _signature_parameters(fn) or []
    return any(p.name == "completions" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               for p in parameters)


def reward_fields(fn: Callable[..., Any], fixed: dict[str, Any]) -> tuple[list[str], list[str],
                                                                           bool]:
    """What a reward function asks of the prompt records, from its signature: the
    ``required`` and ``optional`` (defaulted) keyword parameters after
    ``(prompts, responses)`` (or besides TRL's ``prompts``, ``completions`` and
    ``completion_ids``) that ``params.kwargs`` does not already give, and whether it takes
    ``**kwargs`` (then it gets every field, as TRL's reward functions do)."""
    parameters = _signature_parameters(fn)
    if parameters is None:  # give it nothing
        return [], [], False
    named = [p for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if takes_completions(fn):
        named = [p for p in named if p.name not in TRL_ARGUMENTS]
    else:
        named = named[2:]
    named = [p for p in named if p.name not in fixed]
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
    names = {k for row in rows for k in row} - set(fixed) - set(PROMPT_KEYS) if takes_all \
        else set(required) | {n for n in optional if all(n in row for row in rows)}
    return {name: [row.get(name) for row in rows] for name in sorted(names)}


def reward_inputs(fn: Callable[..., Any], prompts: list[str], responses: list[str],
                  fields_json: list[str] | None) -> tuple[list[list[Any]], dict[str, list[Any]]]:
    """The positional and keyword arguments (a list with a value per row each) that give
    ``fn`` the prompts and responses: ``[prompts, responses]`` positionally, or, for a
    function in TRL's convention (``takes_completions``), ``completions=`` and (if it takes
    them) ``prompts=``. Chat records (a ``messages`` field in every row) then give TRL's
    conversational form: ``prompts`` as the records' messages and each completion as
    ``[{"role": "assistant", "content": response}]``; plain records give strings."""
    if not takes_completions(fn):
        return [prompts, responses], {}
    rows = [json.loads(text) for text in fields_json] if fields_json else []
    chat = bool(rows) and all(isinstance(row.get("messages"), list) for row in rows)
    keywords: dict[str, list[Any]] = {"completions": [
        [{"role": "assistant", "content": r}] for r in responses] if chat else list(responses)}
    parameters = _signature_parameters(fn) or []
    if any(p.name == "prompts" or p.kind is p.VAR_KEYWORD for p in parameters):
        keywords["prompts"] = [row["messages"] for row in rows] if chat else list(prompts)
    return [], keywords
