"""Worker layouts: how many device workers an embedded cluster runs, and how many torch
threads each. The runtime starts its default; the planner compares the others."""

from __future__ import annotations

import os


def default_torch_threads(workers: int, cores: int | None = None) -> int:
    """Torch threads per embedded worker: the cores split between workers, keeping one
    for the coordinator and scheduler. On 2 cores with 1 worker, 2 threads made each
    iteration 1.34x slower than 1 thread, the scheduler's work stalling torch's OpenMP
    threads (benchmarks/overhead.py)."""
    cores = cores or os.cpu_count() or 1
    return max(1, (cores - 1) // workers)


def layouts(cores: int, max_workers: int) -> list[tuple[int, int]]:
    """Embedded worker layouts worth comparing on ``cores`` cores: ``W`` workers of
    ``cores // W`` torch threads (every core busy with torch) and of ``(cores - 1) // W``
    (a core left to the coordinator), for ``W`` up to ``max_workers``."""
    out = []
    for w in range(1, max(1, min(cores, max_workers)) + 1):
        out += [(w, max(1, cores // w)), (w, max(1, (cores - 1) // w))]
    return list(dict.fromkeys(out))
