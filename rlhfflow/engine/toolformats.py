"""How a model writes tool calls: a registry of formats, one class per model family.

A format turns the text of one model turn into its tool calls, in order, each a
:class:`ToolCall` (the tool's name and its arguments) or a :class:`CallError` (a call
that does not parse, or one cut before its end), and names the string that ends a call
(the rollout stops the model's turn right after it). The same parse serves the rollout's
:class:`~rlhfflow.engine.environments.ToolEnvironment` and an OpenAI-compatible endpoint
(:func:`openai_tool_calls`).

Built in: ``hermes`` (``<tool_call>{json}</tool_call>``, Qwen 2.5, Hermes),
``qwen3_coder`` (Qwen3-Coder's XML), ``llama3_json`` (Llama 3.1-3.3's JSON), and the
tokenizer's own ``response_template`` (transformers' ``parse_response``) for ``auto``.
A new format is a :class:`ToolFormat` subclass decorated with
``@register_tool_format("name")``, or named by import path in the pipeline
(``tool_format: "formats.py:MyFormat"``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from rlhfflow.engine.usercode import imported, load_function
from rlhfflow.errors import did_you_mean


@dataclass(frozen=True)
class ToolCall:
    """One call as the model wrote it: the tool's ``name`` and its ``arguments`` (a dict
    when the model wrote an object; whatever it wrote otherwise, for the caller to
    refuse)."""

    name: str
    arguments: Any


@dataclass(frozen=True)
class CallError:
    """A call that cannot be run: ``kind`` (``json``: it does not parse; ``cut``: it
    stops before its end) and the message the model is shown after ``error: ``."""

    kind: str
    message: str


Parsed = list[ToolCall | CallError]


class ToolFormat:
    """A tool-call format: ``parse`` a model turn into its calls; ``stop``, the string
    that ends a call (None: the model ends its turn itself, at EOS). ``tools`` are the
    OpenAI function schemas of the tools (``transformers.utils.get_json_schema``), for
    formats whose arguments are untyped text (cast by the parameter's type)."""

    name: ClassVar[str] = ""
    stop: str | None = None
    start: str | None = None
    """The string that opens a call, where the format has one: what a turn says before
    it is its text (an endpoint's ``content`` beside its ``tool_calls``)."""

    def parse(self, text: str, tools: Sequence[dict] = ()) -> Parsed:
        """The calls of ``text``, in order; ``[]``: the turn calls no tool."""
        raise NotImplementedError


TOOL_FORMATS: dict[str, type[ToolFormat]] = {}


def register_tool_format(name: str) -> Callable[[type[ToolFormat]], type[ToolFormat]]:
    """Class decorator that registers a :class:`ToolFormat` under ``name``."""

    def decorator(cls: type[ToolFormat]) -> type[ToolFormat]:
        existing = TOOL_FORMATS.get(name)
        if existing is not None and existing is not cls:
            raise ValueError(f"tool format {name!r} is already registered: {existing}")
        cls.name = name
        TOOL_FORMATS[name] = cls
        return cls

    return decorator


def json_call(body: str, arguments_key: str = "arguments") -> ToolCall | CallError:
    """A call written as ``{"name": ..., "arguments": {...}}`` (``arguments_key``:
    ``parameters`` as Llama writes it; ``arguments`` is taken too)."""
    try:
        request = json.loads(body)
    except json.JSONDecodeError as exc:
        return CallError("json", f"the tool call is not JSON: {exc.msg}")
    if not isinstance(request, dict) or not isinstance(request.get("name"), str):
        return CallError("json", 'expected {"name": "...", "arguments": {...}}')
    arguments = request.get(arguments_key, request.get("arguments", {}))
    return ToolCall(request["name"], arguments)


@register_tool_format("hermes")
class Hermes(ToolFormat):
    """Hermes and Qwen 2.5 (their chat templates list the tools in ``<tools></tools>``)::

        <tool_call>
        {"name": "add", "arguments": {"a": 2, "b": 3}}
        </tool_call>

    Several calls in a turn, one block each. A ``<tool_call>`` without its end counts
    only when the turn has no whole call (a turn cut at its token limit)."""

    stop = "</tool_call>"
    start = "<tool_call>"
    CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str, tools: Sequence[dict] = ()) -> Parsed:
        bodies = self.CALL.findall(text)
        if not bodies and "<tool_call>" in text:
            return [CallError("cut", "a <tool_call> without </tool_call>")]
        return [json_call(body) for body in bodies]


@register_tool_format("qwen3_coder")
class Qwen3Coder(ToolFormat):
    """Qwen3-Coder (and Qwen 3.5): XML, one ``<parameter>`` per argument::

        <tool_call>
        <function=add>
        <parameter=a>
        2
        </parameter>
        <parameter=b>
        3
        </parameter>
        </function>
        </tool_call>

    A value is text: it is kept a string when the tool's schema says ``string`` (or
    when it is not JSON), else read as JSON (``2`` -> 2, ``[1, 2]`` -> a list)."""

    stop = "</tool_call>"
    start = "<tool_call>"
    CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*\Z", re.DOTALL)
    PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    def parse(self, text: str, tools: Sequence[dict] = ()) -> Parsed:
        calls: Parsed = []
        for body in self.CALL.findall(text):
            function = self.FUNCTION.match(body)
            if function is None:
                calls.append(CallError("json", "expected <function=NAME> ... </function> "
                                               "inside <tool_call>"))
                continue
            name = function.group(1).strip()
            types = _parameter_types(tools, name)
            arguments = {key.strip(): _value(value, types.get(key.strip()))
                         for key, value in self.PARAMETER.findall(function.group(2))}
            calls.append(ToolCall(name, arguments))
        if text.count("<tool_call>") > text.count("</tool_call>"):
            calls.append(CallError("cut", "a <tool_call> without </tool_call>"))
        return calls


def _parameter_types(tools: Sequence[dict], name: str) -> dict[str, str]:
    for tool in tools:
        function = tool.get("function", tool)
        if function.get("name") == name:
            properties = function.get("parameters", {}).get("properties", {})
            return {key: spec.get("type") for key, spec in properties.items()}
    return {}


def _value(text: str, schema_type: str | None) -> Any:
    if schema_type == "string":
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


@register_tool_format("llama3_json")
class Llama3Json(ToolFormat):
    """Llama 3.1-3.3 (JSON tool calling): the whole turn is the call, optionally after
    ``<|python_tag|>``; several calls are separated by ``;``::

        {"name": "add", "parameters": {"a": 2, "b": 3}}; {"name": "neg", "parameters": {"x": 1}}

    A turn that does not start with ``{`` is an answer, not a call. The model ends the
    turn itself (``<|eom_id|>``/``<|eot_id|>``), so there is no stop string; a JSON
    object the turn's end cuts is ``cut``."""

    stop = None
    DECODER = json.JSONDecoder()

    def parse(self, text: str, tools: Sequence[dict] = ()) -> Parsed:
        text = text.strip().removeprefix("<|python_tag|>").strip()
        if not text.startswith("{"):
            return []
        calls: Parsed = []
        at = 0
        while at < len(text):
            try:
                request, end = self.DECODER.raw_decode(text, at)
            except json.JSONDecodeError as exc:
                cut = exc.pos >= len(text)
                calls.append(CallError("cut", "a tool call cut before its end") if cut
                             else CallError("json", f"the tool call is not JSON: {exc.msg}"))
                break
            calls.append(json_call(json.dumps(request), "parameters"))
            at = end
            while at < len(text) and text[at] in "; \n\t":
                at += 1
        return calls


class ResponseTemplate(ToolFormat):
    """The tokenizer's own ``response_template`` (transformers' ``parse_response``), for
    ``auto`` when the tokenizer ships one: its ``tool_calls`` field gives the calls. A
    turn it cannot parse is one ``json`` error; its stop is the field's closing literal,
    if it has one."""

    name = "response_template"

    def __init__(self, template: dict) -> None:
        self.template = template
        close = template.get("fields", {}).get("tool_calls", {}).get("close")
        self.stop = close if isinstance(close, str) else \
            close[0] if isinstance(close, list) and len(close) == 1 else None

    def parse(self, text: str, tools: Sequence[dict] = ()) -> Parsed:
        from transformers.utils.chat_parsing import parse_response

        try:
            message = parse_response(text, self.template, prefix="", tools=list(tools) or None)
        except ValueError as exc:
            return [CallError("json", f"the tool call does not parse: "
                                      f"{str(exc).strip().splitlines()[0]}")]
        calls: Parsed = []
        for call in message.get("tool_calls") or []:
            function = call.get("function", call) if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                calls.append(CallError("json", 'expected {"name": "...", "arguments": {...}}'))
                continue
            arguments = function.get("arguments", {})
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError as exc:
                    calls.append(CallError("json", f"the arguments are not JSON: {exc.msg}"))
                    continue
            calls.append(ToolCall(function["name"], arguments))
        return calls


def tool_format_problem(ref: str, base_dir: Path | str | None) -> str | None:
    """Why ``ref`` (``auto``, a registered name, or an import path of a
    :class:`ToolFormat` subclass) names no tool format, or None."""
    if ref == "auto" or ref in TOOL_FORMATS:
        return None
    if ":" not in ref:
        known = ", ".join(["auto", *sorted(TOOL_FORMATS)])
        return (f"unknown tool format {ref!r}{did_you_mean(ref, TOOL_FORMATS)}; known: "
                f"{known} (or an import path 'file.py:Class' of a ToolFormat subclass)")
    problem, found = imported(ref, base_dir)
    if problem:
        return problem
    if not (isinstance(found, type) and issubclass(found, ToolFormat)):
        return f"{ref!r} is not a ToolFormat subclass (rlhfflow.engine.toolformats)"
    return None


def tool_format(ref: str, tokenizer: Any = None, base_dir: Path | str | None = None
                ) -> ToolFormat:
    """The format ``ref`` names (checked by :func:`tool_format_problem`). ``auto``: the
    tokenizer's ``response_template`` if it has one with a ``tool_calls`` field, else
    ``hermes``."""
    if ref == "auto":
        template = getattr(tokenizer, "response_template", None)
        if isinstance(template, dict) and "tool_calls" in template.get("fields", {}):
            return ResponseTemplate(template)
        return Hermes()
    if ref in TOOL_FORMATS:
        return TOOL_FORMATS[ref]()
    return load_function(ref, base_dir)()


def openai_tool_calls(fmt: ToolFormat, text: str, tools: Sequence[dict] = ()
                      ) -> tuple[list[dict], list[CallError]]:
    """A completion's ``text`` as OpenAI chat ``tool_calls`` (``{"id", "type":
    "function", "function": {"name", "arguments": JSON text}}``), and the calls that did
    not parse."""
    calls, errors = [], []
    for i, call in enumerate(fmt.parse(text, tools)):
        if isinstance(call, CallError):
            errors.append(call)
            continue
        calls.append({"id": f"call_{i}", "type": "function",
                      "function": {"name": call.name,
                                   "arguments": json.dumps(call.arguments)}})
    return calls, errors
