"""What the benchmarks share: one embedded Dask cluster for all the runs of a multi-run
benchmark, the check that their variants can share it, and the record every benchmark
keeps of its figures (``emit_result``).

rlhfflow is imported inside the functions that need it, so a benchmark that only records
its result (``vs_trl.py``'s parent process) does not pay for torch and Dask.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

RESULTS = Path(os.environ.get("RLHFFLOW_BENCH_RESULTS")
               or Path(__file__).resolve().parent / "results")
"""Where each benchmark appends its figures: ``results/SCRIPT.jsonl``, one line a run
(``RLHFFLOW_BENCH_RESULTS`` elsewhere: the GPU check keeps its own with its output)."""


def machine() -> dict[str, Any]:
    """The machine a figure was measured on: CPU model and cores (``/proc/cpuinfo`` where
    there is one)."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu or platform.processor() or platform.machine(),
            "cores": os.cpu_count()}


def emit_result(result: Mapping[str, Any], script: str | Path,
                results: Path = RESULTS) -> Path:
    """Print ``result`` as the benchmark's last line (one JSON object) and append it, with
    the date, the machine and the command, to ``results/SCRIPT.jsonl``; returns that
    file. The figures then have a history that the docs' performance pages can cite."""
    print(json.dumps(result))
    record = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
              "machine": machine(),
              "command": shlex.join([Path(sys.executable).name, *sys.argv]),
              "result": result}
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{Path(script).stem}.jsonl"
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    return path


def check_gangs(config: Path, workers: int, variants: Mapping[str, Mapping[str, Any]]) -> None:
    """Fail before any run if two variants (name -> overrides) would put one worker in
    different gangs: a worker process joins one torch.distributed process group for its
    life, so the later run would fail minutes in."""
    from rlhfflow.config import load_pipeline
    from rlhfflow.plan.auto.planner import resolve_plan

    owner: dict[int, tuple[int, ...]] = {}
    for name, overrides in variants.items():
        for gang in resolve_plan(load_pipeline(config, overrides), workers).gangs:
            for w in gang:
                if owner.setdefault(w, gang) != gang:
                    raise SystemExit(f"{name} on {workers} workers puts worker {w} in gang "
                                     f"{list(gang)}, another variant in {list(owner[w])}: "
                                     f"they cannot share one cluster")


@contextmanager
def shared_cluster(workers: int, iterations: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """One embedded cluster for every run, so all variants get the same worker processes
    and start-up (iteration 0 is left out anyway). Yields the torch threads per worker and
    the overrides that send a run there."""
    from rlhfflow.plan.layout import default_torch_threads
    from rlhfflow.runtime.cluster import local_cluster

    threads = default_torch_threads(workers)
    cluster = local_cluster(workers, dashboard_address=":0", torch_threads=threads)
    # the workers' torch threads must match what the embedded cluster was started with
    settings = {"iterations": iterations, "cluster.address": cluster.scheduler_address,
                "cluster.workers": workers, "cluster.torch_threads": threads,
                "cluster.dashboard_address": ":0"}
    try:
        yield threads, settings
    finally:
        cluster.close()


def print_stage_table(rows: Mapping[str, Mapping[str, Any]], width: int) -> None:
    """The median seconds per stage (``row["stage_s"]``), one column per variant."""
    stages = sorted({st for row in rows.values() for st in row["stage_s"]})
    print(f"\nstage_s (median){'':<8}" + "".join(f"{name:>{width}}" for name in rows))
    for st in stages:
        cells = (row["stage_s"].get(st) for row in rows.values())
        print(f"{st:<24}" + "".join(f"{c:>{width}.4f}" if c is not None else f"{'-':>{width}}"
                                    for c in cells))
