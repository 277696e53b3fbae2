"""Do threads and processes stay flat when a tool hangs on 10% of its calls?

Plays `--iterations` iterations of `--episodes` episodes, each episode one model turn with
one call of a tool that hangs (sleeps an hour) on one call in ten, through the rollout's
tool environment (`rlhfflow.engine.environments.ToolEnvironment`: each call in a child
process killed at `tool_timeout_s`), and samples this process's threads and live child
processes after every iteration. Prints a table and, as its last line, one JSON object of
the figures. `--isolation thread` shows what the old way leaves behind.

    python benchmarks/tool_soak.py                       # 500 iterations x 8 calls
    python benchmarks/tool_soak.py --isolation thread --iterations 50
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

from shared import emit_result

from rlhfflow.engine.environments import ToolEnvironment


def flaky(i: int) -> int:
    """Hangs on one call in ten."""
    if i % 10 == 0:
        time.sleep(3600)
    return i * i


def live_children() -> int:
    """Live (not zombie) child processes of this process."""
    me, count = str(os.getpid()), 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            count += stat[1] == me and stat[0] != "Z"
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=500)
    parser.add_argument("--episodes", type=int, default=8, help="tool calls per iteration")
    parser.add_argument("--timeout", type=float, default=0.2, help="tool_timeout_s")
    parser.add_argument("--isolation", choices=("process", "thread"), default="process")
    args = parser.parse_args()
    env = ToolEnvironment({"flaky": flaky}, args.timeout, isolation=args.isolation)
    threads, children, timeouts, calls = [], [], 0, 0
    start = time.perf_counter()
    for iteration in range(args.iterations):
        for episode in range(args.episodes):
            i = iteration * args.episodes + episode
            call = json.dumps({"name": "flaky", "arguments": {"i": i}})
            messages, _, _, info = env.step(f"<tool_call>{call}</tool_call>")
            calls += 1
            timeouts += int(info.get("errors_timeout", 0))
        threads.append(threading.active_count())
        children.append(live_children())
    seconds = time.perf_counter() - start
    figures = {
        "isolation": args.isolation, "iterations": args.iterations, "calls": calls,
        "timeouts": timeouts, "threads_first": threads[0], "threads_last": threads[-1],
        "threads_max": max(threads), "children_first": children[0],
        "children_last": children[-1], "children_max": max(children),
        "seconds": round(seconds, 1),
    }
    print(f"{'':<10} {'first':>6} {'last':>6} {'max':>6}")
    print(f"{'threads':<10} {threads[0]:>6} {threads[-1]:>6} {max(threads):>6}")
    print(f"{'children':<10} {children[0]:>6} {children[-1]:>6} {max(children):>6}")
    print(f"{calls} calls, {timeouts} timed out, {seconds:.1f} s ({args.isolation})")
    emit_result(figures, __file__)


if __name__ == "__main__":
    main()
