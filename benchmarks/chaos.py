"""Chaos: a worker killed or frozen, or the coordinator killed, at a random moment of a
random iteration costs the run time, never its results.

Each config runs as a real ``rlhfflow run`` subprocess on its embedded cluster of 2
workers (``--set iterations=N --set checkpoint.every=2 --set cluster.workers=2``), once
untouched per placement (the reference), then once per fault. A seeded campaign mixes the
fault kinds (``--kinds``), placements (``--placements``) and the warm server on and off
(``--warm``, ``RLHFFLOW_WARM``): every combination in turn, in a shuffled order. A watcher
follows ``OUT/metrics.jsonl`` and, a seeded uniform delay after the k-th line appeared (k
random in 1..N-2), does the fault:

- ``worker``: SIGKILL one device worker process;
- ``stop``: SIGSTOP one device worker past the run's heartbeat timeout (``--heartbeat-s``,
  5 s), then SIGCONT it (``--stop-s``);
- ``coordinator``: SIGKILL the coordinator of a run started with ``--supervise`` (which
  restarts it, resuming from the last checkpoint).

Each faulted run must:

- exit 0;
- have every iteration 0..N-1 in ``metrics.jsonl`` exactly once, in order;
- have the results (rewards, KL, losses, lengths) of the reference, exactly; except under
  bounded staleness (``overlap.max_staleness`` > 0), where which weights generated a batch
  depends on timing: there only completeness is checked.

    python benchmarks/chaos.py [--faults 8] [--seed 0] [--iterations 8]
        [--configs configs/ppo-tiny.yaml] [--placements interleaved,colocated,...]
        [--kinds worker,coordinator,stop] [--warm off,on] [--stop-s 8] [--heartbeat-s 5]

Prints a table (fault, placement, warm server, outcome, time lost: by the run's own clock,
``stalled_s``, and against the reference: the seconds from the first metrics record to the
exit, faulted minus untouched), then one JSON object with the counts, the median and
worst time lost (in all, by kind, placement and warm server) as its last line; exits 1 if
a run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.soak import RESULT_KEYS  # noqa: E402

#: placement name -> the overrides that make it; "stale" results may differ from the
#: reference (the weights a batch is generated with depend on timing)
PLACEMENTS: dict[str, tuple[list[str], bool]] = {
    "colocated": (["placement.strategy=colocated"], False),
    "interleaved": (["placement.strategy=interleaved"], False),
    "disaggregated": (["placement.strategy=disaggregated"], False),
    "disaggregated-stale1": (["placement.strategy=disaggregated",
                              "overlap.max_staleness=1"], True),
}

KINDS = ("worker", "coordinator", "stop")
"""The faults: SIGKILL a device worker, SIGKILL the coordinator (under ``--supervise``),
SIGSTOP a device worker past the heartbeat timeout and SIGCONT it."""

#: ``RLHFFLOW_WARM`` of a run with the warm server off / on (on: its idle exit, seconds)
WARM = {"off": "0", "on": "300"}

#: for ``stop`` faults: the run's ``cluster.heartbeat_timeout_s`` (a worker that sends no
#: heartbeat for this long is declared lost); the worker is stopped for longer than this
HEARTBEAT_TIMEOUT_S = 5


@dataclass
class Fault:
    """One fault: ``kind`` (see ``KINDS``) ``delay_s`` after iteration ``after`` appeared
    in the metrics."""

    kind: str
    after: int
    delay_s: float
    done: bool = False
    at_s: float | None = None
    last: int = -1  # the newest iteration in the metrics at the fault


@dataclass
class Outcome:
    """What one run did: its exit code, the seconds from its first metrics record to its
    exit, the checks and the last line of its log."""

    config: str
    placement: str
    warm: str
    fault: Fault | None
    code: int
    wall_s: float
    stalled_s: float | None = None
    checks: dict[str, bool] = field(default_factory=dict)
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.code == 0 and all(self.checks.values())


def command(config: Path, out: Path, iterations: int, overrides: list[str],
            supervise: bool = False) -> list[str]:
    """The ``rlhfflow run`` command line of one run."""
    sets = [f"iterations={iterations}", "checkpoint.every=2", "cluster.workers=2",
            "cluster.dashboard_address=127.0.0.1:0", *overrides]
    return [sys.executable, "-m", "rlhfflow.cli.main", "run", str(config), "--out", str(out),
            "--overwrite", *["--supervise"] * supervise,
            *[a for s in sets for a in ("--set", s)]]


def run_processes(log: Path, out: Path) -> tuple[psutil.Process | None, list[psutil.Process]]:
    """The coordinator and the device workers of the run writing ``log`` into ``out``,
    however it was started (cold or as forks of a warm server, supervised or not): the
    coordinator is the process whose standard output is ``log`` and that listens on TCP
    (the scheduler runs in it; the supervisor, a warm client and a fork server do not);
    the workers are the processes whose output goes to the run's worker logs
    (``OUT/logs/worker-N.log``)."""
    logs = str(out / "logs") + os.sep
    coordinator, workers = None, []
    for process in psutil.process_iter():
        try:
            target = os.readlink(f"/proc/{process.pid}/fd/1")
            if target.startswith(logs) and "resource_tracker" not in " ".join(
                    process.cmdline()):  # a helper a worker started is no worker
                workers.append(process)
            elif target == str(log) and any(
                    c.status == psutil.CONN_LISTEN
                    for c in process.net_connections(kind="tcp")):
                coordinator = process
        except (OSError, psutil.Error):  # gone, or not ours
            continue
    return coordinator, workers


def metrics_lines(path: Path) -> list[dict[str, Any]]:
    """The complete records of a metrics.jsonl being written."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # a line being written
            break
    return records


def inject(log: Path, out: Path, fault: Fault, stopped_s: float, pace_s: float,
           finished: threading.Event) -> None:
    """Wait for line ``fault.after + 1`` of the run's metrics, then ``fault.delay_s`` (a
    fraction, made seconds here: of up to 1.5 iterations at the run's own pace so far, or
    ``pace_s`` before it has one), then do the fault: to the coordinator, or to one device
    worker (a random one, from the fault's delay)."""
    metrics = out / "metrics.jsonl"
    start = time.monotonic()
    first = None
    while not finished.wait(0.02):
        lines = len(metrics_lines(metrics))
        if lines and first is None:
            first = time.monotonic()
        if lines > fault.after:
            break
    if fault.after > 0 and first is not None:
        # the machine's load changes by the minute: the pace of this run, not the reference
        pace_s = (time.monotonic() - first) / fault.after
    fault.delay_s = round(fault.delay_s * 1.5 * pace_s, 3)
    if finished.wait(fault.delay_s):
        return
    coordinator, workers = run_processes(log, out)
    victim = coordinator if fault.kind == "coordinator" else (
        workers[int(fault.delay_s * 1000) % len(workers)] if workers else None)
    if victim is None:
        return
    fault.last = max((r.get("iteration", -1) for r in metrics_lines(metrics)), default=-1)
    try:
        victim.send_signal(signal.SIGSTOP if fault.kind == "stop" else signal.SIGKILL)
    except psutil.NoSuchProcess:
        return
    fault.at_s = round(time.monotonic() - start, 2)
    fault.done = True
    if fault.kind == "stop":
        finished.wait(stopped_s)
        try:
            victim.send_signal(signal.SIGCONT)
        except psutil.NoSuchProcess:  # its run ended it meanwhile
            pass


def follow(metrics: Path, finished: threading.Event, seen: dict[int, float]) -> None:
    """Note when each iteration's record first appears in ``metrics`` (a run cut back to
    its last checkpoint writes some again: the first time stays)."""
    while not finished.wait(0.05):
        for record in metrics_lines(metrics):
            seen.setdefault(record.get("iteration"), time.monotonic())


def stalled_s(seen: dict[int, float], last: int) -> float | None:
    """The time a fault cost, by the run's own clock: how much longer than its median
    iteration the run took from iteration ``last`` (the newest at the fault) to the next
    (the machine's load, which moves every run's pace, cancels out)."""
    gaps = {k: seen[k + 1] - seen[k] for k in seen if k + 1 in seen}
    others = [gap for k, gap in gaps.items() if k != last]
    if last not in gaps or not others:
        return None
    return round(gaps[last] - statistics.median(others), 2)


def run_once(config: Path, out: Path, iterations: int, overrides: list[str],
             fault: Fault | None, stopped_s: float, timeout: float, warm: str = "off",
             pace_s: float = 1.0, heartbeat_s: float = HEARTBEAT_TIMEOUT_S
             ) -> tuple[int, float, str, dict[int, float]]:
    """One run, with ``fault`` if given (a ``coordinator`` fault: under ``--supervise``;
    ``pace_s``: seconds an iteration, before the run shows its own), the warm server
    ``warm`` ("on" or "off"); returns its exit code, the seconds from its
    first metrics record to its exit (start-up, which varies most with the machine's load,
    left out), its log (also kept as ``OUT/run.log``) and when each iteration's record
    first appeared (``follow``)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RLHFFLOW_WARM": WARM[warm],
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if fault is not None and fault.kind == "stop":
        # the scheduler (in the run's process) drops a worker silent this long
        overrides = [*overrides, f"cluster.heartbeat_timeout_s={heartbeat_s:g}"]
    supervise = fault is not None and fault.kind == "coordinator"
    start = time.monotonic()
    seen: dict[int, float] = {}
    # a named file (not a temporary one): the coordinator is found by its output
    log_path = out.parent / f"{out.name}.log"
    with log_path.open("w+") as log:
        proc = subprocess.Popen(command(config, out, iterations, overrides, supervise),
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                                env=env)
        finished = threading.Event()
        watchers = [threading.Thread(target=follow, daemon=True,
                                     args=(out / "metrics.jsonl", finished, seen))]
        if fault is not None:
            watchers.append(threading.Thread(target=inject, daemon=True, args=(
                log_path, out, fault, stopped_s, pace_s, finished)))
        for w in watchers:
            w.start()
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        finally:
            finished.set()
            for w in watchers:
                w.join()
        loop_s = time.monotonic() - (min(seen.values()) if seen else start)
        log.seek(0)
        text = log.read()
    log_path.unlink()
    out.mkdir(parents=True, exist_ok=True)
    (out / "run.log").write_text(text)
    return code, loop_s, text, seen


def check(out: Path, reference: list[dict[str, Any]], iterations: int, stale: bool
          ) -> dict[str, bool]:
    """Every iteration once, in order; the reference's results unless ``stale``."""
    records = metrics_lines(out / "metrics.jsonl")
    checks = {"each_iteration_once": [r.get("iteration") for r in records]
              == list(range(iterations))}
    if not stale:
        keys = [k for k in RESULT_KEYS if reference and k in reference[0]] + \
            [k for k in ("value_loss",) if reference and k in reference[0]]
        checks["results_equal_reference"] = (
            [{k: r.get(k) for k in keys} for r in records]
            == [{k: r.get(k) for k in keys} for r in reference])
    return checks


def plan_faults(n: int, seed: int, iterations: int, kinds: list[str], configs: list[str],
                placements: list[str], warms: list[str] = ("off",), after: int | None = None
                ) -> list[tuple[str, str, str, Fault]]:
    """``n`` faults (config, placement, warm server, fault): every combination of config,
    placement, warm server and kind in turn, the order shuffled; each after a random
    iteration (0..N-3, so a fault has something left to recover into), a random fraction
    of up to 1.5 iterations (made seconds as the run goes: ``inject``)."""
    rng = random.Random(seed)
    combos = [(c, p, w, k) for c in configs for p in placements for w in warms for k in kinds]
    rounds = [rng.sample(combos, len(combos)) for _ in range(-(-n // len(combos)))]
    chosen = [combo for shuffled in rounds for combo in shuffled][:n]
    return [(c, p, w, Fault(k, rng.randrange(0, max(iterations - 2, 1))
                            if after is None else after, rng.random()))
            for c, p, w, k in chosen]


def lost_figures(lost: list[float]) -> dict[str, float | None]:
    """The median and worst of the seconds lost per fault."""
    return {"lost_median_s": round(statistics.median(lost), 2) if lost else None,
            "lost_worst_s": round(max(lost), 2) if lost else None}


def chaos(configs: list[str], placements: list[str], faults: int, seed: int,
          iterations: int, kinds: list[str] = ("worker",), stopped_s: float = 8.0,
          timeout: float = 600, directory: Path | None = None, say=print,
          after: int | None = None, warms: list[str] = ("off",), parallel: int = 1,
          heartbeat_s: float = HEARTBEAT_TIMEOUT_S) -> dict[str, Any]:
    """The references (warm server off), then the faulted runs, ``parallel`` runs at a
    time; returns the figures (see the module docstring). ``say`` gets one table row per
    run, as it ends."""
    tmp = tempfile.TemporaryDirectory() if directory is None else None
    base = Path(tmp.name) if tmp else directory
    base.mkdir(parents=True, exist_ok=True)
    plan = plan_faults(faults, seed, iterations, list(kinds), configs, placements,
                       list(warms), after)
    saying = threading.Lock()

    def reference(combo: tuple[str, str]) -> tuple[float, list[dict[str, Any]]]:
        config, placement = combo
        out = base / f"ref-{Path(config).stem}-{placement}"
        code, wall, log, _ = run_once(ROOT / config, out, iterations,
                                      PLACEMENTS[placement][0], None, 0, timeout)
        if code != 0:
            raise RuntimeError(f"the reference run of {config} ({placement}) exited with "
                               f"{code}:\n{log[-3000:]}")
        return wall, metrics_lines(out / "metrics.jsonl")

    def faulted(i: int) -> Outcome:
        config, placement, warm, fault = plan[i]
        overrides, stale = PLACEMENTS[placement]
        ref_wall, expected = references[config, placement]
        # the delay: up to 1.5 iterations (any phase of the next iteration or the one
        # after), at the run's pace, or the reference's median before it has one
        pace_s = statistics.median(r.get("iteration_s", 1.0) for r in expected)
        out = base / f"run-{i}"
        code, wall, log, seen = run_once(ROOT / config, out, iterations, overrides, fault,
                                         stopped_s, timeout, warm, pace_s, heartbeat_s)
        outcome = Outcome(config, placement, warm, fault, code, wall,
                          stalled_s=stalled_s(seen, fault.last))
        if fault.done:
            outcome.checks = check(out, expected, iterations, stale)
        if code != 0:
            lines = [ln for ln in log.splitlines() if ln.strip()]
            outcome.error = lines[-1] if lines else f"exit {code}"
        what = (f"{fault.kind}@{fault.after}+{fault.delay_s:.2f}s"
                if fault.done else f"{fault.kind}@{fault.after} (missed)")
        result = "recovered" if outcome.ok else (
            f"FAILED exit {code}" if code else "FAILED " + ",".join(
                k for k, v in outcome.checks.items() if not v))
        with saying:
            stalled = f"{outcome.stalled_s:.1f}" if outcome.stalled_s is not None else "-"
            say(f"{i:<4}{what:<28}{Path(config).stem:<14}{placement:<22}{warm:<6}"
                f"{result:<30}{stalled:>7}{wall - ref_wall:>9.1f}")
            if not outcome.ok and outcome.error:
                say(f"    {outcome.error[:300]}")
        return outcome

    say(f"{'#':<4}{'fault':<28}{'config':<14}{'placement':<22}{'warm':<6}{'outcome':<30}"
        f"{'lost_s':>7}{'vs_ref_s':>9}")
    combos = list(dict.fromkeys((c, p) for c, p, _, _ in plan))
    try:
        with ThreadPoolExecutor(max(parallel, 1)) as pool:
            references = dict(zip(combos, pool.map(reference, combos), strict=True))
            outcomes = list(pool.map(faulted, range(len(plan))))
    finally:
        if tmp:
            tmp.cleanup()
    injected = [o for o in outcomes if o.fault and o.fault.done]

    def lost(of: list[Outcome]) -> list[float]:
        return [o.stalled_s for o in of if o.ok and o.stalled_s is not None]

    def vs_reference(of: list[Outcome]) -> list[float]:
        return [o.wall_s - references[o.config, o.placement][0] for o in of if o.ok]

    def counts(of: list[Outcome]) -> dict[str, Any]:
        return {"faults": len(of), "recovered": sum(o.ok for o in of), **lost_figures(lost(of))}

    return {
        "faults": len(injected), "missed": len(outcomes) - len(injected),
        "recovered": sum(o.ok for o in injected),
        "failed_exit": sum(o.code != 0 for o in injected),
        "failed_checks": sum(o.code == 0 and not o.ok for o in injected),
        # runs that failed before their fault came: no fault's, but a failure all the same
        "failed_before_fault": sum(o.code != 0 for o in outcomes if not o.fault.done),
        "recovered_pct": round(100 * sum(o.ok for o in injected) / len(injected), 1)
        if injected else None,
        "results_compared": sum(o.ok and "results_equal_reference" in o.checks
                                for o in injected),
        **lost_figures(lost(injected)),
        # the faulted run's wall time minus the reference's: the load of the machine
        # when each ran moves it by more than a fault costs where the machine is shared
        **{f"{k}_vs_reference": v for k, v in lost_figures(vs_reference(injected)).items()},
        "by_kind": {k: counts([o for o in injected if o.fault.kind == k]) for k in kinds},
        "by_placement": {p: counts([o for o in injected if o.placement == p])
                         for p in placements},
        "by_warm": {w: counts([o for o in injected if o.warm == w]) for w in warms},
        "errors": sorted({o.error[:200] for o in outcomes if o.error}),
        "kinds": list(kinds), "warm": list(warms), "seed": seed, "iterations": iterations,
        "parallel": parallel, "stop_s": stopped_s, "heartbeat_timeout_s": heartbeat_s,
        # each fault: kind@iteration+delay, placement, warm server, ok, seconds lost (by
        # the run's own clock, and against the reference)
        "runs": [[f"{o.fault.kind}@{o.fault.after}+{o.fault.delay_s:.2f}", o.placement,
                  o.warm, o.ok, o.stalled_s,
                  round(o.wall_s - references[o.config, o.placement][0], 1)]
                 for o in injected],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--configs", default="configs/ppo-tiny.yaml",
                        help="comma-separated configs (relative to the repository)")
    parser.add_argument("--placements", default="interleaved",
                        help="comma-separated, of: " + ", ".join(PLACEMENTS))
    parser.add_argument("--kinds", default="worker",
                        help="comma-separated fault kinds, of: " + ", ".join(KINDS))
    parser.add_argument("--warm", default="off",
                        help="comma-separated, of: off, on (the warm server, RLHFFLOW_WARM)")
    parser.add_argument("--stop-s", type=float, default=8.0, metavar="SECONDS",
                        help="a stop fault's SIGSTOP lasts this long before its SIGCONT; the "
                             "runs' heartbeat timeout is --heartbeat-s")
    parser.add_argument("--heartbeat-s", type=float, default=HEARTBEAT_TIMEOUT_S,
                        metavar="SECONDS",
                        help="a stop fault's run has this cluster.heartbeat_timeout_s "
                             f"(default {HEARTBEAT_TIMEOUT_S}; on a loaded machine a "
                             "worker busy starting can be this silent too)")
    parser.add_argument("--after", type=int, default=None, metavar="K",
                        help="every fault after iteration K (default: a random one)")
    parser.add_argument("--parallel", type=int, default=1, metavar="N",
                        help="N runs at a time (the time lost is then measured against "
                             "references run as many at a time)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the runs (and their run.log) here")
    args = parser.parse_args()
    kinds, warms = args.kinds.split(","), args.warm.split(",")
    for given, known, option in ((kinds, KINDS, "--kinds"), (warms, WARM, "--warm"),
                                 (args.placements.split(","), PLACEMENTS, "--placements")):
        unknown = sorted(set(given) - set(known))
        if unknown:
            parser.error(f"{option}: unknown {', '.join(unknown)}; expected some of "
                         f"{', '.join(known)}")
    figures = chaos(args.configs.split(","), args.placements.split(","), args.faults,
                    args.seed, args.iterations, kinds, args.stop_s, directory=args.workdir,
                    after=args.after, warms=warms, parallel=args.parallel,
                    heartbeat_s=args.heartbeat_s,
                    say=lambda line: print(line, flush=True))
    from benchmarks.shared import emit_result

    emit_result(figures, __file__)
    if figures["recovered"] != figures["faults"] or figures["failed_before_fault"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
