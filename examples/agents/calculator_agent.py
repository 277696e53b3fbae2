"""A calculator agent written against the `openai` SDK only: no rlhfflow import.

It asks the model a product ("What is 347 * 58?"), runs the calculator when the model
calls it, gives the result back, and takes the model's last number as its answer. The
same function runs against any OpenAI-compatible server:

    rlhfflow serve models/smollm2-135m --port 8000            (or vLLM, or ...)
    python examples/agents/calculator_agent.py --base-url http://127.0.0.1:8000/v1 \
        --model smollm2-135m examples/multiturn/data/calc-test.jsonl

and rlhfflow trains it as it is (calculator.yaml beside this file: `agent:
calculator_agent.py:solve`), the endpoint then being the run's policy.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import operator
import re

CALCULATOR = {"type": "function", "function": {
    "name": "calculate",
    "description": "The value of an arithmetic expression (numbers, + - * / and parentheses).",
    "parameters": {"type": "object", "required": ["expression"], "properties": {
        "expression": {"type": "string", "description": 'the expression, e.g. "(12 + 3) * 4"'}}}}}
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """The calculator: arithmetic only (no names, no calls)."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")

    return str(value(ast.parse(expression, mode="eval").body))


def run_tool(call) -> str:
    """The calculator's answer to one tool call, or the error the model is shown."""
    if call.function.name != "calculate":
        return f"error: no tool named {call.function.name!r}"
    try:
        return calculate(str(json.loads(call.function.arguments)["expression"]))
    except Exception as exc:  # the model sees what went wrong, as a tool would say it
        return f"error: {type(exc).__name__}: {exc}"


async def solve(client, record, model: str = "policy") -> dict:
    """One episode: up to two calls of the calculator, then the answer. The reward is 1
    for the right number in the model's last turn, plus 0.2 for a calculator call worth
    the answer (it helps a model that does not call it yet to start)."""
    messages = list(record["messages"])
    right_call = False
    calls = 0
    for _ in range(3):
        answer = await client.chat.completions.create(
            model=model, messages=messages, tools=[CALCULATOR], max_tokens=36,
            temperature=0.7)
        message = answer.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            calls += 1
            result = run_tool(call)
            right_call |= result.removesuffix(".0") == record["answer"]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    numbers = NUMBER.findall(message.content or "") if not message.tool_calls else []
    exact = bool(numbers) and numbers[-1].replace(",", "") == record["answer"]
    return {"reward": float(exact) + 0.2 * right_call,
            "info": {"exact": float(exact), "tool_calls": float(calls)}}


async def _evaluate(base_url: str, api_key: str, model: str, path: str, limit: int) -> None:
    from openai import AsyncOpenAI

    with open(path) as lines:
        records = [json.loads(line) for line in lines][:limit]
    async with AsyncOpenAI(base_url=base_url, api_key=api_key) as client:
        results = await asyncio.gather(*(solve(client, r, model) for r in records))
    exact = [r["info"]["exact"] for r in results]
    print(f"exact answers: {sum(exact):.0f} of {len(exact)} ({sum(exact) / len(exact):.3f})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("records", help="a JSON-lines file of {messages, answer} records")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--model", default="policy")
    parser.add_argument("--limit", type=int, default=48)
    args = parser.parse_args()
    asyncio.run(_evaluate(args.base_url, args.api_key, args.model, args.records, args.limit))
