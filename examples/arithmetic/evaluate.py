"""Greedy accuracy of a checkpoint on the held-out arithmetic questions.

    python examples/arithmetic/evaluate.py models/smollm2-135m                 # before
    python examples/arithmetic/evaluate.py runs/arithmetic/models/actor/final  # after

Each question is rendered with the model's chat template, answered greedily (at most
``--max-new-tokens`` tokens) and scored with the example's exact-match reward.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))
from reward import exact_match  # noqa: E402


def greedy_answers(model_dir: str, records: list[dict], max_new_tokens: int,
                   batch_size: int) -> list[str]:
    """The model's greedy response to each record's ``messages``."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    responses = []
    for start in range(0, len(records), batch_size):
        batch = records[start:start + batch_size]
        texts = [tokenizer.apply_chat_template(r["messages"], tokenize=False,
                                               add_generation_prompt=True) for r in batch]
        inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        responses += tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:],
                                            skip_special_tokens=True)
    return responses


def main() -> None:
    """Print the accuracy and a few responses."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--data", type=Path, default=Path(__file__).parent / "data" / "test.jsonl")
    parser.add_argument("--limit", type=int, default=200, help="questions to ask")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=50)
    args = parser.parse_args()
    records = [json.loads(line) for line in args.data.read_text().splitlines()][:args.limit]
    started = time.perf_counter()
    responses = greedy_answers(args.model_dir, records, args.max_new_tokens, args.batch_size)
    scores = exact_match([], responses, [r["answer"] for r in records])
    for record, response in list(zip(records, responses, strict=True))[:5]:
        print(f"  {record['messages'][-1]['content']!r} -> {response!r} "
              f"(answer {record['answer']})")
    print(f"accuracy {sum(scores) / len(scores):.3f} on {len(scores)} questions "
          f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
