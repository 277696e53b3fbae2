"""The soak's checker (``benchmarks/soak.py``) on a short run: a supervised run whose
worker is SIGKILLed twice ends with every iteration exactly once in the metrics and the
buffer, readable groups, loadable checkpoints and the results of an uninterrupted run."""

from __future__ import annotations

import pytest

from benchmarks.soak import check, run_supervised, write_pipeline
from rlhfflow.config.loader import load_pipeline
from rlhfflow.runtime.run import run_pipeline


@pytest.mark.slow
def test_a_run_whose_worker_is_killed_again_and_again_loses_and_repeats_nothing(tmp_path):
    iterations = 20
    # one worker: the uninterrupted run can then be the in-process one (equal results,
    # tested in test_executor) and costs no cluster
    clean = write_pipeline(tmp_path / "clean", iterations, every=5, workers=1)
    run_pipeline(load_pipeline(clean), progress=False, inline=True)
    faulted = write_pipeline(tmp_path / "faulted", iterations, every=5, workers=1)
    _, faults, log = run_supervised(faulted, iterations, kill_every=7)

    assert [f.kind for f in faults] == ["worker", "worker"], log
    # each kill is noticed and recovered from; on a loaded machine (the suite's other
    # xdist process) a restarted worker was once lost a third time, and the supervisor
    # restarted the run: more recoveries, the same results (checked below)
    assert log.count("recovering from the last checkpoint") >= 2, log
    checks = check(tmp_path / "faulted" / "out", tmp_path / "clean" / "out", iterations)
    assert all(checks.values()), checks
