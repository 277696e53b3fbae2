"""Soak: a long run under repeated faults loses nothing, repeats nothing and computes what
an uninterrupted run computes.

A tiny GRPO pipeline (a copy of ``configs/grpo-tiny.yaml`` with a small batch and few
tokens, a checkpoint every ``--every`` iterations) runs as a real ``rlhfflow run
--supervise`` subprocess on its embedded cluster, twice: once untouched, once while a
watcher follows its ``metrics.jsonl`` and SIGKILLs a device worker process every
``--kill-every`` iterations and the coordinator (the supervisor's child) once, half-way.
Then the faulted run is checked against the untouched one:

- every iteration 0..N-1 is in ``metrics.jsonl`` exactly once, in order, and is a committed
  group of the experience buffer, with nothing left uncommitted;
- every committed group is readable (all its columns, every row);
- the last checkpoint is of iteration N-1 and its models load with transformers (and its
  optimizer states with torch), as do the final models;
- the results (rewards, KL, losses, lengths) equal the untouched run's, iteration by
  iteration, exactly.

It reports the faults, both wall times and the time lost per fault (extra wall time /
faults).

    python benchmarks/soak.py [--iterations 100] [--kill-every 15] [--every 5]

Prints a table, then one JSON object with the figures as its last line; exits 1 if a check
failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

from rlhfflow.runtime.cluster import embedded_worker_processes

ROOT = Path(__file__).resolve().parents[1]
# what must not change under faults (timings may)
RESULT_KEYS = ("iteration", "samples", "reward_mean", "reward_std", "kl_mean", "policy_loss",
               "clip_frac", "approx_kl", "response_length_mean", "tokens_generated")


def write_pipeline(directory: Path, iterations: int, every: int, workers: int = 2) -> Path:
    """A copy of ``configs/grpo-tiny.yaml`` sized for a soak (~0.3 s an iteration on 2
    cores) writing into ``directory/out``; returns its path."""
    from rlhfflow.config.yamlfile import apply_overrides

    data = yaml.safe_load((ROOT / "configs" / "grpo-tiny.yaml").read_text())
    data = apply_overrides(data, {
        "iterations": iterations,
        "output": str(directory / "out"),
        "data.prompts": str(ROOT / "configs" / "data" / "prompts.jsonl"),
        "data.batch_size": 4,
        # as written, not the planner's: the runs compared must split alike (another
        # split moves log-probs by float rounding, ~1e-8)
        "data.micro_batches": 2,
        "stages.generate.params.max_new_tokens": 8,
        "stages.train_actor.params.epochs": 1,
        "checkpoint.every": every,
        "checkpoint.keep": 2,
        "cluster.workers": workers,
        "cluster.torch_threads": 1,
        "cluster.dashboard_address": "127.0.0.1:0",
        # every worker kill is one recovery of the coordinator it happens under
        "cluster.max_restarts": 1000,
    })
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "soak.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@dataclass
class Fault:
    """One SIGKILL: of a ``worker`` or of the ``coordinator``, after ``iteration`` was
    committed, at ``at_s`` seconds into the run; ``regained_s`` later the run committed
    an iteration past ``iteration`` again (detection, restart, reload, the iterations
    redone since the checkpoint, and one new iteration)."""

    kind: str
    iteration: int
    at_s: float
    regained_s: float | None = None


@dataclass
class Watcher:
    """Follows a supervised run's ``metrics.jsonl`` and SIGKILLs a device worker each time
    the run gets ``kill_every`` iterations further, and the coordinator once, when it has
    committed ``coordinator_at``. Runs in a thread beside the run."""

    supervisor: psutil.Process
    metrics: Path
    kill_every: int
    coordinator_at: int | None
    last: int  # no fault at or after this iteration: nothing would be left to recover
    started: float = field(default_factory=time.monotonic)
    faults: list[Fault] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        """Watch until ``done`` is set (the run ended)."""
        next_worker = self.kill_every if self.kill_every > 0 else None
        highest = -1
        while not self.done.wait(0.05):
            highest = max(highest, _last_iteration(self.metrics))
            for fault in self.faults:
                if fault.regained_s is None and highest > fault.iteration:
                    fault.regained_s = round(time.monotonic() - self.started - fault.at_s, 2)
            if self.coordinator_at is not None and highest >= self.coordinator_at:
                if self._kill_coordinator(highest):
                    self.coordinator_at = None
                    if next_worker is not None and next_worker <= highest:
                        next_worker = highest + self.kill_every
            elif next_worker is not None and next_worker <= highest < self.last:
                if self._kill_worker(highest):
                    next_worker = highest + self.kill_every

    def _coordinator(self) -> psutil.Process | None:
        try:
            children = self.supervisor.children()
        except psutil.NoSuchProcess:
            return None
        return children[0] if len(children) == 1 else None

    def _kill_worker(self, iteration: int) -> bool:
        coordinator = self._coordinator()
        workers = device_workers(coordinator) if coordinator else []
        if not workers:  # between coordinators, or the cluster still starting
            return False
        victim = workers[len(self.faults) % len(workers)]
        return self._kill(victim, "worker", iteration)

    def _kill_coordinator(self, iteration: int) -> bool:
        coordinator = self._coordinator()
        return coordinator is not None and self._kill(coordinator, "coordinator", iteration)

    def _kill(self, process: psutil.Process, kind: str, iteration: int) -> bool:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            return False
        self.faults.append(Fault(kind, iteration, round(time.monotonic() - self.started, 2)))
        return True


def device_workers(coordinator: psutil.Process) -> list[psutil.Process]:
    """The embedded cluster's worker processes: children that its nannies spawned."""
    try:
        return embedded_worker_processes(coordinator)
    except psutil.NoSuchProcess:
        return []


def _last_iteration(metrics: Path) -> int:
    try:
        lines = metrics.read_text().splitlines()
    except FileNotFoundError:
        return -1
    for line in reversed(lines):
        try:
            return int(json.loads(line)["iteration"])
        except (ValueError, KeyError):  # a line being written
            continue
    return -1


def run_supervised(path: Path, iterations: int, kill_every: int = 0,
                   coordinator_kill: bool = False, timeout: float = 1800
                   ) -> tuple[float, list[Fault], str]:
    """``rlhfflow run PATH --supervise --overwrite``, with faults as asked; returns the wall
    time, the faults and the run's stderr. Raises if the run fails."""
    out = Path(yaml.safe_load(path.read_text())["output"])
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlhfflow.cli.main", "run", str(path), "--supervise",
             "--overwrite", "--max-restarts", "3"],
            stdout=subprocess.DEVNULL, stderr=stderr, text=True, env=env)
        watcher = Watcher(psutil.Process(proc.pid), out / "metrics.jsonl", kill_every,
                          iterations // 2 if coordinator_kill else None, last=iterations - 2)
        thread = threading.Thread(target=watcher.run, daemon=True)
        if kill_every or coordinator_kill:
            thread.start()
        try:
            code = proc.wait(timeout=timeout)
        finally:
            watcher.done.set()
            if proc.poll() is None:
                proc.kill()
        wall = time.monotonic() - start
        stderr.seek(0)
        log = stderr.read()
    if code != 0:
        raise RuntimeError(f"the run {path} exited with {code}:\n{log[-4000:]}")
    return wall, watcher.faults, log


def check(out: Path, reference: Path, iterations: int) -> dict[str, bool]:
    """The soak's checks of the run in ``out`` against the untouched run in ``reference``
    (see the module docstring); each check's name -> whether it held."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhfflow.storage import CheckpointStore, ExperienceBuffer, MetricsLog

    records = MetricsLog(out / "metrics.jsonl").read()
    buffer = ExperienceBuffer(out / "buffer.zarr")
    every = list(range(iterations))
    checks = {
        "metrics_each_iteration_once": [r["iteration"] for r in records] == every,
        "buffer_each_iteration_once": buffer.iterations() == every,
        "buffer_nothing_uncommitted": buffer.uncommitted() == [],
    }
    readable = True
    for k in buffer.iterations():
        try:
            batch = buffer.read(k)  # every column
            rows = {len(v) for v in batch.values()}
            readable &= len(rows) == 1 and rows.pop() == records[k]["samples"]
        except Exception:  # noqa: BLE001 - an unreadable group is what this looks for
            readable = False
    checks["buffer_groups_readable"] = readable
    latest = CheckpointStore(out / "checkpoints").latest()
    loads = latest is not None and latest.iteration == iterations - 1
    if loads:
        try:
            AutoModelForCausalLM.from_pretrained(latest.model_dir("actor"))
            torch.load(latest.optimizer_file("actor"), weights_only=False)
            AutoModelForCausalLM.from_pretrained(out / "models" / "actor" / "final")
        except Exception:  # noqa: BLE001 - a checkpoint that does not load fails the check
            loads = False
    checks["checkpoint_loads"] = loads
    expected = MetricsLog(reference / "metrics.jsonl").read()
    checks["results_equal_uninterrupted"] = (
        [{k: r[k] for k in RESULT_KEYS} for r in records]
        == [{k: r[k] for k in RESULT_KEYS} for r in expected])
    return checks


def soak(directory: Path, iterations: int, kill_every: int, every: int,
         coordinator_kill: bool = True, workers: int = 2) -> dict[str, Any]:
    """The untouched run, then the faulted one, then the checks; returns the figures."""
    clean = write_pipeline(directory / "clean", iterations, every, workers)
    clean_s, _, _ = run_supervised(clean, iterations)
    faulted = write_pipeline(directory / "faulted", iterations, every, workers)
    faulted_s, faults, log = run_supervised(faulted, iterations, kill_every, coordinator_kill)
    checks = check(directory / "faulted" / "out", directory / "clean" / "out", iterations)
    lost = (faulted_s - clean_s) / len(faults) if faults else 0.0
    return {
        "iterations": iterations, "workers": workers, "checkpoint_every": every,
        "faults": len(faults),
        "worker_kills": sum(f.kind == "worker" for f in faults),
        "coordinator_kills": sum(f.kind == "coordinator" for f in faults),
        "fault_iterations": [f"{f.kind}@{f.iteration}" for f in faults],
        "regained_s": [f.regained_s for f in faults],
        "recoveries_logged": log.count("recovering from the last checkpoint"),
        "supervisor_restarts": log.count("rlhfflow: supervisor: the run died"),
        "clean_wall_s": round(clean_s, 2), "faulted_wall_s": round(faulted_s, 2),
        "lost_per_fault_s": round(lost, 2),
        "checks": checks, "ok": all(checks.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--kill-every", type=int, default=15,
                        help="SIGKILL a device worker each time the run gets this many "
                             "iterations further")
    parser.add_argument("--every", type=int, default=5, help="checkpoint.every")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--no-coordinator-kill", action="store_true",
                        help="do not SIGKILL the coordinator half-way")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        figures = soak(Path(tmp), args.iterations, args.kill_every, args.every,
                       not args.no_coordinator_kill, args.workers)
    print(f"soak: {figures['iterations']} iterations on {figures['workers']} workers, "
          f"checkpoint every {figures['checkpoint_every']}")
    print(f"{'faults':<28}{figures['faults']} ({figures['worker_kills']} worker, "
          f"{figures['coordinator_kills']} coordinator): "
          + ", ".join(figures["fault_iterations"]))
    print(f"{'wall, no faults':<28}{figures['clean_wall_s']:.1f} s")
    print(f"{'wall, with faults':<28}{figures['faulted_wall_s']:.1f} s")
    print(f"{'time lost per fault':<28}{figures['lost_per_fault_s']:.1f} s")
    print(f"{'kill to next new iteration':<28}"
          + ", ".join(f"{s:.1f} s" if s is not None else "-" for s in figures["regained_s"]))
    for name, ok in figures["checks"].items():
        print(f"{name:<28}{'ok' if ok else 'FAILED'}")
    # imported here: the tests import this module from the repository root, where the
    # benchmarks' own folder is not on the path
    from shared import emit_result

    emit_result(figures, __file__)
    if not figures["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
