"""Episodes per second of the multi-turn ``rollout`` stage when every environment step
burns CPU in Python (a tool that computes, not one that waits): steps inline, on
``env_workers`` threads of the stage's task, and on a CPU pool of Dask worker processes
(``env_placement: pool``, the executor a run gives the stage).

The episodes are number-guessing games on the examples' tiny random Llama (a secret the
model never finds, so every episode runs all its turns); each step spins for
``--env-cpu`` seconds of CPU time. Configurations run in turn in each round; the
speed-ups are medians of the per-round ratios. The pool is a real Dask cluster of
``--pool`` worker processes with the resource ``env`` (as ``cluster.env_workers``
starts), and the rollout runs in this process with the client's executor.

    python benchmarks/multiturn_pool.py [--episodes 16] [--turns 4] [--tokens 12]
                                        [--rounds 3] [--env-cpu 0.05] [--pool 2]

Prints a table, then one JSON object with the figures as its last line.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from multiturn import prompt_batch, tiny_model_dir
from shared import emit_result

CONFIGS = ("inline", "threads", "pool")


class BusyGuess:
    """Guess a number the model never finds; every step spins ``cpu`` seconds of CPU time
    in Python first (holding the GIL, as a tool computing in Python does)."""

    def __init__(self, cpu: float = 0.0) -> None:
        self.cpu = cpu

    def reset(self, record: dict) -> list:
        return []

    def step(self, text: str):
        end = time.thread_time() + self.cpu
        spins = 0
        while time.thread_time() < end:
            spins += 1
        return "higher", -0.1, False, {"spins": spins}


def run_once(store, batch, config: str, args, iteration: int, executor) -> float:
    """Seconds of one rollout call under ``config``."""
    from rlhfflow.stages import StageContext, create_stage

    stage = create_stage("rollout", model="actor", params=dict(
        env=f"{Path(__file__).resolve()}:BusyGuess", env_kwargs={"cpu": args.env_cpu},
        max_turns=args.turns, max_new_tokens=args.tokens,
        max_tokens=args.turns * (args.tokens + 24),
        env_workers=args.threads_env if config == "threads" else 0,
        env_placement="pool" if config == "pool" else "task"))
    ctx = StageContext(iteration=iteration, seed=0, models=store,
                       env_executor=executor if config == "pool" else None)
    start = time.perf_counter()
    stage.run(batch, ctx)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=12, help="max_new_tokens per turn")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--env-cpu", type=float, default=0.05,
                        help="CPU seconds each environment step spins")
    parser.add_argument("--pool", type=int, default=2, help="pool worker processes")
    parser.add_argument("--threads-env", type=int, default=8, help="env_workers threads")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from distributed import Client, LocalCluster

    from rlhfflow.runtime.cluster import ENV_RESOURCE
    from rlhfflow.stages import ModelConfig, ModelStore

    seconds: dict[str, list[float]] = {c: [] for c in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp, \
            LocalCluster(n_workers=args.pool, threads_per_worker=1, processes=True, silence_logs=50,
                         resources={ENV_RESOURCE: 1}, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        executor = client.get_executor(resources={ENV_RESOURCE: 1}, pure=False)
        store = ModelStore({"actor": ModelConfig("actor", "lm", str(tiny_model_dir(Path(tmp))))})
        batch = prompt_batch(store.get("actor").tokenizer, args.episodes)
        for config in CONFIGS:  # warm-up: model load, the pool's imports
            run_once(store, batch, config, args, 0, executor)
        for round_ in range(args.rounds):
            for config in CONFIGS:
                seconds[config].append(run_once(store, batch, config, args, 1 + round_,
                                                executor))
    rate = {c: args.episodes / statistics.median(s) for c, s in seconds.items()}
    ratio = {c: statistics.median(i / x for i, x in zip(seconds["inline"], seconds[c],
                                                         strict=True)) for c in CONFIGS}
    print(f"{'config':<8} {'episodes/s':>11} {'x inline':>9}")
    for c in CONFIGS:
        print(f"{c:<8} {rate[c]:>11.2f} {ratio[c]:>9.2f}")
    emit_result({"episodes": args.episodes, "turns": args.turns, "tokens": args.tokens,
                 "rounds": args.rounds, "env_cpu_s": args.env_cpu, "pool": args.pool,
                 "env_threads": args.threads_env, "episodes_per_s": rate,
                 "speedup_vs_inline": ratio,
                 "seconds": {c: [round(s, 3) for s in v] for c, v in seconds.items()}},
                __file__)


if __name__ == "__main__":
    main()
