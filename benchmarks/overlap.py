"""What streaming, fusion and staleness buy: the same pipeline, same seed, same work on 2
workers, run ``sequential`` (every stage waits for the whole previous stage, every
iteration for the previous one: no streaming, no fusion), ``streaming`` (the default:
micro-batches stream between stages, consecutive ones fused, strictly on-policy) and
``async`` (``max_staleness: 1`` under ``disaggregated``: generation of iteration k runs
while iteration k-1 trains), on one embedded Dask cluster.

In ``async`` the reference log-probs run on the rollout worker (on a frozen replica of
``ref`` there, ``placement.stages.ref_logprob: 0``), next to generation: that balances
the two workers, one generating and scoring, the other training.

Generation is ``--max-new-tokens`` long (default 64) in every mode, so the work is the
same. In RLHF generation dominates the iteration; the demo's 16-token answers make it
about 20% of the work, which no 1+1 split of 2 workers can balance (the rollout worker
would idle most of the time). With 64 tokens, generation, the behaviour and reference
log-probs on the rollout worker weigh about what the two updates weigh on the other
(measured on 2 CPU cores; 48 tokens leave the rollout worker ~15% idle).

Each mode runs ``--rounds`` times, alternating, so drift of the machine hits all alike.
The figures are medians over the steady iterations (iteration 0, which loads models, and
the last one, which has no next rollout to overlap with, are left out) of the iteration time, the overlap (sum of stage times / iteration time) and the
time per stage; per worker, the busy fraction (compute time / wall time of each
iteration's window) is the mean over the steady iterations. Then the median over rounds.
Checks: streaming's rewards and policy losses equal sequential's iteration by iteration
(``max_staleness: 0`` must not change the numbers), async's staleness stays within 1, and
async still learns (its first and last rewards are printed).

    python benchmarks/overlap.py [--config configs/ppo-tiny.yaml] [--iterations 12]
                                 [--rounds 2] [--workers 2] [--max-new-tokens 64]

Prints a table, then one JSON object with the figures as its last line. The goal, which
is reported and not asserted: async's iteration time at most 0.65 x sequential's, and
every worker busy at least 85% of the time.
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
MODES = {
    "sequential": {"overlap.sequential": True},
    "streaming": {},
    "async": {"overlap.max_staleness": 1, "placement.strategy": "disaggregated",
              "placement.stages": {"ref_logprob": 0}},
}
GOAL_RATIO = 0.65  # async iteration time / sequential's
GOAL_BUSY = 0.85  # every worker's busy fraction under async


def run_once(config: Path, mode: str, out: Path, settings: dict) -> dict:
    """One run of ``mode`` (``settings``: the overrides all runs share); returns its
    per-iteration (reward, policy loss) and steady-state figures."""
    pipeline = load_pipeline(config, {**settings, **MODES[mode], "output": str(out)})
    metrics = run_pipeline(pipeline, progress=False, overwrite=True).metrics
    steady = metrics[1:-1]  # not the model loading, not the drain
    stages = sorted({s for m in steady for s in m["stage_s"]})
    stale = [m["staleness_max"] for m in metrics if m["staleness_max"] is not None]
    return {"results": [(m["reward_mean"], m["policy_loss"]) for m in metrics],
            "iteration_s": statistics.median(m["iteration_s"] for m in steady),
            "overlap": statistics.median(m["overlap"] for m in steady),
            "busy": [statistics.mean(m["busy_frac"][w] for m in steady)
                     for w in range(len(steady[0]["busy_frac"]))],
            "stage_s": {s: statistics.median(m["stage_s"][s] for m in steady
                                             if s in m["stage_s"]) for s in stages},
            "staleness_max": max(stale) if stale else None}


def summarize(runs: list[dict]) -> dict:
    """Medians over the rounds of one mode (the busy fraction worker by worker)."""
    stages = sorted({s for r in runs for s in r["stage_s"]})
    stale = [r["staleness_max"] for r in runs if r["staleness_max"] is not None]
    return {"iteration_s": statistics.median(r["iteration_s"] for r in runs),
            "overlap": statistics.median(r["overlap"] for r in runs),
            "busy": [statistics.median(r["busy"][w] for r in runs)
                     for w in range(len(runs[0]["busy"]))],
            "stage_s": {s: statistics.median(r["stage_s"][s] for r in runs
                                             if s in r["stage_s"]) for s in stages},
            "staleness_max": max(stale) if stale else None,
            "reward_first": statistics.median(r["results"][0][0] for r in runs),
            "reward_last": statistics.median(r["results"][-1][0] for r in runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "ppo-tiny.yaml")
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    if args.iterations < 3:
        parser.error("--iterations must be at least 3 (the first and the last iteration "
                     "are left out)")
    if args.rounds < 1 or args.max_new_tokens < 1:
        parser.error("--rounds and --max-new-tokens must be at least 1")
    check_gangs(args.config, args.workers, MODES)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    # one cluster for all, so only the scheduling differs
    with shared_cluster(args.workers, args.iterations) as (threads, settings), \
            tempfile.TemporaryDirectory() as tmp:
        settings["stages.generate.params.max_new_tokens"] = args.max_new_tokens
        for r in range(args.rounds):
            for mode in MODES:
                out = Path(tmp) / f"{mode}-{r}"
                runs[mode].append(run_once(args.config, mode, out, settings))

    rows = {m: summarize(results) for m, results in runs.items()}
    base = rows["sequential"]["iteration_s"]
    ratio = {m: row["iteration_s"] / base for m, row in rows.items()}
    # round by round: streaming against the sequential run of the same round
    identical = all(s["results"] == q["results"]
                    for s, q in zip(runs["streaming"], runs["sequential"], strict=True))
    asyn = rows["async"]
    async_min_busy = min(asyn["busy"])

    print(f"config {args.config.name}, {args.iterations} iterations x {args.rounds} rounds, "
          f"{args.workers} workers, {threads} torch thread(s) each, max_new_tokens "
          f"{args.max_new_tokens}; async: max_staleness 1, disaggregated, ref_logprob on "
          f"the rollout worker")
    print(f"{'mode':<12} {'iteration_s':>12} {'vs seq':>7} {'overlap':>8} "
          f"{'busy per worker':>16} {'min busy':>9} {'stale max':>10}")
    for m, row in rows.items():
        busy = "/".join(f"{b:.2f}" for b in row["busy"])
        stale = "-" if row["staleness_max"] is None else str(row["staleness_max"])
        print(f"{m:<12} {row['iteration_s']:>12.4f} {ratio[m]:>7.3f} {row['overlap']:>8.3f} "
              f"{busy:>16} {min(row['busy']):>9.3f} {stale:>10}")
    print_stage_table(rows, 13)
    print(f"\nstreaming identical to sequential (reward, policy loss): {identical}")
    print(f"async staleness max: {asyn['staleness_max']} (at most 1)")
    print(f"async reward: first {asyn['reward_first']:.4f}, last {asyn['reward_last']:.4f}")
    print(f"goal: async <= {GOAL_RATIO} x sequential: {ratio['async']:.3f} "
          f"({'met' if ratio['async'] <= GOAL_RATIO else 'not met'}); every worker busy >= "
          f"{GOAL_BUSY}: {async_min_busy:.3f} "
          f"({'met' if async_min_busy >= GOAL_BUSY else 'not met'})")
    emit_result({
        **{f"{m}_s": round(rows[m]["iteration_s"], 4) for m in MODES},
        "streaming_vs_sequential": round(ratio["streaming"], 4),
        "async_vs_sequential": round(ratio["async"], 4),
        "async_min_busy_frac": round(async_min_busy, 4),
        "busy_frac": {m: [round(b, 4) for b in rows[m]["busy"]] for m in MODES},
        "overlap": {m: round(rows[m]["overlap"], 4) for m in MODES},
        "stage_s": {m: {k: round(v, 4) for k, v in rows[m]["stage_s"].items()}
                    for m in MODES},
        "streaming_identical": identical,
        "async_staleness_max": asyn["staleness_max"],
        "async_reward_first": round(asyn["reward_first"], 4),
        "async_reward_last": round(asyn["reward_last"], 4),
        "max_new_tokens": args.max_new_tokens, "workers": args.workers,
        "torch_threads": threads, "iterations": args.iterations, "rounds": args.rounds}, __file__)


if __name__ == "__main__":
    main()
