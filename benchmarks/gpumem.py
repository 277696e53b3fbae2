"""The peak GPU memory in use while a block runs, as ``nvidia-smi`` reports it.

Sampled from outside the processes that use the GPU (every process of a run, Dask
workers included, and the CUDA contexts), so two systems are measured alike. Standard
library only: ``gpu/check.py`` and the benchmarks use it.
"""

from __future__ import annotations

import shutil
import subprocess
import threading


class GpuMemory:
    """``with GpuMemory() as memory: ...``; then ``memory.peak_mib``: the most memory in
    use on any GPU while the block ran (MiB, sampled every ``interval_ms``), or None where
    there is no ``nvidia-smi``."""

    def __init__(self, interval_ms: int = 200) -> None:
        self.interval_ms = interval_ms
        self.peak_mib: int | None = None
        self._process: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> GpuMemory:
        tool = shutil.which("nvidia-smi")
        if tool is None:
            return self
        self._process = subprocess.Popen(
            [tool, "--query-gpu=memory.used", "--format=csv,noheader,nounits",
             f"-lms={self.interval_ms}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        for line in self._process.stdout:
            try:
                used = int(line.strip())
            except ValueError:
                continue
            self.peak_mib = used if self.peak_mib is None else max(self.peak_mib, used)

    def __exit__(self, *exc: object) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=10)
            self._reader.join(timeout=10)
