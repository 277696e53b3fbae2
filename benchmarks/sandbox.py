"""What the sandbox for model-written code costs (``rlhfflow.engine.sandbox``), and what
a killable tool call costs (``rlhfflow.engine.toolprocess``).

For each backend that starts here, the same small programs run: in this interpreter
(``exec``, unsandboxed), as a plain ``python3 -I -S -c`` child (unsandboxed, a process
each), and in the sandbox, warm (a started sandbox ready: the pool refills between
calls, outside the timing) and cold (``warm=0``: each call starts one). The figure is
the median overhead of a warm sandboxed call over the in-process run of the same code.
Throughput: ``--threads`` threads calling back to back for ``--seconds``, with the warm
pool, in calls per second (the replacement starts are paid there). Tools: the median
time of a plain tool call in a tool process against the same call on a thread.

    python benchmarks/sandbox.py [--calls 40] [--threads 2] [--seconds 5]

Prints a table, then one JSON object with the figures as its last line.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import subprocess
import threading
import time

from shared import emit_result

from rlhfflow.engine import sandbox
from rlhfflow.engine.environments import ToolEnvironment

PROGRAMS = [
    "print(sum(range(1000)))",
    "primes = [n for n in range(2, 3000) if all(n % d for d in range(2, int(n ** 0.5) + 1))]\n"
    "print(len(primes))",
    "import json\nprint(json.dumps({'a': [1, 2, 3]}))",
]


def in_process(code: str) -> float:
    """Seconds to run ``code`` here, its output captured."""
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(code, "main.py", "exec"), {"__name__": "__main__"})
    return time.perf_counter() - start


def plain_process(code: str, python: str) -> float:
    """Seconds to run ``code`` in an unsandboxed child interpreter."""
    start = time.perf_counter()
    subprocess.run([python, "-I", "-S", "-c", code], capture_output=True, check=True)
    return time.perf_counter() - start


def warm_call(box: sandbox.Sandbox, code: str) -> float:
    """Seconds of one call with a started sandbox ready."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # let the pool's replacement start (not timed)
        time.sleep(0.05)
        if box._ready and box._ready[0].proc.poll() is None:
            break
    time.sleep(0.2)  # and its interpreter finish starting
    start = time.perf_counter()
    outcome = box.run(code)
    elapsed = time.perf_counter() - start
    assert outcome.kind == "ok", outcome.message
    return elapsed


def throughput(box: sandbox.Sandbox, threads: int, seconds: float) -> float:
    """Calls per second of ``threads`` threads calling back to back."""
    counts = [0] * threads
    stop = time.monotonic() + seconds

    def work(i: int) -> None:
        while time.monotonic() < stop:
            box.run(PROGRAMS[0])
            counts[i] += 1

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    start = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return sum(counts) / (time.perf_counter() - start)


def add(a: int, b: int) -> int:
    """The tool of the tool-call figures."""
    return a + b


def tool_call_s(isolation: str, calls: int) -> float:
    """Median seconds of one ``add`` call through the tool environment."""
    env = ToolEnvironment({"add": add}, timeout_s=10, isolation=isolation)
    body = '{"name": "add", "arguments": {"a": 2, "b": 3}}'
    env.call(body)  # the tool process starts
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        assert env.call(body) == "5"
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=40, help="calls per measurement")
    parser.add_argument("--threads", type=int, default=2, help="threads of the throughput")
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds of throughput")
    args = parser.parse_args()
    python = str(sandbox.default_interpreter())
    rows = []
    for name in ("bwrap", "unshare", "process"):
        try:
            backend = sandbox.pick_backend(name)
        except RuntimeError as exc:
            print(f"{name}: does not start here ({exc})")
            continue
        warm = sandbox.Sandbox(backend=backend, warm=2)
        cold = sandbox.Sandbox(backend=backend, warm=0)
        base, plain, hot, chilly = [], [], [], []
        for i in range(args.calls):
            code = PROGRAMS[i % len(PROGRAMS)]
            base.append(in_process(code))
            plain.append(plain_process(code, python))
            hot.append(warm_call(warm, code))
            start = time.perf_counter()
            cold.run(code)
            chilly.append(time.perf_counter() - start)
        rate = throughput(warm, args.threads, args.seconds)
        warm.close()
        cold.close()
        rows.append({"backend": name, "in_process_ms": 1e3 * statistics.median(base),
                     "plain_process_ms": 1e3 * statistics.median(plain),
                     "warm_ms": 1e3 * statistics.median(hot),
                     "cold_ms": 1e3 * statistics.median(chilly),
                     "overhead_ms": 1e3 * statistics.median(
                         h - b for h, b in zip(hot, base, strict=True)),
                     "calls_per_s": rate})
    print(f"{'backend':<9} {'in-process':>11} {'plain proc':>11} {'warm':>8} {'cold':>8} "
          f"{'overhead':>9} {'calls/s':>8}   (medians, ms; {args.threads} threads)")
    for row in rows:
        print(f"{row['backend']:<9} {row['in_process_ms']:>11.2f} "
              f"{row['plain_process_ms']:>11.2f} {row['warm_ms']:>8.2f} {row['cold_ms']:>8.2f} "
              f"{row['overhead_ms']:>9.2f} {row['calls_per_s']:>8.1f}")
    thread_s, process_s = tool_call_s("thread", args.calls), tool_call_s("process", args.calls)
    print(f"a plain tool call: {1e3 * thread_s:.3f} ms on a thread, {1e3 * process_s:.3f} ms "
          f"in a killable tool process")
    best = rows[0]
    emit_result({"backend": best["backend"],
                 "sandbox_overhead_ms": round(best["overhead_ms"], 2),
                 "warm_call_ms": round(best["warm_ms"], 2),
                 "cold_call_ms": round(best["cold_ms"], 2),
                 "plain_process_ms": round(best["plain_process_ms"], 2),
                 "calls_per_s": round(best["calls_per_s"], 1), "threads": args.threads,
                 "by_backend": {r["backend"]: {k: round(v, 2) for k, v in r.items()
                                               if k != "backend"} for r in rows},
                 "tool_thread_ms": round(1e3 * thread_s, 3),
                 "tool_process_ms": round(1e3 * process_s, 3), "calls": args.calls},
                __file__)


if __name__ == "__main__":
    main()
