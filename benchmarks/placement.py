"""What the placement strategy costs: the same pipeline, same seed, same work, run under
``colocated``, ``interleaved`` and ``disaggregated`` on one embedded Dask cluster.

Each strategy runs ``--rounds`` times, alternating, so drift of the machine hits all alike.
The figure is the median steady-state iteration time (iteration 0, which loads models, is
left out), then the median over rounds; likewise the time per stage (``stage_s``), the
bytes of weights reallocated per iteration and the time that took. Rewards are compared
with colocated's iteration by iteration: placement must not change the numbers.

    python benchmarks/placement.py [--config configs/ppo-tiny.yaml] [--iterations 10]
                                   [--rounds 2] [--workers 2]

Prints a table, then one JSON object with the figures as its last line.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from shared import check_gangs, emit_result, print_stage_table, shared_cluster

from rlhfflow.config import load_pipeline
from rlhfflow.runtime.run import run_pipeline

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = ("colocated", "interleaved", "disaggregated")


def run_once(config: Path, strategy: str, out: Path, settings: dict) -> dict:
    """One run of ``strategy`` (``settings``: the overrides all runs share); returns its
    rewards and steady-state medians."""
    pipeline = load_pipeline(config, {**settings, "placement.strategy": strategy,
                                      "output": str(out)})
    metrics = run_pipeline(pipeline, progress=False, overwrite=True).metrics
    steady = metrics[1:]
    stages = sorted({s for m in steady for s in m["stage_s"]})
    return {"rewards": [m["reward_mean"] for m in metrics],
            "iteration_s": statistics.median(m["iteration_s"] for m in steady),
            "stage_s": {s: statistics.median(m["stage_s"][s] for m in steady
                                             if s in m["stage_s"]) for s in stages},
            "realloc_bytes": statistics.median(m["realloc_bytes"] for m in steady),
            "realloc_s": statistics.median(m["realloc_s"] for m in steady)}


def summarize(runs: list[dict], reference: list) -> dict:
    """Medians over rounds of one strategy, and whether every round matched ``reference``."""
    stages = sorted({s for r in runs for s in r["stage_s"]})
    return {"iteration_s": statistics.median(r["iteration_s"] for r in runs),
            "stage_s": {s: statistics.median(r["stage_s"][s] for r in runs
                                             if s in r["stage_s"]) for s in stages},
            "realloc_bytes": int(statistics.median(r["realloc_bytes"] for r in runs)),
            "realloc_s": statistics.median(r["realloc_s"] for r in runs),
            "identical": all(r["rewards"] == reference for r in runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "ppo-tiny.yaml")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    if args.iterations < 2:
        parser.error("--iterations must be at least 2 (iteration 0 is left out)")
    check_gangs(args.config, args.workers,
                {s: {"placement.strategy": s} for s in STRATEGIES})
    runs: dict[str, list[dict]] = {s: [] for s in STRATEGIES}
    # one cluster for all, so only the placement differs
    with shared_cluster(args.workers, args.iterations) as (threads, settings), \
            tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for strategy in STRATEGIES:
                out = Path(tmp) / f"{strategy}-{r}"
                runs[strategy].append(run_once(args.config, strategy, out, settings))

    reference = runs["colocated"][0]["rewards"]
    rows = {s: summarize(results, reference) for s, results in runs.items()}
    base = rows["colocated"]["iteration_s"]
    print(f"config {args.config.name}, {args.iterations} iterations x {args.rounds} rounds, "
          f"{args.workers} workers, {threads} torch thread(s) each")
    print(f"{'strategy':<14} {'iteration_s':>12} {'vs coloc':>9} {'realloc_bytes':>14} "
          f"{'realloc_s':>10} {'same rewards':>13}")
    for s, row in rows.items():
        print(f"{s:<14} {row['iteration_s']:>12.4f} {row['iteration_s'] / base:>9.3f} "
              f"{row['realloc_bytes']:>14} {row['realloc_s']:>10.4f} "
              f"{str(row['identical']):>13}")
    print_stage_table(rows, 15)
    emit_result({
        **{f"{s}_s": round(rows[s]["iteration_s"], 4) for s in STRATEGIES},
        **{f"{s}_vs_colocated": round(rows[s]["iteration_s"] / base, 4)
           for s in STRATEGIES[1:]},
        "realloc_bytes": {s: rows[s]["realloc_bytes"] for s in STRATEGIES},
        "realloc_s": {s: round(rows[s]["realloc_s"], 4) for s in STRATEGIES},
        "stage_s": {s: {k: round(v, 4) for k, v in rows[s]["stage_s"].items()}
                    for s in STRATEGIES},
        "identical_rewards": all(row["identical"] for row in rows.values()),
        "workers": args.workers, "torch_threads": threads,
        "iterations": args.iterations, "rounds": args.rounds}, __file__)


if __name__ == "__main__":
    main()
