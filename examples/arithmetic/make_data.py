"""Write the arithmetic prompts of the verifiable-reward example: questions with answers.

Each line of ``train.jsonl`` and ``test.jsonl`` is one chat turn and its reference answer::

    {"messages": [{"role": "user", "content": "What is 23 + 58? Answer with a number."}],
     "answer": "81"}

The same seed writes the same files; the test questions never occur in the training set.

    python examples/arithmetic/make_data.py              # next to this script
    python examples/arithmetic/make_data.py --task add3 --train 2000 --out /tmp/arith
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

INSTRUCTION = "Answer with a number."


def add2(rng: random.Random) -> tuple[str, int]:
    """Two two-digit numbers added."""
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"What is {a} + {b}?", a + b


def add3(rng: random.Random) -> tuple[str, int]:
    """Two three-digit numbers added."""
    a, b = rng.randint(100, 999), rng.randint(100, 999)
    return f"What is {a} + {b}?", a + b


def mul(rng: random.Random) -> tuple[str, int]:
    """A one-digit number times a number from 11 to 199."""
    a, b = rng.randint(2, 9), rng.randint(11, 199)
    return f"What is {a} * {b}?", a * b


TASKS: dict[str, Callable[[random.Random], tuple[str, int]]] = {
    "add2": add2, "add3": add3, "mul": mul}


def make_records(task: str, n_train: int, n_test: int, seed: int) -> tuple[list[dict], list[dict]]:
    """``n_train`` and ``n_test`` distinct questions of ``task``, with their answers."""
    rng = random.Random(seed)
    seen: dict[str, int] = {}
    limit = 100 * (n_train + n_test)
    while len(seen) < n_train + n_test and limit:
        question, answer = TASKS[task](rng)
        seen.setdefault(question, answer)
        limit -= 1
    if len(seen) < n_train + n_test:
        raise SystemExit(f"task {task!r} has fewer than {n_train + n_test} distinct questions")
    records = [{"messages": [{"role": "user", "content": f"{q} {INSTRUCTION}"}],
                "answer": str(a)} for q, a in seen.items()]
    return records[:n_train], records[n_train:]


def write_jsonl(path: Path, records: list[dict]) -> None:
    """One JSON object per line."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def main() -> None:
    """Parse the options, write ``OUT/train.jsonl`` and ``OUT/test.jsonl``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="add2")
    parser.add_argument("--train", type=int, default=1000, help="training questions")
    parser.add_argument("--test", type=int, default=200, help="held-out questions")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data")
    args = parser.parse_args()
    train, test = make_records(args.task, args.train, args.test, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out / "train.jsonl", train)
    write_jsonl(args.out / "test.jsonl", test)
    print(f"wrote {len(train)} training and {len(test)} test questions ({args.task}) "
          f"to {args.out}")


if __name__ == "__main__":
    main()
