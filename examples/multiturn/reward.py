"""Rewards of the calculator example, on the episode's text (``response_text``).

An episode reads, special tokens removed, like::

    <tool_call>{"name": "calculate", "arguments": {"expression": "347 * 58"}}</tool_call>
    tool
    20126
    assistant
    20126

``exact_answer`` judges the model's last turn only (what follows the last assistant
header), so the tool's own result never counts as the model's answer; ``tool_call``
checks that the episode called the calculator on an expression worth the answer.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
HEADER = "\nassistant\n"


def _calculator():
    """``tools.calculate`` next to this file (reward files are loaded by path)."""
    spec = importlib.util.spec_from_file_location("_calc_tools", Path(__file__).with_name("tools.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.calculate


calculate = _calculator()


def last_turn(text: str) -> str:
    """The model's last turn of an episode's text."""
    return text.rpartition(HEADER)[2]


def final_number(text: str) -> str | None:
    """The last number of the model's last turn (commas removed), or None."""
    found = NUMBER.findall(last_turn(text))
    return found[-1].replace(",", "") if found else None


def exact_answer(prompts: list[str], responses: list[str], answer: list[str]) -> list[float]:
    """1.0 where the model's last turn ends on the reference answer, else 0.0."""
    return [float(final_number(r) == a.strip()) for r, a in zip(responses, answer, strict=True)]


def called_right(text: str, answer: str) -> bool:
    """Whether a tool call of ``text`` asks ``calculate`` for an expression worth
    ``answer`` (JSON that parses, the right name, an expression that evaluates)."""
    for body in TOOL_CALL.findall(text):
        try:
            request = json.loads(body)
            expression = request["arguments"]["expression"]
            if request["name"] == "calculate" and float(calculate(expression)) == float(answer):
                return True
        except (ValueError, KeyError, TypeError, SyntaxError, ZeroDivisionError):
            continue
    return False


def tool_call(prompts: list[str], responses: list[str], answer: list[str]) -> list[float]:
    """1.0 where the episode called the calculator correctly, else 0.0."""
    return [float(called_right(r, a)) for r, a in zip(responses, answer, strict=True)]


def python_right(text: str, answer: str) -> bool:
    """Whether a call of the ``python`` tool in ``text`` came back with ``answer``: the
    tool's message after the call (up to the model's next turn) is the number."""
    for match in re.finditer(r"<tool_call>(.*?)</tool_call>(.*?)(?=\nassistant\n|$)", text,
                             re.DOTALL):
        try:
            name = json.loads(match.group(1))["name"]
        except (ValueError, KeyError, TypeError):
            continue
        if name == "python" and answer in NUMBER.findall(match.group(2)):
            return True
    return False


def python_call(prompts: list[str], responses: list[str], answer: list[str]) -> list[float]:
    """1.0 where the episode ran a program that printed the answer, else 0.0."""
    return [float(python_right(r, a)) for r, a in zip(responses, answer, strict=True)]
