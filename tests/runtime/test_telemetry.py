"""What the coordinator measures of a run besides its learning: each worker's peak
resident set per iteration (``memory_peak_mib``) from the workers' own reports, on a
real cluster, and the closing line's summary of it."""

from __future__ import annotations

import pytest

from rlhfflow.config.loader import load_pipeline
from rlhfflow.runtime.run import run_pipeline
from rlhfflow.runtime.telemetry import memory_peaks, memory_text
from tests.conftest import small_pipeline

MiB = 2**20


def test_the_run_peak_is_each_workers_highest_iteration_peak():
    records = [{"iteration": 0, "memory_peak_mib": [900, None]},
               {"iteration": 1},  # no worker said
               {"iteration": 2, "memory_peak_mib": [700, 1200, 50]}]
    assert memory_peaks(records) == [900, 1200, 50]
    assert memory_text([900, None]) == "; memory peak: w0 900, w1 - MiB"
    assert memory_peaks([{"iteration": 0}]) == [] and memory_text([]) == ""


@pytest.mark.slow
def test_every_worker_reports_its_peak_resident_set_each_iteration(cluster, tmp_path):
    pipeline = load_pipeline(small_pipeline(tmp_path, "grpo", iterations=2),
                             {"cluster.address": cluster.scheduler_address})
    result = run_pipeline(pipeline, progress=False)
    for record in result.metrics:
        peaks = record["memory_peak_mib"]
        assert len(peaks) == 2
        # a worker holds torch and its models: hundreds of MiB, not bytes or GiB-sized
        # nonsense (each is the process's own VmHWM since its last report)
        assert all(p is None or 100 < p < 16 * 1024 for p in peaks), peaks
    assert all(p is not None for p in result.metrics[0]["memory_peak_mib"])
    assert result.summary["memory_peak_mib"] == memory_peaks(result.metrics)
