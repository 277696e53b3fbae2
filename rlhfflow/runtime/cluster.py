"""The embedded cluster: a Dask scheduler in this process and one worker process per
device (plus the CPU pool's for environment steps), forked from a server that imported
torch once, with the Dask settings a long RLHF run needs (quiet timers, short developer
logs, a long heartbeat limit)."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any

import dask

from rlhfflow.launch.forkserver import sigint_ignored, start_fork_server, wait_fork_server
from rlhfflow.monitor.workerlogs import worker_log
from rlhfflow.plan.layout import default_torch_threads
from rlhfflow.runtime.worker.process import WORKER_LOG_VAR

#: What an embedded cluster's worker process runs as it starts (a Dask preload).
WORKER_PRELOAD = "rlhfflow.runtime.worker.process"

#: The Dask resource of the CPU pool's workers (``cluster.env_workers``): environment
#: steps are submitted with ``resources={ENV_RESOURCE: 1}``, so no model worker takes one.
ENV_RESOURCE = "env"


def local_cluster(workers: int, host: str = "127.0.0.1", dashboard_address: str = ":8787",
                  memory_limit: str = "auto", torch_threads: int | None = None,
                  device: str = "auto", log_dir: Path | None = None,
                  heartbeat_timeout_s: float = 900.0, env_workers: int = 0):
    """An embedded cluster: one worker process per device, one thread each, resources
    ``{"device": 1}``; and ``env_workers`` processes for environment steps (the CPU pool),
    one thread each, resources ``{"env": 1}``, which hold no model. On GPUs each worker
    sees only its own (``CUDA_VISIBLE_DEVICES``); on CPU each worker's torch gets its
    share of the cores. With ``log_dir``, worker i writes its output to
    ``log_dir/worker-i.log`` (``rlhfflow.monitor.workerlogs``). The scheduler declares a
    worker lost when its connection closes (its process died) or when it sent no
    heartbeat for ``heartbeat_timeout_s``."""
    from distributed import Scheduler, SpecCluster

    gpus = cuda_count() if device in ("auto", "cuda") else 0
    if device == "cuda" and gpus == 0:
        raise RuntimeError("cluster.device is 'cuda' but no CUDA device is visible")
    if gpus:
        workers = min(workers, gpus)
    threads = torch_threads or default_torch_threads(workers)
    # worker processes read logging config from the environment at import: keep their
    # chatter off the user's terminal; a task's failure reaches the user once, as the
    # run's one-line error naming the stage, iteration and cause
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "critical")
    specs = _worker_specs(workers, env_workers, gpus, host, memory_limit, log_dir)
    scheduler = {"cls": Scheduler, "options": {"host": host,
                                               "dashboard_address": dashboard_address}}
    config = _cluster_config(threads, heartbeat_timeout_s)
    # the dashboard's Task Stream page keeps its last tasks in the scheduler (this
    # process) once opened: Dask's 100,000, ~0.5 KB each, are 7,000 iterations of
    # ppo-tiny; 10,000 are 700 iterations, 5 MB. Set for the process, not only while the
    # cluster starts: Dask reads it when the page is first opened. A value of one's own
    # Dask config stays.
    if dask.config.get(TASK_STREAM_KEY) == DASK_TASK_STREAM:
        dask.config.set({TASK_STREAM_KEY: TASK_STREAM_LENGTH})
    if config["distributed.worker.multiprocessing-method"] == "forkserver":
        # Dask gives each worker 30 s to start: not the fork server's imports
        wait_fork_server()
    with dask.config.set(config), sigint_ignored(), warnings.catch_warnings():
        # a dashboard port taken (another run on this machine): Dask serves it on a free
        # port, which the run prints with its dashboard link, instead of a raw warning
        warnings.filterwarnings("ignore", message=r"Port \d+ is already in use")
        for spec in specs.values():
            # whole (DEVELOPER_LOGS included): a Nanny lays its config over Dask's one
            # level deep only
            spec["options"]["config"] = dask.config.merge(dask.config.config)
        # the scheduler runs in this process: a worker lost mid-run is the run's to report
        # (one line, then recovery), not Dask's ERROR lines about lost data on the terminal
        return SpecCluster(workers=specs, scheduler=scheduler, silence_logs=logging.CRITICAL,
                           name="rlhfflow")


def _worker_specs(workers: int, env_workers: int, gpus: int, host: str,
                  memory_limit: str, log_dir: Path | None) -> dict[str, dict]:
    """The ``SpecCluster`` specs of the device workers and the CPU pool's (nannies)."""
    from rlhfflow.runtime.nanny import WatchedNanny

    specs = {}
    for i in range(workers):
        # forked workers start with the fork server's environment: give them this
        # process's as it is now (HF_HUB_CACHE and the like, read when used)
        env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": str(i)} if gpus else {})}
        if log_dir is not None:
            env[WORKER_LOG_VAR] = str(worker_log(log_dir, i))
        specs[f"device-{i}"] = {"cls": WatchedNanny, "options": {
            "nthreads": 1, "resources": {"device": 1}, "host": host, "env": env,
            "memory_limit": memory_limit, "name": f"device-{i}",
            # if the coordinator (and with it the scheduler) dies, workers exit
            "death_timeout": 30}}
    for i in range(env_workers):
        # no GPU: an environment step is Python (a game, a tool call), not a model
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
        if log_dir is not None:
            env[WORKER_LOG_VAR] = str(worker_log(log_dir, workers + i))
        specs[f"env-{i}"] = {"cls": WatchedNanny, "options": {
            "nthreads": 1, "resources": {ENV_RESOURCE: 1}, "host": host, "env": env,
            "memory_limit": memory_limit, "name": f"env-{i}", "death_timeout": 30}}
    return specs


def _cluster_config(threads: int, heartbeat_timeout_s: float) -> dict[str, Any]:
    """The Dask config the embedded cluster starts under (starting the fork server its
    workers are forked from, where the platform has one)."""
    return {
        # backends that start processes (DeepSpeed, vLLM) cannot run in daemonic workers
        "distributed.worker.daemon": False,
        # the scheduler's and the workers' (connect() keeps them so for the run's life)
        **DEVELOPER_LOGS,
        # workers are forks of a server that imported torch and the stages once
        # (start_fork_server), not fresh interpreters that each import them
        "distributed.worker.multiprocessing-method": (
            "forkserver" if start_fork_server() else "spawn"),
        # the rlhfflow page of the dashboard (rlhfflow.monitor.dashboard)
        "distributed.scheduler.preload": [*dask.config.get("distributed.scheduler.preload", []),
                                          "rlhfflow.monitor.dashboard"],
        # the caller's limits in a worker forked from a warm server; its output to its log
        "distributed.worker.preload": [*dask.config.get("distributed.worker.preload", []),
                                       WORKER_PRELOAD],
        # set before the worker process starts (OpenMP and glibc read them at start-up).
        # Deliberately without Dask's default MALLOC_TRIM_THRESHOLD_: setting any malloc
        # threshold turns off glibc's dynamic mmap threshold, so every tensor over 128 KiB
        # becomes an mmap/munmap of fresh pages; we measured torch compute at 2x the time
        # in such workers (benchmarks/overhead.py, docs/performance/overhead.md).
        "distributed.nanny.pre-spawn-environ": {
            "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
            "OPENBLAS_NUM_THREADS": threads},
        # the workers' timers wake their event loop, which then takes the GIL from the
        # running task between two torch ops (see QUIET_TIMERS)
        **quiet_timers(),
        # a worker whose event loop misses heartbeats because torch holds the machine's
        # cores is alive: declared lost, it would cost a restart and the iterations since
        # the last checkpoint. A dead one is noticed without this (its connection closes,
        # its nanny starts a new one), so the limit can be long. The pipeline's, over any
        # Dask config (Dask's default is 5 minutes).
        "distributed.scheduler.worker-ttl": f"{heartbeat_timeout_s}s",
    }


TASK_STREAM_KEY = "distributed.scheduler.dashboard.tasks.task-stream-length"
DASK_TASK_STREAM, TASK_STREAM_LENGTH = 100_000, 10_000
"""The Task Stream page's length: Dask's default, and the embedded cluster's."""

#: The embedded cluster's Dask developer logs (``admin.low-level-log-length``, 1000 entries
#: each by default), in its workers and in the coordinator (this process, which hosts the
#: scheduler; ``DaskBackend.connect`` keeps the setting for the run's life). A worker's logs
#: hold what it did last: the state machine's log and its stimuli (every task's
#: arguments, the prompts inlined into them included), the transfers, and a profile per
#: second (the dashboard's Profile page), the last filling for 1000 s, 3,000 iterations
#: of ppo-tiny; 100 keep the last 100 s of profile. In the coordinator each of Dask's
#: batched streams (the client's to the scheduler, the scheduler's to each worker and
#: client) keeps its last batches of messages, and a batch holds whole tasks: the pickled
#: graphs the client sends, the task specs with the prompts and tensors inlined into
#: them. Measured with ``tracemalloc`` in a ppo-tiny run: 27 MB of the client's pickled
#: graphs alone by iteration 1,000 at 1000 entries, still filling there. The scheduler's
#: transition log and its event topics take the same length; the rlhfflow page keeps its
#: own iterations (``rlhfflow.monitor.dashboard``).
DEVELOPER_LOGS = {"distributed.admin.low-level-log-length": 100}


#: The embedded cluster's timers, as Dask's defaults and as set instead. Each fires a
#: callback in the worker's event loop, which shares the GIL with the running task: the
#: loop takes it between two of the task's torch ops and the task waits for it back.
#: Dask's defaults wake a worker ~76 times a second; these ~20. ``tick`` only measures the
#: loop's latency (Dask warns when it exceeds ``tick.limit``, 3 s); the memory monitor
#: pauses or restarts a worker near its memory limit (rlhfflow's workers hold their
#: models, not spillable data); the sampling profiler (the dashboard's Profile page)
#: walks the running task's stack. Measured: see ``quiet_timers``.
QUIET_TIMERS = {
    "distributed.admin.tick.interval": ("20ms", "500ms"),
    "distributed.worker.memory.monitor-interval": ("100ms", "500ms"),
    "distributed.worker.profile.interval": ("10ms", "100ms"),
}


def quiet_timers() -> dict[str, str]:
    """The embedded cluster's timer settings (``QUIET_TIMERS``); a Dask config that sets
    one to other than Dask's default keeps its own. Measured on grpo-tiny's one-task
    iterations: the profiler at 100 ms instead of 10 ms, 138.0 -> 126.8 ms per iteration
    (5 alternating pairs); the tick and memory monitor as set, the worker's event loop
    woke 27 instead of 41 times per iteration, 285 instead of 358 futex calls (GIL
    hand-offs; ``strace -c`` on the worker), 115.0 -> 107.9 ms per iteration (6 pairs)."""
    out = {}
    for key, (default, quiet) in QUIET_TIMERS.items():
        configured = dask.config.get(key, default)
        out[key] = quiet if configured == default else configured
    return out


def embedded_worker_processes(coordinator) -> list:
    """The embedded cluster's worker processes under ``coordinator`` (a
    ``psutil.Process``): forks of its fork server, or processes its nannies spawned."""
    def command(p) -> str:
        try:
            return " ".join(p.cmdline())
        except Exception:  # noqa: BLE001 - gone, or a zombie
            return ""

    children = coordinator.children(recursive=True)
    servers = {c.pid for c in children if "forkserver" in command(c)
               and c.ppid() == coordinator.pid}
    return [c for c in children if c.ppid() in servers or "spawn_main" in command(c)]


def cuda_count() -> int:
    """How many CUDA devices this process sees (0 without a usable CUDA)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - no usable CUDA means CPU workers
        return 0
