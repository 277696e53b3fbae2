"""Tools for the ``rollout`` stage: plain Python functions the model calls with
``<tool_call>{"name": "calculate", "arguments": {"expression": "2 + 3"}}</tool_call>``."""

from __future__ import annotations

import ast
import operator

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """The value of an arithmetic ``expression`` (numbers, + - * / and parentheses)."""
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
    """``a + b``."""
    return a + b
