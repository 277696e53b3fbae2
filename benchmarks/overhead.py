"""What the Dask executor costs: the same pipeline, same seed, same work, run in this
process without Dask (the inline backend: same stage code, same task functions, same
zarr writes) and through the executor on an embedded cluster of one worker.

Each mode runs ``--rounds`` times, alternating, so drift of the machine hits both alike,
with the same torch thread count in both, for each count in ``--threads``. The figure is
the median steady-state iteration time (iteration 0, which loads models, is left out),
executor / in-process; ``overhead_ratio`` is the one at the thread count an embedded
worker gets by default. Cluster start-up is reported apart: it is paid once per run.

    python benchmarks/overhead.py [--config configs/ppo-tiny.yaml] [--iterations 12]

Prints a table, then one JSON object with the figures as its last line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from shared import emit_result

from rlhfflow.config import load_pipeline
from rlhfflow.plan.layout import default_torch_threads
from rlhfflow.runtime.run import run_pipeline

ROOT = Path(__file__).resolve().parents[1]


def run_once(config: Path, iterations: int, inline: bool, out: Path, threads: int) -> dict:
    """One run; returns its per-iteration metrics and wall times."""
    overrides = {"iterations": iterations, "cluster.workers": 1, "output": str(out),
                 "cluster.torch_threads": threads, "cluster.dashboard_address": ":0"}
    pipeline = load_pipeline(config, overrides)
    start = time.perf_counter()
    result = run_pipeline(pipeline, progress=False, inline=inline, overwrite=True)
    total = time.perf_counter() - start
    loop = sum(r["iteration_s"] for r in result.metrics)
    return {"metrics": result.metrics, "total_s": total, "loop_s": loop,
            "startup_s": total - loop,
            "steady_s": statistics.median(r["iteration_s"] for r in result.metrics[1:])}


def measure(config: Path, iterations: int, rounds: int, threads: int) -> list[dict]:
    """Both modes at one thread count; one row per mode."""
    runs: dict[str, list[dict]] = {"in-process": [], "executor": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for mode in runs:
                out = Path(tmp) / f"{mode}-{r}"
                runs[mode].append(run_once(config, iterations, mode == "in-process", out,
                                           threads))
    reference = [round(m["reward_mean"], 6) for m in runs["in-process"][0]["metrics"]]
    same = all([round(m["reward_mean"], 6) for m in run["metrics"]] == reference
               for results in runs.values() for run in results)
    return [{"mode": mode, "threads": threads, "identical": same,
             "iteration_s": statistics.median(x["steady_s"] for x in results),
             "loop_s": statistics.median(x["loop_s"] for x in results),
             "startup_s": statistics.median(x["startup_s"] for x in results),
             "tokens": sum(m["tokens_generated"] for m in results[0]["metrics"])}
            for mode, results in runs.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "ppo-tiny.yaml")
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", default=None,
                        help="comma-separated torch thread counts to compare "
                             "(default: 1 and all cores)")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    counts = [int(t) for t in args.threads.split(",")] if args.threads else \
        sorted({1, cores})
    default = default_torch_threads(1)

    rows = [row for t in counts for row in measure(args.config, args.iterations, args.rounds, t)]
    ratios = {}
    print(f"config {args.config.name}, {args.iterations} iterations x {args.rounds} rounds, "
          f"1 worker, {cores} cores (embedded default: {default} torch thread(s))")
    print(f"{'mode':<12} {'threads':>7} {'iteration_s':>12} {'loop_s':>9} {'startup_s':>10} "
          f"{'tokens':>8} {'same results':>13}")
    for row in rows:
        print(f"{row['mode']:<12} {row['threads']:>7} {row['iteration_s']:>12.4f} "
              f"{row['loop_s']:>9.3f} {row['startup_s']:>10.3f} {row['tokens']:>8} "
              f"{str(row['identical']):>13}")
    for t in counts:
        inline, executor = (r for r in rows if r["threads"] == t)
        ratios[t] = executor["iteration_s"] / inline["iteration_s"]
        print(f"overhead ratio at {t} thread(s) (executor / in-process): {ratios[t]:.3f}")
    headline = ratios.get(default, ratios[counts[0]])
    at_default = [r for r in rows if r["threads"] == (default if default in ratios else counts[0])]
    emit_result({"overhead_ratio": round(headline, 4),
                      "threads": default if default in ratios else counts[0],
                      "overhead_ratio_by_threads": {str(t): round(v, 4)
                                                    for t, v in ratios.items()},
                      "in_process_iteration_s": round(at_default[0]["iteration_s"], 4),
                      "executor_iteration_s": round(at_default[1]["iteration_s"], 4),
                      "executor_startup_s": round(at_default[1]["startup_s"], 3),
                      "iterations": args.iterations, "rounds": args.rounds,
                      "identical_results": all(r["identical"] for r in rows)}, __file__)


if __name__ == "__main__":
    main()
