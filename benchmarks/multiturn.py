"""Episodes per second of the multi-turn ``rollout`` stage: the KV cache kept across turns
against a prefill of the whole episode every turn, and environment steps on threads
(overlapping the decoding of other rows) against steps in turn with decoding.

Each episode is a number-guessing game (``examples/multiturn/envs.py``): the model
speaks, the environment answers "higher"/"lower" until ``--turns`` model turns. Models:
``tiny`` (the 2-layer, 64-wide random Llama of the examples, with a chat template) and
``smollm2`` (SmolLM2-135M-Instruct at ``--smollm2``, its own chat template). Four
configurations per model, run in turn in each round so their ratios share the machine's
state, median over ``--rounds`` rounds of the per-round ratios:

* ``reprefill``: ``kv_cache: false``, environment inline (``env_workers: 0``);
* ``kv``: ``kv_cache: true``, environment inline;
* ``kv+slow-env``: as ``kv``, each environment step sleeps ``--env-delay`` seconds;
* ``kv+slow-env+threads``: as that, steps on ``env_workers: 8`` threads.

    python benchmarks/multiturn.py [--models tiny smollm2] [--episodes 16] [--turns 4]
                                   [--tokens 12] [--rounds 3] [--env-delay 0.05]

Prints a table, then one JSON object with the figures as its last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from shared import emit_result

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "multiturn"
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}: "
                 "{{ m['content'] }}<|im_end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant: {% endif %}")
PROMPTS = ["Guess my number, 1 to 100. Say one number.",
           "I am thinking of a number from 1 to 100. Guess it.",
           "Guess the secret number (1-100).",
           "Pick a number between 1 and 100; I will say higher or lower."]
CONFIGS = {"reprefill": {"kv_cache": False, "env_workers": 0},
           "kv": {"kv_cache": True, "env_workers": 0},
           "kv+slow-env": {"kv_cache": True, "env_workers": 0, "slow": True},
           "kv+slow-env+threads": {"kv_cache": True, "env_workers": 8, "slow": True}}


class SlowGuess:
    """The example's ``GuessNumber`` with a sleep in every step (a slow environment)."""

    def __init__(self, delay: float = 0.0) -> None:
        from rlhfflow.engine.usercode import load_function

        self.delay = delay
        self.game = load_function("envs.py:GuessNumber", EXAMPLE)()

    def reset(self, record: dict) -> list:
        return self.game.reset(record)

    def step(self, text: str):
        time.sleep(self.delay)
        return self.game.step(text)


def tiny_model_dir(root: Path) -> Path:
    """The examples' tiny Llama with a chat template, saved under ``root``."""
    from rlhfflow.engine.models import build_char_tokenizer, build_tiny_model, save_model

    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHAT_TEMPLATE
    model = build_tiny_model(tok, "lm", seed=0)
    model.generation_config.eos_token_id = [tok.eos_token_id,
                                            tok.convert_tokens_to_ids("<|im_end|>")]
    save_model(model, tok, root / "tiny")
    return root / "tiny"


def prompt_batch(tok, episodes: int) -> dict:
    """Chat prompts (rendered with the template), one secret each."""
    from rlhfflow.data.records import pad_prompts, prompt_token_ids

    texts = [tok.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                     add_generation_prompt=True, tokenize=False)
             for i in range(episodes)]
    ids, mask = pad_prompts([prompt_token_ids(tok, t, templated=True) for t in texts],
                            tok.pad_token_id if tok.pad_token_id is not None else 0)
    return {"prompt_ids": ids, "prompt_mask": mask,
            "prompt_index": torch.arange(episodes), "sample_index": torch.zeros(episodes,
                                                                                dtype=torch.long),
            "prompt_text": texts,
            "prompt_fields": [json.dumps({"secret": 1000 + i}) for i in range(episodes)]}


def run_once(store, batch, config: dict, args, iteration: int) -> tuple[float, dict]:
    """Seconds of one rollout call, and its output."""
    from rlhfflow.stages import StageContext, create_stage

    params = {k: v for k, v in config.items() if k != "slow"}
    delay = args.env_delay if config.get("slow") else 0.0
    stage = create_stage("rollout", model="actor", params=dict(
        env="multiturn:SlowGuess", env_kwargs={"delay": delay}, max_turns=args.turns, max_new_tokens=args.tokens,
        max_tokens=args.turns * (args.tokens + 24), **params))
    ctx = StageContext(iteration=iteration, seed=0, models=store,
                       settings={"base_dir": str(EXAMPLE)})
    start = time.perf_counter()
    out = stage.run(batch, ctx)
    return time.perf_counter() - start, out


def bench_model(name: str, path: Path, args) -> dict:
    """Episodes/s of every configuration on one model, and the ratios."""
    from rlhfflow.stages import ModelConfig, ModelStore

    store = ModelStore({"actor": ModelConfig("actor", "lm", str(path))})
    tok = store.get("actor").tokenizer
    batch = prompt_batch(tok, args.episodes)
    run_once(store, batch, CONFIGS["kv"], args, 0)  # warm-up
    seconds: dict[str, list[float]] = {c: [] for c in CONFIGS}
    turns = {}
    for round_ in range(args.rounds):
        for config, settings in CONFIGS.items():
            took, out = run_once(store, batch, settings, args, 1 + round_)
            seconds[config].append(took)
            turns[config] = float(out["turns"].float().mean())
    rate = {c: args.episodes / statistics.median(s) for c, s in seconds.items()}
    cache = statistics.median(r / k for r, k in zip(seconds["reprefill"], seconds["kv"],
                                                    strict=True))
    overlap = statistics.median(
        i / t for i, t in zip(seconds["kv+slow-env"], seconds["kv+slow-env+threads"],
                              strict=True))
    return {"model": name, "episodes_per_s": rate, "kv_cache_speedup": cache,
            "env_threads_speedup": overlap, "mean_turns": turns["kv"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"],
                        choices=["tiny", "smollm2"])
    parser.add_argument("--smollm2", type=Path,
                        default=Path("/work/main/models/smollm2-135m"))
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=12, help="max_new_tokens per turn")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--env-delay", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # env="multiturn:SlowGuess"
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            path = tiny_model_dir(Path(tmp)) if name == "tiny" else args.smollm2
            results.append(bench_model(name, path, args))
    print(f"{'model':<9} " + " ".join(f"{c:>20}" for c in CONFIGS) +
          "   cache x  threads x  turns")
    for r in results:
        print(f"{r['model']:<9} " + " ".join(f"{r['episodes_per_s'][c]:>17.2f}/s"
                                             for c in CONFIGS) +
              f"   {r['kv_cache_speedup']:>6.2f}   {r['env_threads_speedup']:>8.2f}"
              f"   {r['mean_turns']:.1f}")
    emit_result({"episodes": args.episodes, "turns": args.turns, "tokens": args.tokens,
                 "rounds": args.rounds, "env_delay_s": args.env_delay,
                 "threads": args.threads, "models": results}, __file__)


if __name__ == "__main__":
    main()
