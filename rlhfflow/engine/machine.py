"""Figures measured on the machine at hand (the matmul peak, ``rlhfflow.engine.peak``; the
CPU kernels' timings, ``rlhfflow.engine.lean``), kept between runs in
``$XDG_CACHE_HOME/rlhfflow/`` (default ``~/.cache``), one JSON file of figures by key
each; delete a file to measure again.
"""

from __future__ import annotations

import json
import os
import platform
import socket
from pathlib import Path

import torch


def cache_path(name: str) -> Path:
    """Where the figures of file ``name`` are kept."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "rlhfflow" / name


def read_cache(path: Path) -> dict:
    """The figures kept in ``path`` by key ({} without a readable file)."""
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return cached if isinstance(cached, dict) else {}


def write_cache(path: Path, figures: dict) -> None:
    """Keep ``figures`` in ``path``: a sibling written and renamed, so concurrent runs
    never see half a file; an unwritable cache is measured again next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        staged.write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")
        staged.replace(path)
    except OSError:
        pass


def machine_key(what: str, threads: int, device: str = "cpu") -> str:
    """The machine, device, threads, ``what`` and torch version a measured figure holds
    for: its key in a cache file."""
    if device.startswith("cuda"):
        where = f"cuda {torch.cuda.get_device_name(torch.device(device))}"
    else:
        where = f"cpu {_cpu_model()} x{threads} threads"
    return f"{socket.gethostname()} | {where} | {what} | torch {torch.__version__}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def peak_rss(reset: bool = False) -> int | None:
    """This process's resident-set high-water mark in bytes (Linux's ``VmHWM``: what a
    Dask worker's memory limit is measured against, at its highest), or None where the
    kernel does not say. ``reset``: start the mark again from the present resident set
    (``/proc/self/clear_refs``), so the next call gives the peak since this one."""
    try:
        with open("/proc/self/status") as status:
            line = next(x for x in status if x.startswith("VmHWM:"))
        peak = int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    if reset:
        try:
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")
        except OSError:
            pass  # the mark then covers the process's life so far
    return peak

