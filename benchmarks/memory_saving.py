"""Gradient checkpointing on SmolLM2-135M: peak memory and step time of a few training
steps with ``gradient_checkpointing`` off and on.

Each measurement is a fresh process (its peak RSS is its own): it loads the model as a
run's worker does (``ModelStore``: trainable, float32, the lean forward), takes
``--steps`` optimizer steps on a fixed batch of ``--rows`` x ``--tokens`` tokens (the
loss over the response half, through ``response_logits`` as ``train_actor`` computes
it), and reports its peak RSS, the RSS before the first step (weights loaded, no
optimizer state yet) and the median step time after the first. The two variants
alternate for ``--rounds`` rounds; the table gives medians and the median of per-round
ratios (the machine is shared, so single times move).

    python benchmarks/memory_saving.py [--model PATH] [--rounds 2] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.shared import emit_result  # noqa: E402

MODEL = ROOT / "models" / "smollm2-135m"


def rss_mib() -> float:
    """This process's resident memory now, MiB (``/proc/self/statm``)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


def measure(model: str, checkpointing: bool, rows: int, tokens: int, steps: int,
            threads: int) -> dict[str, float]:
    """One process's figures: peak and pre-training RSS (MiB), median step time (s)."""
    import torch

    from rlhfflow.engine.forward import response_logits
    from rlhfflow.stages import ModelConfig, ModelStore

    torch.set_num_threads(threads)
    config = ModelConfig(name="actor", head="lm", init_path=model, trainable=True,
                         gradient_checkpointing=checkpointing)
    resident = ModelStore({"actor": config}).get("actor")
    vocab = resident.module.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    half = tokens // 2
    batch = {"prompt_ids": torch.randint(0, vocab, (rows, half), generator=gen),
             "prompt_mask": torch.ones(rows, half, dtype=torch.long),
             "response_ids": torch.randint(0, vocab, (rows, tokens - half), generator=gen),
             "response_mask": torch.ones(rows, tokens - half, dtype=torch.long)}
    before = rss_mib()
    times, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        logits = response_logits(resident.module, batch)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                 batch["response_ids"].flatten())
        resident.step(loss)
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak_rss_mib": round(peak, 1), "loaded_rss_mib": round(before, 1),
            "step_s": round(statistics.median(times[1:] or times), 3),
            "losses": [round(x, 6) for x in losses]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(MODEL))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", choices=["off", "on"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.model, args.child == "on", args.rows, args.tokens,
                                 args.steps, args.threads)))
        return
    runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    for round_ in range(args.rounds):
        for variant in ("off", "on") if round_ % 2 == 0 else ("on", "off"):
            out = subprocess.run(
                [sys.executable, __file__, "--child", variant, "--model", args.model,
                 "--steps", str(args.steps), "--rows", str(args.rows),
                 "--tokens", str(args.tokens), "--threads", str(args.threads)],
                check=True, capture_output=True, text=True, env=_env()).stdout
            runs[variant].append(json.loads(out.strip().splitlines()[-1]))
            print(f"round {round_} checkpointing {variant}: {runs[variant][-1]}", flush=True)
    # the same losses: checkpointing recomputes, it changes no arithmetic
    same = all(a["losses"] == b["losses"] for a, b in zip(runs["off"], runs["on"], strict=True))

    def med(variant: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[variant])

    def ratio(key: str) -> float:
        return statistics.median(b[key] / a[key]
                                 for a, b in zip(runs["off"], runs["on"], strict=True))

    activation = {v: med(v, "peak_rss_mib") - med(v, "loaded_rss_mib") for v in runs}
    print(f"\nSmolLM2-135M, {args.rows} rows x {args.tokens} tokens, {args.steps} AdamW steps, "
          f"{args.threads} torch threads, {args.rounds} rounds (medians)")
    print(f"{'checkpointing':<14}{'peak RSS MiB':>14}{'peak - loaded':>15}{'step s':>9}")
    for v in runs:
        print(f"{v:<14}{med(v, 'peak_rss_mib'):>14.0f}{activation[v]:>15.0f}"
              f"{med(v, 'step_s'):>9.2f}")
    print(f"on / off: peak RSS {ratio('peak_rss_mib'):.3f}, step time {ratio('step_s'):.3f}; "
          f"identical losses: {same}")
    emit_result({"model": Path(args.model).name, "rows": args.rows, "tokens": args.tokens,
                 "steps": args.steps, "threads": args.threads, "rounds": args.rounds,
                 "peak_rss_mib": {v: med(v, "peak_rss_mib") for v in runs},
                 "peak_over_loaded_mib": {v: round(activation[v], 1) for v in runs},
                 "step_s": {v: med(v, "step_s") for v in runs},
                 "peak_rss_ratio": round(ratio("peak_rss_mib"), 4),
                 "step_time_ratio": round(ratio("step_s"), 4), "identical_losses": same},
                __file__)


def _env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


if __name__ == "__main__":
    main()
