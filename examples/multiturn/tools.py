"""Tools for the ``rollout`` stage: plain Python functions the model calls with
``<tool_call>{"name": "calculate", "arguments": {"expression": "2 + 3"}}</tool_call>``.
Their type hints and ``Args:`` docstrings are the JSON schemas a chat template that shows
tools to the model renders (``transformers.utils.get_json_schema``)."""

from __future__ import annotations

import ast
import operator

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression (numbers, + - * / and parentheses).

    Args:
        expression: the expression, e.g. "(12 + 3) * 4"
    """
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")

    return str(value(ast.parse(expression, mode="eval").body))


def add(a: float, b: float) -> float:
    """The sum of two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b
