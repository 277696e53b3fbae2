"""``run_pipeline``: a run from the outside. Prepare the output directory (a fresh start
or a resume), let the planner choose a plan for ``placement: auto``, start or reach the
cluster while the coordinator reads the prompts, then hand everything to the
``Executor`` and turn what escapes it into a ``RunError``.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

from rlhfflow.config.pipeline import Pipeline, derive
from rlhfflow.monitor.workerlogs import LOG_DIRECTORY
from rlhfflow.plan.auto.fitting import check_memory
from rlhfflow.plan.auto.planner import choose_plan, load_profile
from rlhfflow.runtime.backend import DaskBackend, WorkerLost
from rlhfflow.runtime.cluster import cuda_count
from rlhfflow.runtime.executor import Executor, RunResult
from rlhfflow.runtime.failures import (
    RunError,
    disk_full,
    is_disk_full,
    is_out_of_memory,
    out_of_memory,
)
from rlhfflow.runtime.inline import InlineBackend
from rlhfflow.runtime.prepared import prepare_run
from rlhfflow.runtime.runstate import (
    Resume,
    RunStateError,
    already_done,
    identity_digest,
    output_lock,
    pipeline_identity,
    prepare_output,
)
from rlhfflow.runtime.telemetry import StartupClock


def run_pipeline(pipeline: Pipeline, progress: bool = True, inline: bool = False,
                 overwrite: bool = False, resume: Resume = "auto", force: bool = False,
                 stop: threading.Event | None = None) -> RunResult:
    """Run ``pipeline`` on its cluster (``cluster.address``, or an embedded cluster) or,
    with ``inline=True``, in this process without Dask.

    An output directory holding a run of the same pipeline is resumed from its last
    checkpoint (``resume="auto"``); ``overwrite`` starts afresh. Setting ``stop`` asks the
    run to finish the iteration in flight, save a checkpoint and return. The run holds
    its output directory for its whole life: ``OutputInUse`` if another run does.
    """
    with output_lock(pipeline.output_dir):
        return _run_pipeline(pipeline, progress, inline, overwrite, resume, force, stop)


def _run_pipeline(pipeline: Pipeline, progress: bool, inline: bool, overwrite: bool,
                  resume: Resume, force: bool, stop: threading.Event | None) -> RunResult:
    clock = StartupClock()
    clock.mark("load")  # since the process started: imports, reading and checking FILE
    try:
        out, start = prepare_output(pipeline, overwrite, resume, force)
    except RunStateError as exc:
        raise RunError(str(exc)) from None
    done = already_done(pipeline, start)
    if done is not None:  # a finished run asked for no more iterations: start nothing
        return RunResult(out, already_done=done)
    digest = identity_digest(pipeline_identity(pipeline))
    auto = pipeline.spec.placement.strategy == "auto" and pipeline.spec.data is not None
    choice = None
    if auto and inline:  # one in-process worker: every strategy is the same plan
        pipeline = derive(pipeline, {"placement.strategy": "colocated"})
        auto = False
    elif auto and pipeline.spec.cluster.address is None:
        # the embedded cluster's workers and threads are the planner's to choose
        gpus = 0 if pipeline.spec.cluster.device == "cpu" else cuda_count()
        workers = min(pipeline.spec.cluster.workers, gpus) if gpus else None
        choice = choose_plan(pipeline, load_profile(pipeline), n_workers=workers)
        pipeline = choice.pipeline
        clock.mark("plan")
    elif not auto and not inline and pipeline.spec.cluster.address is None:
        check_memory(pipeline, pipeline.spec.cluster.workers)  # a plan as written
    cluster = pipeline.spec.cluster
    # the coordinator's own preparation (the prompts, the buffer) overlaps the embedded
    # cluster's start (its workers are forks of a server importing torch and the model
    # classes since the command began); an external cluster's plan depends on its
    # workers, so there it comes after connecting
    early = not inline and not cluster.address
    prepared = None
    with ThreadPoolExecutor(1, thread_name_prefix="rlhfflow-prepare") as pool:
        preparing = pool.submit(prepare_run, pipeline, out, start, progress) if early else None
        try:
            backend = _connect(cluster, inline, out / LOG_DIRECTORY)
        except BaseException:
            if preparing is not None:
                preparing.cancel()
                wait([preparing])
            raise
        try:
            # the workers import torch and the stages while this process prepares
            warming = backend.warm() if early else []
            if preparing is not None:
                prepared = preparing.result()
            backend.wait(warming)
        except BaseException as exc:
            backend.close()
            if isinstance(exc, Exception) and is_disk_full(exc):
                raise RunError(disk_full(exc, "the coordinator")) from None
            raise
    clock.mark("cluster + prompts" if early else "cluster")
    try:
        if auto and choice is None:  # a given cluster: plan for the workers it has
            choice = choose_plan(pipeline, load_profile(pipeline),
                                 n_workers=len(backend.workers))
            pipeline = choice.pipeline
        if prepared is None:
            prepared = prepare_run(pipeline, out, start, progress)
            clock.mark("prompts")
        # (the digest is of the file as written: what a resume compares)
        return Executor(prepared, backend, progress, stop, digest=digest, choice=choice,
                        clock=clock).run()
    except WorkerLost as exc:  # past the recoveries, or in the final save
        raise RunError(f"{exc}; run again to resume from the last checkpoint") from None
    except RunError:
        raise
    except Exception as exc:  # the coordinator's own writes: metrics, buffer metadata, ...
        if is_disk_full(exc):
            raise RunError(disk_full(exc, "the coordinator")) from None
        if is_out_of_memory(exc):
            raise RunError(out_of_memory(exc, "the coordinator")) from None
        raise
    finally:
        backend.close()


def _connect(cluster, inline: bool, log_dir: Path):
    """The backend: in process, a running scheduler, or an embedded cluster (whose
    workers' output goes to their logs in ``log_dir``, and on to this terminal)."""
    if inline:
        return InlineBackend()
    try:
        return DaskBackend.connect(
            cluster.address, cluster.workers, log_dir=log_dir, host=cluster.host,
            dashboard_address=cluster.dashboard_address,
            memory_limit=cluster.memory_limit, torch_threads=cluster.torch_threads,
            device=cluster.device, heartbeat_timeout_s=cluster.heartbeat_timeout_s,
            env_workers=cluster.env_workers)
    except OSError as exc:  # TimeoutError too: workers that did not start in time
        if cluster.address:
            raise RunError(f"cannot reach the Dask scheduler at {cluster.address}: {exc}"
                           ) from None
        raise RunError(cluster_failure(exc)) from None
    except RuntimeError as exc:  # e.g. cluster.device: cuda on a machine without one
        raise RunError(str(exc)) from None


def cluster_failure(exc: OSError) -> str:
    """Why the embedded cluster did not start, in one line: the error, the file it is
    about, and, when the workers were to be forks of a warm server, how to do without."""
    from rlhfflow.launch import warm

    text = str(exc) or type(exc).__name__
    server = warm.workers_server()
    # a socket's errors name no file: the one the workers come from, if it is a server's
    filename = getattr(exc, "filename", None) or (server if exc.errno else None)
    if filename and str(filename) not in text:
        text += f": {filename}"
    if server is not None:
        text += f"; the workers come from a warm server: {warm.ENV_VAR}=0 runs without it"
    return f"the embedded cluster did not start: {text}"
