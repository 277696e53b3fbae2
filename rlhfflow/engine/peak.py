"""The machine's measured matmul peak: the denominator of MFU.

``torch.matmul`` of square matrices, at the run's torch thread count (or on its GPU),
sized so one product takes a few tens of milliseconds and timed for about half a
second; the best product's rate is the peak (on a shared machine the others' work only
ever slows a product down). Measured once per machine, device, thread count, dtype and
torch version, and kept in ``$XDG_CACHE_HOME/rlhfflow/matmul_peak.json`` (default
``~/.cache``; delete the file to measure again), through ``rlhfflow.engine.machine``, as
the lean forward's choice of CPU kernel is (``rlhfflow.engine.lean``).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from rlhfflow.engine import machine
from rlhfflow.engine.resident import DTYPES

CACHE_FILE = "matmul_peak.json"
#: the dtypes every run's peak is measured for (a float16 model adds its own)
PEAK_DTYPES = ("float32", "bfloat16")


def cache_path() -> Path:
    """Where measured peaks are kept."""
    return machine.cache_path(CACHE_FILE)


def matmul_peaks(dtypes: tuple[str, ...] = PEAK_DTYPES, threads: int | None = None,
                 device: str = "cpu") -> dict[str, float]:
    """The matmul peak (FLOP/s) of each dtype name on ``device`` (``cpu``: with
    ``threads`` torch threads, default the process's), from the cache or measured
    now and cached."""
    threads = threads or torch.get_num_threads()
    path = cache_path()
    cached = machine.read_cache(path)
    peaks, measured = {}, False
    for dtype in dtypes:
        key = _key(dtype, threads, device)
        if not isinstance(cached.get(key), int | float):
            cached[key] = measure_peak(DTYPES[dtype], threads, device)
            measured = True
        peaks[dtype] = float(cached[key])
    if measured:
        machine.write_cache(path, cached)
    return peaks


def measure_peak(dtype: torch.dtype, threads: int = 1, device: str = "cpu",
                 seconds: float = 0.5) -> float:
    """Time ``torch.matmul`` of square ``dtype`` matrices on ``device`` for about
    ``seconds``; the best product's FLOP/s (``2 n^3`` per product)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        size, elapsed = 256, 0.0
        while True:  # grow until one product takes 20 ms (or the size is large)
            a = torch.randn(size, size, generator=gen, device=device).to(dtype)
            b = torch.randn(size, size, generator=gen, device=device).to(dtype)
            elapsed = min(_time(a, b, device), _time(a, b, device))  # the first warms up
            if elapsed >= 0.02 or size >= 8192:
                break
            size *= 2
        best, spent, products = elapsed, 0.0, 0
        while spent < seconds or products < 3:
            taken = _time(a, b, device)
            best, spent, products = min(best, taken), spent + taken, products + 1
        return 2.0 * size ** 3 / best
    finally:
        torch.set_num_threads(previous)


def _time(a: torch.Tensor, b: torch.Tensor, device: str) -> float:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    start = time.perf_counter()
    torch.matmul(a, b)
    sync()
    return time.perf_counter() - start


def _key(dtype: str, threads: int, device: str) -> str:
    """The machine, device, threads, dtype and torch version a peak holds for."""
    return machine.machine_key(dtype, threads, device)
