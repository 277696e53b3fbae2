"""What the Dask executor costs: the same pipeline, same seed, same work, run in this
process without Dask (the inline backend: same stage code, same task functions, same
zarr writes) and through the executor on an embedded cluster of one worker.

Each mode runs ``--rounds`` times, alternating, so drift of the machine hits both alike.
The figure is the median steady-state iteration time (iteration 0, which loads models,
is left out), executor / in-process. Cluster start-up is reported apart: it is paid once
per run, not per iteration.

    python benchmarks/overhead.py [--config configs/ppo-tiny.yaml] [--iterations 12]

Prints a table, then one JSON object with the figures as its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from rlhfflow.pipeline import load_pipeline
from rlhfflow.pipeline.executor import run_pipeline

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "ppo-tiny.yaml")
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads in both modes (default: all cores)")
    args = parser.parse_args()

    runs: dict[str, list[dict]] = {"in-process": [], "executor": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for mode in ("in-process", "executor"):
                out = Path(tmp) / f"{mode}-{r}"
                runs[mode].append(run_once(args.config, args.iterations,
                                           mode == "in-process", out, args.threads))

    def rewards(run: dict) -> list[float]:
        return [round(m["reward_mean"], 6) for m in run["metrics"]]

    same = all(rewards(a) == rewards(runs["in-process"][0]) for mode in runs for a in runs[mode])
    rows = []
    for mode, results in runs.items():
        rows.append({"mode": mode,
                     "iteration_s": statistics.median(x["steady_s"] for x in results),
                     "loop_s": statistics.median(x["loop_s"] for x in results),
                     "startup_s": statistics.median(x["startup_s"] for x in results),
                     "tokens": sum(m["tokens_generated"] for m in results[0]["metrics"])})
    inline, executor = rows
    ratio = executor["iteration_s"] / inline["iteration_s"]

    print(f"config {args.config.name}, {args.iterations} iterations x {args.rounds} rounds, "
          f"1 worker, {args.threads} torch threads; identical results: {same}")
    print(f"{'mode':<12} {'iteration_s':>12} {'loop_s':>9} {'startup_s':>10} {'tokens':>8}")
    for row in rows:
        print(f"{row['mode']:<12} {row['iteration_s']:>12.4f} {row['loop_s']:>9.3f} "
              f"{row['startup_s']:>10.3f} {row['tokens']:>8}")
    print(f"overhead ratio (executor / in-process, median steady iteration): {ratio:.3f}")
    print(json.dumps({"overhead_ratio": round(ratio, 4),
                      "in_process_iteration_s": round(inline["iteration_s"], 4),
                      "executor_iteration_s": round(executor["iteration_s"], 4),
                      "executor_startup_s": round(executor["startup_s"], 3),
                      "in_process_startup_s": round(inline["startup_s"], 3),
                      "iterations": args.iterations, "rounds": args.rounds,
                      "identical_results": same}))


if __name__ == "__main__":
    main()
