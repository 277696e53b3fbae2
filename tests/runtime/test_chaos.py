"""A worker killed at any moment costs the run time, not the run: the race behind issue
31 driven deterministically on a real cluster, and a short run of the chaos harness
(``benchmarks/chaos.py``)."""

from __future__ import annotations

import os
import signal
import sys
import time

import cloudpickle
import dask
import pytest
from distributed import Client, LocalCluster, get_worker
from distributed.diagnostics.plugin import WorkerPlugin

from rlhfflow.runtime.backend import DaskBackend, TaskFailed, WorkerLost
from tests.launch.test_warm import runtime  # noqa: F401 - a fixture: a warm server of the test's own

# the worker processes need not import this module
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _once(key: str) -> str:
    """Stands for a stage task, which runs once: run again (its worker's models have
    moved on since), it fails as ``check_versions`` does."""
    runs = get_worker().__dict__.setdefault("_rlhfflow_test_runs", set())
    if key in runs:
        raise RuntimeError(f"{key} ran twice (StaleWeights: its models moved on)")
    runs.add(key)
    return key


def _fail() -> None:
    raise RuntimeError("the stage failed")


def _consume(value: str) -> str:
    return value + "+consumed"


def _wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_task_that_fails_because_a_worker_died_is_the_workers_loss_not_the_stages():
    # Dask keeps the lineage of every result in memory: when the worker holding one dies,
    # the scheduler runs the tasks that made it again, on the survivors, where an old
    # stage task fails (its models are newer). That error could reach the coordinator
    # before it noticed the loss, and ended the run (issue 31: StaleWeights, "expects
    # version 0", in iteration 5). Here the error is there first, every time.
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        backend = DaskBackend(client)
        survivor, victim = backend.workers
        made = backend.submit(_once, "generate-0", key="generate-0", worker=survivor)
        used = backend.submit(_consume, made, key="consume-0", worker=victim)
        backend.wait([used], pinned=backend.workers)
        del made  # its data is released; ``used`` keeps its lineage
        _wait_for(lambda: not client.who_has(["generate-0"]).get("generate-0"))
        pid = client.run(os.getpid, workers=[victim])[victim]
        os.kill(pid, signal.SIGKILL)
        _wait_for(lambda: used.status == "error")  # run again on the survivor, failed

        with pytest.raises(WorkerLost):
            backend.wait([used], pinned=[survivor, victim])


class _DiesOnSetup(WorkerPlugin):
    """A worker plugin that ends the process of the worker ``victim`` as it is installed
    there, as a nanny kills a worker while a recovery installs the resident state."""

    def __init__(self, victim: str) -> None:
        self.victim = victim

    def setup(self, worker) -> None:
        if worker.address == self.victim:
            os._exit(1)


def test_a_worker_that_dies_as_the_resident_state_is_installed_is_a_lost_worker():
    # found by benchmarks/chaos.py (a worker stopped past the heartbeat timeout): woken,
    # it registered again and was counted, then its nanny killed it while the recovery
    # installed the resident state; the scheduler's broadcast to it failed, and the
    # CommClosedError ended the run instead of another recovery
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        backend = DaskBackend(client)
        with pytest.raises(WorkerLost):
            backend.install_plugin(_DiesOnSetup(backend.workers[1]), "dies")


def test_a_task_that_fails_with_every_worker_alive_is_the_stages_failure():
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        backend = DaskBackend(client)
        failing = backend.submit(_fail, key="train-1", worker=backend.workers[0])
        with pytest.raises(TaskFailed, match="the stage failed"):
            backend.wait([failing], pinned=backend.workers)


def test_a_live_worker_is_never_reported_lost_while_the_client_refreshes_its_summary():
    # issue 42: under load, a run on an external cluster stopped with "worker ... left
    # the cluster while it held resident models", both workers alive. Every 2 s the
    # client's event loop overwrites what Client.scheduler_info() returns with a summary
    # that lists no workers; a check whose thread waited for the cores after its answer
    # came read the summary. Here it comes every millisecond: ~3% of the old checks saw it.
    with dask.config.set({"distributed.client.scheduler-info-interval": "1ms"}), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                         dashboard_address=":0") as cluster, Client(cluster) as client:
        backend = DaskBackend(client)
        assert len(backend.workers) == 2
        for _ in range(2000):
            backend.check_alive(backend.workers)
        assert backend.wait_for_workers(2, timeout=0) and len(backend.workers) == 2


@pytest.mark.slow
def test_a_worker_removed_for_missing_heartbeats_is_said_so_with_the_setting():
    # a cluster the user started keeps its scheduler's own worker-ttl (Dask's 5 minutes),
    # which cluster.heartbeat_timeout_s does not reach: a worker stopped past it (as an
    # event loop starved of the cores) is lost with what to set
    with dask.config.set({"distributed.scheduler.worker-ttl": "1s"}), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                         dashboard_address=":0") as cluster, Client(cluster) as client:
        backend = DaskBackend(client)
        victim = backend.workers[1]
        os.kill(client.run(os.getpid, workers=[victim])[victim], signal.SIGSTOP)
        _wait_for(lambda: victim not in client.nthreads())
        with pytest.raises(WorkerLost, match=r"heard no heartbeat from it for \d+ s .*set "
                           r"distributed\.scheduler\.worker-ttl in its scheduler's Dask"):
            backend.check_alive(backend.workers)


def _hog_memory() -> None:
    """Stands for a stage that outgrows its worker's memory limit (500 MB)."""
    block = bytearray(600 * 2**20)
    block[::4096] = b"\x01" * len(block[::4096])  # touched: resident, not just reserved
    time.sleep(60)


def test_a_lost_worker_s_log_and_the_run_s_error_say_why_its_process_ended(tmp_path):
    # a worker killed by the OOM killer or ended by its nanny's memory limit writes
    # nothing itself: its nanny says why, in the log and in the WorkerLost line
    from distributed import Scheduler, SpecCluster

    from rlhfflow.runtime.nanny import WatchedNanny
    from rlhfflow.runtime.worker.process import WORKER_LOG_VAR

    log = tmp_path / "worker-0.log"
    spec = {"device-0": {"cls": WatchedNanny, "options": {
        "nthreads": 1, "memory_limit": "500MB", "env": {WORKER_LOG_VAR: str(log)}}}}
    with SpecCluster(workers=spec, scheduler={"cls": Scheduler, "options": {
            "dashboard_address": ":0"}}) as cluster, Client(cluster) as client:
        backend = DaskBackend(client)
        [worker] = backend.workers
        pid = client.run(os.getpid)[worker]
        time.sleep(1.2)  # the nanny samples the worker's memory every 0.5 s
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerLost, match=r"\(killed by SIGKILL; its memory was "):
            _wait_for(lambda: backend.check_alive([worker]))
        [line] = log.read_text().splitlines()
        assert line.startswith(f"rlhfflow: worker device-0 (pid {pid}) ended: killed by "
                               f"SIGKILL; its memory was ")
        assert "kernel's OOM killer or a `kill -9`" in line

        client.wait_for_workers(1)
        [worker] = list(client.scheduler_info()["workers"])
        hog = client.submit(_hog_memory, pure=False)  # noqa: F841 - runs until ended
        with pytest.raises(WorkerLost, match=r"the nanny ended it \(SIGTERM\) as its "
                                             r"memory, .* passed 95% of the worker's "
                                             r"0.47 GiB limit \(cluster.memory_limit\)"):
            _wait_for(lambda: backend.check_alive([worker]))
        assert len(log.read_text().splitlines()) == 2


def test_a_worker_killed_near_its_memory_limit_is_said_to_be_the_oom_killer_s():
    from rlhfflow.runtime.nanny import exit_reason

    gib = 2**30
    said = exit_reason(-9, rss=int(3.9 * gib), limit=4 * gib, available=gib // 4,
                       total=16 * gib, sampled_s=0.3)
    assert said.startswith("killed by SIGKILL; its memory was 3.90 GiB of its 4.00 GiB "
                           "limit 0.3 s before it ended; the machine had 0.25 GiB of 16.00 "
                           "GiB available; near the limit: most likely the kernel's OOM "
                           "killer")
    assert exit_reason(3) == "exited with status 3"
    assert exit_reason(-11, rss=gib) == "killed by SIGSEGV; its memory was 1.00 GiB"


@pytest.mark.slow
def test_workers_killed_at_random_moments_cost_time_not_results(tmp_path):
    # the harness of benchmarks/chaos.py, short: an untouched run, then two runs each
    # losing a worker at a seeded random moment; each must finish with every iteration
    # once and the untouched run's results
    from benchmarks.chaos import chaos

    rows: list[str] = []
    figures = chaos(["configs/ppo-tiny.yaml"], ["interleaved"], faults=2, seed=3,
                    iterations=6, timeout=300, directory=tmp_path, say=rows.append)
    report = "\n".join(rows)
    assert figures["faults"] + figures["missed"] == 2, report
    assert figures["recovered"] == figures["faults"], report


def test_a_campaign_takes_every_kind_placement_and_warm_server_in_turn_in_a_seeded_order():
    from benchmarks.chaos import plan_faults

    placements, kinds, warms = ["colocated", "disaggregated-stale1"], ["worker", "stop",
                                                                      "coordinator"], ["off", "on"]
    plan = plan_faults(30, 7, 6, kinds, ["configs/ppo-tiny.yaml"], placements, warms)
    combos = [(p, w, f.kind) for _, p, w, f in plan]
    assert len(set(combos[:12])) == len(set(combos[12:24])) == 12  # each round: all of them
    assert combos[:12] != combos[12:24]  # in another order
    assert all(0 <= f.after <= 3 and 0 <= f.delay_s < 1 for *_, f in plan)
    again = plan_faults(30, 7, 6, kinds, ["configs/ppo-tiny.yaml"], placements, warms)
    assert [(c, p, w, f.kind, f.after, f.delay_s) for c, p, w, f in plan] == \
        [(c, p, w, f.kind, f.after, f.delay_s) for c, p, w, f in again]


@pytest.mark.slow
def test_a_coordinator_killed_under_supervise_from_a_warm_server_costs_time_not_results(
        tmp_path, runtime, monkeypatch):  # noqa: F811 - the fixture
    # the new kinds of benchmarks/chaos.py, once: the coordinator of a supervised run, a
    # fork of a warm server (one of this test's own), SIGKILLed at a seeded random moment
    from benchmarks.chaos import chaos

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    rows: list[str] = []
    figures = chaos(["configs/ppo-tiny.yaml"], ["interleaved"], faults=1, seed=5,
                    iterations=6, kinds=["coordinator"], warms=["on"], timeout=300,
                    directory=tmp_path, say=rows.append)
    report = "\n".join(rows)
    assert figures["faults"] + figures["missed"] == 1, report
    assert figures["recovered"] == figures["faults"], report
