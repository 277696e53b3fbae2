"""How rlhfflow calls a user's reward function: the entry a pipeline gives
(``RewardFunctionSpec``), the two calling conventions (rlhfflow's positional
``fn(prompts, responses, **fields)`` and TRL's ``fn(prompts=..., completions=...,
**fields)``), the record fields a function takes, each row's episode as messages (a
parameter named ``episode``), the checks made at validation (its signature, a trial call
on two rows) and the one-line description of where it raised. Shared by the ``score``
and ``evaluate`` stages and the loader."""

from __future__ import annotations

import inspect
import json
import re
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from pydantic import BaseModel, ConfigDict

from rlhfflow.engine.usercode import load_function
from rlhfflow.errors import RlhfflowError, did_you_mean


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


class RewardFunctions(Protocol):
    """Params that name reward functions: one ``function`` (with ``kwargs``) or a list."""

    function: str | None
    kwargs: dict[str, Any]
    functions: list[RewardFunctionSpec]


def reward_functions(params: RewardFunctions) -> list[RewardFunctionSpec]:
    """The functions a stage calls: ``functions``, or ``function`` alone (weight 1)."""
    if params.function is not None:
        return [RewardFunctionSpec(function=params.function, kwargs=params.kwargs)]
    return list(params.functions)


class RewardError(RlhfflowError, RuntimeError):
    """A reward function raised: names where (the user's file and line) and what."""


class RewardLengthError(RlhfflowError, ValueError):
    """A reward function returned another number of scores than responses: a bug in the
    function, never skipped."""


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
    if EPISODE in kwargs:
        return (f"kwargs.{EPISODE}", f"{EPISODE!r} is reserved: the stage gives it each "
                                     f"row's episode as messages")
    for key in kwargs:
        if not takes_any and key not in named:
            hint = did_you_mean(key, named) or (
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
                            f"{fn.__name__}({shown}, **kwargs): {exc}; rlhfflow calls "
                            f"{CONVENTION}")
    return None


#: exceptions of a trial call that no real row would avoid: refused at validation
_CODE_ERRORS = (ImportError, NameError)
#: the calling conventions, as the messages of a function called the wrong way name them
CONVENTION = ("fn(prompts: list[str], responses: list[str], **fields) -> list[float], one "
              "value per row (or TRL's fn(prompts=..., completions=..., **fields))")
#: what the trial call gives for the responses (real ones are the model's): two rows,
#: different, so that a function that returns one number whatever it gets is caught
TRIAL_RESPONSES = ("The answer is 42.", "I think it is 7.")
#: what an exception says when a function took a list for the one string it expected
_ON_A_LIST = re.compile(r"\blist\b")


def trial_call(entry: RewardFunctionSpec, base_dir: str | Path | None, prompts: list[str],
               fields: list[dict[str, Any]], episodes: bool = False
               ) -> tuple[bool, str] | None:
    """Call one reward function on two made-up rows, as the stage calls it on a batch: the
    first two ``prompts`` and their record ``fields`` (the first one twice if there is one),
    and ``TRIAL_RESPONSES`` (as one-turn episodes if ``episodes``: the stage scores a
    multi-turn rollout). None when it returns one number per row, else ``(fatal, line)``.

    Fatal: a mistake every row meets (an ImportError or NameError, an AttributeError of a
    module, a TypeError of the call itself), a function that looks per-sample (one number
    back for two rows, or an exception of a list taken for a string) and a result of
    another length than the rows. Not fatal, only worth a warning: any other exception,
    which the made-up responses may cause (a regex that finds no answer in them) and real
    ones would not."""
    fn = load_function(entry.function, base_dir)
    prompts, fields = (prompts * 2)[:2], (fields * 2)[:2]
    responses = list(TRIAL_RESPONSES)
    fields_json = [json.dumps(f) for f in fields]
    columns = record_columns(fn, entry.kwargs, fields_json)
    turns = [[{"role": "assistant", "content": r}] for r in responses] if episodes else None
    args, keywords = reward_inputs(fn, prompts, responses, fields_json, turns)
    try:
        value = fn(*args, **keywords, **columns, **entry.kwargs)
    except Exception as exc:  # noqa: BLE001 - the user's function, any error
        in_call = isinstance(exc, TypeError) and exc.__traceback__ is not None \
            and exc.__traceback__.tb_next is None  # raised binding the arguments
        of_module = isinstance(exc, AttributeError) and inspect.ismodule(
            getattr(exc, "obj", None))
        if in_call:
            return True, f"{describe_error(exc, fn)}; rlhfflow calls {CONVENTION}"
        if isinstance(exc, _CODE_ERRORS) or of_module:
            return True, (f"{describe_error(exc, fn)}; fix it (or set params.check: false "
                          f"to skip the trial)")
        if isinstance(exc, TypeError | AttributeError) and _ON_A_LIST.search(str(exc)):
            return True, _per_sample(fn, f"{describe_error(exc, fn)} (given lists)")
        return False, (f"{describe_error(exc, fn)}; the made-up responses may cause that "
                       f"where real ones do not (rlhfflow calls {CONVENTION}): if real "
                       f"responses do not, set params.check: false")
    try:
        scores = torch.as_tensor(value, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError):
        scores = None
    if scores is not None and scores.dim() == 0:
        return True, _per_sample(fn, f"reward function {fn.__name__}() returned one number "
                                     f"({value!r}) for {len(responses)} responses")
    if scores is None or scores.numel() != len(responses):
        return True, _length_problem(fn, scores.numel() if scores is not None else value,
                                     len(responses))
    return None


def _length_problem(fn: Callable[..., Any], got: Any, rows: int) -> str:
    """One line: ``fn`` returned ``got`` (a count of numbers, or a value that is not
    numbers) for ``rows`` responses, how it was called and the convention it should
    follow."""
    name = getattr(fn, "__name__", repr(fn))
    got = f"{got} number{'s' if got != 1 else ''}" if isinstance(got, int) \
        else type(got).__name__
    parameters = _signature_parameters(fn) or []
    positional = [p.name for p in parameters[:2]
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    called = ""
    if not takes_completions(fn) and len(positional) == 2 \
            and positional != ["prompts", "responses"]:  # names that suggest other lists
        called = f" (called as {name}({positional[0]}=prompts, {positional[1]}=responses))"
    return (f"reward function {name}() returned {got} for {rows} responses{called}; "
            f"rlhfflow calls {CONVENTION}")


def _per_sample(fn: Callable[..., Any], what: str) -> str:
    """One line: ``fn`` looks like a per-sample function (one response in, one number out:
    ``what`` it did), the convention, and how to wrap it."""
    name = getattr(fn, "__name__", repr(fn))
    parameters = [p.name for p in _signature_parameters(fn) or []
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    fields = parameters[1:] or ["answer"]
    return (f"{what}; it looks per-sample (one response in, one number out), but "
            f"rlhfflow calls a reward function once per batch: {CONVENTION}; wrap it in a "
            f"batch function that calls it per row, e.g. def reward(prompts, responses, "
            f"{', '.join(fields)}): return [{name}(*row) for row in zip(responses, "
            f"{', '.join(fields)})]")


#: TRL's reward-function arguments (``GRPOTrainer``): given by the stage, not by records
TRL_ARGUMENTS = ("prompts", "completions", "completion_ids")
#: record keys that are the prompt itself, never given as a field to ``**kwargs``
PROMPT_KEYS = ("messages",)
#: the parameter that gets each row's episode as messages (``episode_messages``); reserved:
#: never a record field
EPISODE = "episode"


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


def takes_episode(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` has a parameter named ``episode``: it gets each row's episode as a
    list of ``{"role", "content"}`` messages (``reward_inputs``)."""
    return any(p.name == EPISODE and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               for p in _signature_parameters(fn) or [])


def reward_fields(fn: Callable[..., Any], fixed: dict[str, Any]) -> tuple[list[str], list[str],
                                                                           bool]:
    """What a reward function asks of the prompt records, from its signature: the
    ``required`` and ``optional`` (defaulted) keyword parameters after
    ``(prompts, responses)`` (or besides TRL's ``prompts``, ``completions`` and
    ``completion_ids``), other than ``episode``, that ``params.kwargs`` does not already
    give, and whether it takes ``**kwargs`` (then it gets every field, as TRL's reward
    functions do)."""
    parameters = _signature_parameters(fn)
    if parameters is None:  # give it nothing
        return [], [], False
    named = [p for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if takes_completions(fn):
        named = [p for p in named if p.name not in TRL_ARGUMENTS]
    else:
        named = named[2:]
    named = [p for p in named if p.name not in fixed and p.name != EPISODE]
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
    if takes_all:
        names = {k for row in rows for k in row} - set(fixed) - {*PROMPT_KEYS, EPISODE}
    else:
        names = set(required) | {n for n in optional if all(n in row for row in rows)}
    return {name: [row.get(name) for row in rows] for name in sorted(names)}


def episode_messages(turns_json: str) -> list[dict[str, str]]:
    """One multi-turn episode (a ``rollout``'s ``turns_json`` cell) as chat messages, in
    order: the model's turns as ``assistant``, the environment's in their own role
    (``tool`` or ``user``; ``user`` for a plain-text episode's ``env``), without the
    environment turns that hold only the template's turn markers."""
    messages = []
    for turn in json.loads(turns_json) if turns_json else []:
        role = "user" if turn["role"] == "env" else turn["role"]
        if role == "assistant" or turn.get("text"):
            messages.append({"role": role, "content": turn.get("text", "")})
    return messages


def reward_inputs(fn: Callable[..., Any], prompts: list[str], responses: list[str],
                  fields_json: list[str] | None,
                  episodes: list[list[dict[str, str]]] | None = None
                  ) -> tuple[list[list[Any]], dict[str, list[Any]]]:
    """The positional and keyword arguments (a list with a value per row each) that give
    ``fn`` the prompts and responses: ``[prompts, responses]`` positionally, or, for a
    function in TRL's convention (``takes_completions``), ``completions=`` and (if it takes
    them) ``prompts=``. Chat records (a ``messages`` field in every row) then give TRL's
    conversational form: ``prompts`` as the records' messages and each completion as
    ``[{"role": "assistant", "content": response}]``; plain records give strings.

    ``episodes``: each row's multi-turn episode as messages (``episode_messages``), when
    the responses are a rollout's. A TRL function's completions are then the episodes, and
    a function with a parameter named ``episode`` gets them (else one-turn episodes,
    ``[{"role": "assistant", "content": response}]``)."""
    one_turn = [[{"role": "assistant", "content": r}] for r in responses]
    keywords: dict[str, list[Any]] = {}
    if takes_episode(fn):
        keywords[EPISODE] = episodes if episodes is not None else one_turn
    if not takes_completions(fn):
        return [prompts, responses], keywords
    rows = [json.loads(text) for text in fields_json] if fields_json else []
    chat = bool(rows) and all(isinstance(row.get("messages"), list) for row in rows)
    keywords["completions"] = episodes if episodes is not None else \
        one_turn if chat else list(responses)
    parameters = _signature_parameters(fn) or []
    if any(p.name == "prompts" or p.kind is p.VAR_KEYWORD for p in parameters):
        keywords["prompts"] = [row["messages"] for row in rows] if chat else list(prompts)
    return [], keywords
