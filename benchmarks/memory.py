"""Memory over a long run: does each process's resident memory stay flat?

``configs/ppo-tiny.yaml`` runs as a real ``rlhfflow run`` subprocess (``RLHFFLOW_WARM=0``,
its embedded cluster of 2 workers) with ``--set iterations=N``. A sampler follows its
``metrics.jsonl`` and, every ``--every`` iterations, reads the resident memory (RSS) and
the unique memory (USS: the pages no other process shares, which a fork's copy-on-write
pages are not, until written) of the coordinator (which hosts the Dask scheduler) and of
each worker process.

It prints one row per sample, then per process the memory at iteration ``--from`` (after
warm-up: the allocator's arenas, the caches and Dask's bounded logs filled) and at the end,
the growth in percent and in MB per iteration. The last line is a JSON object with those
figures.

    python benchmarks/memory.py [--iterations 3000] [--every 50] [--from 500]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from rlhfflow.runtime.cluster import embedded_worker_processes

ROOT = Path(__file__).resolve().parents[1]
MB = 1 << 20


@dataclass
class Sample:
    """The memory of each process after ``iteration`` was logged, in MB (RSS, USS)."""

    iteration: int
    rss: dict[str, float]
    uss: dict[str, float]


@dataclass
class Sampler:
    """Reads the memory of a run's coordinator and worker processes each time its
    ``metrics.jsonl`` gets ``every`` iterations further."""

    coordinator: psutil.Process
    metrics: Path
    every: int
    samples: list[Sample] = field(default_factory=list)
    _offset: int = 0
    _last: int = -1

    def poll(self) -> None:
        """Sample if the run logged an iteration that is due since the last poll."""
        last = self._last_iteration()
        if last < 0 or last == self._last:
            return
        due = last // self.every > self._last // self.every or self._last < 0
        self._last = last
        if due:
            self.sample(last)

    def sample(self, iteration: int) -> None:
        """Record the memory of every process now, as of ``iteration``."""
        processes = {"coordinator": self.coordinator}
        try:
            workers = embedded_worker_processes(self.coordinator)
        except psutil.NoSuchProcess:
            return
        # in start order: worker-0 is the older fork
        for i, p in enumerate(sorted(workers, key=lambda p: p.create_time())):
            processes[f"worker-{i}"] = p
        rss, uss = {}, {}
        for name, p in processes.items():
            try:
                info = p.memory_full_info()  # USS: one read of /proc/PID/smaps
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            rss[name], uss[name] = round(info.rss / MB, 1), round(info.uss / MB, 1)
        self.samples.append(Sample(iteration, rss, uss))

    def _last_iteration(self) -> int:
        # reads only what was appended since the last poll: the file grows by a line of
        # ~1 KB an iteration, and rereading it whole would itself be the sampler's cost
        try:
            with self.metrics.open("rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return self._last
        end = chunk.rfind(b"\n")
        if end < 0:
            return self._last
        self._offset += end + 1
        last = self._last
        for line in chunk[:end].splitlines():
            start = line.find(b'"iteration": ')
            if start >= 0:
                digits = line[start + 13:].split(b",", 1)[0]
                last = int(digits)
        return last


def run(iterations: int, every: int, directory: Path, timeout: float
        ) -> tuple[list[Sample], float, bool]:
    """``rlhfflow run configs/ppo-tiny.yaml --set iterations=N`` into ``directory``,
    sampled; returns the samples, the wall time and whether it ran to the end (a run
    still going after ``timeout`` seconds is killed: the samples so far are the
    figures). Raises if the run fails."""
    out = directory / "out"
    env = {**os.environ, "RLHFFLOW_WARM": "0", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "rlhfflow.cli.main", "run",
               str(ROOT / "configs" / "ppo-tiny.yaml"), "--overwrite",
               "--set", f"iterations={iterations}", "--set", f"output={out}",
               # a free port: another run on this machine may hold the default one
               "--set", "cluster.dashboard_address=127.0.0.1:0"]
    start = time.monotonic()
    finished = True
    with (directory / "run.log").open("w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        sampler = Sampler(psutil.Process(proc.pid), out / "metrics.jsonl", every)
        try:
            while proc.poll() is None:
                if time.monotonic() - start > timeout:
                    finished = False
                    break
                sampler.poll()
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                # the workers exit with their nannies, in the coordinator
                proc.kill()
                proc.wait()
    wall = time.monotonic() - start
    if finished and proc.returncode != 0:
        raise RuntimeError(f"the run exited with {proc.returncode}:\n"
                           + (directory / "run.log").read_text()[-4000:])
    return sampler.samples, wall, finished


def growth(samples: list[Sample], since: int) -> dict[str, dict[str, float]]:
    """Per process, RSS and USS at the first sample at or after iteration ``since`` and at
    the last sample, the growth in percent and in MB per iteration."""
    base = next((s for s in samples if s.iteration >= since), None)
    last = samples[-1] if samples else None
    if base is None or last is None or last.iteration <= base.iteration:
        return {}
    span = last.iteration - base.iteration
    out = {}
    for name in base.rss:
        if name not in last.rss:
            continue
        figures = {"from_iteration": base.iteration, "to_iteration": last.iteration}
        for kind in ("rss", "uss"):
            a, b = getattr(base, kind)[name], getattr(last, kind)[name]
            figures.update({f"{kind}_from_mb": a, f"{kind}_to_mb": b,
                            f"{kind}_growth_pct": round(100 * (b - a) / a, 2),
                            f"{kind}_mb_per_iteration": round((b - a) / span, 4)})
        out[name] = figures
    return out


def print_table(samples: list[Sample], figures: dict[str, dict[str, float]]) -> None:
    """One row per sample (RSS / USS per process, MB), then the growth per process."""
    names = list(samples[0].rss) if samples else []
    print(f"{'iteration':>9}  " + "  ".join(f"{n + ' rss/uss MB':>24}" for n in names))
    for s in samples:
        cells = [f"{s.rss.get(n, float('nan')):>11.1f} / {s.uss.get(n, float('nan')):<10.1f}"
                 for n in names]
        print(f"{s.iteration:>9}  " + "  ".join(f"{c:>24}" for c in cells))
    for name, f in figures.items():
        print(f"{name:<12} iterations {f['from_iteration']}..{f['to_iteration']}: "
              f"RSS {f['rss_from_mb']:.1f} -> {f['rss_to_mb']:.1f} MB "
              f"({f['rss_growth_pct']:+.2f}%, {f['rss_mb_per_iteration']:+.4f} MB/iteration); "
              f"USS {f['uss_from_mb']:.1f} -> {f['uss_to_mb']:.1f} MB "
              f"({f['uss_growth_pct']:+.2f}%, {f['uss_mb_per_iteration']:+.4f} MB/iteration)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=3000)
    parser.add_argument("--every", type=int, default=50, help="sample every N iterations")
    parser.add_argument("--from", dest="since", type=int, default=500,
                        help="growth is measured from the first sample at or after this "
                             "iteration (after warm-up)")
    parser.add_argument("--timeout", type=float, default=4 * 3600,
                        help="stop the run after this many seconds and report the "
                             "samples so far")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        samples, wall, finished = run(args.iterations, args.every, Path(tmp), args.timeout)
    figures = growth(samples, args.since)
    reached = samples[-1].iteration + 1 if samples else 0
    stopped = "" if finished else f"; stopped after {args.timeout:g} s at iteration {reached}"
    print(f"memory: configs/ppo-tiny.yaml, {args.iterations} iterations, 2 workers, "
          f"sampled every {args.every}; wall {wall:.0f} s{stopped}")
    print_table(samples, figures)
    # imported here: the tests import this module from the repository root, where the
    # benchmarks' own folder is not on the path
    from shared import emit_result

    worst = max((f["rss_growth_pct"] for f in figures.values()), default=None)
    emit_result({"iterations": args.iterations, "finished": finished,
                 "sampled_through": reached - 1, "since": args.since, "every": args.every,
                 "wall_s": round(wall, 1), "max_rss_growth_pct": worst,
                 "processes": figures}, __file__)


if __name__ == "__main__":
    main()
