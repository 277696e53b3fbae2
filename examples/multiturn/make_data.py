"""Write the prompts of the calculator and guessing examples (seeded train and test sets).

Calculator: 3-digit by 2-digit products, with answers.

Each line of ``calc-train.jsonl`` and ``calc-test.jsonl`` is a chat that tells the model
about the calculator tool, shows one worked call (a product not in either set), and asks
a new question; ``answer`` is the reference::

    {"messages": [{"role": "system", ...}, {"role": "user", "content": "What is 123 * 45?"},
                  {"role": "assistant", "content": "<tool_call>{...}</tool_call>"},
                  {"role": "tool", "content": "5535"}, {"role": "assistant", "content": "5535"},
                  {"role": "user", "content": "What is 347 * 58?"}],
     "answer": "20126"}

Python (``python-train.jsonl``, ``python-test.jsonl``): the same questions, with the
sandboxed ``python`` tool shown instead (the worked call runs ``print(123 * 45)``).

Guessing (``guess-train.jsonl``, ``guess-test.jsonl``): a chat asking for a number from 1
to ``--top`` and the ``secret`` the environment (``envs.py:GuessNumber``) knows.

The same seed writes the same files; the test questions never occur in the training set
(the guessing sets differ in their wording's order only: there are few secrets).

    python examples/multiturn/make_data.py              # next to this script, in data/
    python examples/multiturn/make_data.py --train 500 --test 100 --seed 1 --out /tmp/calc
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SYSTEM = {
    "calculate": "You have a calculator. Call it as shown, then answer with the number only.",
    "python": "You can run Python code. Call it as shown, then answer with the number only.",
}
EXAMPLE = (123, 45)  # the worked call every prompt shows; never asked


def call(a: int, b: int, tool: str = "calculate") -> str:
    """The model's tool call that computes ``a * b``: the calculator's, or a program for
    the sandboxed ``python`` tool that prints it."""
    arguments = {"expression": f"{a} * {b}"} if tool == "calculate" \
        else {"code": f"print({a} * {b})"}
    return f"<tool_call>{json.dumps({'name': tool, 'arguments': arguments})}</tool_call>"


def record(a: int, b: int, tool: str = "calculate") -> dict:
    """The chat asking for ``a * b``, after the worked example, and its answer."""
    x, y = EXAMPLE
    result = str(x * y) if tool == "calculate" else f"{x * y}\n"  # what print() prints
    messages = [{"role": "system", "content": SYSTEM[tool]},
                {"role": "user", "content": f"What is {x} * {y}?"},
                {"role": "assistant", "content": call(x, y, tool)},
                {"role": "tool", "content": result},
                {"role": "assistant", "content": str(x * y)},
                {"role": "user", "content": f"What is {a} * {b}?"}]
    return {"messages": messages, "answer": str(a * b)}


def make_records(n_train: int, n_test: int, seed: int, tool: str = "calculate"
                 ) -> tuple[list[dict], list[dict]]:
    """``n_train`` and ``n_test`` distinct products of a 3-digit and a 2-digit number,
    asked with the ``tool`` (``"calculate"`` or ``"python"``) shown."""
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = {EXAMPLE}
    pairs: list[tuple[int, int]] = []
    while len(pairs) < n_train + n_test:
        pair = (rng.randint(100, 999), rng.randint(10, 99))
        if pair not in seen:
            seen.add(pair)
            pairs.append(pair)
    records = [record(a, b, tool) for a, b in pairs]
    return records[:n_train], records[n_train:]


GUESS = ("I am thinking of a whole number from 1 to {top}. Guess it: reply with one "
         "number only, like 4, and I will tell you if my number is higher or lower.")


def guess_records(n: int, top: int, rng: random.Random) -> list[dict]:
    """``n`` guessing prompts with secrets drawn from 1..``top``."""
    return [{"messages": [{"role": "user", "content": GUESS.format(top=top)}],
             "secret": rng.randint(1, top)} for _ in range(n)]


def write_jsonl(path: Path, records: list[dict]) -> None:
    """One JSON object per line."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def main() -> None:
    """Parse the options, write ``OUT/{calc,python,guess}-{train,test}.jsonl``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=1000, help="training questions")
    parser.add_argument("--test", type=int, default=200, help="held-out questions")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--top", type=int, default=10, help="guess a number from 1 to TOP")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data")
    args = parser.parse_args()
    train, test = make_records(args.train, args.test, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out / "calc-train.jsonl", train)
    write_jsonl(args.out / "calc-test.jsonl", test)
    train_py, test_py = make_records(args.train, args.test, args.seed, tool="python")
    write_jsonl(args.out / "python-train.jsonl", train_py)
    write_jsonl(args.out / "python-test.jsonl", test_py)
    rng = random.Random(args.seed)
    write_jsonl(args.out / "guess-train.jsonl", guess_records(args.train, args.top, rng))
    write_jsonl(args.out / "guess-test.jsonl", guess_records(args.test, args.top, rng))
    print(f"wrote {len(train)} training and {len(test)} test questions of each game to "
          f"{args.out}")


if __name__ == "__main__":
    main()
