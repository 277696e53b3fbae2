"""What answers the model in a multi-turn episode: an environment (:class:`Environment`,
with ``reset`` and ``step``) or plain tool functions (:class:`ToolEnvironment`), the checks
of what they return, an episode's record (:class:`Episode`), and how their messages become
tokens (:class:`TurnFormat`). The loop that plays episodes is
:mod:`rlhfflow.engine.episodes`.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import json
import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rlhfflow.engine import toolprocess
from rlhfflow.engine.toolformats import CallError, Hermes, ToolFormat, json_call
from rlhfflow.engine.toolprocess import ToolFailed
from rlhfflow.engine.usercode import load_function
from rlhfflow.errors import RlhfflowError, UserError

log = logging.getLogger(__name__)

Message = dict[str, str]


class Environment(Protocol):
    """What an environment class provides. One instance plays one episode (the stage
    creates it with ``params.env_kwargs``)."""

    def reset(self, record: dict[str, Any]) -> list[Message] | str:
        """Start an episode for a prompt record (its fields, and ``prompt``: the prompt's
        text as the model sees it). Returns messages shown after the prompt, before the
        model's first turn; usually none (``[]`` or ``""``)."""

    def step(self, text: str) -> tuple[list[Message] | str, float, bool, dict]:
        """Answer the model's turn ``text``: ``(messages, reward, done, info)``. The
        messages (a string is one message) are shown to the model unless ``done``; the
        rewards of an episode are summed into ``env_reward``."""


TOOL_CALL = Hermes.CALL


class EnvironmentNotShippable(RlhfflowError, TypeError):
    """An environment that cannot be pickled to the pool (``env_placement: pool``)."""


class ToolEnvironment:
    """Plain functions as an environment. Every tool call in the model's turn, as
    ``tool_format`` parses it (:mod:`rlhfflow.engine.toolformats`; by default Hermes'
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``), calls
    ``name(**arguments)``, and its result
    (``str`` of a string, else JSON) comes back as one message; ``info`` counts the
    turn's ``calls``, those that came back as ``errors``, and each error by its kind as
    ``errors_<kind>``. Mistakes come back as the message ``error: ...`` instead of
    raising: a call that does not parse (``json``), an unknown tool (``unknown_tool``),
    arguments that are not an object (``arguments``), a call cut before its
    end (``cut``), an exception (``exception``), a
    call slower than ``timeout_s`` (``timeout``), a tool whose process died (``crash``),
    a result of its own that starts with ``error:`` (``tool``), or a :class:`ToolFailed`
    (its kind). With ``isolation="process"`` (the default) each call runs in a child
    process (``rlhfflow.engine.toolprocess``) that is killed at the timeout, everything
    it started with it; ``"thread"`` runs it on a thread, which Python cannot stop: a
    call past the timeout is left running. A function marked ``sandboxed`` (the
    sandbox's ``python``) is called here: it starts its own sandboxed process, with the
    ``sandbox`` settings. A turn with no tool call ends the episode; tools give no
    reward (a ``score`` stage judges the episode)."""

    def __init__(self, tools: dict[str, Callable[..., Any]], timeout_s: float,
                 isolation: str = "process", sandbox: Any = None,
                 tool_format: ToolFormat | None = None) -> None:
        self.tools = tools
        self.timeout_s = timeout_s
        self.isolation = isolation
        self.sandbox = sandbox
        self.tool_format = tool_format if tool_format is not None else Hermes()
        self._schemas: list[dict] | None = None

    def reset(self, record: dict[str, Any]) -> list[Message]:
        """Tools need no opening."""
        return []

    def step(self, text: str) -> tuple[list[Message], float, bool, dict]:
        """Run the turn's tool calls, in order."""
        calls = self.tool_format.parse(text, self.schemas())
        if not calls:
            return [], 0.0, True, {"calls": 0, "errors": 0}
        info: dict[str, int] = {"calls": len(calls), "errors": 0}
        messages = []
        for call in calls:
            if isinstance(call, CallError):
                result, kind = f"error: {call.message}", call.kind
            else:
                result, kind = self.run(call.name, call.arguments)
            messages.append({"content": result})
            if kind is not None:
                info["errors"] += 1
                info[f"errors_{kind}"] = info.get(f"errors_{kind}", 0) + 1
        return messages, 0.0, False, info

    def schemas(self) -> list[dict]:
        """The tools' OpenAI function schemas, for formats that type their arguments by
        them (a tool without one is left out); built once."""
        if self._schemas is None:
            from transformers.utils import get_json_schema

            self._schemas = []
            for fn in self.tools.values():
                try:
                    self._schemas.append(get_json_schema(fn))
                except Exception:  # noqa: BLE001  (no type hints or docstring: untyped)
                    continue
        return self._schemas

    def call(self, body: str) -> str:
        """The text a Hermes tool call's JSON ``body`` returns to the model."""
        return self.answer(body)[0]

    def answer(self, body: str) -> tuple[str, str | None]:
        """``(text, kind)``: the text a Hermes tool call's JSON ``body`` returns to the
        model, and the kind of error it is (None: none)."""
        call = json_call(body)
        if isinstance(call, CallError):
            return f"error: {call.message}", call.kind
        return self.run(call.name, call.arguments)

    def run(self, name: str, arguments: Any) -> tuple[str, str | None]:
        """``(text, kind)``: what calling tool ``name`` with ``arguments`` returns to
        the model, and the kind of error it is (None: none)."""
        if name not in self.tools:
            return f"error: unknown tool {name!r} (known: {', '.join(sorted(self.tools))})", \
                "unknown_tool"
        if not isinstance(arguments, dict):
            return "error: 'arguments' must be a JSON object", "arguments"
        fn = self.tools[name]
        try:
            if getattr(fn, "sandboxed", False):
                text = self._sandboxed(fn, arguments)
            elif self.isolation == "process":
                status, text = self._in_process(fn, arguments)
                if status == "error":  # the tool raised, in its process
                    return f"error: {text}", "exception"
            else:
                text = _text(_call_abandoning(fn, arguments, self.timeout_s))
        except (concurrent.futures.TimeoutError, toolprocess.ToolTimeout):
            return f"error: tool {name!r} took more than {self.timeout_s:g} s", "timeout"
        except toolprocess.ToolCrashed as exc:
            return f"error: {exc}", "crash"
        except ToolFailed as exc:
            return f"error: {exc.message}", exc.kind
        except Exception as exc:  # noqa: BLE001  (the tool's failure is the model's answer)
            return f"error: {type(exc).__name__}: {exc}", "exception"
        return text, "tool" if text.startswith("error: ") else None

    def _sandboxed(self, fn: Callable[..., Any], arguments: dict[str, Any]) -> str:
        from rlhfflow.engine import sandbox

        settings = self.sandbox or sandbox.SandboxSettings()
        with sandbox.using(settings):
            return _text(fn(**arguments))

    def _in_process(self, fn: Callable[..., Any], arguments: dict[str, Any]
                    ) -> tuple[str, str]:
        """``("ok", text)`` or ``("error", "Type: message")`` of the call in a tool
        process."""
        try:
            payload = toolprocess.pickled(fn, arguments)
        except Exception:  # noqa: BLE001  (a closure over something that does not pickle)
            log.warning("tool %s does not pickle: it runs on a thread, which cannot be "
                        "stopped at its timeout", getattr(fn, "__name__", fn))
            return "ok", _text(_call_abandoning(fn, arguments, self.timeout_s))
        return toolprocess.call(payload, self.timeout_s)


def _text(result: Any) -> str:
    return result if isinstance(result, str) else json.dumps(result, default=str)


def _call_abandoning(fn: Callable[..., Any], arguments: dict[str, Any],
                     timeout_s: float) -> Any:
    """``fn(**arguments)``, or ``concurrent.futures.TimeoutError`` after ``timeout_s``,
    the call left running in a daemon thread: a thread pool's threads are joined when
    the interpreter exits, so an abandoned call that never returns held the process
    (``rlhfflow stage test`` printed its result, then waited for a hung tool)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def call() -> None:
        try:
            future.set_result(fn(**arguments))
        except BaseException as exc:  # noqa: BLE001 - the caller's to judge
            future.set_exception(exc)

    threading.Thread(target=call, name=f"tool-{getattr(fn, '__name__', 'call')}",
                     daemon=True).start()
    return future.result(timeout_s)


class EnvironmentMisbehaved(UserError):
    """An environment's ``reset`` or ``step`` returned something of the wrong shape: one
    line naming its file and class, the hook and what was expected."""


@dataclass
class Episode:
    """One row's episode so far: its response tokens, which are the model's, their
    log-probs, the model's last turn, the uniforms it used, the model turns taken, the
    reward, and ``log``: the turns as who said what (``add``, ``took``)."""

    env: Any
    tokens: list[int] = field(default_factory=list)
    said: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    drawn: int = 0
    turns: int = 0
    reward: float = 0.0
    info: dict[str, float] = field(default_factory=dict)
    done: bool = False
    env_seconds: float = 0.0
    log: list[dict[str, Any]] = field(default_factory=list)
    #: per response token, the version of the weights that sampled it (-1: not sampled)
    versions: list[int] = field(default_factory=list)

    def add(self, tokens: Sequence[int], logprobs: Sequence[float] | None,
            messages: Sequence[Message] = (), role: str = "env",
            version: int | Sequence[int] = -1) -> None:
        """Append the model's tokens (with log-probs, sampled by the weights of
        ``version``, one for all or one per token) or the environment's (None, with the
        ``messages`` they render, whose role defaults to ``role``), and log the turn with
        its span of response tokens."""
        start = len(self.tokens)
        self.tokens += tokens
        if logprobs is None or isinstance(version, int):
            self.versions += [version if logprobs is not None else -1] * len(tokens)
        else:
            self.versions += list(version)
        self.mask += [1 if logprobs is not None else 0] * len(tokens)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(tokens)
        span = [start, len(self.tokens)]
        if logprobs is not None:
            self.log.append({"role": "assistant", "span": span, "reward": 0.0})
        elif messages:
            self.log += [{"role": m.get("role", role), "text": m["content"], "span": span}
                         for m in messages]
        elif tokens:  # no message, but the template's turn markers
            self.log.append({"role": role, "text": "", "span": span})

    def took(self, result: Any) -> tuple[list[Message] | str, float, bool, dict]:
        """The environment's ``step`` result, checked (``EnvironmentMisbehaved``), its
        reward added to the episode's and to the model turn it answers."""
        problem = step_problem(result)
        if problem:
            raise EnvironmentMisbehaved(f"{env_name(self.env)}.step returned {problem}")
        messages, reward, done, info = result
        reward = float(reward)
        self.reward += reward
        turn = next((t for t in reversed(self.log) if t["role"] == "assistant"), None)
        if turn is not None:
            turn["reward"] += reward
            if info:
                turn["info"] = json.loads(json.dumps(info, default=str))
        return messages, reward, bool(done), info

    def opened(self, messages: Any) -> list[Message] | str:
        """The environment's ``reset`` result, checked (``EnvironmentMisbehaved``)."""
        problem = messages_problem(messages)
        if problem:
            raise EnvironmentMisbehaved(
                f"{env_name(self.env)}.reset returned {problem}; expected a string or a "
                "list of {'role', 'content': str} dicts (the messages before the model's "
                "first turn)")
        return messages


def env_name(env: Any) -> str:
    """``file.py:Class`` of an environment instance, for messages."""
    cls = type(env)
    try:
        where = Path(inspect.getsourcefile(cls) or cls.__module__).name
    except TypeError:
        where = cls.__module__
    return f"{where}:{cls.__qualname__}"


def messages_problem(messages: Any) -> str | None:
    """Why ``messages`` (what ``reset`` or ``step`` shows the model) is not a string or
    a list of ``{"role": ..., "content": str}`` dicts, or None."""
    if isinstance(messages, str):
        return None
    if not isinstance(messages, list | tuple):
        return f"messages of type {type(messages).__name__}"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) \
                or not isinstance(m.get("role", ""), str):
            return f"message {i} {m!r:.60}"
    return None


EXPECTED_STEP = ("expected a tuple (messages, reward, done, info): messages a string or "
                 "a list of {'role', 'content': str} dicts, reward a number, done a "
                 "bool, info a dict or None")


def step_problem(result: Any) -> str | None:
    """What is wrong with a ``step`` result (``"..., expected ..."``), or None."""
    if not isinstance(result, tuple | list) or len(result) != 4:
        shown = f"a {len(result)}-tuple" if isinstance(result, tuple | list) \
            else type(result).__name__
        return f"{shown} {result!r:.60}; {EXPECTED_STEP}"
    messages, reward, done, info = result
    problem = messages_problem(messages)
    if problem is None and (isinstance(reward, bool) or not _is_number(reward)):
        problem = f"reward {reward!r:.40}"
    if problem is None and not (isinstance(done, bool | int)  # numpy's bool too
                                or getattr(getattr(done, "dtype", None), "kind", "") == "b"):
        problem = f"done {done!r:.40}"
    if problem is None and info is not None and not isinstance(info, dict):
        problem = f"info {info!r:.40}"
    return None if problem is None else f"{problem}; {EXPECTED_STEP}"


def _is_number(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


class TurnFormat:
    """How environment messages become tokens after a model turn: the chat template's
    rendering of them, or plain text. Built once per call from the tokenizer."""

    PLACEHOLDER = "\x00turn\x00"

    def __init__(self, tokenizer, separator: str) -> None:
        self.tokenizer = tokenizer
        self.separator = separator
        self.template = bool(getattr(tokenizer, "chat_template", None))
        if self.template:
            self.role = "tool" if self._renders("tool") else "user"
            opening = [{"role": "user", "content": "x"}]
            ended = self._render([*opening, self._said(self.PLACEHOLDER)], False)
            self.base = ended
            # what closes an assistant turn after its text (e.g. "<|im_end|>")
            self.close = ended[ended.index(self.PLACEHOLDER) + len(self.PLACEHOLDER):]
            self.opening = opening
            asked = self._render(opening, True)
            self.generation_prompt = asked[len(self._render(opening, False)):]

    def _said(self, text: str) -> Message:
        return {"role": "assistant", "content": text}

    def _render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False)

    def _renders(self, role: str) -> bool:
        try:
            text = self._render([{"role": "user", "content": "x"}, self._said("y"),
                                 {"role": role, "content": self.PLACEHOLDER}], True)
        except Exception:  # noqa: BLE001  (a template may raise on a role it lacks)
            return False
        return self.PLACEHOLDER in text

    def templated(self, prompt_text: str) -> bool:
        """Whether a prompt was rendered with the chat template: it ends with the
        template's generation prompt (the assistant's header)."""
        return self.template and bool(self.generation_prompt) and \
            prompt_text.endswith(self.generation_prompt)

    def tokens(self, messages: list[Message] | str, templated: bool,
               ended_at: int | None) -> list[int]:
        """Tokens of the environment's ``messages`` after a model turn, up to the start
        of the model's next turn. ``ended_at``: the token that ended the model's turn,
        if it ended at an EOS (the template's own end of turn is then not repeated)."""
        if isinstance(messages, str):
            messages = [{"content": messages}] if messages else []
        if not templated:
            text = "".join(self.separator + m["content"] for m in messages) + self.separator
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        turns = [{"role": m.get("role", self.role), "content": m["content"]} for m in messages]
        full = self._render([*self.opening, self._said(self.PLACEHOLDER), *turns], True)
        if not full.startswith(self.base):
            raise ValueError("the chat template renders an earlier turn differently once "
                             "later turns follow; the rollout stage cannot join its turns")
        close = self.close
        if ended_at is not None:
            said = self.tokenizer.decode([ended_at], skip_special_tokens=False)
            close = close.removeprefix(said) if said else close
        return self.tokenizer(close + full[len(self.base):],
                              add_special_tokens=False)["input_ids"]


def shows_tools(tokenizer) -> bool | None:
    """Whether the tokenizer's chat template shows tools to the model: its rendering of a
    prompt changes with a ``tools`` argument. None: it failed on the probe tool."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    opening = [{"role": "user", "content": "x"}]
    probe = {"type": "function", "function": {
        "name": "probe", "description": "a probe",
        "parameters": {"type": "object", "properties": {}}}}
    try:
        return _render_tools(tokenizer, opening, [probe]) != \
            _render_tools(tokenizer, opening, None)
    except Exception:  # noqa: BLE001  (the template's own error)
        return None


def _render_tools(tokenizer, messages: list[Message], tools: list[dict] | None) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=True)


def tool_schemas(refs: Sequence[str], base_dir: Path | str | None) -> list[dict]:
    """The OpenAI function schemas of the tool functions ``refs`` names, from their type
    hints and docstrings (``transformers.utils.get_json_schema``), as a chat template's
    ``tools=`` takes them."""
    from transformers.utils import get_json_schema

    return [get_json_schema(load_function(ref, base_dir)) for ref in refs]


def tool_schema_problem(refs: Sequence[str], tokenizer, base_dir: Path | str | None
                        ) -> tuple[str, str] | None:
    """``(key, message)`` if the chat template, when it shows tools to the model
    (:func:`shows_tools`), cannot be given the tools: a function whose JSON schema
    cannot be built from its type hints and docstring
    (``transformers.utils.get_json_schema``), or a template that fails on them."""
    if shows_tools(tokenizer) is False:
        return None  # the template shows no tools: the prompt must describe them
    schemas = []
    for i, ref in enumerate(refs):
        try:
            schemas.extend(tool_schemas([ref], base_dir))
        except Exception as exc:  # noqa: BLE001  (transformers' parsing exceptions)
            return (f"params.tools[{i}]", f"the chat template shows tools to the model, "
                    f"but {ref!r} has no JSON schema: {_first_line(exc)} (give it type "
                    "hints and a docstring with an Args: section)")
    try:
        _render_tools(tokenizer, [{"role": "user", "content": "x"}], schemas)
    except Exception as exc:  # noqa: BLE001  (the template's own error)
        return ("params.tools", f"the model's chat template cannot render these tools: "
                                f"{type(exc).__name__}: {_first_line(exc)}")
    return None


def _first_line(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def check_shippable(episodes: Sequence[Episode], where: str) -> None:
    """Make the environments of ``episodes`` ready to travel to the CPU pool: the
    pipeline's own files they come from go by value (a pool worker cannot import them by
    their name here), and one that does not pickle is ``EnvironmentNotShippable``, one
    line starting with ``where`` (the stage and its key)."""
    import cloudpickle

    from rlhfflow.engine.usercode import by_value

    if not episodes:
        return
    env = episodes[0].env
    by_value(*(env.tools.values() if isinstance(env, ToolEnvironment) else [type(env)]))
    try:
        cloudpickle.dumps(env)
    except Exception as exc:  # noqa: BLE001  (anything pickling raises is the answer)
        raise EnvironmentNotShippable(
            f"{where}: the environment cannot be pickled to run on the pool "
            f"(env_placement: pool): {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
